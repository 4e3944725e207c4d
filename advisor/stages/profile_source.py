"""`sdzero advise --replan FILE|RUN`: plan for 1-N nodes from what was measured on one node of the target.

Two sources, read into one `Profile`:

- a profile file (YAML or JSON; docs/advisor.md section 2c, `examples/profile.yaml`): the model (a diffusers
  pipeline folder, a named shape such as `sd2-base-unet`, or a trained parameter count), the device and its
  GPUs per node, and for one or more configs measured on one node: ZeRO stage, precision, per-GPU
  micro-batch, accumulation, the step time or samples/s, and the peak memory per GPU;
- a training run's folder: the trainer's metrics.jsonl (step times and peak memory per step) and the
  effective ds_config.json it wrote (stage, precision, micro-batch, accumulation), with run_config.json for
  the model, resolution and ranks (one node assumed).

The measured step is the target's own: its compute per sample is the step less the communication the
node's links need for it (costed on the machine's NVLink, through the overlap account), solved once per
config; other node counts add the inter-node cost of the preset's fabric. No process group, no trial.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.decide.search import SearchResult
from advisor.measure.grid import GridRequest, plan_grid
from advisor.measure.input_figures import keep_input
from advisor.measure.trials import TrialSettings
from advisor.model.collective_cost import ops_from_mix
from advisor.model.collective_mix import collective_mix
from advisor.model.memory import (
    DEFAULT_BYTES_PER_ELEMENT,
    STATE_KINDS,
    ActivationFit,
    MemoryModel,
    ZeroSettings,
    fit_memory_model,
    state_elements,
)
from advisor.model.network import Network, build_network
from advisor.model.step_time import TimeModel
from advisor.model.target_compute import (
    MODEL_SHAPES,
    PROFILE,
    ComputeBasis,
    TargetCompute,
    shape_cost,
    shape_numels,
)
from advisor.model.time_to_train import train_amount
from advisor.stages.input_schema import (
    MetricsStepIn,
    ProfileConfigIn,
    ProfileFileIn,
    RunConfigIn,
    RunDsConfigIn,
    check,
    load_yaml_bounded,
)
from advisor.stages.inputs import AdviseInputs, InputSource, build_inputs, check_request_options, claim_out
from advisor.stages.measure import HardwareFigures, MeasuredTrials
from advisor.stages.request import AdviseRequest
from advisor.stages.target import TARGET_GPUS
from sdzero.atomic import write_csv_atomic
from sdzero.config.user_file import read_json_lines, read_user_json, read_user_text
from sdzero.constants import GIB
from sdzero.errors import UserError

SOURCE = "profile"
"""trials.csv's `source` of a row read from a profile or a run folder (advisor.stages.fit dispatches on it)."""
PARAMETER_TENSOR = 1 << 22
"""A profile with a parameter count only: the count is split into tensors of this many elements (4M, a
large UNet's typical weight) for the bucket and ZeRO-3 gather counts; named in the answer's notes."""
VALIDATION_COLUMNS = (
    "config_id",
    "quantity",
    "predicted",
    "measured",
    "held_out",
    "check",
    "node_count",
    "micro_batch",
    "zero_stage",
    "grad_accum",
)
"""validation.csv's columns (advisor.model.prediction_error)."""
PROFILE_BYTES = 1 << 20
"""A profile file is a few lines; a bound, so a device or a huge file given by mistake is one line."""
STEADY_SKIP = 0.1
"""A run folder's first steps (this share, at least one) are left out of its step time: warm-up."""


@dataclass(frozen=True)
class ProfileConfig:
    zero_stage: int
    precision: str
    micro_batch: int
    grad_accum: int
    step_time_s: float
    memory_bytes: float
    """Peak memory per GPU (torch.cuda.max_memory_allocated); NaN where the profile does not give it."""
    offload: str = "none"


@dataclass(frozen=True)
class Profile:
    source: str
    """Where it was read ('profile file X' or 'training run X')."""
    model: str
    numels: tuple[int, ...]
    device: str
    gpus_per_node: int
    configs: tuple[ProfileConfig, ...]
    base: dict[str, Any]
    dataset_images: int | None
    forward_share: float
    notes: tuple[str, ...] = ()
    nodes: int = 1
    """Nodes the configs ran on (a profile measured across several nodes: their link is in its steps)."""
    input: dict[str, Any] | None = None
    """The file's input figures as a launch's "input" section; None where it gives none."""

    @property
    def where(self) -> str:
        nodes = "one node" if self.nodes == 1 else f"{self.nodes} nodes"
        return f"{nodes} of {self.gpus_per_node} {self.device} GPUs"


def is_profile_source(path: Path) -> bool:
    """A profile file, or a run folder (metrics.jsonl and ds_config.json) rather than an advise folder."""
    # anything but a folder is a profile file, read by the regular-file reader: a FIFO is named as one
    is_file = os.path.lexists(path) and not path.is_dir()
    return is_file or ((path / "metrics.jsonl").exists() and (path / "ds_config.json").exists())


def read_profile(path: Path) -> Profile:
    """A profile file (see the module doc; its schema: advisor.stages.input_schema); every missing or bad
    field is one line naming it."""
    where = f"--replan {path}"
    text = read_user_text(path, "--replan", PROFILE_BYTES)  # a FIFO, a device, a huge file: one line
    record = check(ProfileFileIn, load_yaml_bounded(text, where), where)  # YAML is a superset of JSON
    configs = tuple(_config(c, record.gpus_per_node * record.nodes) for c in record.configs)
    numels, model, notes = _numels(record, where)
    return Profile(
        f"profile file {path}",
        model,
        numels,
        record.device,
        record.gpus_per_node,
        configs,
        _base_config(configs[0], record),
        record.dataset_images,
        _forward_share(model),
        notes,
        record.nodes,
        record.input.section() if record.input is not None else None,
    )


def _config(c: ProfileConfigIn, gpus: int) -> ProfileConfig:
    """One measured config; `gpus`: every GPU of the run (its nodes x GPUs per node)."""
    batch = c.micro_batch * c.grad_accum * gpus
    if c.step_time_s is not None:
        step = c.step_time_s
    elif c.samples_per_s is not None:
        step = batch / c.samples_per_s
    else:
        step = batch / gpus / float(c.samples_per_s_per_gpu or math.nan)
    memory = c.memory_gib * GIB if c.memory_gib is not None else math.nan
    return ProfileConfig(c.zero_stage, c.precision, c.micro_batch, c.grad_accum, step, memory, c.offload)


def _numels(record: ProfileFileIn, where: str) -> tuple[tuple[int, ...], str, tuple[str, ...]]:
    """(trained parameter sizes, model name, notes) from `model` (a named shape or a diffusers folder) or
    `parameters` (a count)."""
    from advisor.model.memory import trained_numels

    model = record.model
    if model in MODEL_SHAPES:
        return shape_numels(str(model)), str(model), ()
    if model is not None:
        if not Path(str(model)).is_dir():
            raise UserError(
                f"{where}: model {model!r} is neither a diffusers folder nor a named shape "
                f"({', '.join(MODEL_SHAPES)}); or give `parameters: N`"
            )
        return trained_numels(str(model)), str(model), ()
    count = int(record.parameters or 0)  # the schema requires `model` or `parameters` (>= 1)
    whole, rest = divmod(count, PARAMETER_TENSOR)
    numels = (PARAMETER_TENSOR,) * whole + ((rest,) if rest else ())
    note = f"parameters only: {count:,} taken as tensors of {PARAMETER_TENSOR:,} for bucket and gather counts"
    return numels, f"{count:,} parameters", (note,)


def _forward_share(model: str) -> float:
    """The forward pass's share of a micro-step's arithmetic: counted for a named shape or a folder, else
    one third (a backward pass costs about twice its forward: two matrix products per forward one)."""
    from advisor.model.model_cost import count_model_cost

    if model in MODEL_SHAPES:
        return shape_cost(model).forward_share
    if Path(model).is_dir():
        return count_model_cost(model).forward_share
    return 1 / 3


def _base_config(c: ProfileConfig, record: ProfileFileIn) -> dict[str, Any]:
    """The DeepSpeed JSON the profile's first config stands for; the optional keys overlap_comm,
    reduce_bucket_size and allgather_bucket_size (elements) and lr as the profile gives them."""
    zero: dict[str, Any] = {"stage": c.zero_stage, "overlap_comm": record.overlap_comm}
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if getattr(record, key) is not None:
            zero[key] = getattr(record, key)
    return {
        "train_micro_batch_size_per_gpu": c.micro_batch,
        "gradient_accumulation_steps": c.grad_accum,
        "optimizer": {"type": "AdamW", "params": {"lr": record.lr}},
        c.precision: {"enabled": True},
        "zero_optimization": zero,
    }


def read_run_folder(path: Path, target_gpu: str | None, gpus_per_node: int | None = None) -> Profile:
    """A training run's folder: its steady steps' median step time and its peak memory, at the config of
    its effective ds_config.json; the run's ranks are taken as one node (said in the notes)."""
    from advisor.model.memory import trained_numels

    where = f"--replan {path}"
    steps = _metric_steps(path / "metrics.jsonl", where)
    if not steps:
        raise UserError(f"{where}: metrics.jsonl has no step with step_time_s; train a few steps first")
    config = read_user_json(path / "ds_config.json", f"{where}:")
    ds = check(RunDsConfigIn, config, f"{where}/ds_config.json")
    run_path = path / "run_config.json"
    run = (
        check(RunConfigIn, read_user_json(run_path, f"{where}:"), str(run_path))
        if run_path.exists()
        else RunConfigIn()
    )
    device = (target_gpu or run.target_gpu or "").lower()
    if device not in TARGET_GPUS:
        raise UserError(f"{where}: which GPU did it run on? give --target-gpu ({', '.join(TARGET_GPUS)})")
    model = run.model
    if not Path(model).is_dir():
        raise UserError(
            f"{where}: run_config.json names no model folder here ({model!r}); plan from a profile file"
        )
    precision = "bf16" if ds.bf16 is not None and ds.bf16.enabled else "fp16"
    world = run.world_size
    gpus = gpus_per_node if gpus_per_node and world % gpus_per_node == 0 else world
    stage = ds.zero_optimization.stage
    shape = (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps)
    # a run that swept several batch shapes (sdzero's config sweep) records each step's own: one config each
    groups: dict[tuple[int, int], list[MetricsStepIn]] = {}
    for r in steps:
        groups.setdefault((r.micro_batch or shape[0], r.grad_accum or shape[1]), []).append(r)
    configs = []
    for (mb, accum), rows in groups.items():
        steady = rows[max(1, math.ceil(len(rows) * STEADY_SKIP)) :] or rows
        step = statistics.median(r.step_time_s for r in steady)
        peak = max(r.peak_mem_bytes or 0.0 for r in rows) or math.nan
        configs.append(ProfileConfig(stage, precision, mb, accum, step, peak))
    notes = (
        f"from the steady steps of metrics.jsonl ({len(steps)} steps, the first {STEADY_SKIP:.0%} of each "
        f"config's left out); its {world} ranks taken as {world // gpus} node(s) of {gpus} (--gpus-per-node)",
    )
    return Profile(
        f"training run {path}",
        model,
        trained_numels(model),
        device,
        gpus,
        tuple(configs),
        config,
        None,
        _forward_share(model),
        notes,
        world // gpus,
    )


def _metric_steps(path: Path, where: str) -> list[MetricsStepIn]:
    """The steps of a run's metrics.jsonl, each checked by the schema (a step time of 0 or NaN is one line
    naming its line); a line that is not JSON, or nested beyond reason, is skipped and counted, as a line
    cut by a kill is."""
    lines, _skipped = read_json_lines(path, f"{where}:")
    return [
        check(MetricsStepIn, record, f"{path} line {number}")
        for number, record in lines
        if "step_time_s" in record
    ]


def profile_trials(profile: Profile, zero: ZeroSettings, setup: str) -> pd.DataFrame:
    """One ok 'trial' row per measured config: what the report, the memory fit and the candidates read.
    Model-state bytes are the formula's; the activations are what the measured peak leaves over them."""
    rows = []
    for c in profile.configs:
        world = profile.gpus_per_node * profile.nodes
        elements = state_elements(
            profile.numels, c.zero_stage, world, zero.persistence_threshold, zero.overlap_comm
        )
        states = {f"{k}_bytes": elements[k] * DEFAULT_BYTES_PER_ELEMENT[k] for k in STATE_KINDS}
        bare = MemoryModel(profile.numels, zero, 0.0, ActivationFit(0.0, 0.0), device="cuda")
        without = bare.per_rank_bytes(c.zero_stage, c.precision, c.micro_batch, c.offload, world)["allocated"]
        batch = c.micro_batch * c.grad_accum * world
        rows.append(
            {
                "trial_id": f"profile-z{c.zero_stage}-{c.precision}-mb{c.micro_batch}-ga{c.grad_accum}",
                "setup_id": setup,
                "status": "ok",
                "source": SOURCE,
                "zero_stage": c.zero_stage,
                "precision": c.precision,
                "micro_batch": c.micro_batch,
                "offload": c.offload,
                "grad_accum": c.grad_accum,
                "world_size": world,
                "ranks_per_node": profile.gpus_per_node,
                "nodes": profile.nodes,
                "global_batch": batch,
                "step_time_s": c.step_time_s,
                "step_time_median_s": c.step_time_s,
                "samples_per_s": batch / c.step_time_s,
                "comm_s": 0.0,
                "device_peak_bytes": c.memory_bytes,
                "cuda_peak_bytes": c.memory_bytes,
                **states,
                "bucket_bytes": bare.bucket_bytes(c.zero_stage),
                "frozen_bytes": 0.0,
                # no peak given: activations unknown, taken as none (said in the notes)
                "activation_bytes": 0.0 if math.isnan(c.memory_bytes) else max(c.memory_bytes - without, 0.0),
                "forward_share": profile.forward_share,
            }
        )
    return pd.DataFrame(rows)


def profile_stages(
    request: AdviseRequest, path: Path
) -> tuple[AdviseInputs, HardwareFigures, MeasuredTrials]:
    """The inputs and measure stages from a profile file or a run folder: nothing measured."""
    r = request
    for given, what in (
        (r.hostfile is not None, "--hostfile"),
        (r.budget_minutes is not None, "--budget-minutes"),
        (r.model is not None, "--model"),
        (r.deepspeed_config is not None, "--deepspeed-config"),
    ):
        if given:
            raise UserError(
                f"--replan {path}: {what} does not apply to a profile or a run's folder; the file says it"
            )
    a_file = not path.is_dir()
    profile = read_profile(path) if a_file else read_run_folder(path, r.target_gpu, r.gpus_per_node)
    if r.target_gpu and r.target_gpu.lower() != profile.device and a_file:
        raise UserError(
            f"--target-gpu {r.target_gpu}: the profile measured {profile.device}; a profile plans for its own "
            "device (plan another GPU from a profile of it, or from trials with --target-tflops)"
        )
    inputs = profile_inputs(r, path, profile)
    if profile.input is not None:  # kept as an advise folder's input.json: the predict stage bounds by it
        keep_input(inputs.out_dir, [profile.input], None)
    hardware = _hardware(inputs, profile, inputs.memory_given or (0.0, ""))
    measured = profile_measured(inputs, profile)
    inputs.say(f"planning from {profile.source}; nothing measured")
    return inputs, hardware, measured


def profile_inputs(r: AdviseRequest, path: Path, profile: Profile) -> AdviseInputs:
    """The inputs stage for a profile: the request checked, the grid of the measured configs, the target's
    batch (the profile's on one node unless --global-batch) and its memory (the profile's GPU's)."""
    checked = check_request_options(r)
    gpus = r.gpus_per_node or profile.gpus_per_node
    out_dir = Path(r.out_dir).resolve()
    claim_out(out_dir)
    grid = GridRequest(
        stages=tuple(sorted({c.zero_stage for c in profile.configs})),
        precisions=tuple(sorted({c.precision for c in profile.configs})),
        micro_batches=tuple(sorted({c.micro_batch for c in profile.configs})),
        ranks_per_node=(gpus,),
    )
    if r.samples is None and profile.dataset_images is None:
        raise UserError(
            f"--replan {path}: give --samples (samples in one epoch) or dataset_images in the profile"
        )
    amount = train_amount(
        r.samples, r.epochs, profile.dataset_images or 1, f"the profile's dataset_images ({path})"
    )
    memory = (
        (r.device_memory_gib, "assumed (user figure: --device-memory-gib)")
        if r.device_memory_gib
        else (TARGET_GPUS[profile.device], f"assumed ({profile.device} nominal memory, the profile's device)")
    )
    settings = TrialSettings(
        model=profile.model,
        data=Path("DATA"),
        steps=0,
        warmup_steps=0,
        trial_timeout_s=0.0,
        stall_timeout_s=None,
        train_args=(),
    )
    source = InputSource(
        base=profile.base,
        device={"device": profile.device, "count": gpus, "bf16": True, "fp16": True},
        ranks=profile.gpus_per_node,
        target_gpus=gpus,
        differs=None,
        memory_given=memory,
        model=profile.model,
        data=settings.data,
        settings=settings,
        setup="profile-" + hashlib.sha1(profile.source.encode()).hexdigest()[:12],
        plan=plan_grid(grid, {"bf16": True, "fp16": True}),
        notes=profile_notes(profile),
        amount=amount,
    )
    return build_inputs(r, out_dir, checked, source)


def profile_notes(profile: Profile) -> list[str]:
    unknown = any(math.isnan(c.memory_bytes) for c in profile.configs)
    return [
        f"planned from {profile.source}: {len(profile.configs)} config(s) measured on {profile.where} "
        "(measured on the target); nothing measured here",
        *profile.notes,
        *(
            [
                "memory per GPU not in the profile: activations unknown, so memory figures hold model states "
                "and buckets only"
            ]
            if unknown
            else []
        ),
    ]


def profile_measured(inputs: AdviseInputs, profile: Profile) -> MeasuredTrials:
    """The measure stage for a profile: its configs as trial rows, no check trial (an empty
    validation.csv with its columns), and a runner that refuses to run anything."""
    zero = ZeroSettings.from_config(profile.base)
    trials = profile_trials(profile, zero, inputs.setup)
    validation = pd.DataFrame(columns=list(VALIDATION_COLUMNS))
    write_csv_atomic(validation, inputs.out_dir / "validation.csv")

    def no_trials(_specs: list[Any]) -> pd.DataFrame:
        raise UserError("a plan from a profile runs no trial; run sdzero advise to measure more")

    return MeasuredTrials(
        trials=trials,
        search=SearchResult(trials, len(trials), [], [f"read from {profile.source}"]),
        validation=validation,
        check_ids=[],
        numels=profile.numels,
        zero=zero,
        runner=no_trials,
        budget_s=0.0,
        per_trial_s=0.0,
        notes=[],
    )


def _hardware(inputs: AdviseInputs, profile: Profile, memory: tuple[float, str]) -> HardwareFigures:
    """The profile's node and the target's: the machine's NVLink inside, the preset's fabric between."""
    r = inputs.request
    fit_path = inputs.out_dir / "comm" / "comm_fit.json"
    links = (r.preset, r.inter_node_gbps, r.inter_node_latency_us, r.nics_per_node)
    measured_net, measured_notes = build_network(
        None, profile.gpus_per_node, *links, gpu_target=profile.device
    )
    target_net, notes = build_network(None, inputs.target_gpus, *links, gpu_target=profile.device)
    return HardwareFigures(
        fit_path=fit_path,
        measured_net=measured_net,
        measured_notes=measured_notes,
        target_net=target_net,
        memory_bytes=memory[0] * GIB,
        memory_source=memory[1],
        usable_bytes=memory[0] * GIB * (1 - r.headroom),
        notes=notes,
    )


def is_profile_trials(trials: pd.DataFrame) -> bool:
    return "source" in trials and bool((trials["source"] == SOURCE).any())


def fit_profile(
    measured: MeasuredTrials, hardware: HardwareFigures
) -> tuple[MemoryModel, TimeModel, list[str], ComputeBasis]:
    """The memory model on the profile's peaks; compute per sample solved from each measured step: the
    step less the exposed communication its node's links need at that compute (a fixed point: the overlap
    windows grow with the compute)."""
    trials = measured.trials
    forward_share = float(trials["forward_share"].iloc[0])
    memory = fit_memory_model(trials, measured.numels, measured.zero)
    world = int(trials["world_size"].max())
    ops = {s: ops_from_mix(collective_mix(measured.numels, s, world, measured.zero)) for s in (0, 1, 2, 3)}
    net = hardware.measured_net
    by_group: dict[tuple[int, str, str], float] = {}
    for _, row in trials.iterrows():
        group = (int(row["zero_stage"]), str(row["precision"]), str(row["offload"]))
        by_group[group] = per_sample_s(row, ops, net, forward_share)
    target = TargetCompute(
        min(by_group.values()), forward_share, "measured on the target's node", by_group=by_group
    )
    timing = TimeModel({}, {}, ops, target=target)
    line = (
        f"target compute {PROFILE}: measured on the target ({int(trials['nodes'].iloc[0])} node(s) of "
        f"{net.gpus_per_node} GPUs), less the communication its links need (the machine's NVLink and NICs)"
    )
    return memory, timing, [*memory.notes], ComputeBasis(PROFILE, line, target)


def per_sample_s(row: pd.Series, ops: dict[int, Any], net: Network, forward_share: float) -> float:
    stage, precision, offload = int(row["zero_stage"]), str(row["precision"]), str(row["offload"])
    mb, accum, step = int(row["micro_batch"]), int(row["grad_accum"]), float(row["step_time_s"])
    seconds = step / (mb * accum)
    for _ in range(8):
        model = TimeModel({}, {}, ops, target=TargetCompute(seconds, forward_share, ""))
        predicted = model.predict(stage, precision, mb, accum, int(row["nodes"]), net, offload)
        compute = step - predicted.exposed_comm_s
        if not compute > 0:
            raise UserError(
                f"{row['trial_id']}: a {step:.3g} s step is shorter than the node's communication "
                f"({predicted.exposed_comm_s:.3g} s on the preset's links); check gpus_per_node, nodes and --preset"
            )
        seconds = compute / (mb * accum)
    return seconds
