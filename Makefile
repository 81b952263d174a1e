# Two entry points, each doing all of the set-up on a fresh machine with Python 3.10+:
#   make docs   executes every chapter and builds the book into _docs/
#   make test   runs the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: docs test test-fast screenshots test-perturbed test-other-kernels fresh-clone setup execute sync check-sync export-check clean-check site bench clean

setup: $(STAMP)

# torch 2.13.0 first: on the project's machines that release is a CPU build on local disk; a bare
# `torch` requirement would pull a multi-GB CUDA build.
# The site needs KaTeX, Observable Plot and d3 from the npm registry (package-lock.json); the browser test needs Debian's
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
# from the outputs saved in the notebooks; also writes README.md, nbs/sidebar.yml and the front page's interactive
# figure's data and charting library (nbs/js/, ignored by git; tools/explorable_data.py).
site: setup
	$(BIN)/python tools/build_site.py

# The site's browser test again, writing a screenshot of every page at both widths to _docs/_screenshots/ to look at.
screenshots: setup
	ICTD_SCREENSHOTS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_site.py -k browser

# Keep the py:percent twins under text/ in step after editing a notebook (or a twin).
sync: setup
	$(BIN)/jupytext --sync nbs/[0-9]*.ipynb

# The full suite (what CI runs): every tier, unit, claims (statistics over seeds) and book (notebooks, site, packaging).
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto --durations=20

# The edit loop's quick check: the `unit` tier only (under a minute).
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto -q -m unit

# Claims that survive another CPU: the `claims` tier and every chapter's embedded checks again, with every initial
# parameter of every training run nudged by a relative 1e-9 (ICTD_PERTURB, chapter A). The rebuild test is left out:
# it compares printed digits with the committed notebooks, which a nudge changes by design.
test-perturbed: setup
	ICTD_PERTURB=1e-9 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto -q -m claims
	ICTD_PERTURB=1e-9 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto -q tests/test_notebooks.py

# The rebuild test with another set of torch's CPU kernels than this CPU's default, so that a printed digit or a figure
# that depends on the kernels' rounding fails here: AVX2 on a CPU whose default is AVX-512, plain (unvectorised)
# kernels on an AVX2 CPU. (The committed notebooks were executed on an AVX-512 CPU; `make test` checks them here.)
OTHER_KERNELS = $(BIN)/python -c "import torch; print('avx2' if torch.backends.cpu.get_cpu_capability() == 'AVX512' else 'default')"
test-other-kernels: setup
	ATEN_CPU_CAPABILITY=$$($(OTHER_KERNELS)) OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto -q tests/test_rebuild.py

# On a fresh clone of the committed HEAD, in a temporary folder, with wall times: what CI runs (.ci/run; `make test`
# first, on the committed files as they are), then `make docs`, which must leave the tracked files unchanged.
fresh-clone:
	bash tools/fresh_clone_check.sh

# Speed and memory of the pretraining engine and the forward pass, with ratios measured in one run (among them the
# predecessor's linear protocol through the engine against its old side loop); writes bench/results.json, which the
# CLI chapter shows (commit it after running on a quiet machine).
bench: setup
	OMP_NUM_THREADS=1 $(BIN)/python bench/bench_engine.py

clean:
	rm -rf _proc _docs .pytest_cache
