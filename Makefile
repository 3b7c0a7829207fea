# Every target sets itself up: a fresh clone needs only Python 3.10+ and pip.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
EXTRAS ?= all,dev
PYTEST_ARGS ?=

.PHONY: install test lint demo bench docs clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m examples.demo

bench: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS),bench]"
	$(PY) benchmarks/mha.py
	$(PY) benchmarks/local.py
	$(PY) benchmarks/adapters.py

docs: $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS),docs]"
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) out site .pytest_cache .ruff_cache .hypothesis
