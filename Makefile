# The two README commands. Both create .venv and install requirements.txt first (once; again when it changes).
#   make quickstart   the whole pipeline on the CPU: prepare python-docs, train 3 ZeRO-3 processes, evaluate
#   make test         the test suite (real multi-process ZeRO-3 runs on the CPU, about 20 minutes on 2 cores, 2 workers)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup quickstart test
setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

quickstart: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash quickstart.sh

test: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests -n 2 --dist loadfile --durations=12
