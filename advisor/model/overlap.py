"""Which communication hides behind compute: the bucket-level account of a step ("hideable window").

A collective issued while compute goes on can run beside it, on a device that runs collectives on a
stream of their own (DeepSpeed's side stream on CUDA; on a CPU every collective blocks the rank, so
nothing hides). Per op, by when it runs in the step (advisor.model.collective_mix):

- ZeRO-1/2's reduce buckets with `overlap_comm` are sent during backward: all but the last bucket can
  hide behind the rest of backward; the last bucket is sent when backward ends and cannot.
- ZeRO-3's prefetched parameter gathers run during forward (and backward, for parameters gathered again):
  all but the first prefetch can hide behind that phase's compute; its reduce-scatters with
  `overlap_comm` hide behind backward like ZeRO-2's buckets.
- Collectives at the accumulation boundary (ZeRO-0/1's reduction) and after the optimizer step (the
  gathers of updated partitions, persistent parameters) have nothing left to run beside: all exposed.

The hideable part of every op of a phase shares that phase's compute of one micro-step (the window): what
exceeds the window stays exposed. The account is the same within and across nodes: the window hides the
sum of both parts, and what stays exposed is split between them in proportion to their costs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

HIDING_PHASES: tuple[str, ...] = ("forward", "backward")
"""Phases with compute that an op issued in them can run beside."""


@dataclass(frozen=True)
class Windows:
    """Compute per micro-step that collectives issued in each phase can run beside, seconds."""

    forward_s: float
    backward_s: float

    def of(self, phase: str) -> float:
        return {"forward": self.forward_s, "backward": self.backward_s}.get(phase, 0.0)


@dataclass(frozen=True)
class OpCost:
    """One op's costed seconds per occurrence (per micro-step where `per_micro_step`, else per step)."""

    phase: str
    per_micro_step: bool
    exposed_share: float
    """The part that cannot hide whatever the window (the last bucket, the first prefetch); 1: all."""
    intra_s: float
    inter_s: float


def exposed_s(costs: Iterable[OpCost], grad_accum: int, windows: Windows | None) -> tuple[float, float]:
    """Exposed communication per optimizer step, (within nodes, across nodes). Without windows (a device
    with no side stream, or no measured phase split) everything is exposed."""
    intra = inter = 0.0
    hideable: dict[str, list[tuple[float, float]]] = {p: [] for p in HIDING_PHASES}
    for c in costs:
        repeat = grad_accum if c.per_micro_step else 1
        can_hide = windows is not None and c.per_micro_step and c.phase in HIDING_PHASES
        share = min(max(c.exposed_share, 0.0), 1.0) if can_hide else 1.0
        intra += c.intra_s * share * repeat
        inter += c.inter_s * share * repeat
        if share < 1.0:
            hideable[c.phase].append((c.intra_s * (1 - share), c.inter_s * (1 - share)))
    for phase, parts in hideable.items():
        total = sum(a + b for a, b in parts)
        if total <= 0 or windows is None:
            continue
        left = max(total - windows.of(phase), 0.0) / total  # the share the window cannot cover
        intra += sum(a for a, _ in parts) * left * grad_accum
        inter += sum(b for _, b in parts) * left * grad_accum
    return intra, inter
