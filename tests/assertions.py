"""Comparisons the tier tests share (a helper module, not a test file: pytest collects test_*.py).

Test files import it as `from assertions import ...`: pytest puts tests/ on sys.path for the
test modules it imports (no __init__.py here). Not in conftest.py, whose module name
tutorials/conftest.py shares.
"""

import torch


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Relative error in the Frobenius norm below tol; NaN or inf on either side fails."""
    assert torch.isfinite(actual).all(), "non-finite values in the output under test"
    assert torch.isfinite(expected).all(), "non-finite values in the reference"
    err = float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
    assert err < tol, f"relative error {err:.3g} >= {tol}"
