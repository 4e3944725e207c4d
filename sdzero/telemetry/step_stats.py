"""Per-step statistics kept on the device until the metrics line needs them.

At each optimizer step's end the Trainer launches one small all-gather of (mean loss, peak memory, stop vote)
on the loss's device (`launch_step_stats`) and reads it back only when it writes that step's metrics line
(`StepLog.flush`). On a CUDA run with event timing the line is written one step late: step N's values are
read after step N+1 has been queued, so the read finds them done and the GPU never runs dry while the CPU
waits. On the CPU, and with `--sync-timing`, each step is read at its own end, as before.

The stop vote (SIGTERM/SIGUSR1) travels with the stats, so a lagged run acts on it one step later; every
rank reads the same gathered votes at the same step, so all still stop together.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sdzero.constants import STEP_PHASES as PHASES
from sdzero.telemetry.phase_timers import PendingPhases


class PendingStats:
    """The all-gathered (loss, peak bytes, stop) of every rank, still on the device."""

    def __init__(self, parts: list[torch.Tensor], world: int) -> None:
        self.parts, self.world = parts, world

    def resolve(self) -> tuple[float, list[int], bool]:
        # the one device-to-host copy of the step (a sync point, taken a step late on CUDA)
        table = torch.stack(self.parts).cpu().tolist()
        loss = sum(row[0] for row in table) / self.world
        return loss, [int(row[1]) for row in table], any(row[2] > 0 for row in table)


def launch_step_stats(
    loss_sum: torch.Tensor, micro_steps: int, world: int, stop: bool, peak_bytes: int
) -> PendingStats:
    """Start the per-step all-gather without reading anything back to the host.

    The tensor lives on the loss's device: NCCL has no CPU backend ("No backend type associated with device
    type cpu"); gloo takes CPU tensors. It is filled by device ops only: `float(loss_sum)`, or a tensor built
    from host values with `torch.tensor(..., device=cuda)`, would each synchronize the GPU."""
    local = torch.zeros(3, dtype=torch.float64, device=loss_sum.device)
    local[0] = loss_sum.detach().to(torch.float64) / micro_steps
    local[1] = float(peak_bytes)  # a fill with a host scalar: no sync
    local[2] = float(stop)
    parts = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(parts, local)
    return PendingStats(parts, world)


@dataclass
class PendingStep:
    """One optimizer step whose metrics line is not written yet; host values captured at its end."""

    step: int
    epoch: int
    start: float
    stats: PendingStats
    phases: PendingPhases
    fields: dict[str, Any] = field(default_factory=dict)
    """Host-side record fields taken at the step's end (lr, loss scale, skipped steps, batch shape)."""
    global_samples: int = 0
    """Samples trained so far (DeepSpeed's count, the x axis of its monitor)."""
    step_time_s: float | None = None
    """Wall time of the loop iteration that ran this step; None: measured when read (lag 0)."""


class StepLog:
    """Writes each step's metrics line when its stats are read, `lag` steps after the step."""

    def __init__(
        self,
        lag: int,
        global_batch: int,
        writer: Any,
        monitor: Any,
        on_record: Callable[[int, dict[str, Any]], None],
        bar: Any,
    ) -> None:
        self.lag, self.global_batch = lag, global_batch
        self.writer, self.monitor, self.on_record, self.bar = writer, monitor, on_record, bar
        self.pending: deque[PendingStep] = deque()
        self.losses: list[float] = []
        self.rates: list[float] = []

    def add(self, pending: PendingStep) -> bool:
        """Queue a finished step; write the lines now due. True if a written step carried a stop vote."""
        self.pending.append(pending)
        stop = False
        while len(self.pending) > self.lag:
            stop = self._write(self.pending.popleft()) or stop
        if self.pending:  # lag 1: the step still pending ran in this iteration, which ends here
            self.pending[-1].step_time_s = time.perf_counter() - self.pending[-1].start
        return stop

    def flush(self) -> None:
        """Write every pending line (after the last step)."""
        while self.pending:
            self._write(self.pending.popleft())

    def _write(self, p: PendingStep) -> bool:
        loss, peaks, stop = p.stats.resolve()
        step_time = p.step_time_s if p.step_time_s is not None else time.perf_counter() - p.start
        samples_per_s = self.global_batch / step_time
        self.losses.append(loss)
        self.rates.append(samples_per_s)
        seconds = p.phases.seconds()
        record = {
            "step": p.step,
            "epoch": p.epoch,
            "loss": loss,
            "samples_per_s": samples_per_s,
            "step_time_s": step_time,
            **{k: seconds.get(k, 0.0) for k in PHASES},
            **p.fields,
            "peak_mem_bytes": max(peaks),
            "peak_mem_bytes_per_rank": peaks,
        }
        if self.writer is not None:
            self.writer.write(record)
            if self.monitor is not None and self.monitor.enabled:
                # DeepSpeed's monitor logs lr and loss scale itself; the rank-mean loss is ours to add.
                self.monitor.write_events(
                    [
                        ("Train/Samples/train_loss", loss, p.global_samples),
                        ("Train/Samples/samples_per_s", samples_per_s, p.global_samples),
                    ]
                )
        self.on_record(p.step, record)  # the Trainer's on_metrics event
        self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_s:.1f}")
        self.bar.update(1)
        return stop
