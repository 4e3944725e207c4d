"""Fitting both models on a set of trials, and measuring their error on trials held out of the fit.

Every ok trial is predicted twice: once by the model fitted on all trials (held_out false: how well the
model reproduces what it saw) and once by a model fitted on all the other trials (leave-one-out, held_out
true: the honest error, the one printed next to the recommendation). The rows go to validation.csv.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from advisor.model.memory import MemoryModel, ZeroSettings, fit_memory_model
from advisor.model.network import Network
from advisor.model.step_time import TimeModel, fit_time_model, measured_step_s

QUANTITIES = ("step_time_s", "mem_per_rank_bytes", "activation_bytes", "model_state_bytes")


@dataclass
class Models:
    memory: MemoryModel
    timing: TimeModel


def fit_models(
    trials: pd.DataFrame, numels: tuple[int, ...], zero: ZeroSettings, measured_net: Network
) -> Models:
    return Models(fit_memory_model(trials, numels, zero), fit_time_model(trials, measured_net))


def trial_predictions(models: Models, row: pd.Series, measured_net: Network) -> dict[str, float]:
    net = replace(measured_net, gpus_per_node=int(row["ranks_per_node"]))
    stage, precision, mb = int(row["zero_stage"]), str(row["precision"]), int(row["micro_batch"])
    step = models.timing.predict(
        stage, precision, mb, int(row["grad_accum"]), int(row.get("nodes", 1) or 1), net, str(row["offload"])
    )
    mem = models.memory.per_rank_bytes(stage, precision, mb, str(row["offload"]), int(row["world_size"]))
    return {"step_time_s": step.step_time_s, "mem_per_rank_bytes": mem["total"],
            "activation_bytes": mem["activations"],
            "model_state_bytes": float(sum(models.memory.state_bytes(stage, precision, int(row["world_size"])).values()))}  # fmt: skip


def measured_values(row: pd.Series) -> dict[str, float]:
    step = float(measured_step_s(row.to_frame().T).iloc[0])
    return {"step_time_s": step, "mem_per_rank_bytes": float(row["device_peak_bytes"]),
            "activation_bytes": float(row["activation_bytes"]), "model_state_bytes": float(row["model_state_bytes"])}  # fmt: skip


def validation_table(trials: pd.DataFrame, numels: tuple[int, ...], zero: ZeroSettings,
                     measured_net: Network) -> pd.DataFrame:  # fmt: skip
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
                rows.append({"config_id": row["trial_id"], "quantity": quantity, "predicted": predicted[quantity],
                             "measured": measured[quantity], "held_out": held_out,
                             "node_count": int(row.get("nodes", 1) or 1), "micro_batch": int(row["micro_batch"]),
                             "zero_stage": int(row["zero_stage"])})  # fmt: skip
    return pd.DataFrame(rows)


def check_rows(models: Models, checks: pd.DataFrame, measured_net: Network) -> pd.DataFrame:
    """Validation rows of trials run after the fit to check it (`check` true): predicted by a model that
    never saw them, the most honest error there is."""
    rows = []
    for _, row in checks[checks["status"] == "ok"].iterrows():
        predicted, measured = trial_predictions(models, row, measured_net), measured_values(row)
        for quantity in QUANTITIES:
            rows.append({"config_id": row["trial_id"], "quantity": quantity, "predicted": predicted[quantity],
                         "measured": measured[quantity], "held_out": True, "check": True,
                         "node_count": int(row.get("nodes", 1) or 1), "micro_batch": int(row["micro_batch"]),
                         "zero_stage": int(row["zero_stage"])})  # fmt: skip
    return pd.DataFrame(rows)


def mape(validation: pd.DataFrame, quantity: str, held_out: bool = True) -> float | None:
    """Mean absolute percentage error (a fraction) of one quantity; None without such rows. Check trials
    (measured after the fit), where there are any, are the held-out set; else leave-one-out."""
    if held_out and "check" in validation and validation["check"].fillna(False).astype(bool).any():
        validation = validation[validation["check"].fillna(False).astype(bool)]
    rows = validation[(validation["quantity"] == quantity) & (validation["held_out"] == held_out)]
    rows = rows[rows["measured"] > 0]
    if rows.empty:
        return None
    return float(np.mean(np.abs(rows["predicted"] / rows["measured"] - 1)))
