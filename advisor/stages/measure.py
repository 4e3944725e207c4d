"""The measure stage: the collectives benchmark and the device memory (measure_hardware), then the launches
the search plans, one per group, and the held-out check of the model on the configs it never fitted
(measure_trials).

Files: <out>/comm/ (the benchmark), <out>/profile/trials.csv (one row per config) and one folder per
launch under <out>/profile/trials/, <out>/launches.json (their costs), <out>/validation.csv.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.decide.search import SearchResult, run_search
from advisor.measure.launch import LAUNCHES_FILE
from advisor.measure.trials import TrialSettings
from advisor.model.lora_sizing import lora_numels
from advisor.model.memory import ZeroSettings, trained_numels
from advisor.model.network import Network, build_network
from advisor.model.predict import grad_accum_for
from advisor.model.prediction_error import check_rows, fit_models, validation_table
from advisor.stages.inputs import AdviseInputs
from advisor.stages.target import device_memory_bytes
from sdzero.atomic import write_csv_atomic
from sdzero.constants import GIB
from sdzero.errors import UserError

TrialRunner = Callable[..., pd.DataFrame]
"""Launches the specs not yet measured (`measure_s`: each launch's seconds of timed steps); returns the
table of every trial of the setup so far."""


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
    """Trained parameter counts of the model (advisor.model.lora_sizing.network_numels: a LoRA run's adapters,
    with its frozen base beside them)."""
    zero: ZeroSettings
    """The base config's ZeRO settings (buckets, persistence threshold, overlap)."""
    runner: TrialRunner
    """Runs more trials of this setup (--tune-buckets uses it)."""
    budget_s: float
    """The whole wall-clock budget, seconds."""
    per_trial_s: float
    notes: list[str] = field(default_factory=list)


def measure_hardware(inputs: AdviseInputs) -> HardwareFigures:
    """Benchmark the collectives over this machine's ranks, or with a hostfile the trials' ranks per host on
    every host (the within-host fit then comes from the hosts, the trials host among them), build the
    measured and the target networks from the fit, and find the target's device memory."""
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
    elif inputs.trials_host is not None:
        memory_bytes, memory_source = trials_host_memory(inputs.device, inputs.ranks, inputs.trials_host.host)
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


def trials_host_memory(device: dict[str, Any], ranks: int, host: str) -> tuple[float, str]:
    """The trials host's device memory per rank, as its accelerator reported it there
    (advisor.measure.profile.trials_on_first_host): a GPU's own, or a CPU host's shared by its ranks."""
    total = float(device["memory_bytes"])
    if device["device"] != "cpu":
        return total, f"measured ({device['device']} device 0 total memory on {host})"
    return total / ranks, f"measured (host memory of {host} / {ranks} ranks, no accelerator)"


def measure_trials(inputs: AdviseInputs, hardware: HardwareFigures) -> MeasuredTrials:
    """One launch per group while the budget holds (advisor.decide.search), then the held-out check of
    the accumulation configs the launches measured beside the others."""
    # --lora-rank: the adapters, with the frozen base beside them (advisor.model.lora_sizing)
    numels = lora_numels(inputs.model, inputs.user_args) or trained_numels(inputs.model)
    zero = ZeroSettings.from_config(inputs.base)
    given = inputs.request.budget_minutes
    base_s = (5.0 if inputs.on_cpu else 30.0) * 60
    total_s = given * 60 if given else base_s
    runner = trial_runner(
        # the race's leader is a config that fits the memory the plan has (sdzero.training.measuring.race)
        replace(inputs.settings, race_memory_cap_bytes=hardware.usable_bytes),
        inputs.base,
        inputs.out_dir / "profile",
        inputs.setup,
        inputs.say,
        inputs.out_dir / LAUNCHES_FILE,
        # a contended launch is launched again only while the budget has room (the default budget's
        # deadline follows the search's, which the first launch may raise)
        None if not given else inputs.started + total_s,
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
        default_base_s=None if given else budget_s,
    )
    if search.trials[search.trials["status"] == "ok"].empty:
        raise UserError(f"no trial succeeded; see the logs under {inputs.out_dir / 'profile' / 'trials'}")
    check = check_model(inputs, hardware, search.trials, search.check_ids, numels, zero)
    return MeasuredTrials(
        trials=search.trials,
        search=search,
        validation=check.validation,
        check_ids=check.check_ids,
        numels=numels,
        zero=zero,
        runner=runner,
        budget_s=search.budget_s + total_s - budget_s,  # the search's budget from the command's start
        per_trial_s=check.per_trial_s,
        # a launch left contended (advisor.measure.launch), in one line each
        notes=[*check.notes, *getattr(runner, "answer_lines", list)()],
    )


def check_model(
    inputs: AdviseInputs,
    hardware: HardwareFigures,
    trials: pd.DataFrame,
    check_ids: list[str],
    numels: tuple[int, ...],
    zero: ZeroSettings,
) -> ModelCheck:
    """The held-out error: the accumulation checks predicted by the model fitted on every other trial
    (they are never in the fit that predicts them), leave-one-out for the rest. Writes validation.csv."""
    net = hardware.measured_net
    held = trials["trial_id"].astype(str).isin(check_ids)
    fitted_on = trials[~held]
    validation = validation_table(fitted_on, numels, zero, net)
    notes: list[str] = []
    if check_ids:
        fitted = fit_models(fitted_on, numels, zero, net)
        validation = pd.concat([validation, check_rows(fitted, trials[held], net)], ignore_index=True)
    else:
        notes.append("no check config measured: no held-out error; leave-one-out is shown instead")
    per_trial = float(pd.to_numeric(trials["wall_s"], errors="coerce").mean())
    write_csv_atomic(validation, inputs.out_dir / "validation.csv")
    return ModelCheck(trials, validation, list(check_ids), per_trial, notes)


def trial_runner(
    settings: TrialSettings,
    base: dict[str, Any],
    profile_dir: Path,
    setup: str,
    say: Callable[[str], None],
    launches_path: Path | None = None,
    deadline: float | None = None,
) -> TrialRunner:
    """Launch the specs not yet in <profile_dir>/trials.csv, one launch per group; return the table
    (advisor.measure.launch)."""
    from advisor.measure.launch import LaunchRunner

    return LaunchRunner(
        settings, base, profile_dir, setup, say, deadline=deadline, launches_path=launches_path
    )
