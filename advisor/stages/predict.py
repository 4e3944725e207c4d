"""The predict stage: every candidate config at every node count, and the files the report reads about
them: predictions.csv, trials.csv (the report's columns) and environment.json."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd

from advisor.decide.recommend import what_would_fit
from advisor.decide.scaling_table import BatchReach
from advisor.measure.grid import GridPlan, is_checkpointed
from advisor.measure.input_figures import keep_input, launch_input_sections
from advisor.model.batch_growth import SamplesRule, samples_rule
from advisor.model.host_memory import HostSetup, add_host_memory, host_setup, node_ram, option_value
from advisor.model.input_rate import InputPlan, bound_predictions, plan_from
from advisor.model.network import Network, build_network
from advisor.model.predict import BatchTarget, Candidate, predict_table
from advisor.model.step_time import TimeModel
from advisor.model.target_compute import PROFILE, ComputeBasis, compute_basis
from advisor.model.time_to_train import StartUp, add_time_to_train, startup_rests, startup_s
from advisor.model.uncertainty import Spread, add_intervals, estimate_spread, link_spread
from advisor.stages.fit import FittedModels
from advisor.stages.inputs import AdviseInputs
from advisor.stages.measure import HardwareFigures, MeasuredTrials
from advisor.stages.target import machine_target
from sdzero.atomic import write_csv_atomic, write_json_atomic
from sdzero.config.options import DEFAULTS
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
    basis: ComputeBasis
    """Where the target's compute comes from (advisor.model.target_compute)."""
    target_net: Network
    """The network predicted for: the measure stage's, with a GPU target's intra-node link its machine's."""
    timing: TimeModel
    """The fitted step-time model with the target's compute (the one the table was predicted with)."""


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
    basis = fitted.basis or compute_basis_of(inputs)
    timing = fitted.timing.for_target(basis.target)
    target_net = settled_network(inputs, hardware, basis, notes)
    table = predict_table(
        candidates,
        inputs.node_list,
        fitted.memory,
        timing,
        target_net,
        hardware.usable_bytes,
        inputs.target,
    )
    if table.empty:  # the inputs stage checked reach, so only out-of-memory trials removed what reached it
        raise UserError(
            f"--global-batch {inputs.target.describe()}: only micro-batches that ran out of memory reach it"
        )
    rule = samples_rule(inputs.request.samples_rule)
    table = with_larger_batches(
        table, candidates, inputs, fitted, timing, target_net, hardware.usable_bytes, rule
    )
    table = bound_predictions(table, input_plan(inputs))  # no row faster than its input can feed it
    startup = startup_s(measured.trials)
    table = add_time_to_train(table, inputs.amount, startup)
    spread = run_spread(inputs, hardware, measured)
    table = add_intervals(table, spread)
    table = add_host_memory(table, fitted.memory, host_setup_of(inputs, target_net))
    out_dir = inputs.out_dir
    write_csv_atomic(table, out_dir / "predictions.csv")
    trials = measured.trials
    report_trials = trials.assign(dtype=trials["precision"], mem_per_rank_bytes=trials["device_peak_bytes"])
    write_csv_atomic(report_trials, out_dir / "trials.csv")
    environment = environment_record(
        hardware.memory_bytes,
        hardware.memory_source,
        inputs.request.headroom,
        target_net,
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
    return Predictions(candidates, table, startup, spread, basis, target_net, timing)


def input_plan(inputs: AdviseInputs) -> InputPlan | None:
    """The input rate model from the launches' measurements and the node's settings (--loader-workers,
    --cpu-cores-per-node, else the trial machine's cores when the target is nodes like it,
    --storage-gbps); kept in <out>/input.json. None where no launch measured its input."""
    r = inputs.request
    sections = launch_input_sections(inputs.out_dir)
    cores = r.cpu_cores_per_node
    if cores is None and not inputs.differs and sections:
        cores = sections[-1].get("cpu_count")
    plan = plan_from(sections, inputs.target_gpus, r.loader_workers, cores, r.storage_gbps)
    if plan is not None and inputs.differs:  # the trials' ranks' CPU is not the target's (CPU vs GPU)
        plan = replace(plan, rank_cpu_s_per_sample=None)
    keep_input(inputs.out_dir, sections, plan.record() if plan else None)
    return plan


def host_setup_of(inputs: AdviseInputs, target_net: Network) -> HostSetup:
    """What decides the plan's host RAM per node (advisor.model.host_memory): the node's RAM (declared, a
    preset's, or this machine's when the target is nodes like it) and the run's trainer options."""
    r = inputs.request
    node = node_ram(r.host_memory_gib, r.preset, not inputs.differs)
    cost = inputs.model_cost
    resolution = (
        cost.resolution if cost is not None else int(option_value(inputs.user_args, "--resolution") or 0)
    )
    return host_setup(
        inputs.user_args,
        target_net.gpus_per_node,
        resolution,
        inputs.amount.samples_per_epoch,
        node,
        DEFAULTS.num_workers,
    )


def compute_basis_of(inputs: AdviseInputs) -> ComputeBasis:
    """The target's compute for trials measured here: this device's when it is the target's kind, else the
    model's FLOPs over a declared or published rate, else none (advisor.model.target_compute)."""
    r = inputs.request
    _, target_gpu = machine_target(r.preset, r.gpus_per_node, r.target_gpu)
    other = None
    if inputs.on_cpu and inputs.differs:
        other = "the trials ran on a CPU and the target is GPUs"
    return compute_basis(other, target_gpu, r.target_tflops, inputs.model_cost)


def settled_network(
    inputs: AdviseInputs, hardware: HardwareFigures, basis: ComputeBasis, notes: list[str]
) -> Network:
    """The target's network: the measure stage's, except that a GPU target planned from CPU trials takes
    its intra-node link from its machine, never from the CPU ranks' shared memory; the note goes into
    `notes` (the run's)."""
    if not (inputs.on_cpu and inputs.differs) or basis.kind == PROFILE:
        return hardware.target_net
    r = inputs.request
    _, target_gpu = machine_target(r.preset, r.gpus_per_node, r.target_gpu)
    net, built = build_network(
        hardware.fit_path,
        inputs.target_gpus,
        r.preset,
        r.inter_node_gbps,
        r.inter_node_latency_us,
        r.nics_per_node,
        gpu_target=target_gpu or "gpu",
    )
    notes += [n for n in built if n not in notes]
    return net


def with_larger_batches(
    table: pd.DataFrame,
    candidates: list[Candidate],
    inputs: AdviseInputs,
    fitted: FittedModels,
    timing: TimeModel,
    net: Network,
    usable_bytes: float,
    rule: SamplesRule,
) -> pd.DataFrame:
    """Node counts the asked global batch cannot spread over, predicted at the smallest batch that reaches
    each (weak scaling), marked `larger_batch`, with the samples they need by `rule` (`samples_factor`)."""
    # every row's samples by the rule against the batch the base LR (and its quality) was tuned for: a
    # --global-batch above it grows the samples as a larger-batch row does
    reference = inputs.lr_reference
    table = table.assign(
        larger_batch=False, samples_factor=table["global_batch"].map(lambda b: rule.factor(int(b), reference))
    )
    reached = set(table["node_count"])
    reach = BatchReach(
        tuple(sorted({c.micro_batch for c in candidates})), net.gpus_per_node, inputs.target.lo
    )
    grown = []
    for n in (n for n in inputs.node_list if n not in reached):
        batch = max(reach.smallest_batch(n), inputs.target.hi)
        rows = predict_table(
            candidates, [n], fitted.memory, timing, net, usable_bytes, BatchTarget(batch, batch)
        )
        if not rows.empty:
            grown.append(rows.assign(larger_batch=True, samples_factor=rule.factor(batch, reference)))
    if not grown:
        return table
    whole = pd.concat([table, *grown], ignore_index=True)
    # efficiency against the smallest node count's own row, as predict_table computes it
    first = whole.loc[
        whole.groupby("config_id")["node_count"].idxmin(), ["config_id", "node_count", "samples_per_s"]
    ]
    base = first.set_index("config_id")
    per_node = whole["config_id"].map(base["samples_per_s"] / base["node_count"])
    return whole.assign(efficiency=whole["samples_per_s"] / (per_node * whole["node_count"]))


def run_spread(inputs: AdviseInputs, hardware: HardwareFigures, measured: MeasuredTrials) -> Spread:
    """The run's own uncertainty: its trials' intervals, held-out errors, noise floor and link fits."""
    from advisor.measure.alphabeta import load_fits
    from advisor.model.uncertainty import run_noise_floor

    inter = hardware.target_net.inter
    assumed = not inter.source.startswith("measured")
    fits = load_fits(hardware.fit_path) if os.path.lexists(hardware.fit_path) else []
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
    )


def candidates_from(plan: GridPlan, trials: pd.DataFrame) -> list[Candidate]:
    """Every grid point, less those above an out-of-memory trial of their ladder."""
    oom = trials[trials["status"] == "oom"]
    gc = oom.apply(is_checkpointed, axis=1).astype(bool) if not oom.empty else pd.Series(dtype=bool)
    out = []
    for spec in (s for ladder in plan.ladders for s in ladder):
        same = oom[
            (oom["zero_stage"] == spec.zero_stage)
            & (oom["precision"] == spec.precision)
            & (oom["offload"] == spec.offload)
            & (gc == spec.checkpointing)
        ]
        if same.empty or spec.micro_batch < same["micro_batch"].min():
            out.append(
                Candidate(spec.zero_stage, spec.precision, spec.micro_batch, spec.offload, spec.checkpointing)
            )
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
