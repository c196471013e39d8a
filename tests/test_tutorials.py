"""The tutorial notebooks: each runs top to bottom, writes nothing, and matches its paired script.

tutorials/NN_name.py (jupytext py:percent) is the source of each notebook; NN_name.ipynb is
generated from it with outputs (`jupytext --to ipynb --execute tutorials/NN_name.py`) and
committed so the docs site shows them. The tests execute the notebook in memory with nbclient
(nothing is written back), in tutorials/ as the notebooks expect, within 300 s each.
"""

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT_S = 300
NAMES = ["01_from_paper_to_code", "02_weight_absorption", "03_paged_cache_and_kernels",
         "04_memory_and_speed"]


def _listing() -> set[str]:
    return {str(p.relative_to(TUTORIALS)) for p in TUTORIALS.rglob("*")
            if ".ipynb_checkpoints" not in p.parts and "__pycache__" not in p.parts}


def test_every_tutorial_is_there_with_its_script():
    assert [nb.stem for nb in NOTEBOOKS] == NAMES
    for nb in NOTEBOOKS:
        assert nb.with_suffix(".py").is_file(), f"{nb.name} has no paired {nb.stem}.py"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_matches_its_script(notebook):
    """The committed .ipynb was generated from the current .py: same cells, same sources."""
    script = jupytext.read(notebook.with_suffix(".py"))
    committed = nbformat.read(notebook, as_version=4)
    pairs = [(a.cell_type, a.source) for a in script.cells]
    assert pairs == [(b.cell_type, b.source) for b in committed.cells], (
        f"{notebook.name} is out of date with {notebook.stem}.py; regenerate it with "
        f"`.venv/bin/jupytext --to ipynb --execute tutorials/{notebook.stem}.py`")
    code = [cell for cell in committed.cells if cell.cell_type == "code"]
    assert all(cell.get("execution_count") for cell in code), (
        f"{notebook.name} is committed without outputs; execute it (command above)")
    errors = [out for cell in code for out in cell.get("outputs", [])
              if out.get("output_type") == "error"]
    assert not errors, f"{notebook.name} was committed with an error: {errors[0].get('ename')}"


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_notebook_runs(notebook, monkeypatch):
    """Top to bottom on this machine, in under TIMEOUT_S, without leaving files behind."""
    # plots inline (an MPLBACKEND=Agg from the caller would silently drop them)
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(notebook, as_version=4)
    before = _listing()
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(TUTORIALS)}})
    start = time.monotonic()
    client.execute()
    took = time.monotonic() - start
    assert took < TIMEOUT_S, f"{notebook.name} took {took:.0f} s"
    assert _listing() == before, f"{notebook.name} wrote {sorted(_listing() - before)}"
    print(f"{notebook.name}: {took:.1f} s")
