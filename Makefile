# sdzero: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel by default (small, on this machine's disk); on GPU machines: make venv TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
# mpi4py needs an MPI toolchain (apt: libopenmpi-dev openmpi-bin); it is added when mpicc is present.
EXTRAS ?= dev$(shell command -v mpicc >/dev/null 2>&1 && echo ,mpi)
PYTEST_ARGS ?=
# DeepSpeed's JIT-built ops live with the venv: two checkouts sharing ~/.cache/torch_extensions rebuild
# each other's ops, and a rank killed mid-build leaves a lock that makes every later launch wait forever.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: venv demo test test-unit lint format bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	@# DeepSpeed builds its ops just in time; build the ones the trainer uses once here, not inside a
	@# timed (and possibly killed) job: Adam (fused and CPU) and, on CPUs, the shared-memory collectives.
	@# A build killed midway leaves its `lock` file, and torch then waits for it forever: no build takes
	@# 30 minutes, so an older lock is a dead one.
	@find "$(TORCH_EXTENSIONS_DIR)" -name lock -mmin +30 -print -delete 2>/dev/null | sed 's/^/removed stale build lock: /' || true
	$(BIN)/python -c "import torch; from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam; \
	  from deepspeed.accelerator import get_accelerator; \
	  p = [torch.nn.Parameter(torch.zeros(1))]; FusedAdam(p); DeepSpeedCPUAdam(p); \
	  b = get_accelerator().create_op_builder('ShareMemCommBuilder'); b is None or b.load()" >/dev/null
	touch $@

demo: venv
	$(BIN)/sdzero demo --out demo

test: venv
	$(BIN)/pytest -q --durations=25 $(PYTEST_ARGS) tests

test-unit: venv
	$(BIN)/pytest -q -m "not dist and not multinode" tests

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python bench/trainer_overhead.py

clean:
	rm -rf demo .pytest_cache
