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
    accumulation_check,
    finished_trials,
    load_base_config,
    setup_id,
    write_trial_config,
)
from advisor.model.error import ERROR_EXPLAINED, check_rows, error_summary, fit_models, validation_table
from advisor.model.memory import ZeroSettings, trained_numels
from advisor.model.network import PRESETS, Network, build_network
from advisor.model.predict import (
    BatchTarget,
    Candidate,
    check_reachable,
    grad_accum_for,
    node_counts,
    predict_table,
)
from advisor.model.recommend import launch_command, recommend, what_would_fit
from advisor.model.scaling import (
    DEFAULT_MIN_EFFICIENCY,
)
from advisor.model.search import check_specs, run_search
from sdzero.constants import GIB
from sdzero.errors import UserError
from sdzero.io import write_csv_atomic, write_json_atomic
from sdzero.lr import DEFAULT_LR_SCALING, check_rule
from sdzero.lr import reference_batch as lr_reference_batch_of
from sdzero.options import DEFAULTS, cli_option, input_option

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


TARGET_GPUS = {
    "a100-40gb": 40.0,
    "a100-80gb": 80.0,
    "h100-80gb": 80.0,
    "h100-94gb": 94.0,
    "h200": 141.0,
    "l40s": 48.0,
    "a10g": 24.0,
    "l4": 24.0,
    "v100-32gb": 32.0,
    "rtx4090": 24.0,
}
"""--target-gpu names and their memory in GiB (the vendors' nominal figure; the usable part is smaller,
which --headroom accounts for)."""


def check_options(
    max_nodes: int,
    headroom: float,
    device_memory_gib: float | None,
    lr_scaling: str,
    budget_minutes: float | None,
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    fixed_nodes: int | None = None,
    target_gpu: str | None = None,
) -> list[int]:
    """The node counts to predict (1, 2, 4, ... --max-nodes, and --nodes); bad values raise UserError."""
    nodes = node_counts(max_nodes)
    if not 0 <= headroom < 1:
        raise UserError(f"--headroom {headroom}: a fraction in [0, 1), e.g. 0.1 keeps 10% of memory free")
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise UserError(f"--device-memory-gib {device_memory_gib}: must be a positive number of GiB")
    check_rule(lr_scaling)
    if budget_minutes is not None and not budget_minutes > 0:
        raise UserError(f"--budget-minutes {budget_minutes}: must be a positive number of minutes")
    if not 0 < min_efficiency <= 1:
        raise UserError(f"--min-efficiency {min_efficiency}: a fraction in (0, 1], e.g. 0.8")
    if target_gpu is not None and target_gpu.lower() not in TARGET_GPUS:
        raise UserError(
            f"--target-gpu {target_gpu!r}: unknown; choose from {', '.join(TARGET_GPUS)} "
            "or give --device-memory-gib"
        )
    if fixed_nodes is not None:
        node_counts(fixed_nodes)  # the same bounds as --max-nodes
        nodes = sorted({*nodes, fixed_nodes})
    return nodes


def target_differs(
    device: dict[str, Any], ranks: int, gpus_per_node: int | None, target_gpu: str | None
) -> str | None:
    """Why the trials' device is not the target's (None when the target is nodes like this one)."""
    here = "a CPU" if device["device"] == "cpu" else f"{ranks} {device['device']} device(s)"
    if target_gpu is not None:
        return f"the trials ran on {here}; the target is {target_gpu} GPUs"
    if device["device"] == "cpu" and gpus_per_node is not None:
        return f"the trials ran on {here}; the target has {gpus_per_node} GPUs per node (--gpus-per-node)"
    if device["device"] != "cpu" and gpus_per_node is not None and gpus_per_node != ranks:
        return f"the trials ran on {here}; the target has {gpus_per_node} per node (--gpus-per-node)"
    return None


def target_memory(
    differs: str | None, device_memory_gib: float | None, target_gpu: str | None
) -> tuple[float, str] | None:
    """(GiB, where it comes from) for a target unlike this machine; refuses when nothing gives it."""
    if device_memory_gib:
        return device_memory_gib, "assumed (user figure: --device-memory-gib)"
    if target_gpu:
        return TARGET_GPUS[target_gpu.lower()], f"assumed (--target-gpu {target_gpu.lower()} nominal memory)"
    if differs:
        raise UserError(
            f"{differs}: give the target's device memory with --device-memory-gib (or --target-gpu "
            f"{'/'.join(TARGET_GPUS)}) so memory is predicted for it, not for this machine"
        )
    return None


def device_memory_bytes(device: dict[str, Any], ranks_per_node: int) -> tuple[float, str]:
    """A GPU's total memory, or on a CPU the host's memory shared by the node's ranks."""
    if device["device"] != "cpu":
        code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return float(out.stdout.strip()), f"{device['device']} device 0 total memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / ranks_per_node, f"host memory / {ranks_per_node} ranks (no accelerator)"


ADVISOR_OWNED = (
    "--deepspeed_config",
    "--model",
    "--data",
    "--output-dir",
    "--max-steps",
    "--profile-out",
    "--profile-warmup-steps",
    "--local_rank",
)
"""Trainer options every trial sets itself: --train-args may not change them."""


def check_train_args(train_args: Sequence[str] | str) -> tuple[str, ...]:
    """The user's extra trainer options (--resolution, --cache-dir, --gradient-checkpointing, ...), which
    change what a step costs and so must be measured; checked by the trainer's own parser, and refused if
    they take over what the trials set."""
    from sdzero.config import build_parser, given_train_options

    args = tuple(shlex.split(train_args)) if isinstance(train_args, str) else tuple(train_args)
    given = given_train_options(args, "--train-args")
    owned = {build_parser()._option_string_actions[flag].dest for flag in ADVISOR_OWNED}
    for dest, name in given.items():
        if dest in owned:
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


def trial_runner(
    settings: Any, base: dict[str, Any], profile_dir: Path, setup: str, say: Callable[[str], None]
) -> Callable[[list[TrialSpec]], pd.DataFrame]:
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
            say(
                f"trial {spec.trial_id}: {outcome.status} in {outcome.wall_s:.0f} s"
                + (f" ({outcome.reason})" if outcome.reason else "")
            )
        return latest_rows(read_trials(csv_path), setup)

    return run


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
    nics_per_node: int | None = None,
    tune_buckets: bool = False,
    global_batch: str | None = None,
    headroom: float = 0.1,
    device_memory_gib: float | None = None,
    lr_scaling: str = DEFAULT_LR_SCALING,
    grid: GridRequest | None = None,
    comm_budget_s: float | None = None,
    log: Callable[[str], None] | None = None,
    train_args: Sequence[str] = (),
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    nodes: int | None = None,
    target_gpu: str | None = None,
    lr_reference_batch: int | None = None,
) -> AdviseResult:
    """The whole advise pipeline; bad input raises UserError before any trial starts."""
    from advisor.measure.collectives_launch import CommRunError, run_comm
    from advisor.measure.profile import default_ranks, device_support, plan_for_device, trial_settings
    from advisor.outcome import Outcome, build_recommendation
    from sdzero.launch import shipped_config

    say = log or (lambda message: None)
    node_list = check_options(
        max_nodes, headroom, device_memory_gib, lr_scaling, budget_minutes, min_efficiency, nodes, target_gpu
    )
    if lr_reference_batch is not None and lr_reference_batch < 1:
        raise UserError(f"--lr-reference-batch {lr_reference_batch}: must be at least 1")
    user_args = check_train_args(train_args)
    # the target network's flags too: a bad --preset or --gpus-per-node fails before anything is written
    build_network(
        None,
        1 if gpus_per_node is None else gpus_per_node,
        preset,
        inter_node_gbps,
        inter_node_latency_us,
        nics_per_node,
    )
    asked = BatchTarget.parse(global_batch)
    base = load_base_config(Path(deepspeed_config) if deepspeed_config else shipped_config("zero2_bf16.json"))
    device = device_support()
    on_cpu = device["device"] == "cpu"
    ranks = default_ranks(device)
    differs = target_differs(device, ranks, gpus_per_node, target_gpu)
    memory_given = target_memory(differs, device_memory_gib, target_gpu)  # refuses before any trial
    target_gpus = ranks if gpus_per_node is None else gpus_per_node
    # Strong scaling unless asked: the base JSON's batch on one target node, the LR's reference too.
    base_batch = lr_reference_batch_of(base, target_gpus)
    target = asked or BatchTarget(base_batch, base_batch)
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model, data = default_inputs(out_dir, model, data)
    steps, warmup = (5, 1) if on_cpu else (5, 2)
    # The user's options last: they override the CPU default (argparse keeps the last value).
    train_args = (*(("--num-workers", "1") if on_cpu else ()), *user_args)
    # With a hostfile the trials run on this host only; the hosts' link is measured by the benchmark, and
    # the recommended config is then run across the hosts to check the scale-out prediction (below).
    hosts = prepare_hostfile(hostfile, say)
    settings = trial_settings(model, data, steps, warmup, 900.0, 300.0, None, None, train_args)
    plan = plan_for_device(grid or (CPU_GRID if on_cpu else GridRequest()), device)
    micro_batches = [s.micro_batch for ladder in plan.ladders for s in ladder]
    try:
        check_reachable(micro_batches, target_gpus, node_list, target)
    except UserError as exc:
        if asked is not None:
            raise
        raise UserError(
            f"the base config's global batch {base_batch} (kept at every node count unless "
            f"--global-batch says otherwise) is out of reach: {exc}"
        ) from None
    notes = list(plan.notes)
    started = time.monotonic()

    comm_dir = out_dir / "comm"
    try:
        run_comm(
            comm_dir,
            num_ranks=ranks,
            hostfile=hostfile,
            backends=("torch",),
            max_bytes=(16 if on_cpu else 256) * 2**20,
            budget_s=comm_budget_s or (15.0 if on_cpu else 60.0),
            log=say,
        )
    except CommRunError as exc:
        notes.append(f"collectives benchmark failed ({exc}); network figures assumed")
    fit_path = comm_dir / "comm_fit.json"
    measured_net, net_notes = build_network(fit_path, ranks)
    target_net, target_notes = build_network(
        fit_path, target_gpus, preset, inter_node_gbps, inter_node_latency_us, nics_per_node
    )
    notes += [n for n in target_notes if n not in notes]
    if memory_given:
        memory_bytes, memory_source = memory_given[0] * GIB, memory_given[1]
    else:
        memory_bytes, memory_source = device_memory_bytes(device, ranks)
        memory_source = f"measured ({memory_source})"
    usable = memory_bytes * (1 - headroom)

    numels = trained_numels(model)
    zero = ZeroSettings.from_config(base)
    setup = setup_id(
        {
            "base": base,
            "model": settings.model,
            "data": str(settings.data),
            "steps": steps,
            "warmup": warmup,
            "train_args": list(train_args),
            "hosts": settings.hosts,
        }
    )
    runner = trial_runner(settings, base, out_dir / "profile", setup, say)
    total_s = (budget_minutes or (5.0 if on_cpu else 30.0)) * 60
    budget_s = total_s - (time.monotonic() - started)
    # The search judges each config at every node count the global batch reaches (beyond them nothing runs).
    reach = [n for n in node_list if any(grad_accum_for(m, n * target_gpus, target) for m in micro_batches)]
    search = run_search(
        plan, runner, numels, zero, measured_net, target_net, reach, usable, target, budget_s, log=say
    )
    trials = search.trials
    ok = trials[trials["status"] == "ok"]
    if ok.empty:
        raise UserError(f"no trial succeeded; see the logs under {out_dir / 'profile' / 'trials'}")

    # Check trials: configs the model predicts before they run and never fitted on: the held-out error.
    validation = validation_table(trials, numels, zero, measured_net)
    checks = check_specs(plan, trials, numels, zero, measured_net, usable)
    if checks:
        # The model's fastest check config again at accumulation 4: every fitted trial ran at accumulation
        # 1, so this is what tests the split of once-per-step from per-micro-step costs.
        checks.append(accumulation_check(checks[0]))
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
        notes.append("no budget left for check trials: no held-out error; leave-one-out is shown instead")
    write_csv_atomic(validation, out_dir / "validation.csv")
    models = fit_models(trials, numels, zero, measured_net)
    notes += models.memory.notes + models.timing.notes
    candidates = candidates_from(plan, trials)
    predictions = predict_table(
        candidates, node_list, models.memory, models.timing, target_net, usable, target
    )
    if predictions.empty:  # check_reachable passed, so only out-of-memory trials removed what reached it
        raise UserError(
            f"--global-batch {target.describe()}: only micro-batches that ran out of memory reach it"
        )
    write_csv_atomic(predictions, out_dir / "predictions.csv")
    report_trials = trials.assign(dtype=trials["precision"], mem_per_rank_bytes=trials["device_peak_bytes"])
    write_csv_atomic(report_trials, out_dir / "trials.csv")
    environment = _environment(
        memory_bytes, memory_source, headroom, target_net, measured_net, notes + net_notes
    )
    write_json_atomic(out_dir / "environment.json", environment)
    if not predictions["feasible"].any():
        raise UserError(
            "nothing fits: " + what_would_fit(models.memory, candidates, node_list, target_gpus, usable)
        )

    reference = lr_reference_batch or base_batch
    best, config, runners, lr = recommend(
        predictions, base, usable, lr_scaling, reference, nodes, min_efficiency
    )
    if tune_buckets:  # overlap_comm and bucket size, measured only where the model says they matter
        from advisor.model.knobs import knob_choices
        from advisor.model.knobs import tune_buckets as run_tuning

        choices = knob_choices(
            models.timing,
            numels,
            zero,
            int(best["zero_stage"]),
            str(best["dtype"]),
            int(best["micro_batch"]),
            int(best["grad_accum"]),
            int(best["node_count"]),
            target_net,
            str(best["offload"]),
            models.memory,
            usable,
        )
        notes += run_tuning(best, choices, runner, ranks)
    config_path = out_dir / "recommended_ds_config.json"
    write_json_atomic(config_path, config)
    elapsed_s = time.monotonic() - started
    outcome = Outcome(
        best=best,
        runners=runners,
        lr=lr,
        trials=trials,
        predictions=predictions,
        node_list=node_list,
        min_efficiency=min_efficiency,
        fixed_nodes=nodes,
        target=target,
        target_asked=asked is not None,
        base_batch=base_batch,
        target_net=target_net,
        measured_net=measured_net,
        trial_device=device,
        trial_ranks=ranks,
        differs=differs,
        memory_bytes=memory_bytes,
        memory_source=memory_source,
        usable_bytes=usable,
        errors=error_summary(validation),
        check_ids=check_ids,
        search=search,
        elapsed_s=elapsed_s,
        budget_s=total_s,
        per_trial_s=per_trial,
        notes=notes,
    )
    recommendation = build_recommendation(outcome)
    recommendation["launch_command"] = launch_command(
        config_path,
        model,
        data,
        int(best["node_count"]),
        target_gpus,
        hostfile,
        out_dir / "run",
        user_args,
        lr,
    )
    recommendation["error_explained"] = ERROR_EXPLAINED
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


def scaleout_check(
    best: Any,
    base: dict[str, Any],
    settings: Any,
    hostfile: Path,
    hosts: list[Any],
    fit_path: Path,
    out_dir: Path,
    say: Callable[[str], None],
) -> dict[str, Any]:
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
    say(
        f"scale-out check: predicted {row.predicted_step_s:.3f} s/step, measured {row.measured_step_s:.3f} s "
        f"({row.error:+.1%})"
    )
    return {**vars(row), "error": row.error}


def _environment(
    memory_bytes: float, source: str, headroom: float, target: Network, measured: Network, notes: list[str]
) -> dict[str, Any]:
    env: dict[str, Any] = {}
    try:
        from sdzero.environment import environment_snapshot  # type: ignore[import-not-found,unused-ignore]

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


def advise_command(
    max_nodes: Annotated[int, typer.Option(help="Predict for 1, 2, 4, ... up to this many nodes.")] = 32,
    model: Annotated[
        str | None, input_option("model", note="default: the embedded tiny model, written into --out")
    ] = None,
    data: Annotated[
        Path | None, input_option("data", note="default: synthetic data written into --out")
    ] = None,
    deepspeed_config: Annotated[
        Path | None,
        input_option("deepspeed_config", note="the base of every trial; default ds_configs/zero2_bf16.json"),
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
        input_option("hostfile", note="trials and benchmark run across its hosts (measured inter-node link)"),
    ] = DEFAULTS.hostfile,
    gpus_per_node: Annotated[
        int | None, cli_option("gpus_per_node", note="of the target cluster; default: this machine's")
    ] = None,
    inter_node_gbps: Annotated[
        float | None,
        typer.Option(help="achievable inter-node bandwidth per NIC, Gbit/s (describes the target network)."),
    ] = None,
    tune_buckets: Annotated[
        bool,
        typer.Option(
            help="also try overlap_comm and reduce bucket sizes, measured only where predicted to matter."
        ),
    ] = False,
    nics_per_node: Annotated[
        int | None,
        typer.Option(
            help="inter-node NICs per node (rail-optimised: one per GPU); default: preset's, else 1."
        ),
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
            help="global batch target, e.g. 256, or a range 256-1024; default: the base config's on one "
            "target node, kept at every node count (strong scaling)."
        ),
    ] = None,
    headroom: Annotated[float, typer.Option(help="fraction of device memory left free.")] = 0.1,
    device_memory_gib: Annotated[
        float | None,
        typer.Option(help="device memory per rank of the target; required when it is not this machine."),
    ] = None,
    target_gpu: Annotated[
        str | None,
        typer.Option(help=f"the target's GPU, for its memory: {', '.join(TARGET_GPUS)}."),
    ] = None,
    min_efficiency: Annotated[
        float,
        typer.Option(help="recommend the largest node count keeping this scaling efficiency (0-1]."),
    ] = DEFAULT_MIN_EFFICIENCY,
    nodes: Annotated[
        int | None,
        cli_option("nodes", note="recommend for this node count instead of choosing by efficiency"),
    ] = None,
    lr_scaling: Annotated[str, cli_option("lr_scaling")] = DEFAULTS.lr_scaling,
    lr_reference_batch: Annotated[
        int | None,
        cli_option(
            "lr_reference_batch",
            help="global batch the base LR was tuned for; default: the base config's on one node",
        ),
    ] = DEFAULTS.lr_reference_batch,
    train_args: Annotated[
        str, cli_option("train_args", note="also in the recommended launch; checked by the trainer's parser")
    ] = DEFAULTS.train_args,
) -> None:
    """Measure a few trials and the network, predict 1..--max-nodes nodes, recommend a runnable config."""
    from rich.console import Console

    from advisor.report.terminal import print_advice

    console = Console(stderr=True)
    result = run_advise(
        max_nodes=max_nodes,
        model=model,
        data=data,
        deepspeed_config=deepspeed_config,
        out_dir=out,
        budget_minutes=budget_minutes,
        hostfile=hostfile,
        gpus_per_node=gpus_per_node,
        inter_node_gbps=inter_node_gbps,
        inter_node_latency_us=inter_node_latency_us,
        preset=preset,
        nics_per_node=nics_per_node,
        tune_buckets=tune_buckets,
        global_batch=global_batch,
        headroom=headroom,
        device_memory_gib=device_memory_gib,
        lr_scaling=lr_scaling,
        log=lambda message: console.print(f"[dim]{message}[/dim]"),
        train_args=check_train_args(train_args),
        min_efficiency=min_efficiency,
        nodes=nodes,
        target_gpu=target_gpu,
        lr_reference_batch=lr_reference_batch,
    )
    print_advice(result.recommendation, result.trials_run, result.full_grid, result.out_dir, result.report)
