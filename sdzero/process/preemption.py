"""Preemption: SIGTERM / SIGUSR1 become a checkpoint at the next step boundary and exit code 143.

The handler only records the signal. The ranks agree at the end of each optimizer step, inside the small
collective the loop already makes for its step statistics, so a signal that reached one rank stops all of
them at the same step (Slurm signals every task, a single `kill` signals one). A watchdog bounds the
time: if the save hangs (a rank died, a filesystem stalls), the process exits with EXIT_WATCHDOG (75, not
143: "stopped without a new checkpoint" must not read as "saved"), and the unfinished checkpoint, having no
manifest, is never loaded.

DataLoader workers ignore these signals: a launcher or Slurm signals the whole process tree, and a worker
killed by SIGTERM makes the main process raise before it can save.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import types
from collections.abc import Callable
from typing import Any

log = logging.getLogger("sdzero.process.preemption")

EXIT_PREEMPTED = 143
"""128 + SIGTERM, what schedulers expect from a job that stopped on request (also used for SIGUSR1): the
checkpoint of the step it stopped at is committed."""
EXIT_WATCHDOG = 75
"""EX_TEMPFAIL: the preemption save did not finish in --preempt-timeout-s; resume from an older checkpoint."""
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is committed; the interpreter exits with 143."""

    def __init__(self) -> None:
        super().__init__(EXIT_PREEMPTED)


class PreemptionFlag:
    """Set by SIGTERM/SIGUSR1 on this rank; `requested` is what this rank contributes to the agreement."""

    def __init__(self, timeout_s: float, timer: Callable[..., Any] = threading.Timer) -> None:
        """`timer(interval, function, args=...)` starts the watchdog (threading.Timer; tests pass one they
        fire themselves instead of sleeping)."""
        self.timeout_s = timeout_s
        self.signum: int | None = None
        self._timer = timer
        self._watchdog: Any = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> PreemptionFlag:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            self._watchdog = self._timer(self.timeout_s, _give_up, args=(self.timeout_s,))
            self._watchdog.daemon = True
            self._watchdog.start()

    def disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()


def _give_up(timeout_s: float) -> None:
    log.error(
        "preemption: no complete checkpoint within %.0f s of the signal; exiting with %d without one",
        timeout_s,
        EXIT_WATCHDOG,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_WATCHDOG)


def ignore_preemption_signals(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: leave SIGTERM/SIGUSR1 to the rank process (see the module docstring)."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def exit_now(code: int) -> None:
    """Leave at once after flushing, skipping interpreter teardown: it would join DataLoader workers,
    which ignore SIGTERM (see above), and wait on them forever after the checkpoint is already safe."""
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
