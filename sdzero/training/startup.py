"""Where each rank's start-up went: its phases' seconds (sdzero.training.run_watch marks them), shared once
when setup ends and written into the first step's metrics line (`startup`), with the longest phase named.

Ranks meet in the start-up's collectives, so a rank that is slow in one phase shows on the others as time
in the phase where they wait for it; the longest phase of any rank, and the ranks' median in that phase,
say which rank and which phase held the start-up.
"""

from __future__ import annotations

import socket
import statistics
from typing import Any

import torch.distributed as dist

from sdzero.training.callbacks import Callback, TrainerView


def share_phases(phases: list[tuple[str, float]]) -> list[dict[str, Any]]:
    """Every rank's {rank, host, phases, total_s}, by rank: one all-gather at the end of setup (this rank
    alone without a process group)."""
    mine = {"host": socket.gethostname(), "phases": {name: round(s, 3) for name, s in phases}}
    if dist.is_available() and dist.is_initialized():
        rows: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    return [
        {"rank": r, **row, "total_s": round(sum(row["phases"].values()), 3)} for r, row in enumerate(rows)
    ]


def longest_phase(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank and phase with the most seconds of any, with the ranks' median in that phase."""
    best = max(
        ((row, name, s) for row in ranks for name, s in row["phases"].items()),
        key=lambda t: t[2],
        default=None,
    )
    if best is None:
        return None
    row, name, seconds = best
    return {
        "rank": row["rank"],
        "host": row["host"],
        "phase": name,
        "seconds": seconds,
        "median_s": statistics.median(r["phases"].get(name, 0.0) for r in ranks),
    }


def longest_line(found: dict[str, Any]) -> str:
    return (
        f"longest: rank {found['rank']} ({found['host']}) in {found['phase']} {found['seconds']:.3g} s "
        f"(median of the ranks {found['median_s']:.3g} s)"
    )


class StartupRecord(Callback):
    """Adds the shared start-up table to the first step's metrics line."""

    def __init__(self, ranks: list[dict[str, Any]]) -> None:
        self.ranks: list[dict[str, Any]] | None = ranks

    def on_optimizer_step(self, trainer: TrainerView, step: int) -> None:
        if self.ranks is None:
            return
        trainer.step_extras["startup"] = {
            "total_s": max(r["total_s"] for r in self.ranks),
            "ranks": self.ranks,
            "longest": longest_phase(self.ranks),
        }
        self.ranks = None
