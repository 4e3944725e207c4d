"""One config's measurements inside a launch of several (sdzero.training.measuring.sweep): a `Probe` told by the
launch's driver what kind each step is, installed in the Trainer's measuring slot while its config runs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from sdzero.training.measuring.probe import Probe


class ConfigProbe(Probe):
    """One config's measurements inside a sweep; the sweep tells it what kind of step comes next."""

    def __init__(self, engine: Any, ds: Any, frozen: tuple[torch.nn.Module, ...], out: Path) -> None:
        super().__init__(engine, ds, frozen, out, warmup_steps=0)
        self.kinds: dict[int, str] = {}
        """Each step's kind: "warmup" (uncounted), "instrumented" (comms logger, timers, memory meters) or
        "timed" (nothing a user's run lacks). By step: on CUDA a step's record arrives a step late."""
        self.comm_result: dict[str, Any] | None = None
        self.peak_cuda: int | None = None
        self.step_at: list[float] = []
        self.loader_wait_apart = False
        """Loader workers feed the steps: their wait is taken out of the step (see on_metrics)."""
        """Epoch seconds at the end of each timed step (where the advisor puts the config in time)."""

    def on_step_begin(self, trainer: Any, step: int) -> None:
        if self.kinds.get(step) == "instrumented":
            self._arm_instruments()
            self.comm.reset()

    def on_step_queued(self, trainer: Any, step: int) -> None:
        if self.kinds.get(step) != "instrumented":
            return
        self._disarm_instruments()
        mark = self.comm.elapsed_s()
        result = self.comm.totals(1)
        self.comm.close()
        # A config has two instrumented steps (its first and second visits); the one with less time in
        # collectives is kept: other work on the machine only ever adds time to a collective, and one
        # slowed step would be read as the config's communication (and taken out of its compute).
        kept = self.comm_marks[0] if self.comm_marks else None
        if kept is not None and mark is not None and mark >= kept:
            return
        self.comm_marks = [] if mark is None else [mark]
        self.comm_result = result
        if self.engine.wall_clock_breakdown():
            cache = self.engine.get_wall_clock_timers()
            self.ds_timers = [
                {
                    k: cache[k] / 1e3
                    for k in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
                    if k in cache
                }
            ]

    def on_metrics(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
        if self.kinds.get(step) == "timed":
            if self.loader_wait_apart and record.get("data_s"):
                # The step without its wait on the loader workers: the input's own rate is measured apart
                # (sdzero.data.input_probe) and bounds the plan there (advisor.model.input_rate); kept in
                # the step, a trial starved by its input would be read as slow compute at every node count.
                wait = min(float(record["data_s"]), float(record["step_time_s"]))
                record = {**record, "step_time_s": record["step_time_s"] - wait, "input_wait_s": wait}
            self.records.append(record)
            self.step_at.append(time.time())

    def wants_stop(self, trainer: Any) -> bool:
        return False  # the launch's driver decides when it ends (sdzero.training.measuring.race)

    def on_finish(self, trainer: Any) -> None:
        """Nothing: the launch writes every config's profile itself (ConfigSweep), not one probe's file."""

    def comm_totals(self) -> dict[str, Any] | None:
        return self.comm_result

    def cuda_peak(self) -> int | None:
        return self.peak_cuda

    def figures(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        profile = self._summary(ranks)
        profile["stopped_by"] = "launch"
        profile["measured_at"] = statistics.median(self.step_at) if self.step_at else None
        return profile
