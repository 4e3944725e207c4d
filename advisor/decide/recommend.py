"""The recommendation: the node count chosen by efficiency (advisor.decide.scaling_table), the fastest config that
fits there, its DeepSpeed JSON, launch command and runners-up.

The JSON is the user's base JSON with the winner's knobs written in by the same code that writes each
trial's JSON (advisor.measure.grid.trial_ds_config), minus the trial-only instruments, with the accumulation for the
global batch and the learning rate from the one rule (sdzero.config.lr_rule): the trainer runs it unchanged (its own
default reference is the JSON's batch, so it does not scale that LR again). Its global batch is not
written (train_batch_size): DeepSpeed derives it from micro-batch x accumulation x world size, so the same
file also runs on fewer ranks for a smoke test.
"""

from __future__ import annotations

import copy
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.decide.node_rules import table_knee
from advisor.decide.scaling_table import DEFAULT_MIN_EFFICIENCY, scaling_table
from advisor.decide.ties import is_measured, is_tie, pick_config
from advisor.measure.grid import TrialSpec, trial_ds_config
from advisor.model.memory import MemoryModel
from advisor.model.predict import Candidate
from sdzero.config.lr_rule import LrChoice, base_lr_of, check_rule, choose_lr
from sdzero.constants import GIB
from sdzero.errors import UserError

COMM_BOUND_SHARE = 0.3
"""A config whose exposed communication is above this share of its step is called communication-bound."""
RUNNERS_UP = 5


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


def launch_command(
    config_path: Path,
    model: str,
    data: Path,
    nodes: int,
    gpus_per_node: int,
    hostfile: Path | None,
    output_dir: Path,
    train_args: Sequence[str] = (),
    lr: LrChoice | None = None,
) -> str:
    """The deepspeed command; with `lr`, its warm-up flag and a trailing shell comment stating the LR, the
    rule and the factor (the LR itself is in the JSON)."""
    from sdzero.cluster.launch_command import deepspeed_command

    args = [
        "--deepspeed_config",
        str(config_path),
        "--model",
        model,
        "--data",
        str(data),
        "--output-dir",
        str(output_dir),
        *train_args,
    ]
    if lr is not None and lr.warmup_steps and "--lr-warmup-steps" not in train_args:
        args += ["--lr-warmup-steps", str(lr.warmup_steps)]
    # Printed for the target cluster: its own `deepspeed`, a hostfile that is there, the default port.
    cmd = deepspeed_command(
        args,
        num_gpus=gpus_per_node,
        hostfile=Path(hostfile or "hostfile") if nodes > 1 else None,
        num_nodes=nodes if nodes > 1 else None,
        executable="deepspeed",
        check_hostfile=False,
        shell_proof=False,
        pick_port=False,
    )
    return shlex.join(cmd) + (f"  # {lr.describe()}" if lr is not None else "")


def why_not(row: pd.Series, best: pd.Series, usable_bytes: float) -> str:
    """One line on why this config lost to the recommendation; "within noise" where the two cannot be told
    apart (advisor.decide.ties.is_tie)."""
    host = row.get("host_reason")
    if not bool(row["feasible"]) and isinstance(host, str) and host:
        return host
    if not bool(row["feasible"]):
        return (
            f"memory: needs {row['mem_per_rank_bytes'] / GIB:.2f} GiB per rank, over the "
            f"{usable_bytes / GIB:.2f} GiB usable"
        )
    if _flag(row, "contended") and not _flag(best, "contended"):
        return (
            "left out: measured only while other processes took the cores (contended), so its step was "
            "the machine's, not the config's; a quiet run measures it"
        )
    slower = 1 - row["samples_per_s"] / best["samples_per_s"]
    if is_tie(row, best):
        how = f"{-slower:.0%} faster predicted" if slower < 0 else f"{slower:.0%} slower predicted"
        unmeasured = ", not measured" if not is_measured(row) and is_measured(best) else ""
        return f"within noise of the pick ({how}{unmeasured}): a tie, decided by the tie rule (see tie)"
    share = row["exposed_comm_s"] / row["step_time_s"]
    if share > COMM_BOUND_SHARE and share > best["exposed_comm_s"] / best["step_time_s"]:
        return (
            f"communication-bound: {share:.0%} of its step is exposed communication at "
            f"{int(row['node_count'])} nodes ({slower:.0%} slower)"
        )
    if row["micro_batch"] < best["micro_batch"]:
        return f"smaller micro-batch: fixed per-step costs weigh more ({slower:.0%} slower)"
    return f"{slower:.0%} slower: more compute per sample at ZeRO-{int(row['zero_stage'])} {row['dtype']}"


def _flag(row: pd.Series, column: str) -> bool:
    value = row.get(column, False)
    return False if value is None or pd.isna(value) else str(value).strip().lower() in {"true", "1"}


def what_would_fit(
    memory: MemoryModel,
    candidates: list[Candidate],
    nodes: list[int],
    gpus_per_node: int,
    usable_bytes: float,
) -> str:
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
    smallest = min(
        memory.per_rank_bytes(
            c.zero_stage, c.precision, c.micro_batch, c.offload, max(nodes) * gpus_per_node
        )["total"]
        for c in candidates
    )
    advice = (
        f"the least predicted need is {smallest / GIB:.2f} GiB per rank, over {usable_bytes / GIB:.2f} GiB "
        f"usable; {c.config_id} at {max(nodes)} nodes would need {need / GIB:.2f} GiB"
    )
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
    node_count: int | None = None,
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
) -> tuple[pd.Series, dict[str, Any], list[dict[str, Any]], LrChoice]:
    """(the winning row, its DeepSpeed JSON, runners-up with why_not, its LR and how it was reached).

    The node count is `node_count` (--nodes) if given, else the largest that keeps `min_efficiency`;
    the winner is the fastest config that fits there, or among configs tied with it within noise the one
    TIE_RULE prefers (the row's `tie_note` says so); runners-up are the other configs at that count."""
    check_rule(lr_scaling)
    fits = predictions[predictions["feasible"].astype(bool)]
    if fits.empty:
        raise ValueError("nothing fits")  # the caller turns this into what_would_fit
    if node_count is None:
        nodes = sorted(int(n) for n in predictions["node_count"].unique())
        node_count = table_knee(scaling_table(predictions, nodes, min_efficiency, "", set()))
    here = fits[fits["node_count"] == node_count]
    if here.empty:
        raise UserError(
            f"--nodes {node_count}: no config both fits in memory and reaches the global batch there "
            "(see the scaling table); choose another --nodes or --global-batch"
        )
    pick = pick_config(here)
    best = pick.row.copy()
    best["tie_note"] = pick.describe()
    lr = choose_lr(base_lr_of(base_config), int(best["global_batch"]), reference_batch, lr_scaling)
    config = recommended_ds_config(base_config, best, lr.lr)
    others = predictions[
        (predictions["config_id"] != best["config_id"]) & (predictions["node_count"] == node_count)
    ]
    ranked = others.sort_values(["feasible", "samples_per_s"], ascending=False)
    runners = [
        {
            k: _plain(row[k])
            for k in (
                "config_id",
                "node_count",
                "samples_per_s",
                "step_time_s",
                "mem_per_rank_bytes",
                "grad_accum",
                "global_batch",
            )
        }
        | {"why_not": why_not(row, best, usable_bytes)}
        for _, row in ranked.head(RUNNERS_UP).iterrows()
    ]
    return best, config, runners, lr


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value
