# Two entry points: `make up` (a local mesh serving a model) and `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test test-fast

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the CPU build: otherwise dependents pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/stratamesh up

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -ra

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -m "not slow"
