# Every target sets itself up: a fresh clone needs only Python 3.10+ and pip.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
EXTRAS ?= all,dev
# Two workers (the CI machine has 2 cores); loadfile keeps a file's module fixtures on one worker.
PYTEST_ARGS ?= -n 2 --dist loadfile
# pip installs without byte-compiling (two minutes of one core for every file of torch and
# the extras); Python writes the byte code of what is imported, on first import, into .venv
# and __pycache__/ (git ignores both). Where PYTHONDONTWRITEBYTECODE is set (the machines
# we test on set it), every process of the suite would compile torch's sources anew.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install test test-flex test-floor test-latest lint demo bench docs docs-check clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

# The suite runs with the fused-attention switch both ways; the second run skips the
# examples, which do not depend on the switch beyond what tests/mmattn covers, the slow tests
# (the inductor sweep, the ONNX Runtime and transformers model files, the longest dynamic=True
# captures; the aot_eager sweep still compiles the explicit path) and the tests that run
# both paths themselves (pins_path, see tests/conftest.py). docs/decisions.md: "CI stays
# under 15 minutes".
# The compiled-FlexAttention sweep over every pattern (one CPU compile per mask_mod, about 19
# minutes with a cold inductor cache) runs in `make test-flex`; `make test` keeps its two
# always-on cases (docs/decisions.md, "Flex sweep outside make test").
test: $(STAMP) lint
	MMATTN_FUSED_ATTN=1 $(PY) -m pytest $(PYTEST_ARGS) -m "not flex_sweep"
	MMATTN_FUSED_ATTN=0 $(PY) -m pytest $(PYTEST_ARGS) -m "not slow and not pins_path" tests/mmattn tests/adapters

# The declared floors, tested (issue 41): a second venv with exactly pyproject's floors
# (tools/floors.py turns each `name>=X` of the core and of FLOOR_EXTRAS into `name==X`, so
# the two cannot drift; the test tools at their pins), then tests/mmattn and tests/adapters
# without the slow tests, on the fused path (the default). Not the onnx, examples and docs
# extras: their floors are read off release notes (docs/decisions.md, "Packaging: the floors
# and why"). Measured on a 2-core machine shared with other jobs: 2.5 minutes to install,
# 16 to test (1863 passed). A feature the floor's torch lacks is skipped by name
# (tests/_features.py).
FLOOR_VENV   := .venv-floor
FLOOR_EXTRAS ?= vision,audio,graph,timm,hf
FLOOR_TOOLS  := pytest,pytest-xdist,hypothesis
FLOOR_STAMP  := $(FLOOR_VENV)/.installed

$(FLOOR_STAMP): pyproject.toml constraints.txt tools/floors.py
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PYTHON) tools/floors.py --extras $(FLOOR_EXTRAS) --tools $(FLOOR_TOOLS) \
		> $(FLOOR_VENV)/floors.txt
	$(FLOOR_VENV)/bin/python -m pip install --quiet --no-compile -r $(FLOOR_VENV)/floors.txt
	$(FLOOR_VENV)/bin/python -m pip install --quiet --no-compile --no-deps -e .
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	MMATTN_FUSED_ATTN=1 $(FLOOR_VENV)/bin/python -m pytest $(PYTEST_ARGS) -m "not slow" tests/mmattn tests/adapters

# The newest releases: what `pip install mmattn[all]` gives a new user today (no
# constraints.txt), the same tests as test-floor. A release-time command, not in .ci/run
# (another 5 GB venv and 15 minutes); a pip configuration that caps versions still applies.
LATEST_VENV := .venv-latest

test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --no-compile -e ".[all,dev]"
	$(LATEST_VENV)/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|torchvision|torchaudio|torch.geometric|timm|transformers|einops) '
	$(LATEST_VENV)/bin/python -m pytest $(PYTEST_ARGS) -m "not slow" tests/mmattn tests/adapters

test-flex: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m flex_sweep tests/mmattn

demo: $(STAMP)
	$(PY) -m examples.demo

# Every benchmark writes its table into docs/performance.md (between its bench markers).
# natten builds against the installed torch: it installs without build isolation, first,
# so that the bench extra finds it satisfied.
bench: $(STAMP)
	$(PY) -m pip install --quiet --no-build-isolation -c constraints.txt natten
	$(PY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS),bench]"
	$(PY) benchmarks/mha.py --write-docs
	$(PY) benchmarks/local.py --write-docs
	$(PY) benchmarks/adapters.py --rounds 15 --write-docs
	$(PY) benchmarks/variants.py --write-docs
	$(PY) benchmarks/decode.py --write-docs
	$(PY) benchmarks/varlen.py --write-docs
	$(PY) benchmarks/compile.py --write-docs
	$(PY) benchmarks/seqpar.py --write-docs
	$(PY) benchmarks/huggingface.py --write-docs
	$(PY) benchmarks/edge.py --write-docs
	$(PY) benchmarks/neighborhood.py --write-docs
	$(PY) benchmarks/export.py --write-docs
	$(PY) benchmarks/streaming.py --write-docs
	$(PY) benchmarks/mass.py --write-docs

# The docs tools come with the dev extra; --strict turns every warning (a broken link, a
# docstring mkdocstrings cannot read) into a failure. The site carries its own MathJax
# (docs/_tools/mkdocs/hooks.py copies it from the docs extra): it needs no network.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# Every page of the built site in headless Chromium with the network off: formulas typeset,
# images loaded, no request leaving 127.0.0.1 (docs/_tools/docs_check.py). Debian's chromium,
# never a downloaded browser; without one it skips with the reason, unless
# DOCS_CHECK_ARGS=--require-browser (as .ci/run, which installs it).
DOCS_CHECK_ARGS ?=
docs-check: docs
	$(PY) docs/_tools/docs_check.py --site site $(DOCS_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(LATEST_VENV) out site .pytest_cache .ruff_cache .hypothesis
