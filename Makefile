# The two README commands. Both create .venv and install requirements.txt first (once; again when it changes).
#   make quickstart   the whole pipeline on the CPU: prepare python-docs, train 3 ZeRO-3 processes, evaluate
#   make test         the test suite (real multi-process ZeRO-3 runs on the CPU, 3 workers; docs/testing.md)
#   make test-fast    the edit loop: no multi-process launch, no minute-long single run (about a minute)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup quickstart test test-fast
setup: $(VENV)/.installed

# The packages byte-compiled on all cores, not by pip on one: 2-core AMD EPYC, 106 s installing with pip's compile,
# 36 + 45 s this way. Some packages ship files that are no Python 3 (templates): compileall fails on them, pip skips them.
$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

quickstart: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash quickstart.sh

test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests -n 3 --dist loadfile --no-loadscope-reorder --durations=12

test-fast: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" TEST_TIER=fast $(PY) -m pytest tests -m "not launch and not slow" -n 2 --durations=8
