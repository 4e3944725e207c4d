# sdzero: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel by default (small, on this machine's disk); on GPU machines: make venv TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0
# mpi4py needs an MPI toolchain (apt: libopenmpi-dev openmpi-bin); it is added when mpicc is present.
EXTRAS ?= dev,tensorboard,wandb,parquet$(shell command -v mpicc >/dev/null 2>&1 && echo ,mpi)
PYTEST_ARGS ?=
# The versions the tests passed with (pip constraints: they pin whatever gets installed, and add nothing).
# pyproject.toml keeps floors for library users; see docs/cluster.md for updating the lock (`make lock`).
LOCK ?= requirements/lock.txt
# DeepSpeed's JIT-built ops live with the venv: two checkouts sharing ~/.cache/torch_extensions rebuild
# each other's ops, and a rank killed mid-build leaves a lock that makes every later launch wait forever.
# `import sdzero` points DeepSpeed at this folder in every process (sdzero/__init__.py), shell or make;
# a TORCH_EXTENSIONS_DIR of your own wins there and here.
TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: venv demo test test-unit lint format bench clean lock gpu-bundle

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c $(LOCK) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	@# DeepSpeed builds its ops just in time; build the ones the trainer uses once here, not inside a
	@# timed (and possibly killed) job: Adam (fused and CPU) and, on CPUs, the shared-memory collectives.
	@# FusedAdam only where a CUDA toolkit matching torch's CUDA exists (sdzero/training/adam_kernel.py):
	@# elsewhere runs use torch's fused AdamW, and this says so in one line.
	@# A build killed midway leaves its `lock` file, and torch then waits for it forever: no build takes
	@# 30 minutes, so an older lock is a dead one.
	@mkdir -p "$(TORCH_EXTENSIONS_DIR)"
	@find "$(TORCH_EXTENSIONS_DIR)" -name lock -mmin +30 -print -delete 2>/dev/null | sed 's/^/removed stale build lock: /' || true
	@# Its output goes to a log, shown when the build fails: a pipe into tail would hide the failure.
	@$(BIN)/python -m sdzero.training.adam_kernel > $(VENV)/prebuild.log 2>&1 || { tail -n 20 $(VENV)/prebuild.log; exit 1; }
	@tail -n 1 $(VENV)/prebuild.log
	touch $@

demo: venv
	$(BIN)/sdzero demo --out demo

# The unit tier on both cores (pytest-xdist: single-process tests, so two workers cannot collide), then
# every multi-rank tier one test at a time (two launches at once would share 2 cores and time out).
test: test-unit
	$(BIN)/pytest -q --durations=25 $(PYTEST_ARGS) tests --ignore=tests/unit

test-unit: venv
	$(BIN)/pytest -q -n 2 $(PYTEST_ARGS) tests/unit

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python bench/trainer_overhead.py

# Wheels for an offline GPU machine (Python 3.12, CUDA torch, no deepspeed/diffusers/hjson/pydantic) in the
# ignored build/gpu-wheelhouse (40 MiB at most); bench/gpu_first_run.py installs them there. docs/gpu.md.
gpu-bundle: venv
	$(BIN)/python bench/gpu_bundle.py --out build/gpu-wheelhouse --max-mib 40

# Rewrite $(LOCK) from this venv, once the tests pass with what it holds (after `$(BIN)/pip install -U X`).
# Local version labels (torch's +cpu) are dropped: the same line then pins the CUDA wheel on GPU machines.
lock: venv
	@{ echo "# Tested versions: \`make venv\` installs with \`pip install -c $(LOCK)\`. Regenerate: \`make lock\`."; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^#' | sed -E 's/^([^=]+==[^+]+)\+.*/\1/'; } > $(LOCK).tmp
	mv $(LOCK).tmp $(LOCK)
	@echo "wrote $(LOCK) ($$(grep -vc '^#' $(LOCK)) pins)"

clean:
	rm -rf demo .pytest_cache
