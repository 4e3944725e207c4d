"""Test-only faults, injected into the trainer's ranks as a Trainer callback (sdzero.training.callbacks).

The ranks load it through SDZERO_CALLBACKS=fault_callbacks:from_env with this folder on their PYTHONPATH
(`fault_env` sets both); each fault is armed by its own variable:

- SDZERO_TEST_CRASH_AT_STEP=N: every rank raises InjectedCrash at the start of step N (the advisor's
  failure tests read its name in the trial's reason);
- SDZERO_TEST_HANG_AT_STEP=N: every rank sleeps for ever there;
- SDZERO_TEST_SAMPLE_LOG=DIR: each rank appends the (epoch, sample indices) of every micro-batch it trains
  on to DIR/rank_<r>.jsonl, so a test can check that resumes neither repeat nor skip a sample;
- SDZERO_TEST_KILL_BEFORE_COMMIT=N: rank 0 SIGKILLs itself once every shard of step N's checkpoint is
  written and hashed, before the commit;
- SDZERO_TEST_SLOW_HOST=HOSTNAME:SECONDS: the ranks on host HOSTNAME sleep SECONDS in every micro-batch's
  data phase (a slow disk or loader on one node: a straggler);
- SDZERO_TEST_OOM_FROM_MICRO_BATCH=N: every rank raises torch.OutOfMemoryError on a micro-batch of N samples
  or more, as a device that cannot hold it would (the config sweep's tests).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from sdzero.models.step_input import StepInput
from sdzero.training.callbacks import CALLBACKS_ENV, Callback

SUPPORT = Path(__file__).resolve().parent
CRASH_AT = "SDZERO_TEST_CRASH_AT_STEP"
HANG_AT = "SDZERO_TEST_HANG_AT_STEP"
SAMPLE_LOG = "SDZERO_TEST_SAMPLE_LOG"
KILL_BEFORE_COMMIT = "SDZERO_TEST_KILL_BEFORE_COMMIT"
OOM_FROM = "SDZERO_TEST_OOM_FROM_MICRO_BATCH"
SLOW_HOST = "SDZERO_TEST_SLOW_HOST"
FACTORY = "fault_callbacks:from_env"


class InjectedCrash(RuntimeError):
    """Raised at the start of step SDZERO_TEST_CRASH_AT_STEP."""


def _step(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


class Faults(Callback):
    def __init__(self) -> None:
        self.crash_at, self.hang_at = _step(CRASH_AT), _step(HANG_AT)
        self.kill_at = _step(KILL_BEFORE_COMMIT)
        self.oom_from = _step(OOM_FROM)
        host, _, seconds = os.environ.get(SLOW_HOST, "").partition(":")
        self.slow_s = float(seconds) if host and host == socket.gethostname() else 0.0
        folder = os.environ.get(SAMPLE_LOG)
        self.sample_log = Path(folder) if folder else None
        self._log_path: Path | None = None

    def on_setup(self, trainer: Any) -> None:
        if self.sample_log is not None:
            self._log_path = self.sample_log / f"rank_{trainer.rank}.jsonl"

    def on_step_begin(self, trainer: Any, step: int) -> None:
        if step == self.crash_at:
            raise InjectedCrash(f"injected crash at step {step} ({CRASH_AT})")
        if step == self.hang_at:
            print(f"sdzero: injected hang at step {step} ({HANG_AT})", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def on_batch(self, trainer: Any, batch: StepInput) -> None:
        if self.slow_s:
            time.sleep(self.slow_s)
        if self.oom_from is not None and len(batch.index) >= self.oom_from:
            import torch

            raise torch.OutOfMemoryError(
                f"injected: out of memory at micro-batch {len(batch.index)} ({OOM_FROM})"
            )
        if self._log_path is not None:
            with open(self._log_path, "a") as f:
                f.write(json.dumps({"epoch": trainer.batches.epoch, "index": batch.index.tolist()}) + "\n")

    def on_checkpoint_staged(self, trainer: Any, step: int, folder: Path) -> None:
        if trainer.rank == 0 and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def from_env() -> Faults | None:
    """The SDZERO_CALLBACKS factory: a Faults callback when any fault variable is set."""
    if not any(
        os.environ.get(name)
        for name in (CRASH_AT, HANG_AT, SAMPLE_LOG, KILL_BEFORE_COMMIT, OOM_FROM, SLOW_HOST)
    ):
        return None
    return Faults()


def fault_env(faults: dict[str, str]) -> dict[str, str]:
    """The environment that arms `faults` ({variable: value}) in ranks started from this process."""
    path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))
    return {CALLBACKS_ENV: FACTORY, "PYTHONPATH": path, **faults}
