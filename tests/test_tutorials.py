"""The tutorial notebooks: each matches its paired script and is committed executed.

tutorials/NN_name.py (jupytext py:percent) is the source of each notebook; NN_name.ipynb is
generated from it with outputs (`jupytext --to ipynb --execute tutorials/NN_name.py`) and
committed so the docs site shows them. Executing them is nbmake's job, not this file's:
`make test` runs `pytest --nbmake --nbmake-timeout=180` over testpaths that include tutorials/,
so each notebook runs once, in memory, in tutorials/;
tutorials/conftest.py fails one that takes 180 s or more in all or leaves a file behind. The
checks here are static and take a second or two.
"""

import re
import shlex
import tomllib
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = ROOT / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("[0-9][0-9]_*.ipynb"))
TIMEOUT_S = 180
NAMES = ["01_from_paper_to_code", "02_weight_absorption", "03_paged_cache_and_kernels",
         "04_memory_and_speed"]


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


def test_make_test_executes_each_notebook_once_with_nbmake():
    """`make test` runs pytest with --nbmake and a 180 s timeout over testpaths that hold
    tutorials/ and no other notebook (a copy elsewhere would run twice)."""
    makefile = (ROOT / "Makefile").read_text()
    nbmake = re.search(r"^NBMAKE\s*:?=\s*(.*)$", makefile, re.M)
    assert nbmake, "Makefile defines no NBMAKE options"
    assert shlex.split(nbmake.group(1)) == ["--nbmake", f"--nbmake-timeout={TIMEOUT_S}"]
    assert re.search(r"^test:.*\n\t.*-m pytest .*\$\(NBMAKE\)", makefile, re.M)
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "tutorials" in options["testpaths"]
    found = sorted(nb for path in options["testpaths"] for nb in (ROOT / path).rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in nb.parts)
    assert found == NOTEBOOKS



@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_table_of_contents_links_each_heading(notebook):
    """On the docs site mkdocs-jupyter builds a notebook's table of contents from its markdown
    with code spans cut out, and gives the rendered headings ids of the whole text: a heading
    with a code span gets a table-of-contents link that goes nowhere."""
    plugin = pytest.importorskip("mkdocs_jupyter.plugin")
    pytest.importorskip("mkdocs_jupyter.convert")  # makes nbconvert's headings take its ids
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    def ids(items):
        for item in items:
            yield item.id
            yield from ids(item.children)

    toc, _ = plugin.get_nb_toc(str(notebook), 6)
    cells = nbformat.read(notebook, as_version=4).cells
    headings = [line for cell in cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if re.match(r"#{1,6} ", line)]
    rendered = [re.search(r'<h[1-6][^>]* id="([^"]*)"', markdown2html_mistune(line)).group(1)
                for line in headings]
    assert headings and list(ids(toc)) == rendered, list(zip(headings, ids(toc), rendered))
