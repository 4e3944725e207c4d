"""The trainer's side of the progress record and the stall watch (sdzero.telemetry.progress,
sdzero.process.stall_watch): opened before the process group forms, so that start-up is watched too, and
closed with the Trainer.

Start-up phases are marked with `progress.enter` where setup runs them; each one's time is kept here and
logged by rank 0 as one line once training starts, so that a slow start says where it went.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sdzero.config.train_config import TrainConfig, rank_from_env
from sdzero.process.stall_watch import StallWatch, enable_flight_recorder
from sdzero.telemetry import progress
from sdzero.telemetry.progress import open_record, reap_stale, records_dir, run_key
from sdzero.training.startup import longest_line, longest_phase, share_phases

log = logging.getLogger("sdzero")

_WATCH: StallWatch | None = None


def nccl_backend() -> bool:
    """The process group will be NCCL's: DeepSpeed picks it on CUDA (the accelerator's backend)."""
    import torch

    return torch.cuda.is_available()


def start_watch(cfg: TrainConfig) -> StallWatch:
    """Open this rank's progress record and start its watcher thread; before the process group forms."""
    global _WATCH
    stop_watch()
    reap_stale()  # records of this host's killed runs (a SIGKILLed rank cannot remove its own)
    folder = records_dir(run_key(cfg.output_dir))
    record = open_record(folder, rank_from_env())
    nccl = nccl_backend()
    if nccl:
        enable_flight_recorder()  # read by torch when the NCCL group is created, so set before it
    _WATCH = StallWatch(record, folder, cfg.output_dir, cfg.stall_seconds, nccl=nccl).start()
    global _CLOCK
    _CLOCK = StartupClock()
    mark("process group")
    return _WATCH


def joined(world: int) -> None:
    """The process group formed: the watch now knows how many ranks to wait for."""
    if _WATCH is not None:
        _WATCH.set_world(world)


def output_ready() -> None:
    """The output folder is the run's (claimed): the watch may write its host files there."""
    if _WATCH is not None:
        _WATCH.output_ready()


def startup_line(phases: list[tuple[str, float]]) -> str:
    """`start-up 41 s: engine build 30 s, model load 6.1 s, ...` (largest first)."""
    total = sum(s for _, s in phases)
    parts = ", ".join(f"{name} {s:.3g} s" for name, s in sorted(phases, key=lambda p: -p[1]))
    return f"start-up {total:.3g} s: {parts}"


class StartupClock:
    """Marks each start-up phase in the record and keeps how long each took."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._name: str | None = None
        self._since = time.perf_counter()

    def enter(self, name: str | None) -> None:
        now = time.perf_counter()
        if self._name is not None:
            self.phases.append((self._name, now - self._since))
        self._name, self._since = name, now
        if name is not None:
            progress.enter(name)


_CLOCK = StartupClock()


def mark(name: str) -> None:
    """Setup entered start-up phase `name` (one of sdzero.telemetry.progress.PHASES)."""
    _CLOCK.enter(name)


def startup_done(rank: int) -> list[dict[str, Any]]:
    """Close the last start-up phase and share every rank's phases (one all-gather); rank 0 logs where its
    start-up went and the longest phase of any rank. Every rank's {rank, host, phases, total_s}."""
    _CLOCK.enter(None)
    ranks = share_phases(_CLOCK.phases)
    found = longest_phase(ranks)
    if rank == 0 and _CLOCK.phases:
        log.info("%s%s", startup_line(_CLOCK.phases), f"; {longest_line(found)}" if found else "")
    return ranks


def stop_watch() -> None:
    """Stop the watcher thread and remove this rank's record (a normal end, a crash, a preemption)."""
    global _WATCH
    if _WATCH is not None:
        _WATCH.stop()
        _WATCH = None
    progress.close_record()
