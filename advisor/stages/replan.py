"""`sdzero advise --replan OUT`: answer again from what an earlier run measured, measuring nothing.

A run of `sdzero advise` leaves in its folder the trials it fitted (trials.csv), the link probes and their
alpha-beta fits (comm/), the held-out checks (validation.csv) and, in plan_inputs.json, what the fits need
besides them: the model's trained parameter sizes, the base DeepSpeed JSON, this machine's device, ranks
and memory, the grid and the search's log. A replan reads those, fits the same models on the same trials
and predicts for another target (--preset, --inter-node-gbps, --nics-per-node, --gpus-per-node,
--target-gpu, --device-memory-gib), another batch (--global-batch), another amount of training (--epochs,
--samples, --gpu-hour-price) or another node-count rule (--nodes, --deadline-hours, --max-gpu-hours,
--min-efficiency): no process group, no trial, no model loaded, so a run measured on a GPU node plans
from a laptop in seconds. With the same options it gives the run's own table.

It refuses, in one line, a folder whose trials were measured for another model (its trained parameter
sizes differ) or another config (base JSON or --train-args), and the options that would need measuring
(--hostfile, --tune-buckets, --budget-minutes, another --data).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.decide.search import SearchResult
from advisor.measure.csv_tables import read_table
from advisor.measure.grid import GridPlan, GridRequest, load_base_config, plan_grid
from advisor.measure.input_figures import INPUT_FILE
from advisor.measure.launch import LAUNCHES_FILE
from advisor.measure.trials import TrialSettings
from advisor.model.lora_sizing import frozen_base_of, with_frozen_base
from advisor.model.memory import ZeroSettings
from advisor.model.model_cost import ModelCost
from advisor.model.network import build_network
from advisor.model.time_to_train import train_amount
from advisor.stages.inputs import (
    AdviseInputs,
    InputSource,
    build_inputs,
    check_request_options,
    claim_out,
    counted_cost,
    dataset_size,
    with_checkpointing_knob,
)
from advisor.stages.measure import HardwareFigures, MeasuredTrials
from advisor.stages.profile_source import is_profile_source, profile_stages
from advisor.stages.request import CPU_GRID, AdviseRequest
from advisor.stages.target import machine_target, target_differs, target_memory
from sdzero.atomic import write_json_atomic
from sdzero.config.user_file import read_user_json
from sdzero.constants import GIB
from sdzero.errors import UserError

PLAN_INPUTS = "plan_inputs.json"
TEXT_COLUMNS = ("trial_id", "setup_id", "status", "reason", "precision", "offload", "notes")
"""Read back as text (a setup hash such as '5e1234567890' would otherwise come back as a number)."""
REPORT_ONLY = ("dtype", "mem_per_rank_bytes")
"""Columns the predict stage adds to trials.csv for the report (advisor.stages.predict)."""
PLAN_VERSION = 1
COPIED = ("trials.csv", "comm/comm.csv", "comm/comm_fit.json", "validation.csv", LAUNCHES_FILE, INPUT_FILE)
"""What a replan into another folder copies there, so that folder reports and replans on its own: the
launches too, whose halves are the run's noise floor (without them the intervals leave drift out), and
the input measurements (advisor.measure.input_figures)."""


def write_plan_inputs(inputs: AdviseInputs, hardware: HardwareFigures, measured: MeasuredTrials) -> Path:
    """<out>/plan_inputs.json: what a replan needs besides the trials and the link probes."""
    r = inputs.request
    grid = with_checkpointing_knob(r.grid or (CPU_GRID if inputs.on_cpu else GridRequest()), r)
    payload = {
        "version": PLAN_VERSION,
        "setup_id": inputs.setup,
        "model": inputs.model,
        "data": str(inputs.data),
        "embedded": inputs.embedded,
        "data_given": r.data is not None,
        "base": inputs.base,
        "train_args": list(inputs.user_args),
        "steps": inputs.settings.steps,
        "warmup_steps": inputs.settings.warmup_steps,
        "device": inputs.device,
        "ranks": inputs.ranks,
        "grid": asdict(grid),
        "numels": list(measured.numels),
        "frozen_base_numels": list(frozen_base_of(measured.numels)),  # a LoRA run's (model.lora_sizing)
        "model_cost": inputs.model_cost.record() if inputs.model_cost else None,
        "memory_here_bytes": None if inputs.memory_given else hardware.memory_bytes,
        "memory_here_source": None if inputs.memory_given else hardware.memory_source,
        # The dataset's own size, not --samples: a replan without --samples trains one epoch of the data.
        "dataset": dict(
            zip(("images", "source"), dataset_size(r, inputs.data, inputs.embedded), strict=True)
        ),
        "search": {
            "full_grid": measured.search.full_grid,
            "chosen_by_model": measured.search.chosen_by_model,
            "log": measured.search.log,
        },
        "check_ids": measured.check_ids,
        "budget_s": measured.budget_s,
        "per_trial_s": measured.per_trial_s,
        "elapsed_s": time.monotonic() - inputs.started,
        # The target's notes are the replan's own (its target may differ); the rest are the run's.
        "input_notes": [*inputs.notes, *(n for n in hardware.notes if n not in _target_notes(inputs))],
        "measure_notes": measured.notes,
    }
    path = inputs.out_dir / PLAN_INPUTS
    write_json_atomic(path, payload)
    return path


def _target_notes(inputs: AdviseInputs) -> list[str]:
    r = inputs.request
    fit_path = inputs.out_dir / "comm" / "comm_fit.json"
    return build_network(
        fit_path, inputs.target_gpus, r.preset, r.inter_node_gbps, r.inter_node_latency_us, r.nics_per_node
    )[1]


def read_plan_inputs(folder: Path) -> dict[str, Any]:
    path = folder / PLAN_INPUTS
    if not folder.is_dir():
        raise UserError(f"--replan {folder}: no such folder; give the --out of an earlier sdzero advise")
    if not os.path.lexists(path):
        raise UserError(
            f"--replan {folder}: no {PLAN_INPUTS} there (written by sdzero advise from this version on); "
            f"run `sdzero advise --out {folder}` once: its finished trials are reused"
        )
    record = read_user_json(path, "--replan")  # a FIFO, /dev/zero, a loop: named, never read for ever
    if not isinstance(record, dict) or record.get("version") != PLAN_VERSION:
        raise UserError(f"--replan {path}: written by another version of sdzero; rerun sdzero advise there")
    return record


def refuse_unmatched(request: AdviseRequest, record: dict[str, Any], folder: Path) -> None:
    """One line for options a replan cannot honour, or a model or config the trials were not measured for."""
    r = request
    needs_measuring = [
        (r.hostfile is not None, "--hostfile (the link is measured by sdzero advise --hostfile)"),
        (r.tune_buckets, "--tune-buckets (bucket sizes are measured)"),
        (r.budget_minutes is not None, "--budget-minutes (a replan runs no trial)"),
        (r.grid is not None, "another trial grid"),
    ]
    for given, what in needs_measuring:
        if given:
            raise UserError(f"--replan {folder}: {what}; without it the replan measures nothing")
    if r.data is not None and Path(r.data).resolve() != Path(record["data"]).resolve():
        raise UserError(
            f"--data {r.data}: the trials in {folder} ran on {record['data']}; give --samples N for the size "
            "of another dataset, or run sdzero advise on it"
        )
    if r.train_args and list(r.train_args) != list(record["train_args"]):
        raise UserError(
            f"--train-args: the trials in {folder} ran with {' '.join(record['train_args']) or 'none'}; "
            "other trainer options change what a step costs, so run sdzero advise with them"
        )
    if r.deepspeed_config is not None:
        base = load_base_config(Path(r.deepspeed_config))
        if base != record["base"]:
            keys = sorted(k for k in {*base, *record["base"]} if base.get(k) != record["base"].get(k))
            raise UserError(
                f"--deepspeed-config {r.deepspeed_config}: the trials in {folder} ran from another base config "
                f"({', '.join(keys)} differ); run sdzero advise with it"
            )
    if r.model is not None:
        from advisor.model.lora_sizing import network_numels

        if list(network_numels(r.model, record["train_args"])) != list(record["numels"]):
            raise UserError(
                f"--model {r.model}: the trials in {folder} measured another network (its trained parameter "
                "sizes differ); run sdzero advise with this model"
            )


def replan_inputs(request: AdviseRequest, record: dict[str, Any], folder: Path) -> AdviseInputs:
    """The inputs stage of a replan: the request checked against the record, nothing asked of the device."""
    r = request
    checked = check_request_options(r)
    refuse_unmatched(r, record, folder)
    device, ranks, base = record["device"], int(record["ranks"]), record["base"]
    gpus_per_node, target_gpu = machine_target(r.preset, r.gpus_per_node, r.target_gpu)
    differs = target_differs(device, ranks, gpus_per_node, target_gpu)
    memory_given = target_memory(differs, r.device_memory_gib, target_gpu)
    out_dir = Path(r.out_dir).resolve()
    claim_out(out_dir)
    grid = GridRequest(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["grid"].items()})
    amount = train_amount(
        r.samples, r.epochs, int(record["dataset"]["images"]), str(record["dataset"]["source"])
    )
    settings = TrialSettings(
        model=record["model"],
        data=Path(record["data"]),
        steps=int(record["steps"]),
        warmup_steps=int(record["warmup_steps"]),
        trial_timeout_s=0.0,
        stall_timeout_s=None,
        train_args=tuple(record["train_args"]),
    )
    source = InputSource(
        base=base,
        device=device,
        ranks=ranks,
        target_gpus=ranks if gpus_per_node is None else gpus_per_node,
        differs=differs,
        memory_given=memory_given,
        model=record["model"],
        data=settings.data,
        settings=settings,
        setup=record["setup_id"],
        plan=replan_grid(grid, device, ranks),
        notes=list(record["input_notes"]),
        amount=amount,
        user_args=tuple(record["train_args"]),
        started=time.monotonic() - float(record["elapsed_s"]),
        embedded=bool(record["embedded"]),
        model_cost=recorded_cost(record),
    )
    return build_inputs(r, out_dir, checked, source)


def recorded_cost(record: dict[str, Any]) -> ModelCost | None:
    """The FLOPs the run counted; a record from before they were counted has them counted now (the
    network is built on the meta device: no weights are loaded)."""
    if "model_cost" in record:
        return ModelCost.from_record(record["model_cost"])
    return counted_cost(str(record["model"]), tuple(record["train_args"]))[0]


def replan_grid(grid: GridRequest, device: dict[str, Any], ranks: int) -> GridPlan:
    """The run's grid, planned as advisor.measure.profile.plan_for_device planned it."""
    from dataclasses import replace

    if not grid.ranks_per_node:
        grid = replace(grid, ranks_per_node=(ranks,))
    return plan_grid(grid, {p: bool(device[p]) for p in ("bf16", "fp16")})


def replan_hardware(inputs: AdviseInputs, record: dict[str, Any], folder: Path) -> HardwareFigures:
    """The networks from the run's link probes and fits; the target's memory as asked, else the run's."""
    r = inputs.request
    fit_path = folder / "comm" / "comm_fit.json"
    measured_net, measured_notes = build_network(fit_path, inputs.ranks)
    target_net, target_notes = build_network(
        fit_path, inputs.target_gpus, r.preset, r.inter_node_gbps, r.inter_node_latency_us, r.nics_per_node
    )
    if inputs.memory_given:
        memory_bytes, source = inputs.memory_given[0] * GIB, inputs.memory_given[1]
    elif record.get("memory_here_bytes"):
        memory_bytes, source = float(record["memory_here_bytes"]), str(record["memory_here_source"])
    else:
        raise UserError(
            f"--replan {folder}: the run was given its target's memory, so this machine's was not measured; "
            "give --device-memory-gib or --target-gpu"
        )
    notes = [n for n in target_notes if n not in inputs.notes]
    return HardwareFigures(
        fit_path=fit_path,
        measured_net=measured_net,
        measured_notes=measured_notes,
        target_net=target_net,
        memory_bytes=memory_bytes,
        memory_source=source,
        usable_bytes=memory_bytes * (1 - r.headroom),
        notes=notes,
    )


def replan_trials(inputs: AdviseInputs, record: dict[str, Any], folder: Path) -> MeasuredTrials:
    """The trials the run fitted (its trials.csv: the last attempt of each, of its setup) and its
    held-out checks."""
    path = folder / "trials.csv"
    if not os.path.lexists(path):
        raise UserError(f"--replan {folder}: no trials.csv there; rerun sdzero advise --out {folder}")
    trials = read_table(path, "--replan", dtype={c: str for c in TEXT_COLUMNS})
    trials = trials.drop(columns=[c for c in REPORT_ONLY if c in trials])  # the predict stage's additions
    if "setup_id" in trials and (trials["setup_id"].astype(str) != str(record["setup_id"])).any():
        raise UserError(
            f"--replan {folder}: its trials.csv holds trials of another setup than plan_inputs.json"
        )
    if trials[trials["status"] == "ok"].empty:
        raise UserError(f"--replan {folder}: no finished trial in trials.csv")
    validation_path = folder / "validation.csv"
    validation = (
        read_table(validation_path, "--replan") if os.path.lexists(validation_path) else pd.DataFrame()
    )
    search = record["search"]

    def no_trials(_specs: list[Any]) -> pd.DataFrame:
        raise UserError("a replan runs no trial; run sdzero advise to measure more")

    return MeasuredTrials(
        trials=trials,
        search=SearchResult(
            trials, int(search["full_grid"]), list(search["chosen_by_model"]), list(search["log"])
        ),
        validation=validation,
        check_ids=list(record["check_ids"]),
        numels=with_frozen_base(record["numels"], record.get("frozen_base_numels")),
        zero=ZeroSettings.from_config(inputs.base),  # as the run's measure stage read it
        runner=no_trials,
        budget_s=float(record["budget_s"]),
        per_trial_s=float(record["per_trial_s"]),
        notes=list(record["measure_notes"]),
    )


def replan_out(replan: Path) -> Path:
    """--out's default for --replan: the advise folder itself; for a profile file or a run's folder (whose
    files are the user's), the default reports/advise."""
    return AdviseRequest().out_dir if is_profile_source(Path(replan)) else Path(replan)


def replan_stages(request: AdviseRequest) -> tuple[AdviseInputs, HardwareFigures, MeasuredTrials]:
    """The inputs and measure stages of a replan: read from the folder (or a profile file, a training
    run's folder: advisor.stages.profile_source), not measured."""
    assert request.replan is not None
    folder = Path(request.replan).resolve()
    if is_profile_source(folder):
        return profile_stages(request, folder)
    record = read_plan_inputs(folder)
    inputs = replan_inputs(request, record, folder)
    hardware = replan_hardware(inputs, record, folder)
    measured = replan_trials(inputs, record, folder)
    carry_over(folder, inputs.out_dir, record)
    inputs.say(
        f"replanning from {folder}: {len(measured.trials)} trials, its link probes and checks; nothing measured"
    )
    return inputs, hardware, measured


def carry_over(folder: Path, out_dir: Path, record: dict[str, Any]) -> None:
    """Into another folder: the measurements and the record, so it reports and replans on its own."""
    if out_dir == folder.resolve():
        return
    for name in COPIED:
        source = folder / name
        if source.is_file():
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, out_dir / name)
    write_json_atomic(out_dir / PLAN_INPUTS, record | {"replanned_from": str(folder.resolve())})
