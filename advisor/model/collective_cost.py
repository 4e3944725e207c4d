"""What each collective costs: a trial's (or the derived mix's) ops as full-buffer volumes, and each op's
alpha-beta cost at a target world size, within and across nodes.

Each op's size is its full buffer, costed at the target world size with the alpha-beta figures of
advisor.model.network, as the library runs it (`Network.algorithm`): NCCL hierarchically (inside the
node first, then across nodes, where the node's ranks share its NICs); gloo as one ring over all
W = nodes x ranks-per-node ranks in rank order, whose bytes move at its slowest hop's rate (the link
across nodes) and whose latency crosses nodes on the hops that do (`_flat_ring_latency_s`). The op
list says which ops repeat per accumulation micro-step (ZeRO-2's reductions, ZeRO-3's gathers and
reduce-scatters) and which run once per step (ZeRO-0/1's boundary reduction, the gathers after the
optimizer step). advisor.model.step_time fits the compute and puts the two together.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from advisor.model.collective_mix import Collective, logger_view
from advisor.model.network import Link, Network

SMALL_OP_BYTES = 1024
"""Ops below this size (loss-scale checks, broadcasts of flags) cost latency only and run once per step."""
BURST_CALLS = 16
"""An op issued at least this often per step is issued in bursts, not waited for call by call (ZeRO-3's
parameter gathers: prefetch, and the gather of persistent parameters after each step); each call then
costs the link's burst latency where `sdzero comm` measured one (advisor.measure.collectives_rank.measure_burst), and
the burst's bytes move while its calls wait out their latencies, so it takes the longer of the two.

A burst's calls are started without waiting (async), and DeepSpeed's comms_logger times an async call up
to its start only, unless the accelerator synchronizes (CUDA does; a CPU does not). Trials now also time
the waits (sdzero.training.measuring.comm_meters.WaitMeter), so their communication includes the bursts as the ranks lived
them. For older trials, whose logged communication misses most of each burst (which would pass for
compute), the fit counts the burst at the larger of what was logged and what it costs on the trial's own
network (see _unlogged_burst_s): a separate benchmark's figure, noisier where latency is CPU scheduling."""


@dataclass(frozen=True)
class CommOp:
    collective: str
    """all_reduce, all_gather or reduce_scatter (how it is costed); others are costed as all_reduce."""
    count: float
    """Calls per optimizer step at grad_accum 1."""
    full_bytes: float
    """Bytes of the whole buffer per step (all calls together), independent of the world size."""
    per_micro_step: bool
    logged_s: float = 0.0
    """Seconds per step (per micro-step where per_micro_step) the trial's ranks spent in it: comms_logger's
    time, plus the time they blocked waiting for it where the trial measured that (`waits_measured`)."""
    waits_measured: bool = False
    """The trial timed its waits on async calls (sdzero.training.measuring.comm_meters.WaitMeter), so `logged_s` is the whole
    time spent in the op; older trials logged the async calls' launch only (see BURST_CALLS)."""
    phase: str = ""
    """When in the step (advisor.model.collective_mix.PHASES), where the derived mix says; "" unknown."""
    exposed_share: float = 1.0
    """The part of its cost that cannot hide behind compute (collective_mix.Collective.exposed_share)."""

    @property
    def burst(self) -> bool:
        return self.count >= BURST_CALLS


STAGE_UNKNOWN = -1
"""For `ops_from_trial`: no stage rule, ops repeat per micro-step by size alone (never, below)."""


def _kind(name: str) -> str:
    if name.startswith("all_gather"):
        return "all_gather"
    if name.startswith("reduce_scatter"):
        return "reduce_scatter"
    return "all_reduce"


def ops_from_trial(comm_ops: str | dict | None, stage: int, world: int, grad_accum: int = 1) -> list[CommOp]:
    """The trial's collectives as full-buffer volumes (comms_logger logs an all-gather's input shard)."""
    raw = json.loads(comm_ops) if isinstance(comm_ops, str) else (comm_ops or {})
    ops = []
    for name, figures in raw.items():
        kind = _kind(name)
        count = float(figures["count_per_step"])
        size = float(figures["bytes_per_step"]) * (world if kind == "all_gather" else 1)
        logged = float(figures.get("seconds_per_step", 0.0))
        large = size / max(count, 1.0) >= SMALL_OP_BYTES
        repeats = large and ((stage == 3) or (stage == 2 and kind != "all_gather"))
        if repeats:  # the trial's figures cover grad_accum micro-steps
            count, size, logged = count / grad_accum, size / grad_accum, logged / grad_accum
        ops.append(CommOp(kind, count, size, repeats, logged, "waited_seconds_per_step" in figures))
    return ops


def ops_from_mix(mix: list[Collective]) -> list[CommOp]:
    """The derived collectives (advisor.model.collective_mix) as ops to cost: what a stage issues where no
    trial logged it (an unmeasured stage, or one measured on a single rank, where DeepSpeed skips them)."""
    return [
        CommOp(
            c.kind,
            float(c.calls),
            float(c.full_bytes),
            c.per_micro_step,
            phase=c.phase,
            exposed_share=c.exposed_share,
        )
        for c in mix
    ]


def ops_by_mix(
    comm_ops: str | dict | None, mix: list[Collective], world: int, grad_accum: int = 1
) -> list[CommOp]:
    """A trial's logged collectives, each split over the derived mix's entries of the same name: the
    logged count, bytes and seconds are kept (what really ran, scaled to the mix's shares), and the mix
    says which part repeats per micro-step and which runs once per step (at ZeRO-3 the persistent
    parameters' gathers after the step share a name with the gathers in every forward). A logged op the
    mix does not name keeps the size rule of `ops_from_trial`."""
    raw = json.loads(comm_ops) if isinstance(comm_ops, str) else (comm_ops or {})
    derived = logger_view(mix, world, grad_accum)
    out: list[CommOp] = []
    for name, figures in raw.items():
        mine = [c for c in mix if c.op == name]
        if name not in derived or not mine:
            out += ops_from_trial({name: figures}, STAGE_UNKNOWN, world, grad_accum)
            continue
        waited = "waited_seconds_per_step" in figures
        count_scale = float(figures["count_per_step"]) / max(derived[name]["count_per_step"], 1e-12)
        bytes_scale = float(figures["bytes_per_step"]) / max(derived[name]["bytes_per_step"], 1e-12)
        logged = float(figures.get("seconds_per_step", 0.0))
        total = sum(c.full_bytes * (grad_accum if c.per_micro_step else 1) for c in mine) or 1.0
        for c in mine:
            repeat = grad_accum if c.per_micro_step else 1
            share = c.full_bytes * repeat / total
            calls = c.calls * count_scale
            out.append(
                CommOp(
                    c.kind,
                    calls,
                    c.full_bytes * bytes_scale,
                    c.per_micro_step,
                    logged * share / repeat,
                    waited,
                    c.phase,
                    1.0 / max(calls, 1.0) if c.overlapped else 1.0,
                )
            )
    return out


def _latency_s(kind: str, ranks: int, link: Link, count: float, tree: bool) -> float:
    """Latency of `count` calls over `ranks` ranks: ring steps (a tree's where shorter and the library has
    one) x the per-hop latency, the burst's where the op comes in bursts and one was measured. A collective
    the library emulates takes the steps of what it runs (gloo's reduce-scatter: an all-reduce)."""
    if ranks <= 1:
        return 0.0
    figures = link.figures(kind)
    if figures.costed_as == "all_reduce":
        steps = 2 * (ranks - 1)
        steps = min(steps, 2 * math.ceil(math.log2(ranks))) if tree else steps
    else:
        steps = ranks - 1
    burst = count >= BURST_CALLS and figures.burst_hop_latency_s is not None
    return count * steps * (figures.burst_hop_latency_s if burst else figures.hop_latency_s)


def _bytes_s(kind: str, size: float, ranks: int, link: Link) -> float:
    """Bus volume of a ring over `ranks` ranks / the link's busbw for this collective."""
    if ranks <= 1:
        return 0.0
    figures = link.figures(kind)
    share = 2 * (ranks - 1) / ranks if figures.costed_as == "all_reduce" else (ranks - 1) / ranks
    return share * size / link.ring_busbw_bytes_s(kind, ranks)


def _level_s(latency_s: float, bytes_s: float, count: float, link: Link, kind: str) -> float:
    """A burst's bytes move while its calls wait out their latencies (the longer of the two); otherwise
    latency and bytes add up."""
    if count >= BURST_CALLS and link.figures(kind).burst_hop_latency_s is not None:
        return max(latency_s, bytes_s)
    return latency_s + bytes_s


def _phase_s(kind: str, size: float, ranks: int, link: Link, count: float, tree: bool = True) -> float:
    """Ring cost of one level: count x latency steps + bus volume / busbw (a burst: the longer of the two),
    with the figures measured for this collective where there are some."""
    latency = _latency_s(kind, ranks, link, count, tree)
    return _level_s(latency, _bytes_s(kind, size, ranks, link), count, link, kind)


def op_seconds(op: CommOp, ranks_per_node: int, nodes: int, net: Network) -> tuple[float, float]:
    """Cost per occurrence, (within the node, across nodes).

    Hierarchical (NCCL): over the node's g ranks first, then across nodes on 1/g of the buffer per rank,
    the g ranks of a node sharing its link (so the node moves the whole buffer's share).
    Flat (gloo, g > 1 across nodes): one ring over all W = nodes x g ranks in rank order; every ring step
    waits for its slowest hop, one across nodes, so the whole op is a W-rank ring on the link across
    nodes: its W-rank ring's steps at that link's latency, and 2(W-1)/W of the buffer for an all-reduce
    through each node's link, not the hierarchy's 2(N-1)/N. Nothing of it runs at the within-node speed.
    (The scale-out runs behind this account: docs/calibration/scaleout-rounds.md.)"""
    kind, size, count = op.collective, op.full_bytes, op.count
    tree = net.algorithm.tree_latency
    if net.algorithm.hierarchical or nodes <= 1 or ranks_per_node <= 1:
        intra = _phase_s(kind, size, ranks_per_node, net.intra, count, tree)
        return intra, _phase_s(kind, size, nodes, net.inter, count, tree)
    ranks = nodes * ranks_per_node
    latency = _flat_ring_latency_s(kind, ranks, nodes, net, count)
    return 0.0, _level_s(latency, _bytes_s(kind, size, ranks, net.inter), count, net.inter, kind)


def _flat_ring_latency_s(kind: str, ranks: int, nodes: int, net: Network, count: float) -> float:
    """Latency of `count` calls of one ring over `ranks` ranks in rank order, `nodes` hosts of equal size
    (gloo): of its sequential hops, those that cross hosts at the link across nodes, the rest at the
    within-node link.

    In gloo's ring (gloo/allreduce.cc `ring`, gloo/allgather.cc) each rank sends to one neighbour and
    receives from the other, and what it sends in one step is what it received in the step before, so an
    op's critical path is a chain of consecutive hops around the ring: 2(W-1) for an all-reduce (its
    reduce-scatter then its all-gather) and W-1 for an all-gather. With g = W / N ranks per host in rank
    order, N of every W consecutive hops cross hosts, so the longest such chain crosses ceil(steps N / W)
    times (at 2 hosts x 2: 3 of an all-reduce's 6 hops, 2 of an all-gather's 3). The bytes are another
    matter: a pipelined ring moves at its slowest hop's rate, so they are all costed on the link across
    nodes (`_bytes_s`). Costing every hop at the cross-host latency overstates a ring with several ranks
    per host: docs/calibration/scaleout-rounds.md has the runs that showed it."""
    steps = 2 * (ranks - 1) if net.inter.figures(kind).costed_as == "all_reduce" else ranks - 1
    crossing = min(math.ceil(steps * nodes / ranks), steps)
    across = _latency_s(kind, ranks, net.inter, count, tree=False)
    within = _latency_s(kind, ranks, net.intra, count, tree=False)
    return (crossing * across + (steps - crossing) * within) / steps
