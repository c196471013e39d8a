# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs mla, runs `python -m mla demo` (CPU unless --device says otherwise)
#   make test   installs the test, docs and tutorial extras and runs the whole suite
PYTHON   ?= python3
VENV     := .venv
BIN      := $(VENV)/bin
PIP      := $(BIN)/python -m pip install -q -c constraints.txt
DEMO_ARGS ?=
# make test executes the tutorial notebooks too, each cell and each notebook within 180 s
NBMAKE   := --nbmake --nbmake-timeout=180

.PHONY: demo test docs docs-serve clean browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# One stamp per set of extras, remade when pyproject.toml or the pins change.
$(VENV)/.installed-run: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[test,docs,tutorials]'
	@touch $@ $(VENV)/.installed-run

demo: $(VENV)/.installed-run
	$(BIN)/python -m mla demo $(DEMO_ARGS)

test: $(VENV)/.installed-test browser
	$(BIN)/python -m pytest -q $(NBMAKE)

docs: $(VENV)/.installed-test browser
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# tests/test_docs.py opens the built site in Debian's Chromium (headless); CI runs as root.
browser:
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
	  || echo "chromium could not be installed; tests/test_docs.py will skip"

clean:
	rm -rf $(VENV) site build *.egg-info .pytest_cache
