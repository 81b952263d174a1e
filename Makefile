# Two entry points, each doing all of the set-up on a fresh machine with Python 3.10+:
#   make docs   executes every chapter and builds the book into _docs/
#   make test   runs the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: docs test setup execute sync check-sync export-check clean-check site bench clean

setup: $(STAMP)

# torch 2.13.0 first: on the project's machines that release is a CPU build on local disk; a bare
# `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): settings.ini setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# Execute every chapter in place so that each output and figure in the book comes from the code.
execute: setup
	$(BIN)/nbdev_export
	$(BIN)/python tools/execute_nbs.py nbs
	$(BIN)/nbdev_clean
	$(BIN)/jupytext --sync nbs/[0-9]*.ipynb >/dev/null

docs: execute site

site: setup
	$(BIN)/python tools/build_site.py

# Keep the py:percent twins under text/ in step after editing a notebook (or a twin).
sync: setup
	$(BIN)/jupytext --sync nbs/[0-9]*.ipynb

test: setup
	$(BIN)/python -m pytest -n auto

bench: setup
	$(BIN)/python bench/bench_forward.py

clean:
	rm -rf _proc _docs .pytest_cache
