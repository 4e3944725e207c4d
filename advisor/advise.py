"""`sdzero advise`: profile -> comm -> model -> prediction -> recommendation -> report, in one folder.

    <out>/profile/trials.csv       every trial (advisor.measure.profile's format; rerunning resumes it)
    <out>/comm/comm.csv, comm_fit.json
    <out>/trials.csv               the trials for the report (with its `dtype` column)
    <out>/predictions.csv, validation.csv, recommendation.json, recommended_ds_config.json,
    <out>/environment.json, <out>/report.html

The files follow the data contract in advisor.report.build's docstring. Without --model/--data the embedded tiny
model and synthetic data are written into <out>/ first, so `sdzero advise --max-nodes 32` runs anywhere.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
import typer

from advisor.measure.grid import (
    GridPlan,
    GridRequest,
    TrialSpec,
    finished_trials,
    load_base_config,
    setup_id,
    write_trial_config,
)
from advisor.model.alphabeta import write_json_atomic
from advisor.model.error import check_rows, fit_models, mape, validation_table
from advisor.model.memory import ZeroSettings, trained_numels
from advisor.model.network import PRESETS, Network, build_network
from advisor.model.predict import BatchTarget, Candidate, check_reachable, node_counts, predict_table
from advisor.model.recommend import LR_SCALINGS, launch_command, recommend, what_would_fit
from advisor.model.search import check_specs, run_search
from sdzero.errors import UserError

GIB = 2**30
CPU_GRID = GridRequest(stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1, 2, 4, 8))
"""On a CPU: 12 grid points, of which the search measures about 5 (a few minutes on 2 cores)."""


@dataclass
class AdviseResult:
    out_dir: Path
    recommendation: dict[str, Any]
    trials_run: int
    full_grid: int
    report: Path | None
    notes: list[str] = field(default_factory=list)


def check_options(max_nodes: int, headroom: float, device_memory_gib: float | None, lr_scaling: str,
                  budget_minutes: float | None) -> list[int]:  # fmt: skip
    nodes = node_counts(max_nodes)
    if not 0 <= headroom < 1:
        raise UserError(f"--headroom {headroom}: a fraction in [0, 1), e.g. 0.1 keeps 10% of memory free")
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise UserError(f"--device-memory-gib {device_memory_gib}: must be a positive number of GiB")
    if lr_scaling not in LR_SCALINGS:
        raise UserError(f"--lr-scaling {lr_scaling!r}: choose linear or sqrt")
    if budget_minutes is not None and not budget_minutes > 0:
        raise UserError(f"--budget-minutes {budget_minutes}: must be a positive number of minutes")
    return nodes


def device_memory_bytes(device: dict[str, Any], ranks_per_node: int) -> tuple[float, str]:
    """A GPU's total memory, or on a CPU the host's memory shared by the node's ranks."""
    if device["device"] != "cpu":
        code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return float(out.stdout.strip()), f"{device['device']} device 0 total memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / ranks_per_node, f"host memory / {ranks_per_node} ranks (no accelerator)"


ADVISOR_OWNED = ("--deepspeed_config", "--model", "--data", "--output-dir", "--max-steps", "--profile-out",
                 "--profile-warmup-steps", "--local_rank")  # fmt: skip
"""Trainer options every trial sets itself: --train-args may not change them."""


def check_train_args(train_args: Sequence[str] | str) -> tuple[str, ...]:
    """The user's extra trainer options (--resolution, --cache-dir, --gradient-checkpointing, ...), which
    change what a step costs and so must be measured; refused if they take over what the trials set."""
    args = tuple(shlex.split(train_args)) if isinstance(train_args, str) else tuple(train_args)
    for arg in args:
        name = arg.split("=", 1)[0]
        if name.replace("_", "-") in {owned.replace("_", "-") for owned in ADVISOR_OWNED}:
            raise UserError(
                f"--train-args: {name} is set by the advisor for every trial (use --model, --data or "
                "--deepspeed-config of `sdzero advise` instead, or leave it out)"
            )
    return args


def default_inputs(out_dir: Path, model: str | None, data: Path | None) -> tuple[str, Path]:
    from sdzero.tiny import write_synthetic_dataset, write_tiny_model

    if model is None:
        model_dir = out_dir / "model"
        if not (model_dir / "model_index.json").exists():
            write_tiny_model(model_dir)
        model = str(model_dir)
    if data is None:
        data = out_dir / "data"
        if not (data / "metadata.jsonl").exists():
            write_synthetic_dataset(data, images=64, size=40)
    return model, Path(data)


def trial_runner(settings: Any, base: dict[str, Any], profile_dir: Path, setup: str,
                 say: Callable[[str], None]) -> Callable[[list[TrialSpec]], pd.DataFrame]:  # fmt: skip
    """Run specs not yet in <profile_dir>/trials.csv with advisor.measure.profile's own pieces; return the table."""
    from advisor.measure.profile import append_row, latest_rows, read_trials, trial_row
    from advisor.measure.trials import run_trial

    csv_path = profile_dir / "trials.csv"

    def run(specs: list[TrialSpec]) -> pd.DataFrame:
        done = finished_trials(read_trials(csv_path), setup)
        for spec in specs:
            if spec.trial_id in done:
                continue
            trial_dir = profile_dir / "trials" / spec.trial_id
            ds_config = write_trial_config(base, spec, trial_dir, spec.ranks_per_node * settings.hosts)
            say(f"trial {spec.trial_id} ...")
            outcome = run_trial(spec, settings, ds_config, trial_dir)
            append_row(csv_path, trial_row(spec, outcome, setup, settings, trial_dir))
            say(f"trial {spec.trial_id}: {outcome.status} in {outcome.wall_s:.0f} s"
                + (f" ({outcome.reason})" if outcome.reason else ""))  # fmt: skip
        return latest_rows(read_trials(csv_path), setup)

    return run


def candidates_from(plan: GridPlan, trials: pd.DataFrame) -> list[Candidate]:
    """Every grid point, less those above an out-of-memory trial of their ladder."""
    oom = trials[trials["status"] == "oom"]
    out = []
    for spec in (s for ladder in plan.ladders for s in ladder):
        same = oom[(oom["zero_stage"] == spec.zero_stage) & (oom["precision"] == spec.precision)
                   & (oom["offload"] == spec.offload)]  # fmt: skip
        if same.empty or spec.micro_batch < same["micro_batch"].min():
            out.append(Candidate(spec.zero_stage, spec.precision, spec.micro_batch, spec.offload))
    return list(dict.fromkeys(out))


def reference_batch(base: dict[str, Any], ranks: int) -> int:
    """The global batch the base JSON's learning rate was set for."""
    if "train_batch_size" in base:
        return int(base["train_batch_size"])
    return (
        int(base.get("train_micro_batch_size_per_gpu", 1))
        * int(base.get("gradient_accumulation_steps", 1))
        * ranks
    )


def write_csv_atomic(table: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    table.to_csv(tmp, index=False)
    os.replace(tmp, path)


def run_advise(
    max_nodes: int = 32,
    model: str | None = None,
    data: Path | None = None,
    deepspeed_config: Path | None = None,
    out_dir: Path = Path("reports/advise"),
    budget_minutes: float | None = None,
    hostfile: Path | None = None,
    gpus_per_node: int | None = None,
    inter_node_gbps: float | None = None,
    inter_node_latency_us: float | None = None,
    preset: str | None = None,
    global_batch: str | None = None,
    headroom: float = 0.1,
    device_memory_gib: float | None = None,
    lr_scaling: str = "linear",
    grid: GridRequest | None = None,
    comm_budget_s: float | None = None,
    log: Callable[[str], None] | None = None,
    train_args: Sequence[str] = (),
) -> AdviseResult:
    """The whole advise pipeline; bad input raises UserError before any trial starts."""
    from advisor.measure.collectives_launch import CommRunError, run_comm
    from advisor.measure.profile import default_ranks, device_support, plan_for_device, trial_settings
    from sdzero.launch import shipped_config

    say = log or (lambda message: None)
    nodes = check_options(max_nodes, headroom, device_memory_gib, lr_scaling, budget_minutes)
    user_args = check_train_args(train_args)
    # the target network's flags too: a bad --preset or --gpus-per-node fails before anything is written
    build_network(
        None, 1 if gpus_per_node is None else gpus_per_node, preset, inter_node_gbps, inter_node_latency_us
    )
    target = BatchTarget.parse(global_batch)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model, data = default_inputs(out_dir, model, data)
    base = load_base_config(Path(deepspeed_config) if deepspeed_config else shipped_config("zero2_bf16.json"))
    device = device_support()
    on_cpu = device["device"] == "cpu"
    ranks = default_ranks(device)
    steps, warmup = (5, 1) if on_cpu else (5, 2)
    # The user's options last: they override the CPU default (argparse keeps the last value).
    train_args = (*(("--num-workers", "1") if on_cpu else ()), *user_args)
    # With a hostfile the trials run on this host only; the hosts' link is measured by the benchmark, and
    # the recommended config is then run across the hosts to check the scale-out prediction (below).
    hosts = prepare_hostfile(hostfile, say)
    settings = trial_settings(model, data, steps, warmup, 900.0, 300.0, None, None, train_args)
    plan = plan_for_device(grid or (CPU_GRID if on_cpu else GridRequest()), device)
    target_gpus = ranks if gpus_per_node is None else gpus_per_node
    check_reachable([s.micro_batch for ladder in plan.ladders for s in ladder], target_gpus, nodes, target)
    notes = list(plan.notes)
    started = time.monotonic()

    comm_dir = out_dir / "comm"
    try:
        run_comm(comm_dir, num_ranks=ranks, hostfile=hostfile, backends=("torch",),
                 max_bytes=(16 if on_cpu else 256) * 2**20,
                 budget_s=comm_budget_s or (15.0 if on_cpu else 60.0), log=say)  # fmt: skip
    except CommRunError as exc:
        notes.append(f"collectives benchmark failed ({exc}); network figures assumed")
    fit_path = comm_dir / "comm_fit.json"
    measured_net, net_notes = build_network(fit_path, ranks)
    target_net, target_notes = build_network(
        fit_path, target_gpus, preset, inter_node_gbps, inter_node_latency_us
    )
    notes += [n for n in target_notes if n not in notes]
    memory_bytes, memory_source = (
        (device_memory_gib * GIB, "--device-memory-gib")
        if device_memory_gib
        else device_memory_bytes(device, ranks)
    )
    usable = memory_bytes * (1 - headroom)

    numels = trained_numels(model)
    zero = ZeroSettings.from_config(base)
    setup = setup_id({"base": base, "model": settings.model, "data": str(settings.data), "steps": steps,
                      "warmup": warmup, "train_args": list(train_args), "hosts": settings.hosts})  # fmt: skip
    runner = trial_runner(settings, base, out_dir / "profile", setup, say)
    total_s = (budget_minutes or (5.0 if on_cpu else 30.0)) * 60
    budget_s = total_s - (time.monotonic() - started)
    search = run_search(plan, runner, numels, zero, measured_net, target_net, max(nodes), usable, target,
                        budget_s, log=say)  # fmt: skip
    trials = search.trials
    ok = trials[trials["status"] == "ok"]
    if ok.empty:
        raise UserError(f"no trial succeeded; see the logs under {out_dir / 'profile' / 'trials'}")

    # Check trials: configs the model predicts before they run and never fitted on. With the few trials a
    # search needs, leaving one out often removes what identifies a parameter; these test the model as
    # it is used.
    validation = validation_table(trials, numels, zero, measured_net)
    checks = check_specs(plan, trials, numels, zero, measured_net, usable)
    check_ids: list[str] = []
    per_trial = float(pd.to_numeric(trials["wall_s"], errors="coerce").mean())
    if checks and total_s - (time.monotonic() - started) > per_trial * len(checks):
        fitted = fit_models(trials, numels, zero, measured_net)
        say("checking the model on " + ", ".join(c.trial_id for c in checks))
        everything = runner(checks)
        checked = everything[everything["trial_id"].isin([c.trial_id for c in checks])]
        check_ids = sorted(checked.loc[checked["status"] == "ok", "trial_id"])
        validation = pd.concat([validation, check_rows(fitted, checked, measured_net)], ignore_index=True)
        trials = everything
    elif checks:
        notes.append(
            "no budget left for check trials: the held-out error is leave-one-out over the search's trials"
        )
    write_csv_atomic(validation, out_dir / "validation.csv")
    errors = {"step_time_mape": mape(validation, "step_time_s"), "memory_mape": mape(validation, "mem_per_rank_bytes"),
              "activation_mape": mape(validation, "activation_bytes")}  # fmt: skip
    models = fit_models(trials, numels, zero, measured_net)
    notes += models.memory.notes + models.timing.notes
    candidates = candidates_from(plan, trials)
    predictions = predict_table(candidates, nodes, models.memory, models.timing, target_net, usable, target)
    if predictions.empty:  # check_reachable passed, so only out-of-memory trials removed what reached it
        raise UserError(f"--global-batch {global_batch}: only micro-batches that ran out of memory reach it")
    write_csv_atomic(predictions, out_dir / "predictions.csv")
    report_trials = trials.assign(dtype=trials["precision"], mem_per_rank_bytes=trials["device_peak_bytes"])
    write_csv_atomic(report_trials, out_dir / "trials.csv")
    environment = _environment(
        memory_bytes, memory_source, headroom, target_net, measured_net, notes + net_notes
    )
    write_json_atomic(out_dir / "environment.json", environment)
    if not predictions["feasible"].any():
        raise UserError(
            "nothing fits: " + what_would_fit(models.memory, candidates, nodes, target_gpus, usable)
        )

    best, config, runners, lr = recommend(predictions, base, usable, lr_scaling, reference_batch(base, ranks))
    config_path = out_dir / "recommended_ds_config.json"
    write_json_atomic(config_path, config)
    recommendation = {
        "config_id": best["config_id"], "node_count": int(best["node_count"]),
        "gpus_per_node": target_gpus, "world_size": int(best["world_size"]),
        "zero_stage": int(best["zero_stage"]), "dtype": best["dtype"], "micro_batch": int(best["micro_batch"]),
        "offload": best["offload"], "samples_per_s": float(best["samples_per_s"]),
        "step_time_s": float(best["step_time_s"]), "compute_s": float(best["compute_s"]),
        "exposed_comm_s": float(best["exposed_comm_s"]), "mem_per_rank_bytes": float(best["mem_per_rank_bytes"]),
        "usable_memory_bytes": usable, "global_batch": int(best["global_batch"]),
        "global_batch_target": target.describe() if target else None, "grad_accum": int(best["grad_accum"]),
        "lr": lr, "lr_scaling": lr_scaling, "lr_reference_batch": reference_batch(base, ranks),
        "launch_command": launch_command(config_path, model, data, int(best["node_count"]), target_gpus, hostfile,
                                         out_dir / "run", user_args),
        "error": {k: v for k, v in errors.items() if v is not None},
        "trials_run": int(len(trials)), "full_grid": int(search.full_grid),
        "check_trials": check_ids,
        "chosen_by_model": search.chosen_by_model, "search_log": search.log,
        "network": target_net.describe(), "runners_up": runners, "notes": notes,
    }  # fmt: skip
    if len(hosts) >= 2:
        recommendation["scaleout_check"] = scaleout_check(
            best, base, settings, hostfile, hosts, fit_path, out_dir, say
        )
    write_json_atomic(out_dir / "recommendation.json", recommendation)
    report = None
    try:
        from advisor.report.build import write_advise_report

        report = write_advise_report(out_dir, out_dir / "report.html")
    except UserError as exc:
        notes.append(f"report not written: {exc}")
    return AdviseResult(out_dir, recommendation, len(trials), search.full_grid, report, notes)


def prepare_hostfile(hostfile: Path | None, say: Callable[[str], None]) -> list[Any]:
    """Check the hosts (as `sdzero launch` does) and write the .deepspeed_env their ranks need."""
    if hostfile is None:
        return []
    from sdzero.hosts import prepare_hosts

    entries, master, interface, env_file, merge = prepare_hosts(Path(hostfile))
    say(
        f"{len(entries)} hosts; master {master} over {interface}; {env_file}: added {sorted(merge.added) or 'nothing'}"
    )
    return entries


def scaleout_check(best: Any, base: dict[str, Any], settings: Any, hostfile: Path, hosts: list[Any],
                   fit_path: Path, out_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Predict the recommended config on the hostfile's hosts from a 1-host trial plus the measured link,
    then run it there: the prediction's error, measured, in recommendation.json and scaleout.csv."""
    from dataclasses import replace

    from advisor.measure.grid import TrialSpec
    from advisor.model.scaleout import check_config, rows_table

    slots = hosts[0].slots
    if any(h.slots != slots for h in hosts):
        return {"skipped": "hosts with different slots= counts; the check needs the same ranks on each"}
    spec = TrialSpec(
        int(best["zero_stage"]), str(best["dtype"]), int(best["micro_batch"]), str(best["offload"]), slots
    )
    remote = replace(settings, hostfile=Path(hostfile).resolve(), hosts=len(hosts))
    say(
        f"scale-out check: {spec.trial_id} on 1 host x {len(hosts) * slots} ranks, then {len(hosts)} hosts x {slots}"
    )
    try:
        row, _ = check_config(spec, base, settings, remote, fit_path, len(hosts), slots, out_dir / "scaleout")
    except RuntimeError as exc:
        return {"failed": str(exc).splitlines()[0]}
    rows_table([row]).to_csv(out_dir / "scaleout.csv", index=False)
    say(f"scale-out check: predicted {row.predicted_step_s:.3f} s/step, measured {row.measured_step_s:.3f} s "
        f"({row.error:+.1%})")  # fmt: skip
    return {**vars(row), "error": row.error}


def _environment(memory_bytes: float, source: str, headroom: float, target: Network, measured: Network,
                 notes: list[str]) -> dict[str, Any]:  # fmt: skip
    env: dict[str, Any] = {}
    try:
        from sdzero.environment import environment_snapshot  # type: ignore[import-not-found,unused-ignore]

        env.update(environment_snapshot())
    except ImportError:
        pass
    return env | {"device_memory_bytes": memory_bytes, "device_memory_source": source, "headroom": headroom,
                  "target_network": target.describe(), "measured_network": measured.describe(), "notes": notes}  # fmt: skip


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def advise_command(
    max_nodes: Annotated[int, typer.Option(help="Predict for 1, 2, 4, ... up to this many nodes.")] = 32,
    model: Annotated[
        str | None,
        typer.Option(
            help="diffusers pipeline folder or hub id; default: the embedded tiny model, written into --out."
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(help="image folder with metadata.jsonl; default: synthetic data written into --out."),
    ] = None,
    deepspeed_config: Annotated[
        Path | None,
        typer.Option(
            help="base DeepSpeed JSON (optimizer, buckets, ...); default ds_configs/zero2_bf16.json."
        ),
    ] = None,
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="folder for trials, benchmark, predictions, recommendation, report."
        ),
    ] = Path("reports/advise"),
    budget_minutes: Annotated[
        float | None,
        typer.Option(help="wall-clock budget for trials and benchmark (default 5 on a CPU, 30 on GPUs)."),
    ] = None,
    hostfile: Annotated[
        Path | None,
        typer.Option(
            help="DeepSpeed hostfile: trials and benchmark run across its hosts (measured inter-node link)."
        ),
    ] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option(help="ranks per node of the target cluster; default: this machine's.")
    ] = None,
    inter_node_gbps: Annotated[
        float | None,
        typer.Option(help="achievable inter-node bandwidth per node, Gbit/s (describes the target network)."),
    ] = None,
    inter_node_latency_us: Annotated[
        float | None, typer.Option(help="inter-node latency per ring hop, microseconds.")
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help=f"named inter-node fabric: {', '.join(PRESETS)} (figures in advisor/model/network.py)."
        ),
    ] = None,
    global_batch: Annotated[
        str | None,
        typer.Option(
            help="global batch target, e.g. 256, or a range 256-1024; accumulation is chosen to reach it."
        ),
    ] = None,
    headroom: Annotated[float, typer.Option(help="fraction of device memory left free.")] = 0.1,
    device_memory_gib: Annotated[
        float | None, typer.Option(help="device memory per rank; default: detected.")
    ] = None,
    lr_scaling: Annotated[
        str, typer.Option(help="learning-rate scaling with the global batch: linear or sqrt.")
    ] = "linear",
    train_args: Annotated[
        str,
        typer.Option(
            help="trainer options for every trial and the recommended launch, e.g. '--resolution 1024 "
            "--gradient-checkpointing' (what changes a step's time or memory must be measured with it)."
        ),
    ] = "",
) -> None:
    """Measure a few trials and the network, predict 1..--max-nodes nodes, recommend a runnable config."""
    from rich.console import Console

    console = Console(stderr=True)
    result = run_advise(
        max_nodes=max_nodes, model=model, data=data, deepspeed_config=deepspeed_config, out_dir=out,
        budget_minutes=budget_minutes, hostfile=hostfile, gpus_per_node=gpus_per_node,
        inter_node_gbps=inter_node_gbps, inter_node_latency_us=inter_node_latency_us, preset=preset,
        global_batch=global_batch, headroom=headroom, device_memory_gib=device_memory_gib, lr_scaling=lr_scaling,
        log=lambda message: console.print(f"[dim]{message}[/dim]"), train_args=check_train_args(train_args),
    )  # fmt: skip
    rec = result.recommendation
    error = rec["error"]
    held_out = (
        f"MAPE on {len(rec['check_trials'])} configs measured after the fit"
        if rec["check_trials"]
        else "leave-one-out MAPE"
    )
    typer.echo(
        f"recommended: {rec['config_id']} on {rec['node_count']} nodes x {rec['gpus_per_node']} ranks, "
        f"accumulation {rec['grad_accum']} (global batch {rec['global_batch']}), lr {rec['lr']:.3g} "
        f"({rec['lr_scaling']} scaling from batch {rec['lr_reference_batch']})\n"
        f"predicted {rec['samples_per_s']:.1f} samples/s, {rec['step_time_s']:.3f} s/step, "
        f"{rec['mem_per_rank_bytes'] / GIB:.3f} GiB per rank\n"
        f"held-out error ({held_out}): step time {_percent(error.get('step_time_mape'))}, "
        f"memory {_percent(error.get('memory_mape'))}\n"
        f"trials run: {result.trials_run} of a full grid of {result.full_grid}"
        + (f" ({len(rec['check_trials'])} of them to check the model)" if rec["check_trials"] else "")
    )
    for runner in rec["runners_up"]:
        typer.echo(f"  runner-up {runner['config_id']} @ {runner['node_count']} nodes: {runner['why_not']}")
    typer.echo(f"config: {result.out_dir / 'recommended_ds_config.json'}\nlaunch: {rec['launch_command']}")
    if result.report:
        typer.echo(f"report: {result.report}")
