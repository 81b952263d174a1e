# Two entry points, each doing all of the set-up on a fresh machine with Python 3.10+:
#   make docs   executes every chapter and builds the book into _docs/
#   make test   runs the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: docs test test-fast setup execute sync check-sync export-check clean-check site bench clean

setup: $(STAMP)

# torch 2.13.0 first: on the project's machines that release is a CPU build on local disk; a bare
# `torch` requirement would pull a multi-GB CUDA build.
# The site needs KaTeX from the npm registry (package-lock.json) and the browser test needs Debian's
# chromium, installed with apt-get when we are root (elsewhere the test says how and is skipped).
$(STAMP): settings.ini setup.py package.json package-lock.json
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	if command -v npm >/dev/null; then npm ci --no-audit --no-fund --loglevel=error; else echo "npm not found: install Node.js to build the site (KaTeX)"; fi
	if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -q && apt-get install -y -q chromium; fi
	touch $@

# Execute every chapter in place so that each output and figure in the book comes from the code.
execute: setup
	$(BIN)/nbdev_export
	OMP_NUM_THREADS=1 $(BIN)/python tools/execute_nbs.py nbs
	$(BIN)/nbdev_clean
	$(BIN)/jupytext --sync nbs/[0-9]*.ipynb >/dev/null

docs: execute site

# The website: nbdev_docs where Quarto is installed, else nbdev's processing + smalldocs (seconds),
# from the outputs saved in the notebooks; also writes README.md and nbs/sidebar.yml.
site: setup
	$(BIN)/python tools/build_site.py

# Keep the py:percent twins under text/ in step after editing a notebook (or a twin).
sync: setup
	$(BIN)/jupytext --sync nbs/[0-9]*.ipynb

# The full suite (what CI runs): every tier, unit, claims (statistics over seeds) and book (notebooks, site, packaging).
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto

# The edit loop's quick check: the `unit` tier only (under a minute).
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto -q -m unit

# Speed and memory of the pretraining engine and the forward pass, with ratios measured in one run (among them the
# predecessor's linear protocol through the engine against its old side loop); writes bench/results.json, which the
# CLI chapter shows (commit it after running on a quiet machine).
bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_engine.py

clean:
	rm -rf _proc _docs .pytest_cache
