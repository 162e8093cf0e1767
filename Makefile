# Two commands do all the set-up on a fresh machine (see README "Quick start"):
#   make demo   # create .venv, install shmstage (+ torch CPU 2.13.0), run `shmstage demo`
#   make test   # system packages (apt, as root), .venv with test deps, lint, the whole suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned: 2.13.0 resolves to a local CPU wheel on our nodes; anything
# else would download several GB of CUDA packages.
TORCH ?= torch==2.13.0
APT_PACKAGES := rsync libjpeg62-turbo-dev zlib1g-dev util-linux tar gzip binutils e2fsprogs \
	slurmctld slurmd slurm-client munge iproute2
# (slurm*, munge, iproute2: tests/test_slurm.py runs a real Slurm; `make slurm` starts one)
# and node + npm when npm is missing: tests/test_stage_objstores.py installs Azurite (the
# Azure Blob emulator) with npm into .cache/azurite
PYTEST_ARGS ?=

.PHONY: demo test lint deps clean docs slurm

$(BIN)/shmstage: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[torch,plot,test]" "$(TORCH)"
	touch $@

deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  command -v npm >/dev/null || missing="$$missing nodejs npm"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing system packages: $$missing" >&2; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  fi; \
	else echo "not root or no apt-get: make sure these are installed: $(APT_PACKAGES) nodejs npm" >&2; fi

demo: deps $(BIN)/shmstage
	$(BIN)/shmstage demo

# docs/cli.md is generated from the Click definitions (tests/test_docs.py checks it)
docs: $(BIN)/shmstage
	$(BIN)/python -m shmstage.cli.docgen > docs/cli.md

lint: $(BIN)/shmstage
	$(BIN)/ruff check shmstage tests benchmarks examples

# tests/suite.py: with no PYTEST_ARGS, tests/test_slurm.py (a real Slurm, mostly waiting on its
# clocks) runs in a second pytest beside the rest; with PYTEST_ARGS, exactly `pytest PYTEST_ARGS`
test: deps $(BIN)/shmstage lint
	$(BIN)/python -m tests.suite $(PYTEST_ARGS)

# A real 4-node Slurm on this machine (root: namespaces, a bridge, loop devices, a user),
# as tests/test_slurm.py runs it; it prints how to submit jobs, Ctrl-C stops and removes it.
# (-m from the checkout: the script imports tests.slurmstate)
slurm: deps $(BIN)/shmstage
	$(BIN)/python -m tests.slurmcluster

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache/azurite
