"""Predictions for node counts 1, 2, 4, ... --max-nodes: samples/s, step split, memory, efficiency.

One row per (node count, config) in predictions.csv (the contract in advisor.report.build). A config is ZeRO stage
x precision x micro-batch x offload; its gradient accumulation is chosen per node count to reach the
global batch: the base config's unless --global-batch says otherwise (inside a range, the largest
accumulation: more micro-steps per optimizer step amortise the once-per-step communication). A config
that cannot reach the target at a node count has no row there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pandas as pd

from advisor.model.memory import MemoryModel
from advisor.model.network import Network
from advisor.model.step_time import TimeModel
from sdzero.errors import UserError

MAX_NODES_LIMIT = 1 << 20


@dataclass(frozen=True)
class Candidate:
    zero_stage: int
    precision: str
    micro_batch: int
    offload: str = "none"
    checkpointing: bool = False
    """Gradient checkpointing; its id ends in `-gc` (ids without it, every earlier folder's, are configs
    without it)."""

    @property
    def config_id(self) -> str:
        return (
            f"z{self.zero_stage}-{self.precision}-mb{self.micro_batch}-off-{self.offload.replace('+', '-')}"
            + ("-gc" if self.checkpointing else "")
        )


@dataclass(frozen=True)
class BatchTarget:
    """The global batch wanted: one value (lo == hi) or a range. `sdzero advise` keeps the base config's
    by default (strong scaling); None here (accumulation 1, the batch grows with the nodes) is for tools
    that replay trials at one node count."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str | None) -> BatchTarget | None:
        if text is None or not str(text).strip():
            return None
        match = re.fullmatch(r"\s*(\d+)\s*(?:(?:-|\.\.|:)\s*(\d+))?\s*", str(text))
        if not match:
            raise UserError(f"--global-batch {text!r}: give a number (256) or a range (256-1024)")
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if lo < 1 or hi < lo:
            raise UserError(f"--global-batch {text!r}: must be >= 1, and a range must be ascending")
        return cls(lo, hi)

    def describe(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


def node_counts(max_nodes: int) -> list[int]:
    """1, 2, 4, ... up to max_nodes, and max_nodes itself."""
    if not 1 <= max_nodes <= MAX_NODES_LIMIT:
        raise UserError(f"--max-nodes {max_nodes}: must be between 1 and {MAX_NODES_LIMIT}")
    counts = [1 << i for i in range(int(math.log2(max_nodes)) + 1)]
    return counts if counts[-1] == max_nodes else [*counts, max_nodes]


def grad_accum_for(micro_batch: int, world: int, target: BatchTarget | None) -> int | None:
    """The accumulation that reaches the target (the largest inside a range), or None if none does."""
    if target is None:
        return 1
    per_step = micro_batch * world
    largest = target.hi // per_step
    return largest if largest >= 1 and largest * per_step >= target.lo else None


def check_reachable(
    micro_batches: list[int], gpus_per_node: int, nodes: list[int], target: BatchTarget | None
) -> None:
    """Fail before any trial if no micro-batch, node count and accumulation give the global batch wanted."""
    if target is None:
        return
    if any(grad_accum_for(m, n * gpus_per_node, target) for m in micro_batches for n in nodes):
        return
    step = min(micro_batches) * gpus_per_node
    raise UserError(
        f"--global-batch {target.describe()}: no config reaches it with {gpus_per_node} ranks per node at "
        f"{nodes[0]}..{nodes[-1]} nodes and micro-batches {', '.join(map(str, sorted(set(micro_batches))))} "
        f"(global batch = micro-batch x accumulation x ranks); choose a multiple of {step} or a range"
    )


def borrowed_halfwidth(timing: TimeModel, c: Candidate, accum: int, step_s: float) -> float:
    """The relative half-width that holds the step a config of a group no trial ran would have with each
    measured group's compute it borrows (TimeModel.borrowed_compute_s): 0 for a measured group."""
    donors = timing.borrowed_compute_s(c.zero_stage, c.precision, c.micro_batch, c.offload)
    if not donors or step_s <= 0:
        return 0.0
    mine = timing.compute_per_micro_s(c.zero_stage, c.precision, c.micro_batch, c.offload)
    up = max(max(donors) - mine, 0.0) * accum / step_s
    down = min(max(mine - min(donors), 0.0) * accum / step_s, 0.99)
    # multiplicative bounds (advisor.model.uncertainty.ratio_bounds): step x (1 + h) and step / (1 + h)
    return max(up, down / (1 - down))


def predict_table(
    candidates: list[Candidate],
    nodes: list[int],
    memory: MemoryModel,
    timing: TimeModel,
    net: Network,
    usable_bytes: float,
    target: BatchTarget | None,
) -> pd.DataFrame:
    rows = []
    for c in candidates:
        for n in nodes:
            world = n * net.gpus_per_node
            accum = grad_accum_for(c.micro_batch, world, target)
            if accum is None:
                continue
            step = timing.predict(
                c.zero_stage, c.precision, c.micro_batch, accum, n, net, c.offload, c.checkpointing
            )
            mem = memory.per_rank_bytes(
                c.zero_stage, c.precision, c.micro_batch, c.offload, world, c.checkpointing
            )
            intra_s, inter_s = step.exposed_intra_s, step.exposed_inter_s
            rows.append(
                {
                    "node_count": n,
                    "config_id": c.config_id,
                    "zero_stage": c.zero_stage,
                    "dtype": c.precision,
                    "micro_batch": c.micro_batch,
                    "offload": c.offload,
                    "checkpointing": c.checkpointing,
                    "grad_accum": accum,
                    "global_batch": c.micro_batch * accum * world,
                    "world_size": world,
                    "samples_per_s": step.samples_per_s,
                    "step_time_s": step.step_time_s,
                    "compute_s": step.compute_s,
                    "exposed_comm_s": step.exposed_comm_s,
                    "comm_s": step.comm_s,
                    "exposed_intra_s": intra_s,
                    "exposed_inter_s": inter_s,
                    "mem_per_rank_bytes": mem["total"],
                    "model_state_bytes": mem["model_states"],
                    "activation_bytes": mem["activations"],
                    "bucket_bytes": mem["buckets"],
                    "frozen_bytes": mem["frozen"],
                    "feasible": mem["total"] <= usable_bytes,
                    "usable_bytes": usable_bytes,  # what the tie rule weighs memory differences against
                    "borrowed_halfwidth": borrowed_halfwidth(timing, c, accum, step.step_time_s),
                    # Seconds the model cannot price, added to the step's upper bound only.
                    "unmeasured_s": timing.unmeasured_handling_s(
                        c.zero_stage, c.precision, c.offload, accum, net.gpus_per_node, n, net
                    ),
                }
            )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    first = table.loc[
        table.groupby("config_id")["node_count"].idxmin(), ["config_id", "node_count", "samples_per_s"]
    ]
    base = first.set_index("config_id")
    per_node = table["config_id"].map(base["samples_per_s"] / base["node_count"])
    table["efficiency"] = table["samples_per_s"] / (per_node * table["node_count"])
    return table
