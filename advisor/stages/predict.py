"""The predict stage: every candidate config at every node count, and the files the report reads about
them: predictions.csv, trials.csv (the report's columns) and environment.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from advisor.measure.grid import GridPlan
from advisor.model.network import Network
from advisor.model.predict import Candidate, predict_table
from advisor.model.recommend import what_would_fit
from advisor.model.time_to_train import StartUp, add_time_to_train, startup_rests, startup_s
from advisor.model.uncertainty import Spread, add_intervals, estimate_spread, link_spread
from advisor.stages.fit import FittedModels
from advisor.stages.inputs import AdviseInputs
from advisor.stages.measure import HardwareFigures, MeasuredTrials
from sdzero.atomic import write_csv_atomic, write_json_atomic
from sdzero.errors import UserError


@dataclass
class Predictions:
    candidates: list[Candidate]
    """The grid points left once out-of-memory trials have ruled out the micro-batches above them."""
    table: pd.DataFrame
    """One row per candidate and node count the global batch reaches (predictions.csv), with its time,
    GPU-hours and optimizer steps to train."""
    startup: StartUp
    """The start-up every run pays once, measured from the trials."""
    spread: Spread
    """Where the table's intervals come from (advisor.model.uncertainty)."""


def predict(
    inputs: AdviseInputs,
    hardware: HardwareFigures,
    measured: MeasuredTrials,
    fitted: FittedModels,
    notes: list[str],
) -> Predictions:
    """Predict, write the report's files, then refuse when nothing fits (the files stay to show why).
    `notes` are the run's notes so far, recorded in environment.json."""
    candidates = candidates_from(inputs.plan, measured.trials)
    table = predict_table(
        candidates,
        inputs.node_list,
        fitted.memory,
        fitted.timing,
        hardware.target_net,
        hardware.usable_bytes,
        inputs.target,
    )
    if table.empty:  # the inputs stage checked reach, so only out-of-memory trials removed what reached it
        raise UserError(
            f"--global-batch {inputs.target.describe()}: only micro-batches that ran out of memory reach it"
        )
    startup = startup_s(measured.trials)
    table = add_time_to_train(table, inputs.amount, startup)
    spread = run_spread(inputs, hardware, measured)
    table = add_intervals(table, spread)
    out_dir = inputs.out_dir
    write_csv_atomic(table, out_dir / "predictions.csv")
    trials = measured.trials
    report_trials = trials.assign(dtype=trials["precision"], mem_per_rank_bytes=trials["device_peak_bytes"])
    write_csv_atomic(report_trials, out_dir / "trials.csv")
    environment = environment_record(
        hardware.memory_bytes,
        hardware.memory_source,
        inputs.request.headroom,
        hardware.target_net,
        hardware.measured_net,
        notes + hardware.measured_notes,
    )
    write_json_atomic(out_dir / "environment.json", environment)
    if not table["feasible"].any():
        usable = hardware.usable_bytes
        raise UserError(
            "nothing fits: "
            + what_would_fit(fitted.memory, candidates, inputs.node_list, inputs.target_gpus, usable)
        )
    return Predictions(candidates, table, startup, spread)


def run_spread(inputs: AdviseInputs, hardware: HardwareFigures, measured: MeasuredTrials) -> Spread:
    """The run's own uncertainty: its trials' intervals, held-out errors, noise floor and link fits."""
    from advisor.measure.duel import DUEL_FILE, read_duels
    from advisor.model.alphabeta import load_fits
    from advisor.model.uncertainty import run_noise_floor

    inter = hardware.target_net.inter
    assumed = not inter.source.startswith("measured")
    fits = load_fits(hardware.fit_path) if hardware.fit_path.is_file() else []
    rel = link_spread(f.rel_rmse for f in fits if f.link_level == "inter")
    floor, dof = run_noise_floor(inputs.out_dir)
    return estimate_spread(
        measured.trials,
        measured.validation,
        floor,
        rel,
        assumed,
        startup_rests(measured.trials),
        noise_dof=dof,
        duels=read_duels(inputs.out_dir / DUEL_FILE),
    )


def candidates_from(plan: GridPlan, trials: pd.DataFrame) -> list[Candidate]:
    """Every grid point, less those above an out-of-memory trial of their ladder."""
    oom = trials[trials["status"] == "oom"]
    out = []
    for spec in (s for ladder in plan.ladders for s in ladder):
        same = oom[
            (oom["zero_stage"] == spec.zero_stage)
            & (oom["precision"] == spec.precision)
            & (oom["offload"] == spec.offload)
        ]
        if same.empty or spec.micro_batch < same["micro_batch"].min():
            out.append(Candidate(spec.zero_stage, spec.precision, spec.micro_batch, spec.offload))
    return list(dict.fromkeys(out))


def environment_record(
    memory_bytes: float, source: str, headroom: float, target: Network, measured: Network, notes: list[str]
) -> dict[str, Any]:
    """environment.json: the software snapshot where sdzero.telemetry has one, and what was assumed."""
    env: dict[str, Any] = {}
    try:
        from sdzero.telemetry.environment import environment_snapshot  # type: ignore[import-not-found,unused-ignore]

        env.update(environment_snapshot())
    except ImportError:
        pass
    return env | {
        "device_memory_bytes": memory_bytes,
        "device_memory_source": source,
        "headroom": headroom,
        "target_network": target.describe(),
        "measured_network": measured.describe(),
        "notes": notes,
    }
