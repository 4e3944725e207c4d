"""The measure stage: the collectives benchmark and the device memory (measure_hardware), then the trials
the search chooses and the check trials that test the model on configs it never fitted (measure_trials).

Files: <out>/comm/ (the benchmark), <out>/profile/trials.csv and one folder per trial, <out>/validation.csv.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.measure.grid import TrialSpec, accumulation_check
from advisor.measure.trials import TrialSettings
from advisor.model.memory import ZeroSettings, trained_numels
from advisor.model.network import Network, build_network
from advisor.model.predict import grad_accum_for
from advisor.model.prediction_error import check_rows, fit_models, validation_table
from advisor.model.search import CHECK_COST_TRIALS, SearchResult, check_specs, run_search
from advisor.stages.inputs import AdviseInputs
from advisor.target import device_memory_bytes
from sdzero.atomic import write_csv_atomic
from sdzero.constants import GIB
from sdzero.errors import UserError

TrialRunner = Callable[[list[TrialSpec]], pd.DataFrame]
"""Runs the specs not yet measured; returns the table of every trial of the setup so far."""


@dataclass
class HardwareFigures:
    """The networks and the device memory the models and predictions use."""

    fit_path: Path
    """<out>/comm/comm_fit.json: the benchmark's alpha-beta fits (absent when it failed)."""
    measured_net: Network
    """The network the trials ran on: this machine's ranks, the benchmark's fits."""
    measured_notes: list[str]
    """What building measured_net assumed (recorded in environment.json only)."""
    target_net: Network
    """The network predicted for: the target's ranks per node and inter-node fabric."""
    memory_bytes: float
    """Device memory per rank of the target."""
    memory_source: str
    """Where memory_bytes comes from (measured here, or the user's figure)."""
    usable_bytes: float
    """memory_bytes less the headroom: what a config must fit in."""
    notes: list[str] = field(default_factory=list)


@dataclass
class ModelCheck:
    """The held-out check: configs the model predicted before they ran, then measured."""

    trials: pd.DataFrame
    """The search's trials and the check trials that ran."""
    validation: pd.DataFrame
    """Leave-one-out rows for the search's trials, held-out rows for the check trials (validation.csv)."""
    check_ids: list[str]
    """trial_ids of the check trials that succeeded."""
    per_trial_s: float
    """Mean wall time of the search's trials: what a check trial is expected to cost."""
    notes: list[str] = field(default_factory=list)


@dataclass
class MeasuredTrials:
    """Every trial this run measured, and what the later stages fit and predict with."""

    trials: pd.DataFrame
    """The last attempt of every trial of this setup: the search's and the checks'."""
    search: SearchResult
    validation: pd.DataFrame
    check_ids: list[str]
    numels: tuple[int, ...]
    """Trained parameter counts of the model (advisor.model.memory.trained_numels)."""
    zero: ZeroSettings
    """The base config's ZeRO settings (buckets, persistence threshold, overlap)."""
    runner: TrialRunner
    """Runs more trials of this setup (--tune-buckets uses it)."""
    budget_s: float
    """The whole wall-clock budget, seconds."""
    per_trial_s: float
    notes: list[str] = field(default_factory=list)


def measure_hardware(inputs: AdviseInputs) -> HardwareFigures:
    """Benchmark the collectives over this machine's ranks (or the hostfile's hosts), build the measured and
    the target networks from the fit, and find the target's device memory."""
    # Late import: tests stand in for the benchmark on its module.
    from advisor.measure.collectives_launch import CommRunError, run_comm

    r = inputs.request
    notes: list[str] = []
    comm_dir = inputs.out_dir / "comm"
    try:
        run_comm(
            comm_dir,
            num_ranks=inputs.ranks,
            hostfile=r.hostfile,
            backends=("torch",),
            max_bytes=(16 if inputs.on_cpu else 256) * 2**20,
            budget_s=r.comm_budget_s or (15.0 if inputs.on_cpu else 60.0),
            log=inputs.say,
        )
    except CommRunError as exc:
        notes.append(f"collectives benchmark failed ({exc}); network figures assumed")
    fit_path = comm_dir / "comm_fit.json"
    measured_net, measured_notes = build_network(fit_path, inputs.ranks)
    target_net, target_notes = build_network(
        fit_path, inputs.target_gpus, r.preset, r.inter_node_gbps, r.inter_node_latency_us, r.nics_per_node
    )
    so_far = [*inputs.notes, *notes]
    notes += [n for n in target_notes if n not in so_far]
    if inputs.memory_given:
        memory_bytes, memory_source = inputs.memory_given[0] * GIB, inputs.memory_given[1]
    else:
        memory_bytes, memory_source = device_memory_bytes(inputs.device, inputs.ranks)
        memory_source = f"measured ({memory_source})"
    return HardwareFigures(
        fit_path=fit_path,
        measured_net=measured_net,
        measured_notes=measured_notes,
        target_net=target_net,
        memory_bytes=memory_bytes,
        memory_source=memory_source,
        usable_bytes=memory_bytes * (1 - r.headroom),
        notes=notes,
    )


def measure_trials(inputs: AdviseInputs, hardware: HardwareFigures) -> MeasuredTrials:
    """The trials the search picks within the budget, then the check trials if the budget leaves room."""
    numels = trained_numels(inputs.model)
    zero = ZeroSettings.from_config(inputs.base)
    total_s = (inputs.request.budget_minutes or (5.0 if inputs.on_cpu else 30.0)) * 60
    runner = trial_runner(
        inputs.settings,
        inputs.base,
        inputs.out_dir / "profile",
        inputs.setup,
        inputs.say,
        inputs.out_dir / "drift.json",  # the reference's brackets and the noise floor
        inputs.started + total_s,  # brackets and re-runs only while the budget has room
    )
    budget_s = total_s - (time.monotonic() - inputs.started)
    # The search judges each config at every node count the global batch reaches (beyond them nothing runs).
    reach = [
        n
        for n in inputs.node_list
        if any(grad_accum_for(m, n * inputs.target_gpus, inputs.target) for m in inputs.micro_batches)
    ]
    search = run_search(
        inputs.plan,
        runner,
        numels,
        zero,
        hardware.measured_net,
        hardware.target_net,
        reach,
        hardware.usable_bytes,
        inputs.target,
        budget_s,
        log=inputs.say,
        # the check trials run after the search: their room is kept from the second micro-batches and the
        # duel (a reserve of their bare mean cost was a few seconds short once a duel's legs raised the mean)
        reserve_trials=CHECK_COST_TRIALS,
    )
    if search.trials[search.trials["status"] == "ok"].empty:
        raise UserError(f"no trial succeeded; see the logs under {inputs.out_dir / 'profile' / 'trials'}")
    check = check_model(inputs, hardware, search.trials, numels, zero, runner, total_s)
    return MeasuredTrials(
        trials=check.trials,
        search=search,
        validation=check.validation,
        check_ids=check.check_ids,
        numels=numels,
        zero=zero,
        runner=runner,
        budget_s=total_s,
        per_trial_s=check.per_trial_s,
        # the machine's drift and any trial left contended (advisor.measure.runner), in one line each
        notes=[*check.notes, *getattr(runner, "answer_lines", list)()],
    )


def check_model(
    inputs: AdviseInputs,
    hardware: HardwareFigures,
    trials: pd.DataFrame,
    numels: tuple[int, ...],
    zero: ZeroSettings,
    runner: TrialRunner,
    total_s: float,
) -> ModelCheck:
    """Check trials: configs the model predicts before they run and never fitted on, the held-out error;
    run only if the budget leaves time for all of them. Writes validation.csv."""
    net = hardware.measured_net
    validation = validation_table(trials, numels, zero, net)
    checks = check_specs(inputs.plan, trials, numels, zero, net, hardware.usable_bytes)
    if checks:
        # The model's fastest check config again at accumulation 4: every fitted trial ran at accumulation
        # 1, so this is what tests the split of once-per-step from per-micro-step costs.
        checks.append(accumulation_check(checks[0]))
    check_ids: list[str] = []
    notes: list[str] = []
    per_trial = float(pd.to_numeric(trials["wall_s"], errors="coerce").mean())
    if checks and total_s - (time.monotonic() - inputs.started) > per_trial * len(checks):
        fitted = fit_models(trials, numels, zero, net)  # fitted before the checks run: they stay held out
        inputs.say("checking the model on " + ", ".join(c.trial_id for c in checks))
        everything = runner(checks)
        checked = everything[everything["trial_id"].isin([c.trial_id for c in checks])]
        check_ids = sorted(checked.loc[checked["status"] == "ok", "trial_id"])
        validation = pd.concat([validation, check_rows(fitted, checked, net)], ignore_index=True)
        trials = everything
    elif checks:
        need_s = time.monotonic() - inputs.started + per_trial * CHECK_COST_TRIALS
        notes.append(
            "no budget left for check trials: no held-out error; leave-one-out is shown instead "
            f"(--budget-minutes {math.ceil(need_s / 60)} with the same --out runs them, reusing these trials)"
        )
    write_csv_atomic(validation, inputs.out_dir / "validation.csv")
    return ModelCheck(trials, validation, check_ids, per_trial, notes)


def trial_runner(
    settings: TrialSettings,
    base: dict[str, Any],
    profile_dir: Path,
    setup: str,
    say: Callable[[str], None],
    drift_path: Path | None = None,
    deadline: float | None = None,
) -> TrialRunner:
    """Run specs not yet in <profile_dir>/trials.csv; return the table. advisor.measure.runner brackets
    them with the reference config, corrects them for drift and runs contended ones again."""
    from advisor.measure.runner import TrialRunner as Runner

    return Runner(settings, base, profile_dir, setup, say, drift_path=drift_path, deadline=deadline)
