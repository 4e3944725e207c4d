"""The trial grid of `sdzero profile`: which configurations to run, their DeepSpeed JSON, which are done.

A trial is one short real run of the trainer. The grid is ZeRO stage x precision x micro-batch x offload x
ranks per node, plus overlap_comm and bucket sizes where the user asks for them. Micro-batches climb a
ladder (1, 2, 4, ...) per combination of the other knobs and stop at the first out-of-memory trial: a
larger micro-batch of the same combination would need more memory still.

Each trial's DeepSpeed JSON is the user's base JSON with the trial's knobs written in, so everything else
(optimizer, clipping, bucket sizes nobody varied) is exactly what the user runs.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from sdzero.atomic import write_json_atomic
from sdzero.errors import UserError

STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""ZeRO-0 is plain data parallelism (every rank holds every state; one gradient all-reduce per step):
DeepSpeed's own autotuner tries it, and on small models it often wins."""
PRECISIONS: tuple[str, ...] = ("bf16", "fp16")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
FINISHED_STATUSES: tuple[str, ...] = ("ok", "oom", "crash", "timeout")
RETRIED_STATUSES: tuple[str, ...] = ("crash", "timeout")
"""With --retry-failed these run again (an environment problem fixed); OOM is a property of the config."""

# DeepSpeed's dynamic loss scaling, as in ds_configs/*_fp16.json, for a base JSON without an fp16 section.
DEFAULT_FP16: dict[str, Any] = {
    "enabled": True,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}
CPU_OFFLOAD: dict[str, Any] = {"device": "cpu", "pin_memory": True}


@dataclass(frozen=True)
class TrialSpec:
    """One point of the grid. None for a communication knob means "as in the base JSON"."""

    zero_stage: int
    precision: str
    micro_batch: int
    offload: str
    ranks_per_node: int
    overlap_comm: bool | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    grad_accum: int | None = None
    """Gradient accumulation steps; None: as in the base JSON. A trial at accumulation > 1 is what tells
    once-per-step costs (the optimizer step, ZeRO-1's boundary reduction) from per-micro-step ones."""
    checkpointing: bool = False
    """Gradient checkpointing: the network recomputes its activations in the backward. Measured in the
    same launch as the configs without it (sdzero.training.measuring.sweep switches it on the built
    network); an id without the `gc` part (every id before it existed) is a config without it."""

    @property
    def trial_id(self) -> str:
        """A readable, stable name: the folder name and the key that marks a trial as done."""
        parts = [
            f"z{self.zero_stage}",
            self.precision,
            f"mb{self.micro_batch}",
            f"off-{self.offload.replace('+', '-')}",
            f"r{self.ranks_per_node}",
        ]
        if self.overlap_comm is not None:
            parts.append(f"oc{int(self.overlap_comm)}")
        if self.reduce_bucket_size is not None:
            parts.append(f"rb{self.reduce_bucket_size}")
        if self.allgather_bucket_size is not None:
            parts.append(f"ag{self.allgather_bucket_size}")
        if self.grad_accum is not None:
            parts.append(f"ga{self.grad_accum}")
        if self.checkpointing:
            parts.append("gc")
        return "-".join(parts)

    @property
    def ladder_key(self) -> TrialSpec:
        """The combination this trial's micro-batch ladder belongs to."""
        return replace(self, micro_batch=0)

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GridRequest:
    """What the user asked for; empty tuples mean the defaults named in each field's docstring."""

    stages: tuple[int, ...] = STAGES
    precisions: tuple[str, ...] = PRECISIONS
    micro_batches: tuple[int, ...] = ()
    """Explicit micro-batches; empty: the ladder 1, 2, 4, ... up to `max_micro_batch`."""
    max_micro_batch: int = 64
    offloads: tuple[str, ...] = ("none",)
    ranks_per_node: tuple[int, ...] = ()
    """Ranks per node; empty: every local GPU, or 2 on a CPU (resolved by the driver)."""
    overlap_comm: tuple[bool, ...] = ()
    reduce_bucket_sizes: tuple[int, ...] = ()
    allgather_bucket_sizes: tuple[int, ...] = ()
    grad_accums: tuple[int, ...] = ()
    """Gradient accumulation steps to try; empty: the base JSON's."""
    checkpointing: tuple[bool, ...] = (False,)
    """Gradient checkpointing off, on, or both (each micro-batch of a ladder with and without it, in
    one launch)."""

    def __post_init__(self) -> None:
        bad = [s for s in self.stages if s not in STAGES]
        if not self.stages or bad:
            raise UserError(f"--stage {bad or '(none)'}: choose from 0, 1, 2, 3")
        bad_p = [p for p in self.precisions if p not in PRECISIONS]
        if not self.precisions or bad_p:
            raise UserError(f"--precision {', '.join(bad_p) or '(none)'}: choose bf16 and/or fp16")
        bad_o = [o for o in self.offloads if o not in OFFLOADS]
        if not self.offloads or bad_o:
            raise UserError(f"--offload {', '.join(bad_o) or '(none)'}: choose from {', '.join(OFFLOADS)}")
        if any(m < 1 for m in self.micro_batches) or self.max_micro_batch < 1:
            raise UserError("--micro-batch and --max-micro-batch must be positive integers")
        if any(a < 1 for a in self.grad_accums):
            raise UserError(f"--grad-accum {list(self.grad_accums)}: accumulation steps must be at least 1")
        if any(r < 1 for r in self.ranks_per_node):
            raise UserError("--ranks must be at least 1 (ranks per node)")
        for flag, sizes in (
            ("--reduce-bucket-size", self.reduce_bucket_sizes),
            ("--allgather-bucket-size", self.allgather_bucket_sizes),
        ):
            # ZeRO-1/2 hand NCCL buckets aligned to 2 elements (4 bytes of fp16/bf16); odd sizes assert.
            if any(s < 2 or s % 2 for s in sizes):
                raise UserError(f"{flag} {list(sizes)}: bucket sizes are element counts, even and >= 2")

    def ladder(self) -> tuple[int, ...]:
        if self.micro_batches:
            return tuple(sorted(set(self.micro_batches)))
        sizes, m = [], 1
        while m <= self.max_micro_batch:
            sizes.append(m)
            m *= 2
        return tuple(sizes)


@dataclass
class GridPlan:
    """Ladders to climb (each a list of specs, micro-batch ascending) and what was left out, and why."""

    ladders: list[list[TrialSpec]]
    notes: list[str] = field(default_factory=list)

    @property
    def max_trials(self) -> int:
        return sum(len(ladder) for ladder in self.ladders)


def plan_grid(request: GridRequest, supported: dict[str, bool]) -> GridPlan:
    """Every valid combination, in a stable order. `supported` maps precision -> the device runs it."""
    notes: list[str] = []
    precisions = []
    for p in dict.fromkeys(request.precisions):
        if supported.get(p, False):
            precisions.append(p)
        else:
            notes.append(f"{p}: skipped, this device does not support it (DeepSpeed's accelerator says so)")
    if "optimizer+params" in request.offloads and set(request.stages) != {3}:
        where = "stage 3 only" if 3 in request.stages else "skipped"
        notes.append(f"offload optimizer+params: {where}, parameter offload is a ZeRO-3 feature")
    ladders: list[list[TrialSpec]] = []
    for stage in sorted(set(request.stages)):
        for precision in precisions:
            for offload in dict.fromkeys(request.offloads):
                if offload == "optimizer+params" and stage != 3:
                    continue
                for ranks in sorted(set(request.ranks_per_node or (2,))):
                    for knobs in _comm_knobs(request):
                        for accum in request.grad_accums or (None,):
                            base = TrialSpec(stage, precision, 0, offload, ranks, *knobs, grad_accum=accum)
                            ladders.append(
                                [
                                    replace(base, micro_batch=m, checkpointing=gc)
                                    for gc in sorted(set(request.checkpointing))
                                    for m in request.ladder()
                                ]
                            )
    if not ladders:
        raise UserError("the grid is empty after the skips above; widen --stage/--precision/--offload")
    return GridPlan(ladders, notes)


ACCUMULATION_CHECK = 4
"""The accumulation of the check trial that `accumulation_check` makes."""


def is_checkpointed(row: Any) -> bool:
    """Whether a trials.csv or predictions row is a config with gradient checkpointing (a row without the
    column, from before it existed, is not)."""
    value = row.get("checkpointing", False) if hasattr(row, "get") else False
    if value is None or (isinstance(value, float) and value != value):
        return False
    return str(value).strip().lower() in {"true", "1", "yes"}


def accumulation_check(spec: TrialSpec, grad_accum: int = ACCUMULATION_CHECK) -> TrialSpec:
    """The same config at accumulation `grad_accum`: a trial the time model did not see when fitted on
    accumulation-1 trials, which checks its split of once-per-step from per-micro-step costs."""
    return replace(spec, grad_accum=grad_accum)


def _comm_knobs(request: GridRequest) -> Iterator[tuple[bool | None, int | None, int | None]]:
    for overlap in request.overlap_comm or (None,):
        for reduce in request.reduce_bucket_sizes or (None,):
            for allgather in request.allgather_bucket_sizes or (None,):
                yield overlap, reduce, allgather


# --------------------------------------------------------------------------------------------------
# DeepSpeed JSON per trial


def load_base_config(path: Path) -> dict[str, Any]:
    """The base DeepSpeed JSON, checked with the trainer's own reader (no "auto", one precision, ...)."""
    from sdzero.config.train_config import load_ds_config

    raw = load_ds_config(Path(path), world_size=1).raw  # batch sizes are rewritten per trial anyway
    if "optimizer" not in raw:
        raise UserError(
            f"--deepspeed-config {path}: no optimizer section; trials need DeepSpeed's optimizer so that its "
            'ZeRO partitions are measured (add e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}})'
        )
    return raw


def grad_accum_of(spec: TrialSpec, base: dict[str, Any]) -> int:
    """The trial's gradient accumulation: its own, else the base JSON's."""
    accum = spec.grad_accum if spec.grad_accum is not None else base.get("gradient_accumulation_steps", 1)
    return int(accum)


def trial_ds_config(base: dict[str, Any], spec: TrialSpec) -> dict[str, Any]:
    """The base JSON with this trial's knobs and DeepSpeed's own instruments switched on."""
    config = copy.deepcopy(base)
    # The global batch follows micro-batch x accumulation x world size; a fixed one would contradict it.
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = spec.micro_batch
    config["gradient_accumulation_steps"] = grad_accum_of(spec, base)
    _set_precision(config, spec.precision)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = spec.zero_stage
    for key in ("offload_optimizer", "offload_param"):
        section = zero.pop(key, None)
        wanted = (
            key == "offload_optimizer"
            and spec.offload != "none"
            or (key == "offload_param" and spec.offload == "optimizer+params")
        )
        if wanted:  # keep the user's own offload settings (NVMe path, pinning) when the base has them
            own = section if section and section.get("device", "none") != "none" else None
            zero[key] = own or dict(CPU_OFFLOAD)
    if spec.overlap_comm is not None:
        zero["overlap_comm"] = spec.overlap_comm
    if spec.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = spec.reduce_bucket_size
    if spec.allgather_bucket_size is not None:
        zero["allgather_bucket_size"] = spec.allgather_bucket_size
    # DeepSpeed's per-step forward/backward/step timers and its per-collective log (sdzero.training.measuring.probe reads
    # both). Both add synchronisations on GPUs, so a trial's samples/s is slightly below an unmeasured run's.
    config["wall_clock_breakdown"] = True
    config["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
    return config


def _set_precision(config: dict[str, Any], precision: str) -> None:
    for key in ("bf16", "bfloat16", "fp16"):
        if key in config:
            config[key] = {**config[key], "enabled": False}
    config.pop("bfloat16", None)  # the legacy spelling; "bf16" is the one written below
    if precision == "bf16":
        config["bf16"] = {**config.get("bf16", {}), "enabled": True}
    else:
        config["fp16"] = {**DEFAULT_FP16, **config.get("fp16", {}), "enabled": True}


def write_trial_config(base: dict[str, Any], spec: TrialSpec, trial_dir: Path, world_size: int) -> Path:
    """Write the trial's JSON into its folder and read it back with the trainer's checks."""
    from sdzero.config.train_config import load_ds_config

    trial_dir.mkdir(parents=True, exist_ok=True)
    path = trial_dir / "ds_config.json"
    write_json_atomic(path, trial_ds_config(base, spec))
    load_ds_config(path, world_size)
    return path


# --------------------------------------------------------------------------------------------------
# What is done already


def setup_id(parts: dict[str, Any]) -> str:
    """A short hash of everything besides the grid point that changes a trial's result.

    A rerun skips a trial only if both its id and this hash match, so changing the base JSON, the model,
    the data, the step counts or the trainer options reruns it instead of reusing a stale row.
    """
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def finished_trials(table: pd.DataFrame, setup: str, retry_failed: bool = False) -> dict[str, str]:
    """trial_id -> status of trials done under this setup (the last row of a trial wins)."""
    if table.empty:
        return {}
    rows = table[table["setup_id"].astype(str) == setup]
    done: dict[str, str] = {}
    for trial_id, status in zip(rows["trial_id"], rows["status"], strict=True):
        done[str(trial_id)] = str(status)
    skip = RETRIED_STATUSES if retry_failed else ()
    return {k: v for k, v in done.items() if v in FINISHED_STATUSES and v not in skip}


def ladder_stopped(ladder: Sequence[TrialSpec], statuses: dict[str, str]) -> int | None:
    """The micro-batch at which this ladder ran out of memory, if it did."""
    for spec in ladder:
        if statuses.get(spec.trial_id) == "oom":
            return spec.micro_batch
    return None


def pending(plan: GridPlan, done: dict[str, str]) -> Iterable[TrialSpec]:
    """Trials still to run, in order; a ladder stops at its first OOM (also one found in an earlier run)."""
    for ladder in plan.ladders:
        for spec in ladder:
            if spec.trial_id not in done:
                yield spec  # the caller records the outcome in `done` before asking for the next one
            if done.get(spec.trial_id) == "oom":
                break
