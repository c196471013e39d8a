"""Comparisons the tier tests share (a helper module, not a test file: pytest collects test_*.py).

Test files import it as `from assertions import ...`: pytest puts tests/ on sys.path for the
test modules it imports (no __init__.py here). Not in conftest.py, whose module name
tutorials/conftest.py shares.
"""

import torch


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error in the Frobenius norm, in float64."""
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Relative error in the Frobenius norm below tol; NaN or inf on either side fails."""
    assert torch.isfinite(actual).all(), "non-finite values in the output under test"
    assert torch.isfinite(expected).all(), "non-finite values in the reference"
    err = float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def check_graphed_decode_steps(paged, common, graphed, hidden: int, tol: float, *, steps: int = 4,
                               num_kv_splits: int = 2, dtype=torch.float32) -> None:
    """Capture `paged.decode_step` over the cache `graphed` in a CUDA graph and replay it for
    `steps` + 1 tokens a row, each checked against the eager call over its twin cache `common`
    (the same tokens so far) within `tol`. Warms up (Triton compiles) on a side stream first."""
    b = graphed.batch_size
    static_x = torch.zeros(b, 1, hidden, device="cuda", dtype=dtype)
    buffers = paged.decode_inputs(graphed)
    with torch.no_grad():
        ref = paged(static_x, common)                 # the first step, eagerly
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            paged.decode_step(static_x, graphed, num_kv_splits=num_kv_splits, **buffers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = paged.decode_step(static_x, graphed, num_kv_splits=num_kv_splits,
                                         **buffers)
        graph.replay()
        assert rel(static_y, ref) < tol
        for _ in range(steps):
            static_x.copy_(torch.randn(b, 1, hidden, device="cuda"))
            ref = paged(static_x, common)
            paged.decode_inputs(graphed, out=buffers)
            graph.replay()
            assert rel(static_y, ref) < tol
    assert graphed.seq_lens.tolist() == common.seq_lens.tolist()
