# Two commands do all the set-up on a fresh machine:
#   make run    execute every lesson notebook (papermill, CPU default preset) into out/, with an HTML page each + index
#   make test   unit tests, multi-process tests, every notebook at the smoke preset (papermill + nbval),
#               and the browser test (JupyterLab and the HTML book in headless Chromium; skips without one)
# Both create .venv first when it is missing.

PY      ?= $(shell command -v python3.11 || command -v python3)
VENV    := .venv
BIN     := $(VENV)/bin
PRESET  ?= default
JOBS    ?= 2
TORCH   ?= torch==2.13.0

.PHONY: run test test-browser book env notebooks refresh lab bench clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml $(wildcard */__init__.py) | $(BIN)/activate
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
	$(BIN)/python -m toolkit.jupyter install >/dev/null  # saved notebooks keep live plotly figures
	touch $@

env: $(VENV)/.installed

run: env
	$(BIN)/python tools/run_all.py --preset $(PRESET) --out out

test: env
	$(BIN)/python -m pytest -n $(JOBS) --dist loadfile --nbval-lax --timeout 900 tests notebooks

test-browser: env      ## JupyterLab and the HTML book in headless Chromium (apt-get install -y chromium)
	$(BIN)/python -m pytest -m browser -p no:cacheprovider --timeout 900 tests/test_browser.py

book: env               ## rewrite the HTML book from out/notebooks without re-running them
	$(BIN)/python tools/book.py out

notebooks: env          ## rebuild notebooks/*.ipynb from notebooks/src/*.py
	$(BIN)/python tools/nb.py build

refresh: env            ## re-execute at smoke and store the outputs nbval checks
	$(BIN)/python tools/nb.py refresh

lab: env                ## JupyterLab on notebooks/ (saving drops plotly's PNG snapshots: toolkit/jupyter.py)
	$(BIN)/jupyter lab notebooks --ContentsManager.pre_save_hook=toolkit.jupyter.drop_plotly_snapshots

bench: env
	for b in benchmarks/bench_*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf out .pytest_cache
