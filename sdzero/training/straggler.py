"""The slow node named: every --straggler-every steps the ranks share their own compute time per step.

A rank's own compute time is the part of its step in which it waits for nobody: data loading, encoding and
the forward pass (under ZeRO 0-2 the forward issues no collective; the backward and the optimizer step
hold the gradient reduction, where a fast rank waits for a slow one, so they are left out). Every rank
keeps its own per-step times (from its metrics lines, no device sync of its own); every N steps one
all-gather of two numbers per rank carries the window's means, off the per-step path.

Per host, the mean over its ranks; a host whose compute time is over STRAGGLER_FRACTION above the median
of the other hosts' in PERSIST_WINDOWS windows in a row is named: in that step's metrics line
(`straggler`), once on the terminal when it is first named (and once when it recovers), and in the
training report. Every sharing step's line carries each host's compute time (`host_compute_s`), which
the report plots over the run.

`wait_share` is the part of every other rank's step spent waiting for the named host's extra compute
time in the phases above: a lower bound (its backward is slower too, which is not measured apart).
"""

from __future__ import annotations

import logging
import socket
import statistics
from typing import Any

import torch
import torch.distributed as dist

from sdzero.telemetry import progress
from sdzero.training.callbacks import Callback, TrainerView

log = logging.getLogger("sdzero")

OWN_PHASES = ("data_s", "encode_s", "forward_s")
STRAGGLER_FRACTION = 0.15
"""A host this much slower than the others' median, window after window, is named."""
PERSIST_WINDOWS = 2
"""Windows in a row a host must be slow in before it is named: one slow window is noise (a save, GC)."""


def host_verdict(
    hosts: list[str], compute_s: list[float], step_s: list[float]
) -> tuple[dict[str, float], dict[str, Any] | None]:
    """(each host's mean own compute time per step, the slowest host's record if it is slow, else None)."""
    per_host: dict[str, list[float]] = {}
    for host, seconds in zip(hosts, compute_s, strict=True):
        per_host.setdefault(host, []).append(seconds)
    means = {h: statistics.fmean(v) for h, v in per_host.items()}
    if len(means) < 2:
        return means, None
    slowest = max(means, key=lambda h: means[h])
    others = statistics.median(v for h, v in means.items() if h != slowest)
    if others <= 0 or means[slowest] <= (1 + STRAGGLER_FRACTION) * others:
        return means, None
    step = statistics.fmean(step_s) if step_s else 0.0
    return means, {
        "host": slowest,
        "ranks": [r for r, h in enumerate(hosts) if h == slowest],
        "compute_s": means[slowest],
        "others_compute_s": others,
        "slower_by": means[slowest] / others - 1,
        "wait_share": min(1.0, (means[slowest] - others) / step) if step > 0 else None,
    }


def rank_hosts() -> list[str]:
    """Each rank's host name, by rank: one all-gather (at setup, not per step)."""
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return [str(n) for n in names]


def straggler_line(found: dict[str, Any]) -> str:
    ranks = found["ranks"]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    share = found.get("wait_share")
    waits = f"; every other rank spends {share:.0%} of its step waiting for it" if share is not None else ""
    return (
        f"slow host {found['host']} ({who}): {found['compute_s'] * 1e3:.0f} ms of own compute per step "
        f"against {found['others_compute_s'] * 1e3:.0f} ms on the other hosts "
        f"(+{found['slower_by']:.0%}){waits}"
    )


class StragglerCallback(Callback):
    """Shares the ranks' own compute time every `every` steps and names a persistently slow host."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.hosts: list[str] = []
        self.compute: list[float] = []
        self.steps: list[float] = []
        self.slow_run: dict[str, int] = {}
        self.named: str | None = None

    def on_setup(self, trainer: TrainerView) -> None:
        self.hosts = rank_hosts()

    def on_metrics(self, trainer: TrainerView, step: int, record: dict[str, Any]) -> None:
        self.compute.append(sum(float(record.get(k) or 0.0) for k in OWN_PHASES))
        self.steps.append(float(record.get("step_time_s") or 0.0))

    def on_optimizer_step(self, trainer: TrainerView, step: int) -> None:
        if step % self.every:
            return
        with progress.phase("straggler sharing"):
            table = self._share(trainer)
        self.compute, self.steps = [], []
        if table is None:
            return
        compute = [row[0] for row in table]
        step_s = [row[1] for row in table]
        means, found = host_verdict(self.hosts, compute, step_s)
        extras: dict[str, Any] = {"host_compute_s": means}
        slow = found["host"] if found else None
        self.slow_run = {slow: self.slow_run.get(slow, 0) + 1} if slow else {}
        if found and self.slow_run[found["host"]] >= PERSIST_WINDOWS:
            extras["straggler"] = found
            if trainer.rank == 0 and self.named != found["host"]:
                log.warning("%s", straggler_line(found))
            self.named = found["host"]
        elif self.named is not None and not found:
            if trainer.rank == 0:
                log.info("host %s is no longer slower than the others", self.named)
            self.named = None
        trainer.step_extras.update(extras)

    def _share(self, trainer: TrainerView) -> list[list[float]] | None:
        """One all-gather of (mean own compute, mean step time) per rank; None when a window is empty.
        On CUDA the tensor is filled from host numbers and read back: one sync every N steps."""
        n = len(self.compute)
        local = torch.tensor(
            [sum(self.compute) / n if n else -1.0, sum(self.steps) / n if n else -1.0],
            dtype=torch.float64,
            device=trainer.device,
        )
        parts = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local)
        table = torch.stack(parts).cpu().tolist()
        return None if any(row[0] < 0 for row in table) else table
