"""The slow link named: every --straggler-every steps, one timed round trip between every pair of hosts.

A slow link does not change a rank's own compute time (what sdzero.training.straggler compares); it
lengthens the collectives, where every rank waits alike, so a rank's step time cannot say whose link it
is. A probe between the hosts' first ranks can: the lower rank of a pair sends PROBE_BYTES, the higher
sends them back, and the lower rank times the round trip. Pairs go in one fixed order (a rank waits for
its earlier pairs only, so no two pairs wait on each other), then one all-reduce (max) gives every rank
every pair's rate. Off the per-step path: it runs at sharing steps only, after the optimizer step.

A host's link is its best pair's rate: a host with a slow link of its own is slow with every other host,
a host that is merely paired with it still has a fast pair. A host whose best rate is under
SLOW_LINK_FRACTION of the other hosts' median in PERSIST_WINDOWS windows in a row is named, in that step's
metrics line (`slow_link`), once on the terminal, and in the training report. With two hosts the one pair
is the only measure of both, so a slow pair is recorded (`host_link_gbps`) but no host is named.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from sdzero.telemetry import progress
from sdzero.training.callbacks import Callback, TrainerView
from sdzero.training.straggler import PERSIST_WINDOWS, rank_hosts

log = logging.getLogger("sdzero")

PROBE_BYTES = 1 << 20
"""Per direction: big enough that a link's rate, not its latency, sets the time on a slow link; small
enough that on a fast one the probe costs about a millisecond."""
SLOW_LINK_FRACTION = 0.5
"""A host whose best link carries under this share of the other hosts' median rate is named."""


def host_pairs(hosts: list[str]) -> list[tuple[int, int]]:
    """(rank, rank) of each pair of hosts, by their first ranks, in one fixed order every rank agrees on."""
    first: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        first.setdefault(host, rank)
    return list(itertools.combinations(sorted(first.values()), 2))


def link_verdict(
    hosts: list[str], pairs: list[tuple[int, int]], gbps: list[float]
) -> tuple[dict[str, float], dict[str, Any] | None]:
    """(each host's best pair rate in Gbit/s, the slowest host's record if its links are slow, else None)."""
    best: dict[str, float] = {}
    for (a, b), rate in zip(pairs, gbps, strict=True):
        for host in (hosts[a], hosts[b]):
            best[host] = max(best.get(host, 0.0), rate)
    if len(best) < 3:
        return best, None
    slowest = min(best, key=lambda h: best[h])
    others = statistics.median(v for h, v in best.items() if h != slowest)
    if others <= 0 or best[slowest] >= SLOW_LINK_FRACTION * others:
        return best, None
    return best, {
        "host": slowest,
        "ranks": [r for r, h in enumerate(hosts) if h == slowest],
        "gbps": best[slowest],
        "others_gbps": others,
    }


def slow_link_line(found: dict[str, Any]) -> str:
    ranks = found["ranks"]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return (
        f"slow link on host {found['host']} ({who}): {found['gbps']:.3g} Gbit/s at best to any other host "
        f"against {found['others_gbps']:.3g} Gbit/s between the other hosts"
    )


def time_pairs(pairs: list[tuple[int, int]], rank: int, device: torch.device) -> list[float]:
    """Each pair's rate in Gbit/s as timed by its lower rank (0 elsewhere), the same on every rank after."""
    payload = torch.zeros(PROBE_BYTES // 4, dtype=torch.float32, device=device)
    rates = torch.zeros(len(pairs), dtype=torch.float64, device=device)
    for i, (low, high) in enumerate(pairs):
        if rank == low:
            start = time.perf_counter()
            dist.send(payload, high)
            dist.recv(payload, high)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the round trip's end, once per pair at a sharing step
            rates[i] = 2 * PROBE_BYTES * 8 / 1e9 / max(time.perf_counter() - start, 1e-9)
        elif rank == high:
            dist.recv(payload, low)
            dist.send(payload, low)
    dist.all_reduce(rates, op=dist.ReduceOp.MAX)
    return rates.cpu().tolist()


class LinkProbeCallback(Callback):
    """Times every host pair's link every `every` steps and names a host whose links are persistently slow."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.hosts: list[str] = []
        self.pairs: list[tuple[int, int]] = []
        self.slow_run: dict[str, int] = {}
        self.named: str | None = None

    def on_setup(self, trainer: TrainerView) -> None:
        self.hosts = rank_hosts()
        self.pairs = host_pairs(self.hosts)

    def on_optimizer_step(self, trainer: TrainerView, step: int) -> None:
        if step % self.every or not self.pairs:
            return
        with progress.phase("link probe"):
            gbps = time_pairs(self.pairs, trainer.rank, trainer.device)
        best, found = link_verdict(self.hosts, self.pairs, gbps)
        extras: dict[str, Any] = {"host_link_gbps": best}
        slow = found["host"] if found else None
        self.slow_run = {slow: self.slow_run.get(slow, 0) + 1} if slow else {}
        if found and self.slow_run[found["host"]] >= PERSIST_WINDOWS:
            extras["slow_link"] = found
            if trainer.rank == 0 and self.named != found["host"]:
                log.warning("%s", slow_link_line(found))
            self.named = found["host"]
        elif self.named is not None and not found:
            if trainer.rank == 0:
                log.info("host %s's links are no longer slower than the others'", self.named)
            self.named = None
        trainer.step_extras.update(extras)
