"""What `sdzero advise` tells the user, as recommendation.json holds it: the recommended config and its LR,
the scaling table and the node-count choice, where each figure comes from, the errors, and whether the
recommended config was measured within the budget.

The terminal (advisor.report.terminal) and the report (advisor.report.advise_page) read this payload and
nothing else, so the three show the same figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from advisor.decide.checkpointing import checkpointing_trade
from advisor.decide.node_rules import NodeRule, table_knee
from advisor.decide.scaling_table import (
    INTERVAL_COLUMNS,
    MEASURED,
    MODELLED,
    BatchReach,
    link_provenance,
    options_beside,
    scaling_table,
    table_records,
)
from advisor.decide.search import CHECK_TRIALS, SearchResult
from advisor.decide.withheld import larger_batch_note, withhold_timing
from advisor.measure.grid import is_checkpointed
from advisor.model.interval_words import NOT_MEASURED_WELL, TOO_WIDE, duration_range, range_text, too_wide
from advisor.model.network import Network
from advisor.model.predict import BatchTarget, Candidate
from advisor.model.target_compute import ComputeBasis
from advisor.model.time_to_train import StartUp, TrainAmount, cost_of, hours, money, trade_line
from sdzero.config.lr_rule import LrChoice, choose_lr
from sdzero.constants import GIB
from sdzero.telemetry.environment import bf16_emulated

GPU_HOURS = "GPU-h"
"""The unit of the hours a run holds its devices (rank-hours when the ranks are CPU processes)."""


@dataclass
class Outcome:
    """Everything the pipeline knows once it has chosen (see advisor.stages.advise.run_advise)."""

    best: pd.Series
    runners: list[dict[str, Any]]
    lr: LrChoice
    trials: pd.DataFrame
    predictions: pd.DataFrame
    node_list: list[int]
    rule: NodeRule
    target: BatchTarget
    target_asked: bool
    base_batch: int
    target_net: Network
    measured_net: Network
    trial_device: dict[str, Any]
    trial_ranks: int
    differs: str | None
    memory_bytes: float
    memory_source: str
    usable_bytes: float
    errors: dict[str, dict[str, Any]]
    check_ids: list[str]
    search: SearchResult
    elapsed_s: float
    budget_s: float
    per_trial_s: float
    notes: list[str]
    amount: TrainAmount
    startup: StartUp
    gpu_hour_price: float | None
    micro_batches: tuple[int, ...]
    """The candidates' micro-batches: which global batches a node count can reach."""
    base_lr: float
    lr_reference: int
    lr_scaling: str
    embedded: bool = False
    samples_rule: str = "same"
    """How the samples grow with a larger global batch (advisor.model.batch_growth)."""
    noise_floor: float | None = None
    """The run's noise floor (advisor.model.uncertainty.run_noise_floor: the pooled spread between the two
    halves of each config's launch, as a mean |deviation|), a fraction; None: not measured."""
    intervals: str = ""
    """Where the predicted figures' 95% intervals come from (advisor.model.uncertainty.Spread.describe)."""
    interval_notes: tuple[str, ...] = ()
    """What the intervals leave out (no noise floor, an assumed link, no held-out errors)."""
    compute: ComputeBasis | None = None
    """Where the target's compute comes from (advisor.model.target_compute); None: this machine's."""
    recompute: tuple[float, str] | None = None
    """(compute added per sample by gradient checkpointing, measured or modelled), from the time model."""

    @property
    def min_efficiency(self) -> float:
        return self.rule.min_efficiency


def measured_ids(trials: pd.DataFrame) -> set[str]:
    """config_ids (advisor.model.predict.Candidate) of the trials that finished."""
    ok = trials[trials["status"] == "ok"]
    return {candidate_of(r).config_id for _, r in ok.iterrows()}


def candidate_of(row: pd.Series) -> Candidate:
    """The config a trials.csv row measured."""
    return Candidate(
        int(row["zero_stage"]),
        str(row["precision"]),
        int(row["micro_batch"]),
        str(row["offload"]),
        is_checkpointed(row),
    )


def provenance(o: Outcome) -> dict[str, Any]:
    # bf16 emulated in software is several times slower than fp32: the figures of such a CPU say so
    emulated = bf16_emulated() if o.trial_device["device"] == "cpu" else ""
    here = (
        f"a CPU ({o.trial_ranks} ranks{'; ' + emulated if emulated else ''})"
        if o.trial_device["device"] == "cpu"
        else f"{o.trial_ranks} {o.trial_device['device']} device(s)"
    )
    target = o.differs or f"nodes like this one ({o.target_net.gpus_per_node} ranks each)"
    inter = link_provenance(o.target_net.inter.source)
    compute = o.compute.line if o.compute is not None else f"compute measured on {here}"
    if o.compute is not None and not o.compute.timed:
        compute = "the target's compute is unknown (see the answer)"
    headline = f"Trials ran on {here}; target: {target}. " + (
        f"The target differs from this machine: {compute}; memory checked against "
        f"{o.memory_bytes / GIB:.3g} GiB, {o.memory_source}. "
        if o.differs
        else ""
    )
    headline += f"Inter-node link: {inter}" + ("." if inter == MEASURED else " (--hostfile measures it).")
    return {
        "headline": headline,
        "trials_ran_on": here,
        "target": target,
        "target_differs": o.differs is not None,
        "compute": compute
        if o.differs
        else f"{MEASURED} on {here} (trials); {MODELLED} for other configs and node counts",
        "memory_per_rank": f"{MODELLED} (fitted to the trials' measured peaks)",
        "device_memory": f"{o.memory_bytes / GIB:.3g} GiB, {o.memory_source}",
        "intra_node_link": f"{link_provenance(o.target_net.intra.source)}: {o.target_net.intra.source}",
        "inter_node_link": f"{inter}: {o.target_net.inter.source}",
    }


def budget_check(o: Outcome, measured: set[str]) -> dict[str, Any]:
    """Whether the recommended config ran as a trial; if not, the best that did and the budget to measure it."""
    chosen = str(o.best["config_id"])
    if chosen in measured:
        return {"recommended_config_measured": True}
    ok = o.trials[o.trials["status"] == "ok"].assign(
        rate=lambda t: pd.to_numeric(t["samples_per_s"], errors="coerce")
    )
    top = ok.loc[ok["rate"].idxmax()]
    best_id = candidate_of(top).config_id
    n = int(o.best["node_count"])
    there = o.predictions[(o.predictions["config_id"] == best_id) & (o.predictions["node_count"] == n)]
    predicted = float(there["samples_per_s"].iloc[0]) if not there.empty else None
    by_budget = any("budget" in line for line in o.search.log)
    minutes = math.ceil((o.elapsed_s + o.per_trial_s * (1 + CHECK_TRIALS)) / 60)
    why = "--budget-minutes ran out" if by_budget else f"the search stopped ({(o.search.log or ['-'])[-1]})"
    message = (
        f"{chosen} was not measured ({why}); its figures are the model's. Best measured config: {best_id} "
        f"({float(top['rate']):.3g} samples/s measured here"
        + (f", {predicted:.3g} predicted at {n} nodes" if predicted is not None else "")
        + f"). --budget-minutes {minutes} with the same --out (the {len(o.trials)} trials done are reused) "
        "leaves room to measure it and check the model on it."
    )
    return {
        "recommended_config_measured": False,
        "best_measured_config": best_id,
        "best_measured_samples_per_s": float(top["rate"]),
        "best_measured_predicted_samples_per_s": predicted,
        "stopped_by_budget": by_budget,
        "suggested_budget_minutes": minutes,
        "message": message,
    }


def groups_without_trials(o: Outcome) -> dict[str, Any]:
    """{"stages": the candidates' ZeRO stage and precision no trial measured, "budget_minutes": the
    --budget-minutes that would measure each once}; stages empty when every group ran."""
    ok = o.trials[o.trials["status"] == "ok"] if not o.trials.empty else o.trials
    ran = {(int(r["zero_stage"]), str(r["precision"])) for _, r in ok.iterrows()}
    wanted = {(int(r["zero_stage"]), str(r["dtype"])) for _, r in o.predictions.iterrows()}
    missing = sorted(wanted - ran)
    minutes = math.ceil((o.elapsed_s + o.per_trial_s * len(missing)) / 60)
    return {
        "stages": [f"ZeRO-{stage} {precision}" for stage, precision in missing],
        "budget_minutes": minutes,
    }


def stages_without_trials(o: Outcome) -> str:
    """Which ZeRO stage and precision of the candidates no trial measured (its costs are borrowed from
    the nearest measured group, advisor.model.step_time._closest), and the budget that would measure each
    once; '' when every group ran."""
    groups = groups_without_trials(o)
    missing, minutes = groups["stages"], groups["budget_minutes"]
    if not missing:
        return ""
    names = ", ".join(missing)
    return (
        f"no trial measured {names}: its costs are borrowed from the measured stages; --budget-minutes "
        f"{minutes} with the same --out would measure {'it' if len(missing) == 1 else 'each'} once"
    )


def node_choice(o: Outcome, table: pd.DataFrame) -> dict[str, Any]:
    chosen = int(o.best["node_count"])
    beside = options_beside(table)
    rows = table_records(table)
    return {
        "rule": o.rule.describe(GPU_HOURS),
        **o.rule.record(),
        "chosen": chosen,
        "knee": table_knee(table),
        **beside,
        "trade": trade_line(rows, chosen, beside["fastest"], GPU_HOURS, o.gpu_hour_price),
        "confidence": o.rule.confidence(table, chosen),
    }


def best_intervals(best: pd.Series) -> dict[str, list[float]]:
    """The recommended row's 95% intervals, {figure: [lo, hi]}, where the predictions carry them."""
    out = {}
    for column in INTERVAL_COLUMNS[::2]:
        figure = column.removesuffix("_lo")
        lo, hi = best.get(f"{figure}_lo"), best.get(f"{figure}_hi")
        if lo is not None and hi is not None and not (pd.isna(lo) or pd.isna(hi)):
            out[figure] = [float(lo), float(hi)]
    return out


def span(
    value: float, bounds: list[float] | None, show: Callable[[float], str], duration: bool = False
) -> str:
    """'4.1 h (3.6-4.7 h)': a figure and its 95% interval as a range (seconds in the figure's own unit
    where `duration`); the figure alone without an interval; NOT_MEASURED_WELL where the interval spans
    more than the figure (advisor.report.answer)."""
    if not bounds:
        return show(value)
    lo, hi = bounds
    if too_wide(value, lo, hi):
        return NOT_MEASURED_WELL
    return f"{show(value)} ({duration_range(value, lo, hi) if duration else range_text(lo, hi)})"


def unreachable_notes(o: Outcome, table: pd.DataFrame) -> None:
    """An unreachable row's way in: the smallest global batch that reaches it and what the one LR rule
    (sdzero.config.lr_rule) would make of the LR there, written into the row."""
    table["reach_note"] = table["reach_note"].astype(object)
    for i in table.index[table["status"] == "unreachable"]:
        batch = table.at[i, "smallest_batch"]
        if pd.isna(batch):
            continue
        lr = choose_lr(o.base_lr, int(batch), o.lr_reference, o.lr_scaling)
        table.at[i, "reach_note"] = (
            f"needs a global batch of {int(batch)} or more: --global-batch {int(batch)} reaches it, "
            f"at {lr.describe()}"
        )
    grown = table["larger_batch"].astype("boolean").fillna(False) if "larger_batch" in table else []
    for i in table.index[grown]:
        batch = int(table.at[i, "global_batch"])
        lr = choose_lr(o.base_lr, batch, o.lr_reference, o.lr_scaling)
        table.at[i, "reach_note"] = larger_batch_note(
            batch, o.target.describe(), lr.describe(), table.at[i, "samples_factor"], o.samples_rule
        )


def time_to_train(o: Outcome) -> dict[str, Any]:
    """The recommended run's time, GPU-hours and cost to train, and what they rest on."""
    best = o.best
    gpu_hours = float(best["gpu_hours"])
    factor = float(best.get("samples_factor", 1.0) or 1.0)  # a batch above the LR's reference trains more
    return {
        "samples": math.ceil(o.amount.samples * factor),
        "samples_factor": factor,
        "samples_rule": o.samples_rule,
        "samples_per_epoch": o.amount.samples_per_epoch,
        "epochs": o.amount.epochs,
        "amount": o.amount.describe()
        + (
            f", x{factor:.3g} for global batch {int(best['global_batch'])} above the LR's reference "
            f"{o.lr_reference} ({o.samples_rule} rule)"
            if factor != 1
            else ""
        ),
        "optimizer_steps": int(best["optimizer_steps"]),
        "seconds": float(best["time_to_train_s"]),
        "gpu_hours": gpu_hours,
        "unit": GPU_HOURS,
        "gpu_hour_price": o.gpu_hour_price,
        "cost": cost_of(gpu_hours, o.gpu_hour_price),
        "startup_s": o.startup.seconds,
        "startup": o.startup.describe(),
        "seconds_interval": best_intervals(best).get("time_to_train_s"),
        "gpu_hours_interval": best_intervals(best).get("gpu_hours"),
    }


def verdict(o: Outcome, rec: dict[str, Any]) -> str:
    """The answer in one line: nodes, config, time, GPU-hours (and cost), and where the figures come from."""
    t = rec["time_to_train"]
    n = rec["node_count"]
    cost = f", {money(t['cost'])} at {t['gpu_hour_price']:g}/{GPU_HOURS}" if t["cost"] is not None else ""
    measured = (
        "measured config" if rec["measured"].get("recommended_config_measured") else "config not measured"
    )
    link = (
        ""
        if n == 1 or link_provenance(o.target_net.inter.source) == MEASURED
        else ", inter-node link assumed"
    )
    held = rec["error"].get("step_time_mape")
    error = f", held-out error {held:.0%}" if held is not None else ""
    took = span(t["seconds"], t.get("seconds_interval"), hours, duration=True)
    spent = span(t["gpu_hours"], t.get("gpu_hours_interval"), lambda v: f"{v:.3g}")
    if NOT_MEASURED_WELL in (took, spent):  # no figure to give: say what it is instead
        figures = f"time and {GPU_HOURS} to train {t['samples']:,} samples {TOO_WIDE}"
    else:
        figures = f"{took}, {spent} {GPU_HOURS}{cost} to train {t['samples']:,} samples"
    return (
        unmeasured_first(rec)
        + f"{n} node{'s' if n != 1 else ''} x {rec['gpus_per_node']} ranks, {rec['config_id']} "
        f"(micro-batch {rec['micro_batch']} x accumulation {rec['grad_accum']}, global batch "
        f"{rec['global_batch']}): {figures} ({MODELLED} from {rec['trials_run']} trials on "
        f"{rec['provenance']['trials_ran_on']}, {measured}{link}{error}; node count by "
        f"{o.rule.verdict_words})"
    )


def input_clause(rec: dict[str, Any]) -> str:
    """'; input-bound: ... remedy: ...' where the chosen node count is held back by its input (its row's
    note, advisor.model.input_rate), else nothing: a plan never recommends an input-bound count silently."""
    row = next((r for r in rec.get("scaling_table", []) if r.get("node_count") == rec["node_count"]), {})
    return f"; {row['input_note']}" if row.get("input_note") else ""


UNMEASURED_PICK = "not measured, and no measured config is within noise of it"


def unmeasured_first(rec: dict[str, Any]) -> str:
    """The verdict's opening when the pick is a config no trial ran (advisor.decide.ties.pick_config
    recommends one only when no measured config is within noise of it): said before anything else, with
    the best measured config to fall back on."""
    measured = rec["measured"]
    if measured.get("recommended_config_measured", True):
        return ""
    fallback = measured.get("best_measured_config")
    return f"{UNMEASURED_PICK}" + (f" (best measured: {fallback})" if fallback else "") + ": "


def build_recommendation(o: Outcome) -> dict[str, Any]:
    best = o.best
    measured = measured_ids(o.trials)
    reach = BatchReach(o.micro_batches, o.target_net.gpus_per_node, o.target.lo)
    table = scaling_table(
        o.predictions, o.node_list, o.min_efficiency, o.target_net.inter.source, measured, reach
    )
    unreachable_notes(o, table)
    whose = "the embedded default fine-tune's" if o.embedded else "the base config's"
    batch_rule = (
        f"{o.target.describe()} (--global-batch)"
        if o.target_asked
        else f"{o.base_batch}, {whose}, held fixed (strong scaling; --global-batch changes it)"
    )
    held_out = o.errors["held_out"]
    rec = {
        "config_id": best["config_id"],
        "node_count": int(best["node_count"]),
        "gpus_per_node": o.target_net.gpus_per_node,
        "world_size": int(best["world_size"]),
        "zero_stage": int(best["zero_stage"]),
        "dtype": best["dtype"],
        "micro_batch": int(best["micro_batch"]),
        "offload": best["offload"],
        "samples_per_s": float(best["samples_per_s"]),
        "step_time_s": float(best["step_time_s"]),
        "compute_s": float(best["compute_s"]),
        "exposed_comm_s": float(best["exposed_comm_s"]),
        "mem_per_rank_bytes": float(best["mem_per_rank_bytes"]),
        "usable_memory_bytes": o.usable_bytes,
        "global_batch": int(best["global_batch"]),
        "global_batch_target": o.target.describe(),
        "global_batch_rule": batch_rule,
        "grad_accum": int(best["grad_accum"]),
        "lr": o.lr.lr,
        "lr_scaling": o.lr.rule,
        "lr_reference_batch": o.lr.reference_batch,
        "lr_factor": o.lr.factor,
        "lr_base": o.lr.base_lr,
        "lr_capped": o.lr.capped,
        "lr_warmup_steps": o.lr.warmup_steps,
        "lr_warning": o.lr.warning,
        "lr_rule": o.lr.describe(),
        "node_choice": node_choice(o, table),
        "scaling_table": table_records(table),
        "provenance": provenance(o),
        "measured": budget_check(o, measured),
        "error": {k: v for k, v in held_out.items() if v is not None},
        "leave_one_out": o.errors["leave_one_out"],
        "trials_run": int(len(o.trials)),
        "full_grid": int(o.search.full_grid),
        "check_trials": o.check_ids,
        "chosen_by_model": o.search.chosen_by_model,
        "search_log": o.search.log,
        "network": o.target_net.describe(),
        "runners_up": o.runners,
        "notes": o.notes,
        "time_to_train": time_to_train(o),
        "noise_floor": o.noise_floor,
        "intervals": best_intervals(best),
        "intervals_from": o.intervals,
        "interval_notes": list(o.interval_notes),
        "tie": str(best.get("tie_note", "") or ""),
        "unmeasured_stages": stages_without_trials(o),
        "unmeasured_groups": groups_without_trials(o),
        "checkpointing": checkpointing_trade(o.predictions, best, *(o.recompute or (None, ""))),
    }
    rec["verdict"] = verdict(o, rec) + input_clause(rec)
    rec["compute_basis"] = {"kind": o.compute.kind if o.compute else MEASURED, "line": compute_line(o)}
    if o.compute is not None and not o.compute.timed:
        withhold_timing(rec, o.compute.line)
    return rec


def compute_line(o: Outcome) -> str:
    return o.compute.line if o.compute is not None else "compute measured here"
