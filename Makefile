# Two entry points: `make up` (a local mesh serving a model) and `make test` (the whole suite).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test test-busy test-fast test-bench

# --no-compile: pip would byte-compile every module of every package (torch, transformers, onnx...), most of which
# nothing here imports: 19 s -> 5 s for torch alone. A module is compiled when first imported instead, and its .pyc
# kept (this Makefile unsets PYTHONDONTWRITEBYTECODE for what it runs).
PIP := $(PY) -m pip install -q --no-compile
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first, pinned to the CPU build: otherwise dependents pull a multi-GB CUDA build.
	$(PIP) -c constraints.txt torch==2.13.0
	$(PIP) -c constraints.txt -e '.[test]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/stratamesh up

# The admin UI's browser test drives Debian's chromium (it skips, saying why, where it cannot be installed).
BROWSER := /usr/bin/chromium
$(BROWSER):
	apt-get install -y -q --no-install-recommends chromium >/dev/null \
	  || (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null) \
	  || echo "chromium could not be installed: the admin UI test will be skipped"

# The WAN test bed's NAT'd sites masquerade with nft (its tests skip, saying why, where it cannot be installed).
NFT := /usr/sbin/nft
$(NFT):
	apt-get install -y -q --no-install-recommends nftables >/dev/null \
	  || (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends nftables >/dev/null) \
	  || echo "nftables could not be installed: the NAT tests will be skipped"

# A pytest-xdist worker a core (the whole suite: 1179 s -> 837-871 s on 2 cores). The tests that start real processes
# (marked slow) spread over the workers like the rest, so two meshes may run at once: each must bear the other's load,
# as on a shared CI box. They are collected first (tests/conftest.py), and a worker that runs out of tests takes half
# of the other's (worksteal): the run ends on short tests on both, not on one long test while the other idles.
# One worker more than the cores, and two at least (on one core too, `taskset -c 0 make test`): much of an
# end-to-end test is waiting on its processes or on an emulated link, which another worker's test fills (on this
# 2-core VM, 3 workers ran the suite in 537 s of pytest against 581 s with 2).
WORKERS := $(shell python3 -c 'import os; print(max(2, len(os.sched_getaffinity(0)) + 1))')
XDIST := -n $(WORKERS) --dist worksteal
# The suite starts ~250 Python processes (agents, coordinators, benchmarks, CLI calls): with PYTHONDONTWRITEBYTECODE
# set, as on some CI boxes, each would compile this project's modules again (~0.1-0.15 s of CPU an agent).
export PYTHONDONTWRITEBYTECODE :=

# The coordinators' lease runs on a real PostgreSQL server, Debian's (its tests skip, saying why, where it cannot be
# installed or started).
PG := /usr/bin/pg_lsclusters
$(PG):
	apt-get install -y -q --no-install-recommends postgresql >/dev/null \
	  || (apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends postgresql >/dev/null) \
	  || echo "postgresql could not be installed: the PostgreSQL tests will be skipped"

# The suite leaves out the benchmarks' smoke runs (marked bench: a script under benchmarks/, a `stratamesh bench`
# command; 770 s of a worker's time, a third of the suite's, on a slow 2-core VM); `make test-bench` runs them.
test: $(STAMP) $(BROWSER) $(NFT) $(PG)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -ra --durations=25 -m "not bench" $(XDIST)

# The suite as on a shared CI box: another process keeps one core busy all along (`.ci/run --busy`).
test-busy: $(STAMP) $(BROWSER) $(NFT) $(PG)
	$(PY) -c 'while True: pass' & busy=$$!; trap "kill $$busy" EXIT; \
	  HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -ra --durations=25 -m "not bench" $(XDIST)

# The benchmarks' smoke runs (each benchmark once, tiny, printing its table).
test-bench: $(STAMP) $(NFT)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -ra --durations=25 -m bench $(XDIST)

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q -m "not slow" $(XDIST)
