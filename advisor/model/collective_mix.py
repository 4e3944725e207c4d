"""The collectives a ZeRO stage issues per optimizer step, derived from the network and the DeepSpeed JSON.

DeepSpeed's comms_logger sees only what ran: at world size 1 DeepSpeed skips ZeRO-3's parameter gathers
altogether, and a stage nobody measured has no log at all. This module derives each stage's collectives
(op, calls, bytes, and when in the step) from the trained network's parameter sizes (module order) and the
JSON's bucket, prefetch and persistence settings, by the rules DeepSpeed 0.19.8 follows (read from its
source; tests/dist/test_collective_mix.py checks them against the comms logger at 2 ranks):

- ZeRO-0 (engine.allreduce_gradients -> buffered_allreduce_fallback): at the accumulation boundary, the
  gradients are flattened into buckets of 500M elements (MEMORY_OPT_ALLREDUCE_SIZE; the JSON does not set
  it) and each bucket is all-reduced. Nothing else: the optimizer then runs on replicated states.
- ZeRO-1/2 (stage_1_and_2.py): gradients fill reduce buckets of `reduce_bucket_size` elements (a bucket
  is sent when the next gradient would overflow it) and each bucket is all-reduced (`reduce_scatter`
  and the multi-rank bucket all-reduce of this version issue one all_reduce per bucket, not the paper's
  reduce-scatter). ZeRO-2 reduces inside every micro-step's backward hooks; ZeRO-1 once, at the boundary
  (also with overlap_comm). After the optimizer step one all_gather_into_tensor gathers the updated
  16-bit partitions (the whole flat buffer, padded to 2N elements; `allgather_bucket_size` only splits
  the fallback path for a torch without all_gather_into_tensor). Two scalar all-reduces per step: the
  gradient norm and the overflow flag.
- ZeRO-3 (stage3.py, partitioned_param_coordinator.py): parameters above
  `stage3_param_persistence_threshold` are all-gathered in every forward, in coalesced calls: each
  module fetch prefetches the next `stage3_prefetch_bucket_size` elements of the trace in one call (a
  call closes once it reaches that size). A parameter gathered in forward is kept for backward when it is
  used again within `stage3_max_reuse_distance` elements of traversal (and everything fits in
  `stage3_max_live_parameters`), else gathered again in backward. Gradients are reduce-scattered in
  every backward, in buckets of `reduce_bucket_size` (a parameter larger than a bucket goes alone).
  Persistent parameters are kept whole but re-gathered after each optimizer step (`_post_step`), one
  call per parameter. One scalar all-reduce per step: the gradient norm.

Bytes here are whole buffers (what every rank ends up with), the size the alpha-beta costs take; the
comms logger records an all-gather's input shard instead (`logger_view` converts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from advisor.model.memory import ZeroSettings

DP_ALLREDUCE_ELEMENTS = 500_000_000
"""ZeRO-0's gradient bucket: deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE, not set by the JSON."""
SCALAR_BYTES = {1: (4, 1), 2: (4, 1), 3: (8,)}
"""Per stage, the bytes of each scalar all-reduce per step (ZeRO-1/2: the fp32 gradient norm and the
overflow flag; ZeRO-3: the norm), as the comms logger records them."""
PHASES: tuple[str, ...] = ("forward", "backward", "boundary", "step")
"""When in the step: inside each micro-step's forward or backward, at the accumulation boundary (after
the last backward, before the optimizer), or after the optimizer step."""


@dataclass(frozen=True)
class Collective:
    op: str
    """DeepSpeed's name for it, as the comms logger records it (all_reduce, all_gather_into_tensor, ...)."""
    phase: str
    calls: int
    """Calls per occurrence: per micro-step where `per_micro_step`, else per optimizer step."""
    full_bytes: float
    """Bytes of the whole buffers of all calls per occurrence (an all-gather's output)."""
    per_micro_step: bool
    what: str
    overlapped: bool = False
    """Issued while compute goes on (overlap_comm's reductions in backward, ZeRO-3's prefetched gathers),
    so all but one call can hide behind it; the last bucket and the first prefetch cannot. Collectives at
    the boundary or after the step have nothing left to overlap with."""

    @property
    def exposed_share(self) -> float:
        """The part of its cost that cannot hide behind compute."""
        return 1.0 / max(self.calls, 1) if self.overlapped else 1.0

    @property
    def kind(self) -> str:
        """How it is costed: all_reduce, all_gather or reduce_scatter."""
        if self.op.startswith("all_gather"):
            return "all_gather"
        if self.op.startswith("reduce_scatter"):
            return "reduce_scatter"
        return "all_reduce"


def bucket_calls(numels: Sequence[int], bucket: int) -> int:
    """Buckets filled in this order: one is sent when the next gradient would overflow it (a gradient
    larger than a bucket is sent alone)."""
    calls = held = 0
    for n in numels:
        if held and held + n > bucket:
            calls, held = calls + 1, 0
        held += n
    return calls + (held > 0)


def prefetch_calls(numels: Sequence[int], bucket: int) -> int:
    """ZeRO-3 fetch calls over a forward: each prefetch takes parameters until it reaches `bucket`
    elements; without prefetch every parameter is fetched with its module (counted one call each, an
    upper bound where a module owns several)."""
    if bucket <= 0:
        return len(numels)
    calls = held = 0
    for n in numels:
        held += n
        if held >= bucket:
            calls, held = calls + 1, 0
    return calls + (held > 0)


def regathered(numels: Sequence[int], zero: ZeroSettings) -> list[int]:
    """ZeRO-3 parameters gathered again in backward: released after their forward use because their
    next use (in backward, in reverse order) is more than max_reuse_distance elements of traversal away,
    or because the gathered model exceeds max_live_parameters."""
    if sum(numels) > zero.max_live_parameters:
        return list(numels)
    again, after = [], 0
    for n in reversed(numels):  # elements traversed between a parameter's forward and backward use
        if 2 * after >= zero.max_reuse_distance:
            again.append(n)
        after += n
    return again


def _padded(n: int, world: int) -> int:
    return -(-n // world) * world


def collective_mix(
    numels: Sequence[int], stage: int, world: int, zero: ZeroSettings, element_bytes: int = 2
) -> list[Collective]:
    """The stage's collectives at `world` ranks (any world size, 1 included: what N ranks would issue)."""
    world = max(world, 1)
    psi = sum(numels)
    if stage == 0:
        calls = bucket_calls(numels, DP_ALLREDUCE_ELEMENTS)
        return [
            Collective("all_reduce", "boundary", calls, psi * element_bytes, False, "gradient all-reduce")
        ]
    scalars = [
        Collective("all_reduce", "step", 1, b, False, "scalar (norm, overflow)") for b in SCALAR_BYTES[stage]
    ]
    if stage in (1, 2):
        # ZeRO-2's hooks fire as gradients become ready (backward: reverse module order); ZeRO-1 without
        # overlap_comm walks the parameters in order at the boundary.
        order = list(reversed(numels)) if stage == 2 or zero.overlap_comm else list(numels)
        padded = math.ceil(psi / (2 * world)) * 2 * world
        return [
            Collective(
                "all_reduce",
                "backward" if stage == 2 else "boundary",
                bucket_calls(order, zero.reduce_bucket_size),
                psi * element_bytes,
                stage == 2,
                "gradient reduction",
                stage == 2 and zero.overlap_comm,
            ),
            Collective(
                "all_gather_into_tensor",
                "step",
                1,
                padded * element_bytes,
                False,
                "updated 16-bit partitions",
            ),
            *scalars,
        ]
    # A LoRA run's frozen base (advisor.model.lora_sizing) is gathered like the adapters, never reduced.
    every = [*getattr(numels, "frozen_base", ()), *numels]
    persistent = [n for n in every if n <= zero.persistence_threshold]
    gathered = [n for n in every if n > zero.persistence_threshold]
    again = regathered(gathered, zero)
    mix = [
        Collective(
            "all_gather_into_tensor",
            "forward",
            prefetch_calls(gathered, zero.prefetch_bucket_size),
            sum(_padded(n, world) for n in gathered) * element_bytes,
            True,
            "parameter gathers",
            zero.prefetch_bucket_size > 0,
        ),
        Collective(
            "reduce_scatter_tensor",
            "backward",
            bucket_calls(list(reversed(numels)), zero.reduce_bucket_size),
            sum(_padded(n, world) for n in numels) * element_bytes,
            True,
            "gradient reduce-scatter",
            zero.overlap_comm,
        ),
    ]
    if again:
        mix.append(
            Collective(
                "all_gather_into_tensor",
                "backward",
                prefetch_calls(again, zero.prefetch_bucket_size),
                sum(_padded(n, world) for n in again) * element_bytes,
                True,
                "parameters gathered again in backward",
                zero.prefetch_bucket_size > 0,
            )
        )
    if persistent:
        mix.append(
            Collective(
                "all_gather_into_tensor",
                "step",
                len(persistent),
                sum(_padded(n, world) for n in persistent) * element_bytes,
                False,
                "persistent parameters after the step",
            )
        )
    return mix + scalars


def logger_view(mix: Sequence[Collective], world: int, grad_accum: int) -> dict[str, dict[str, float]]:
    """What DeepSpeed's comms logger would record per optimizer step, per op name: count_per_step and
    bytes_per_step (an all-gather logged by its input shard, 1/world of the buffer)."""
    view: dict[str, dict[str, float]] = {}
    for c in mix:
        repeat = grad_accum if c.per_micro_step else 1
        size = c.full_bytes / world if c.kind == "all_gather" else c.full_bytes
        entry = view.setdefault(c.op, {"count_per_step": 0.0, "bytes_per_step": 0.0})
        entry["count_per_step"] += c.calls * repeat
        entry["bytes_per_step"] += size * repeat
    return view
