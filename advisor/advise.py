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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.inputs import check_train_args, default_inputs
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
from advisor.measure.scaleout_check import prepare_hostfile, scaleout_check
from advisor.model.memory import ZeroSettings, trained_numels
from advisor.model.network import Network, build_network
from advisor.model.predict import BatchTarget, Candidate, check_reachable, grad_accum_for, predict_table
from advisor.model.prediction_error import (
    ERROR_EXPLAINED,
    check_rows,
    error_summary,
    fit_models,
    validation_table,
)
from advisor.model.recommend import launch_command, recommend, what_would_fit
from advisor.model.scaling_table import DEFAULT_MIN_EFFICIENCY
from advisor.model.search import check_specs, run_search
from advisor.target import check_options, device_memory_bytes, target_differs, target_memory
from sdzero.atomic import write_csv_atomic, write_json_atomic
from sdzero.config.lr_rule import DEFAULT_LR_SCALING
from sdzero.config.lr_rule import reference_batch as lr_reference_batch_of
from sdzero.constants import GIB
from sdzero.errors import UserError

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
    from sdzero.cluster.launch_command import shipped_config

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


def _environment(
    memory_bytes: float, source: str, headroom: float, target: Network, measured: Network, notes: list[str]
) -> dict[str, Any]:
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
