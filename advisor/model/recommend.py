"""The recommendation: the fastest predicted config that fits, its DeepSpeed JSON, launch command, runners-up.

The JSON is the user's base JSON with the winner's knobs written in by the same code that writes each
trial's JSON (advisor.measure.grid.trial_ds_config), minus the trial-only instruments, with the accumulation for the
global batch and the learning rate scaled for it: the trainer runs it unchanged. Its global batch is not
written (train_batch_size): DeepSpeed derives it from micro-batch x accumulation x world size, so the same
file also runs on fewer ranks for a smoke test.
"""

from __future__ import annotations

import copy
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.measure.grid import TrialSpec, trial_ds_config
from advisor.model.memory import MemoryModel
from advisor.model.predict import Candidate
from sdzero.errors import UserError

GIB = 2**30
LR_SCALINGS = ("linear", "sqrt")
COMM_BOUND_SHARE = 0.3
"""A config whose exposed communication is above this share of its step is called communication-bound."""
RUNNERS_UP = 5


def scaled_lr(base_lr: float, scaling: str, global_batch: int, reference_batch: int) -> float:
    ratio = global_batch / reference_batch
    return base_lr * (ratio if scaling == "linear" else math.sqrt(ratio))


def recommended_ds_config(base: dict[str, Any], row: pd.Series, lr: float) -> dict[str, Any]:
    spec = TrialSpec(
        int(row["zero_stage"]), str(row["dtype"]), int(row["micro_batch"]), str(row["offload"]), 1
    )
    config = trial_ds_config(base, spec)
    config["gradient_accumulation_steps"] = int(row["grad_accum"])
    config["wall_clock_breakdown"] = bool(base.get("wall_clock_breakdown", False))  # trial-only instruments
    if "comms_logger" in base:
        config["comms_logger"] = copy.deepcopy(base["comms_logger"])
    else:
        config.pop("comms_logger", None)
    config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = lr
    return config


def launch_command(config_path: Path, model: str, data: Path, nodes: int, gpus_per_node: int,
                   hostfile: Path | None, output_dir: Path, train_args: Sequence[str] = ()) -> str:  # fmt: skip
    from sdzero.launch import TRAIN_SCRIPT

    cmd = ["deepspeed"]
    if nodes > 1:
        cmd += ["--hostfile", str(hostfile or "hostfile"), "--num_nodes", str(nodes)]
    cmd += ["--num_gpus", str(gpus_per_node), str(TRAIN_SCRIPT), "--deepspeed_config", str(config_path),
            "--model", model, "--data", str(data), "--output-dir", str(output_dir), *train_args]  # fmt: skip
    return shlex.join(cmd)


def why_not(row: pd.Series, best: pd.Series, usable_bytes: float) -> str:
    """One line on why this config lost to the recommendation."""
    if not bool(row["feasible"]):
        return (f"memory: needs {row['mem_per_rank_bytes'] / GIB:.2f} GiB per rank, over the "
                f"{usable_bytes / GIB:.2f} GiB usable")  # fmt: skip
    share = row["exposed_comm_s"] / row["step_time_s"]
    slower = 1 - row["samples_per_s"] / best["samples_per_s"]
    if share > COMM_BOUND_SHARE and share > best["exposed_comm_s"] / best["step_time_s"]:
        return (f"communication-bound: {share:.0%} of its step is exposed communication at "
                f"{int(row['node_count'])} nodes ({slower:.0%} slower)")  # fmt: skip
    if row["micro_batch"] < best["micro_batch"]:
        return f"smaller micro-batch: fixed per-step costs weigh more ({slower:.0%} slower)"
    return f"{slower:.0%} slower: more compute per sample at ZeRO-{int(row['zero_stage'])} {row['dtype']}"


def what_would_fit(memory: MemoryModel, candidates: list[Candidate], nodes: list[int], gpus_per_node: int,
                   usable_bytes: float) -> str:  # fmt: skip
    """For the error when nothing fits: the smallest predicted need, and the changes that would fit."""
    world = max(nodes) * gpus_per_node
    options = []
    for c in {
        Candidate(c.zero_stage, c.precision, 1, off) for c in candidates for off in ("none", "optimizer")
    }:
        mem = memory.per_rank_bytes(c.zero_stage, c.precision, 1, c.offload, world)["total"]
        options.append((mem, c))
    options.sort(key=lambda t: t[0])
    need, c = options[0]
    smallest = min(memory.per_rank_bytes(c.zero_stage, c.precision, c.micro_batch, c.offload, max(nodes) * gpus_per_node)["total"]
                   for c in candidates)  # fmt: skip
    advice = (f"the least predicted need is {smallest / GIB:.2f} GiB per rank, over {usable_bytes / GIB:.2f} GiB "
              f"usable; {c.config_id} at {max(nodes)} nodes would need {need / GIB:.2f} GiB")  # fmt: skip
    if need <= usable_bytes:
        return (
            advice
            + f": use ZeRO-{c.zero_stage} with micro-batch 1"
            + (" and --offload optimizer" if c.offload != "none" else "")
        )
    return (
        advice + ": add device memory (--device-memory-gib), lower --headroom, or shrink the model/resolution"
    )


def recommend(
    predictions: pd.DataFrame,
    base_config: dict[str, Any],
    usable_bytes: float,
    lr_scaling: str,
    reference_batch: int,
) -> tuple[pd.Series, dict[str, Any], list[dict[str, Any]], float]:
    """(the winning row, its DeepSpeed JSON, runners-up with why_not, its learning rate)."""
    if lr_scaling not in LR_SCALINGS:
        raise UserError(f"--lr-scaling {lr_scaling!r}: choose linear or sqrt")
    fits = predictions[predictions["feasible"].astype(bool)]
    if fits.empty:
        raise ValueError("nothing fits")  # the caller turns this into what_would_fit
    top = fits["samples_per_s"].max()
    # within 1 % of the fastest, the fewest nodes: the same throughput for less hardware
    close = fits[fits["samples_per_s"] >= 0.99 * top].sort_values(
        ["node_count", "samples_per_s"], ascending=[True, False]
    )
    best = close.iloc[0]
    base_lr = float(base_config.get("optimizer", {}).get("params", {}).get("lr", 1e-4))
    lr = scaled_lr(base_lr, lr_scaling, int(best["global_batch"]), reference_batch)
    config = recommended_ds_config(base_config, best, lr)
    others = predictions[predictions["config_id"] != best["config_id"]]
    runners = []
    if not others.empty:
        # each other config at its own best node count (feasible rows first)
        ranked = others.sort_values(["feasible", "samples_per_s"], ascending=False).drop_duplicates(
            "config_id"
        )
        for _, row in ranked.head(RUNNERS_UP).iterrows():
            runners.append({k: _plain(row[k]) for k in ("config_id", "node_count", "samples_per_s", "step_time_s",
                                                       "mem_per_rank_bytes", "grad_accum", "global_batch")}
                           | {"why_not": why_not(row, best, usable_bytes)})  # fmt: skip
    return best, config, runners, lr


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
