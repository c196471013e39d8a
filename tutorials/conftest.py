"""pytest hooks for the notebooks here, which `pytest` executes with nbmake.

`make test` runs pytest with `--nbmake --nbmake-timeout=180` and pyproject.toml's testpaths
include this folder: nbmake runs each notebook in memory, in this folder, and writes nothing
back. Its timeout bounds one cell; the hook below bounds the whole notebook by the same number of
seconds (kernel start included) and fails a notebook that leaves a file behind in tutorials/.
tests/test_tutorials.py checks the rest (each .ipynb matches its .py, committed executed).
"""

import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _listing() -> set[str]:
    return {str(p.relative_to(HERE)) for p in HERE.rglob("*")
            if ".ipynb_checkpoints" not in p.parts and "__pycache__" not in p.parts}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not getattr(item, "nbmake", False):        # nbmake's NotebookItem sets nbmake = True
        return (yield)
    limit = item.config.getoption("nbmake_timeout")
    before = _listing()
    start = time.monotonic()
    result = yield
    took = time.monotonic() - start
    item.user_properties.append(("wall_s", round(took, 1)))
    assert took < limit, f"{item.path.name} took {took:.0f} s (limit {limit} s a notebook)"
    left = sorted(_listing() - before)
    assert not left, f"{item.path.name} left {left} behind"
    return result
