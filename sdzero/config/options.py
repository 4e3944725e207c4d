"""The one typed option tree: every run option's name, default and help, written once.

Each field of the group dataclasses below (run, objective, SD3 flow matching, data, checkpoints,
validation, export, profile, speed, LoRA) carries its default and its help in `option(...)`; `TrainConfig`
(sdzero.config.train_config) is all of them at once, so `cfg.max_steps` stays a plain attribute wherever it is read.
From these fields come the trainer's argv parser (`argv_parser`, `sdzero/train.py --help`), the options the
`sdzero` commands share (`cli_option`: `sdzero cache`, `profile` and `advise` take the same inputs group),
and the advisor's `--train-args` check, which parses with the trainer's own parser.

Why a small generator and not tyro: the trainer's argv is a contract with launchers and users that must
not move. DeepSpeed's launcher injects `--local_rank=N`, users and tests pass DeepSpeed's own
`--deepspeed_config` spelling next to `--deepspeed-config`, `--no-tf32` negates, `--validation-prompts`
takes `nargs="+"`, and tests assert argparse's exact error lines ("argument --lr-scaling: invalid choice").
tyro derives one spelling per field, renders its own errors and list/boolean conventions, and is not
installed; the generator is ~150 lines of plain argparse/typer and keeps every spelling and message.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from sdzero.config.lr_rule import DEFAULT_LR_SCALING, LR_SCALINGS

PREDICTION_TYPES = ("epsilon", "v_prediction")
WEIGHTING_SCHEMES = ("logit_normal", "mode", "cosmap", "sigma_sqrt", "none")
"""SD3 timestep densities / loss weights, as diffusers.training_utils names them."""
ATTENTION_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
"""`--attention`: PyTorch's scaled_dot_product_attention kernels; auto lets PyTorch pick per call."""
EXPORT_DTYPES = ("fp32", "bf16", "fp16")
LAUNCHERS = ("pdsh", "openmpi")


FIELD_DEFAULT = "<the field's>"
"""`Cli.command_default` when the command line's default is the field's own."""


@dataclass(frozen=True)
class Cli:
    """How one field appears on a command line (kept in the field's metadata)."""

    help: str
    flags: tuple[str, ...] = ()
    """Spellings; default: the field name with dashes (`output_dir` -> `--output-dir`)."""
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negatable: bool = False
    """A boolean that also has `--no-NAME` (argparse's BooleanOptionalAction)."""
    check: Callable[[Any], Any] | None = None
    """A `sdzero` command's check of the value: returns it (or its parsed form), raises UserError."""
    panel: str | None = None
    """The `--help` panel of a `sdzero` command's option (default: Options)."""
    show_default: bool = True
    command_type: Any = None
    """What the command line gives when it is not the field's type (a string the check parses)."""
    command_default: Any = FIELD_DEFAULT
    """The command line's default when it is not the field's (None: the check or the object fills it in)."""


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    factory: Any = MISSING,
    flags: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    negatable: bool = False,
    **command: Any,
) -> Any:
    """A dataclass field with its command-line spelling and help; no default means required. `command`:
    what only the `sdzero` commands read (check, panel, show_default, command_type, command_default)."""
    meta = {"cli": Cli(help, flags, choices, metavar, negatable, **command)}
    return field(default=default, default_factory=factory, metadata=meta)


def shared(
    name: str, value: Any = MISSING, *, note: str = "", help: str | None = None, **command: Any
) -> Any:
    """A field of a command's options that is option `name` of the trainer or the launcher: its spelling and
    help (`note` adds what this command does with it), its default unless `value` is given."""
    trainer = option_field(name)
    cli: Cli = trainer.metadata["cli"]
    text = (cli.help if help is None else help) + (f"; {note}" if note else "")
    spec = {"cli": dataclasses.replace(cli, help=text, **command)}
    if value is MISSING and trainer.default is MISSING:
        return field(metadata=spec)  # required, as the trainer's own
    return field(default=default(name) if value is MISSING else value, metadata=spec)


# ---------------------------------------------------------------------------------------------- groups


@dataclass(kw_only=True)
class RunOptions:
    """run"""

    deepspeed_config: Path = option(
        help="DeepSpeed JSON: ZeRO stage, precision, micro-batch, accumulation (see ds_configs/)",
        flags=("--deepspeed_config", "--deepspeed-config"),
    )
    model: str = option(help="diffusers pipeline folder or hub id (loaded with from_pretrained either way)")
    data: Path = option(
        help="image folder with metadata.jsonl (or metadata.csv / metadata.parquet): file_name, text; or tar "
        "shards in img2dataset's layout: a brace pattern (shards/{000000..000099}.tar) or a folder of .tar files"
    )
    output_dir: Path = option(help="where metrics.jsonl and checkpoints go")
    max_steps: int = option(100, "optimizer steps (not micro-steps)")
    seed: int = option(0, "seed of noise, timesteps, data order and augmentations")
    dist_timeout_s: float = option(
        600.0,
        "seconds a collective waits for a peer before the process group raises: a rank whose host died "
        "makes the others fail (and the job exit non-zero) within this bound instead of hanging for ever",
    )
    stall_seconds: float = option(
        300.0,
        "once every rank is training, when no rank has advanced for this long, name the rank, host, phase "
        "and step that hold the job in <output-dir>/stall.json and exit 142 (restartable with --resume "
        "auto); longer than a checkpoint save, under --dist-timeout-s (0: off)",
    )
    straggler_every: int = option(
        50,
        "every N steps the ranks share their own compute time per step and time a round trip between "
        "every pair of hosts; a host persistently slower than the others, or whose links are, is named in "
        "metrics.jsonl, on the terminal and in the report (0: off)",
    )


@dataclass(kw_only=True)
class ObjectiveOptions:
    """learning rate and objective"""

    lr: float | None = option(None, "base learning rate; default: the JSON's optimizer.params.lr, else 1e-4")
    lr_scaling: str = option(
        DEFAULT_LR_SCALING,
        "how the LR follows the global batch when it differs from --lr-reference-batch (sdzero/config/lr_rule.py; capped)",
        choices=LR_SCALINGS,
    )
    lr_reference_batch: int | None = option(
        None, "global batch the base LR was tuned for; default: the JSON's own (LR unchanged)"
    )
    lr_warmup_steps: int = option(0, "linear LR warm-up, in optimizer steps")
    prediction_type: str | None = option(
        None, "training target; default: the scheduler's own prediction_type", choices=PREDICTION_TYPES
    )
    snr_gamma: float | None = option(
        None, "Min-SNR loss weighting gamma (Hang et al. 2023); 5.0 is the value the paper recommends"
    )
    noise_offset: float = option(0.0, "offset noise strength (DDPM models)")


@dataclass(kw_only=True)
class FlowOptions:
    """SD3 flow matching (only for SD3 models)"""

    weighting_scheme: str | None = option(
        None, "timestep density / loss weight (default logit_normal)", choices=WEIGHTING_SCHEMES
    )
    logit_mean: float | None = option(
        None, "logit_normal: mean of the normal whose sigmoid is u (default 0.0)"
    )
    logit_std: float | None = option(None, "logit_normal: its standard deviation (default 1.0)")
    mode_scale: float | None = option(None, "mode: the scale s of the mode density (default 1.29)")
    precondition_outputs: bool = option(
        False, "compare an x0 estimate (noisy - sigma * prediction) with the latents (EDM-style)"
    )
    max_sequence_length: int | None = option(
        None, "T5 tokens per caption (default 77, at most 512 as in diffusers' SD3 pipeline)"
    )


@dataclass(kw_only=True)
class DataOptions:
    """data"""

    resolution: int | None = option(
        None, "square training resolution in pixels; default: the model's native size"
    )
    random_flip: bool = option(False, "mirror images at random")
    random_crop: bool = option(False, "random instead of center crop")
    cache_dir: Path | None = option(
        None, "train from this `sdzero cache` folder (no VAE or text encoder is loaded)"
    )
    buckets: bool = option(
        False, "aspect-ratio buckets: one resolution of about the --resolution pixel count per optimizer step"
    )
    num_workers: int = option(2, "data-loader worker processes per rank")
    max_bad_fraction: float = option(
        0.5, "above this fraction of unreadable images the run stops instead of skipping them"
    )
    max_image_pixels: int = option(
        8192 * 8192,
        "skip images over this many pixels (width x height) as unreadable, checked from the header before "
        "decoding (decompression bombs)",
    )


@dataclass(kw_only=True)
class CheckpointOptions:
    """checkpoints, resume and EMA (docs/checkpointing.md)"""

    checkpoint_every: int = option(
        0, "save every N optimizer steps and at the end (0: only on SIGTERM/SIGUSR1)"
    )
    keep_last: int = option(
        3,
        "complete checkpoints kept under <output-dir>/checkpoints (>= 2, so a damaged newest one has a "
        "fallback; 0: all)",
    )
    resume: str = option(
        "none", "auto (newest complete checkpoint under the output folder, else a fresh start) | none | PATH"
    )
    resume_elastic: bool = option(
        False, "allow --resume on another world size (converted to DeepSpeed's universal checkpoint)"
    )
    ema_decay: float | None = option(
        None, "keep an EMA of the trained weights with this decay (e.g. 0.9999); exported as unet_ema"
    )
    preempt_timeout_s: float = option(
        300.0, "after SIGTERM/SIGUSR1, exit 143 at most this long after the signal even if the save hangs"
    )


@dataclass(kw_only=True)
class ValidationOptions:
    """validation (docs/checkpointing.md)"""

    validation_prompts: list[str] = option(
        help="prompts sampled with the current weights; images go to <output-dir>/validation/step_N/",
        factory=list,
        metavar="PROMPT",
    )
    validation_every: int = option(0, "sample the validation prompts every N steps (0: only at the end)")
    validation_inference_steps: int = option(25, "denoising steps per validation image")


@dataclass(kw_only=True)
class ExportOptions:
    """export"""

    export_final: bool = option(
        False, "write <output-dir>/final, a complete diffusers pipeline (safetensors), at the end"
    )
    export_dtype: str = option(
        "fp32",
        "dtype of every component of <output-dir>/final (fp32 loads with a bare from_pretrained)",
        choices=EXPORT_DTYPES,
    )


@dataclass(kw_only=True)
class ProfileOptions:
    """profiling (the advisor's trials; sdzero/training/measuring/probe.py)"""

    profile_out: Path | None = option(
        None,
        "write a trial profile (throughput, memory by kind, DeepSpeed breakdown) to this JSON file; a "
        "profiled run is an advisor trial: a stop (SIGTERM, its measurement done) ends it without a "
        "checkpoint unless --checkpoint-every asks for them",
    )
    profile_warmup_steps: int = option(
        1, "steps left out of the profile's figures (allocations, JIT builds, worker start-up)"
    )
    profile_configs: str = option(
        "",
        "measure several configs in this one launch, in interleaved rounds: MICRO_BATCH:ACCUMULATION pairs "
        "such as 1:1,4:1,4:4 (sdzero/training/measuring/sweep.py); --profile-out then holds each config's profile",
    )
    profile_race: bool = option(
        False,
        "with --profile-configs: a config whose samples/s interval lies wholly below the leader's stops "
        "being measured, and the launch ends once the leader is the only config left",
    )
    profile_memory_cap_gib: float = option(
        0.0,
        "with --profile-race: a config whose device peak per rank is over this many GiB cannot be the pick: "
        "it neither leads the race nor keeps the launch going (0: no cap)",
    )
    profile_target_halfwidth: float = option(
        0.0,
        "stop once the 95% interval of the median measured step is within this fraction of it on each "
        "side (a bootstrap over the steps; 0: measure until --max-steps)",
    )
    profile_min_steps: int = option(3, "with --profile-target-halfwidth: measure at least this many steps")
    profile_max_seconds: float = option(
        0.0, "with --profile-target-halfwidth: stop after this many seconds of measured steps (0: no limit)"
    )
    sync_timing: bool = option(
        False, "synchronize the GPU after every phase: exact per-phase times, lower throughput"
    )


@dataclass(kw_only=True)
class SpeedOptions:
    """GPU speed and memory (docs/gpu.md)"""

    tf32: bool = option(
        True,
        "TF32 tensor cores for fp32 matmuls and convolutions (--no-tf32: full fp32); 16-bit parts unaffected",
        negatable=True,
    )
    channels_last: bool = option(
        False, "feed the trained network channels-last (NHWC) activations", negatable=True
    )
    compile: bool = option(
        False, "torch.compile the trained network through DeepSpeed's engine.compile (minutes to build)"
    )
    attention: str = option(
        "auto",
        "SDPA kernel for the trained network's attention (auto: PyTorch picks)",
        choices=ATTENTION_BACKENDS,
    )
    gradient_checkpointing: bool = option(False, "recompute activations in the backward pass (less memory)")


@dataclass(kw_only=True)
class LoraOptions:
    """LoRA adapters (docs/lora.md): train low-rank adapters on the network instead of all its weights"""

    lora_rank: int | None = option(
        None,
        "train LoRA adapters of this rank (peft) on the UNet / SD3 transformer; the base weights stay frozen "
        "(default: train every weight)",
    )
    lora_alpha: float | None = option(
        None, "LoRA scaling numerator (scale = alpha / rank); default: the rank"
    )
    lora_dropout: float = option(0.0, "dropout on the LoRA branch's input, in [0, 1)")
    lora_target_modules: list[str] = option(
        help="module names (or name suffixes) that get adapters; default: the attention projections "
        "diffusers' LoRA scripts use (to_k to_q to_v to_out.0; SD3 also add_k/q/v_proj, to_add_out)",
        factory=list,
        metavar="MODULE",
    )
    export_merged: bool = option(
        False,
        "with --export-final on a LoRA run: also write <output-dir>/final/merged, a complete pipeline with the "
        "adapter fused into the base weights (--export-dtype)",
    )


TRAIN_GROUPS: tuple[type, ...] = (
    RunOptions,
    ObjectiveOptions,
    FlowOptions,
    DataOptions,
    CheckpointOptions,
    ValidationOptions,
    ExportOptions,
    ProfileOptions,
    SpeedOptions,
    LoraOptions,
)
"""The trainer's option groups, in --help order; `TrainConfig` inherits all of them."""


@dataclass(kw_only=True)
class LaunchOptions:
    """launch: how the `sdzero` commands start ranks (the deepspeed launcher's options, sdzero.cluster.launch_command)"""

    hostfile: Path | None = option(None, "DeepSpeed hostfile: one `host slots=N` line per node")
    num_gpus: int | None = option(None, "ranks on this machine (deepspeed --num_gpus)")
    master_addr: str | None = option(None, "rendezvous address; default: the first host's address")
    master_port: int | None = option(None, "rendezvous port; default: a free one")
    launcher: str = option("pdsh", "how ranks start on the hosts: pdsh (ssh) or openmpi", choices=LAUNCHERS)


@dataclass(kw_only=True)
class JobOptions:
    """cluster job: what `sdzero slurm` and `sdzero k8s` write into the batch script or the manifests"""

    nodes: int = option(help="nodes (Slurm) or pods (Kubernetes Indexed Job) the run spans")
    gpus_per_node: int = option(help="ranks (GPUs) per node or pod")
    rendezvous_port: int = option(
        29500,
        "rendezvous port on the first node or the index-0 pod (fixed: every rank must know it in advance)",
        flags=("--master-port",),
    )
    gpus: bool = option(True, "request GPUs (--no-gpus for CPU-only partitions or pods)", negatable=True)


@dataclass(kw_only=True)
class TrialOptions:
    """advisor trials: what `sdzero profile` and `sdzero advise` pass to every short real run"""

    train_args: str = option(
        "",
        "more trainer options for every trial, e.g. '--resolution 1024 --gradient-checkpointing' (what "
        "changes a step's time or memory must be measured with it)",
    )


# ------------------------------------------------------------------------------------- introspection


def _fields(groups: tuple[type, ...]) -> list[tuple[type, dataclasses.Field]]:
    return [(g, f) for g in groups for f in dataclasses.fields(g) if "cli" in f.metadata]


def option_field(name: str) -> dataclasses.Field:
    """The field named `name` in the trainer's or the launcher's options."""
    for _, f in _fields((*TRAIN_GROUPS, LaunchOptions, JobOptions, TrialOptions)):
        if f.name == name:
            return f
    raise KeyError(f"no option field {name!r}")


def default(name: str) -> Any:
    """The dataclass default of option `name` (a typer parameter's default, written in its signature)."""
    f = option_field(name)
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


class _Defaults:
    """`DEFAULTS.name`: the dataclass default of option `name`, read when asked (typer signatures use it, so
    a command stays a plain function whose defaults are the dataclass's)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return default(name)
        except KeyError:
            raise AttributeError(name) from None


DEFAULTS = _Defaults()


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["cli"].flags or ("--" + f.name.replace("_", "-"),)


def _value_type(owner: type, f: dataclasses.Field) -> Any:
    """int, float or str (paths stay strings: `TrainConfig.__post_init__` makes them Paths)."""
    hint = typing.get_type_hints(owner)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    base = typing.get_args(args[0])[0] if typing.get_origin(args[0]) is list else args[0]
    return base if base in (int, float) else None


def _shown_default(value: Any) -> str:
    """' (default: X)' for a default worth showing: not None, not an off switch, not an empty list."""
    if value is None or value is False or value == []:
        return ""
    return f" (default: {value})".replace("%", "%%")


# ------------------------------------------------------------------------------------------- argparse


def argv_parser(groups: tuple[type, ...], **settings: Any) -> argparse.ArgumentParser:
    """An argparse parser with one argument group per dataclass of `groups`; dest = field name."""
    parser = argparse.ArgumentParser(**settings)
    for group in groups:
        title = (group.__doc__ or group.__name__).strip().splitlines()[0]
        target = parser if group is groups[0] else parser.add_argument_group(title)
        for owner, f in _fields((group,)):
            _add_argument(target, owner, f)
    return parser


def _add_argument(target: Any, owner: type, f: dataclasses.Field) -> None:
    cli: Cli = f.metadata["cli"]
    value = default(f.name)
    kwargs: dict[str, Any] = {"dest": f.name, "help": cli.help.replace("%", "%%") + _shown_default(value)}
    if f.default is MISSING and f.default_factory is MISSING:
        kwargs["required"] = True
    elif typing.get_type_hints(owner)[f.name] is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if cli.negatable else "store_true"
        kwargs["default"] = value
    else:
        kwargs["default"] = value
        kwargs["type"] = _value_type(owner, f)
        if isinstance(value, list):
            kwargs["nargs"] = "+"
    if cli.choices is not None:
        kwargs["choices"] = cli.choices
    if cli.metavar is not None:
        kwargs["metavar"] = cli.metavar
    target.add_argument(*flags_of(f), **kwargs)


# ---------------------------------------------------------------------------------------------- typer


def cli_option(name: str, *, note: str = "", panel: str | None = None, help: str | None = None) -> Any:
    """`typer.Option` for option `name`: its spellings and help from the dataclass field (`note` adds what
    this command does with it). The default goes in the signature, `= DEFAULTS.name`, so the command stays
    a plain function with real defaults; a required field's parameter has none."""
    import typer

    f = option_field(name)
    cli: Cli = f.metadata["cli"]
    text = help if help is not None else cli.help
    flags = tuple(sorted(cli.flags, key=lambda flag: "_" in flag))  # the dashed spelling first in --help
    if cli.negatable:
        flags = (f"--{name.replace('_', '-')}/--no-{name.replace('_', '-')}",)
    return typer.Option(*flags, help=text + (f"; {note}" if note else ""), rich_help_panel=panel)


INPUTS_PANEL = "Inputs (shared by sdzero cache, profile and advise)"
"""The rich help panel of the inputs group: model, data, DeepSpeed JSON, hostfile."""


def input_option(name: str, note: str = "") -> Any:
    """An option of the shared inputs group (`model`, `data`, `deepspeed_config`, `hostfile`)."""
    if name not in ("model", "data", "deepspeed_config", "hostfile"):
        raise KeyError(f"{name!r} is not in the shared inputs group")
    return cli_option(name, note=note, panel=INPUTS_PANEL)
