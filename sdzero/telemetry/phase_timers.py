"""Phase times within one optimizer step, without stopping the GPU's queue unless asked.

Three ways to time a phase (data, encode, forward, backward, optimizer), chosen by `timing_mode`:

- "host" (CPU device): wall time around each phase. CPU kernels run synchronously, so the wall time of a
  phase is its work; nothing else is needed.
- "events" (CUDA, the default there): a CUDA event is recorded on the current stream where each phase starts
  and ends. Recording is asynchronous (no CPU-GPU sync point): the CPU keeps queuing kernels. The times are
  read once per optimizer step, from `PendingPhases.seconds()`, which waits only for that step's last event;
  the loop reads a step's times after it has queued the next step, so by then the events have long passed.
  A phase's time is then the GPU's timeline between its two events: the GPU work queued in it, plus any
  time the GPU sat idle waiting for the host inside it (a slow data phase shows up as idle GPU time).
- "sync" (CUDA with `--sync-timing`): `torch.cuda.synchronize()` at each phase's end and wall time, the
  exact per-phase attribution of host and device work together that the advisor's trials model. Each sync
  stops the CPU from queuing ahead: it costs throughput, most at small batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sdzero.telemetry import progress

TIMING_MODES = ("host", "events", "sync")


def timing_mode(device: torch.device, sync_timing: bool) -> str:
    """How the loop times phases on `device` (see the module docstring)."""
    if device.type != "cuda":
        return "host"
    return "sync" if sync_timing else "events"


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class PendingPhases:
    """One step's phase times, read when asked: at once for host/sync timing, from events otherwise."""

    def __init__(self, seconds: dict[str, float], spans: list[tuple[str, Any, Any]]) -> None:
        self._seconds = seconds
        self._spans = spans

    def seconds(self) -> dict[str, float]:
        if self._spans:
            # Waits for this step's last event only: a host wait, never a device-wide synchronize, and by
            # the time the loop asks (one step later) the event has passed, so nothing waits at all.
            self._spans[-1][2].synchronize()
            for name, start, end in self._spans:
                self._seconds[name] = self._seconds.get(name, 0.0) + start.elapsed_time(end) / 1e3
            self._spans = []
        return self._seconds


class PhaseTimer:
    """Accumulates time per phase within one optimizer step (`begin_step` ... `end_step`).

    `event_factory` makes the timing events (CUDA events; tests pass stand-ins to run on a CPU).
    """

    def __init__(self, mode: str, event_factory: Callable[[], Any] = _cuda_event) -> None:
        if mode not in TIMING_MODES:
            raise ValueError(f"timing mode must be one of {TIMING_MODES}, got {mode!r}")
        self.mode = mode
        self._event = event_factory
        self._seconds: dict[str, float] = {}
        self._spans: list[tuple[str, Any, Any]] = []

    def begin_step(self) -> None:
        self._seconds, self._spans = {}, []

    def end_step(self) -> PendingPhases:
        return PendingPhases(self._seconds, self._spans)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # The rank's progress record (plain stores into shared memory: no sync, no system call)
        progress.enter(progress.TIMER_PHASES.get(name, "callbacks"))
        if self.mode == "events":
            start = self._event()
            start.record()
            try:
                yield
            finally:
                end = self._event()
                end.record()
                self._spans.append((name, start, end))
            return
        begin = time.perf_counter()
        try:
            yield
        finally:
            if self.mode == "sync":
                torch.cuda.synchronize()  # a CPU-GPU sync point, only with --sync-timing
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - begin
