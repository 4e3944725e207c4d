"""What the answer withholds when the target's compute is unknown, and how a larger-batch row is marked.

Trials on a CPU say how configs rank and, costed on the target's links, what communication a step needs;
without the target's compute rate (advisor.model.target_compute) they say nothing of its absolute speed. So
such an answer keeps the ranking and the communication figures and drops every figure that rests on the
target's compute: step time, samples/s, efficiency, exposed share, time, GPU-hours and the node count.
"""

from __future__ import annotations

from typing import Any

from advisor.model.batch_growth import samples_rule

WITHHELD_ROW = (
    "samples_per_s",
    "step_time_s",
    "time_to_train_s",
    "gpu_hours",
    "efficiency",
    "efficiency_lo",
    "efficiency_hi",
    "exposed_comm_share",
    "knee",
)
"""Scaling-row figures that rest on the target's compute."""


def withhold_timing(rec: dict[str, Any], why: str) -> None:
    """recommendation.json without the figures that need the target's compute; `why` is the one line."""
    for row in rec.get("scaling_table", []):
        for key in WITHHELD_ROW:
            row[key] = None
        for key in [k for k in row if k.endswith(("_lo", "_hi"))]:
            row[key] = None
    for key in ("samples_per_s", "step_time_s", "compute_s", "exposed_comm_s", "time_to_train", "intervals"):
        rec[key] = None
    choice = rec.get("node_choice", {})
    for key in ("chosen", "knee", "fastest", "most_efficient", "fewest_gpu_hours"):
        choice[key] = None
    choice["trade"] = choice["confidence"] = ""
    rec["timed"] = False
    rec["verdict"] = (
        f"{why}. Shown: the configs ranked at each node count (from the trials here) and the communication "
        f"per step on the target's links; {rec['config_id']} ranks first at {rec['gpus_per_node']} GPUs per node"
    )


def larger_batch_note(batch: int, asked: str, lr: str, factor: Any, rule: str) -> str:
    """A larger-batch row's mark: the batch, the LR the one rule gives there, and the samples it costs."""
    growth = float(factor) if factor is not None else 1.0
    return (
        f"larger batch: global batch {batch} (asked {asked}; weak scaling) at {lr}; trains {growth:.3g}x the "
        f"samples by the {samples_rule(rule).describe()}"
    )
