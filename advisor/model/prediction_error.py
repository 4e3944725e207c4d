"""Fitting both models on a set of trials, and measuring their error on trials held out of the fit.

Every ok trial is predicted twice: once by the model fitted on all trials (held_out false: how well the
model reproduces what it saw) and once by a model fitted on all the other trials (leave-one-out, held_out
true). Check trials (`check` true) are configs run after the fit, predicted before they ran. The rows go
to validation.csv.

One held-out error figure is reported everywhere (terminal, recommendation.json, report), computed by
`error_summary`: the MAPE over the check trials. Leave-one-out is shown beside it under its own name,
with ERROR_EXPLAINED saying why the two differ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from advisor.measure.grid import is_checkpointed
from advisor.model.memory import MemoryModel, ZeroSettings, fit_memory_model
from advisor.model.network import Network
from advisor.model.recompute import Recompute, fit_recompute, split
from advisor.model.step_time import TimeModel, fit_time_model, measured_compute_s, measured_step_s

QUANTITIES = ("step_time_s", "mem_per_rank_bytes", "activation_bytes", "model_state_bytes")


@dataclass
class Models:
    memory: MemoryModel
    timing: TimeModel
    recompute: Recompute | None = None
    """What gradient checkpointing costs and saves (advisor.model.recompute); None: not fitted."""


def fit_models(
    trials: pd.DataFrame, numels: tuple[int, ...], zero: ZeroSettings, measured_net: Network
) -> Models:
    """Both models on the trials without gradient checkpointing, and what checkpointing changes from
    those with it (advisor.model.recompute)."""
    plain, checkpointed = split(trials)
    memory = fit_memory_model(plain, numels, zero)
    timing = fit_time_model(plain, measured_net, numels, zero)
    recompute = fit_recompute(plain, checkpointed, _extra_per_sample(timing, checkpointed))
    timing.recompute_share, timing.recompute_source = recompute.share, recompute.source
    timing.recompute_shares = dict(recompute.by_group)
    memory.checkpointed = recompute.activations
    return Models(memory, timing, recompute)


def _extra_per_sample(
    timing: TimeModel, checkpointed: pd.DataFrame
) -> list[tuple[tuple[int, str, str], float]]:
    """Per ok checkpointed trial: its compute beyond the plain fit's for its config, per unit of that
    config's per-sample compute."""
    ok = checkpointed[checkpointed["status"] == "ok"] if not checkpointed.empty else checkpointed
    if ok.empty:
        return []
    extra = []
    comm = pd.to_numeric(ok["comm_s"], errors="coerce").fillna(0.0) if "comm_s" in ok else 0.0
    compute = measured_compute_s(ok.assign(comm_s=comm))
    for i, row in ok.iterrows():
        key = (int(row["zero_stage"]), str(row["precision"]), int(row["micro_batch"]), str(row["offload"]))
        per_sample = timing.per_sample_part_s(*key)
        if per_sample > 0:
            extra.append(
                (
                    (key[0], key[1], key[3]),
                    (float(compute[i]) - timing.compute_per_micro_s(*key)) / per_sample,
                )
            )
    return extra


def trial_predictions(models: Models, row: pd.Series, measured_net: Network) -> dict[str, float]:
    net = replace(measured_net, gpus_per_node=int(row["ranks_per_node"]))
    stage, precision, mb = int(row["zero_stage"]), str(row["precision"]), int(row["micro_batch"])
    gc = is_checkpointed(row)
    step = models.timing.predict(
        stage,
        precision,
        mb,
        int(row["grad_accum"]),
        int(row.get("nodes", 1) or 1),
        net,
        str(row["offload"]),
        gc,
    )
    mem = models.memory.per_rank_bytes(stage, precision, mb, str(row["offload"]), int(row["world_size"]), gc)
    return {
        "step_time_s": step.step_time_s,
        "mem_per_rank_bytes": mem["allocated"],  # the trials measure the allocator's peak
        "activation_bytes": mem["activations"],
        "model_state_bytes": float(
            sum(models.memory.state_bytes(stage, precision, int(row["world_size"])).values())
        ),
    }


def measured_values(row: pd.Series) -> dict[str, float]:
    step = float(measured_step_s(row.to_frame().T).iloc[0])
    return {
        "step_time_s": step,
        "mem_per_rank_bytes": float(row["device_peak_bytes"]),
        "activation_bytes": float(row["activation_bytes"]),
        "model_state_bytes": float(row["model_state_bytes"]),
    }


def validation_table(
    trials: pd.DataFrame, numels: tuple[int, ...], zero: ZeroSettings, measured_net: Network
) -> pd.DataFrame:
    ok = trials[trials["status"] == "ok"].reset_index(drop=True)
    rows = []
    full = fit_models(ok, numels, zero, measured_net)
    for i, row in ok.iterrows():
        fits = [(False, full)]
        rest = ok.drop(index=i)
        if not rest.empty:
            fits.append((True, fit_models(rest, numels, zero, measured_net)))
        measured = measured_values(row)
        for held_out, models in fits:
            predicted = trial_predictions(models, row, measured_net)
            for quantity in QUANTITIES:
                rows.append(
                    {
                        "config_id": row["trial_id"],
                        "quantity": quantity,
                        "predicted": predicted[quantity],
                        "measured": measured[quantity],
                        "held_out": held_out,
                        "node_count": int(row.get("nodes", 1) or 1),
                        "micro_batch": int(row["micro_batch"]),
                        "zero_stage": int(row["zero_stage"]),
                        "grad_accum": int(row["grad_accum"]),
                    }
                )
    return pd.DataFrame(rows)


def check_rows(models: Models, checks: pd.DataFrame, measured_net: Network) -> pd.DataFrame:
    """Validation rows of trials run after the fit to check it (`check` true): predicted by a model that
    never saw them, the most honest error there is."""
    rows = []
    for _, row in checks[checks["status"] == "ok"].iterrows():
        predicted, measured = trial_predictions(models, row, measured_net), measured_values(row)
        for quantity in QUANTITIES:
            rows.append(
                {
                    "config_id": row["trial_id"],
                    "quantity": quantity,
                    "predicted": predicted[quantity],
                    "measured": measured[quantity],
                    "held_out": True,
                    "check": True,
                    "node_count": int(row.get("nodes", 1) or 1),
                    "micro_batch": int(row["micro_batch"]),
                    "zero_stage": int(row["zero_stage"]),
                    "grad_accum": int(row["grad_accum"]),
                }
            )
    return pd.DataFrame(rows)


def is_check(validation: pd.DataFrame) -> pd.Series:
    """Rows of check trials (run after the fit); all false in a table without the column."""
    if "check" not in validation:
        return pd.Series(False, index=validation.index)
    return validation["check"].fillna(False).astype(bool)


def mape(
    validation: pd.DataFrame, quantity: str, held_out: bool = True, which: str = "check"
) -> float | None:
    """Mean absolute percentage error (a fraction) of one quantity; None without such rows.

    held_out false: the trials the model was fitted on. held_out true: `which` set, "check" (configs run
    after the fit) or "leave_one_out" (the search's trials, each predicted by a fit without it)."""
    if held_out:
        validation = validation[is_check(validation) == (which == "check")]
    rows = validation[
        (validation["quantity"] == quantity) & (validation["held_out"].astype(bool) == held_out)
    ]
    rows = rows[rows["measured"] > 0]
    if rows.empty:
        return None
    return float(np.mean(np.abs(rows["predicted"] / rows["measured"] - 1)))


ERROR_EXPLAINED = (
    "The held-out error is measured on configs run after the model was fitted and predicted before they "
    "ran: it says how far to trust the predicted figures of configs nobody measured, such as the recommended "
    "one. Leave-one-out refits the model without each search trial in turn; with the few trials a search "
    "takes, leaving one out often removes the only trial that pins a stage's or a precision's cost, so it "
    "reads higher and measures how much each trial is needed, not how good the full fit is."
)


def error_summary(validation: pd.DataFrame) -> dict[str, dict[str, float | int | None]]:
    """{"held_out": {...}, "leave_one_out": {...}}: step-time and memory MAPE and the number of trials
    behind each (held_out has 0 trials and no figures when no check trial ran); held_out's `beyond`: how
    many checks were extrapolations (`checks_beyond`)."""
    out: dict[str, dict[str, float | int | None]] = {}
    for key, which in (("held_out", "check"), ("leave_one_out", "leave_one_out")):
        rows = validation[(is_check(validation) == (which == "check")) & validation["held_out"].astype(bool)]
        out[key] = {
            "step_time_mape": mape(validation, "step_time_s", which=which),
            "memory_mape": mape(validation, "mem_per_rank_bytes", which=which),
            "trials": int(rows["config_id"].nunique()),
        }
    out["held_out"]["beyond"] = checks_beyond(validation) if out["held_out"]["trials"] else None
    return out


def checks_beyond(validation: pd.DataFrame) -> int:
    """How many check configs lay outside the micro-batches the search measured their ZeRO stage at (or
    at a stage it never ran): predicted by extrapolating a line, which their error then judges, not the
    interpolation most unmeasured configs get (advisor.model.leverage)."""
    if validation.empty or not {"micro_batch", "zero_stage", "config_id"} <= set(validation):
        return 0
    fitted = validation[~validation["held_out"].astype(bool) & ~is_check(validation)]
    reach = fitted.groupby("zero_stage")["micro_batch"].agg(["min", "max"])
    checks = validation[is_check(validation)].drop_duplicates("config_id")
    beyond = 0
    for _, row in checks.iterrows():
        stage = row["zero_stage"]
        inside = (
            stage in reach.index and reach.loc[stage, "min"] <= row["micro_batch"] <= reach.loc[stage, "max"]
        )
        beyond += not inside
    return beyond


def error_by(validation: pd.DataFrame, column: str, quantity: str = "step_time_s") -> pd.DataFrame:
    """Held-out MAPE of one quantity per value of `column` (micro_batch, grad_accum or node_count): where
    the model errs, not only how much. Columns: the value, mape, trials."""
    rows = validation[(validation["quantity"] == quantity) & validation["held_out"].astype(bool)]
    rows = rows[(rows["measured"] > 0) & rows.get(column, pd.Series(dtype=float)).notna()]
    if rows.empty:
        return pd.DataFrame(columns=[column, "mape", "trials"])
    err = (rows["predicted"] / rows["measured"] - 1).abs()
    out = err.groupby(rows[column]).agg(["mean", "size"]).reset_index()
    return out.rename(columns={"mean": "mape", "size": "trials"})
