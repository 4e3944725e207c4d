"""Run options and the DeepSpeed JSON, validated before any process group exists.

One source of truth per fact: ZeRO stage, precision, micro-batch and accumulation are read from the
DeepSpeed JSON (`DsSettings`); the run options (`TrainConfig`) hold only what DeepSpeed does not know.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdzero.config.data_source import is_shard_source
from sdzero.config.ds_json import check_ds_values, read_ds_json
from sdzero.config.ds_schema import check_with_deepspeed
from sdzero.config.lora_check import check_lora_numbers
from sdzero.config.lr_rule import LR_SCALINGS, LrChoice, base_lr_of, choose_lr, reference_batch
from sdzero.config.options import (
    PREDICTION_TYPES,
    TRAIN_GROUPS,
    WEIGHTING_SCHEMES,
    argv_parser,
)
from sdzero.config.user_file import read_user_bytes
from sdzero.errors import UserError

MODE_SCALE_MAX = 2 / (math.pi - 2)
"""Above this the `mode` density is not monotone in u (SD3 paper, eq. 20: -1 <= s <= 2/(pi-2))."""


MAX_NOISE_OFFSET = 1.0
"""Offset noise beyond the noise itself (a unit Gaussian) drowns the signal; larger is a typo."""


def world_size_from_env() -> int:
    """World size as the launcher announced it (deepspeed/torchrun, OpenMPI, or a PMI launcher)."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def rank_from_env() -> int:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


@dataclass(frozen=True)
class DsSettings:
    """What the trainer reads from a DeepSpeed JSON (never a second copy that could disagree)."""

    path: Path
    raw: dict[str, Any]
    """The JSON exactly as loaded; the trainer passes a copy with the resolved LR to DeepSpeed."""
    zero_stage: int
    dtype: str
    """"bf16", "fp16" or "fp32": the compute dtype of the trained network."""
    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def offload_optimizer(self) -> bool:
        return _offload_device(self.raw, "offload_optimizer") not in (None, "none")

    @property
    def offload_param(self) -> bool:
        return _offload_device(self.raw, "offload_param") not in (None, "none")


def _offload_device(raw: dict[str, Any], key: str) -> str | None:
    section = raw.get("zero_optimization", {}).get(key)
    return None if not section else str(section.get("device", "none"))


def _positive_int(raw: dict[str, Any], key: str, path: Path) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if value == "auto":
        raise UserError(
            f'{path}: "{key}": "auto" is a Hugging Face accelerate placeholder, not DeepSpeed; put a number there'
        )
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f'{path}: "{key}" must be a positive integer, got {value!r}')
    return value


def load_ds_config(path: Path, world_size: int) -> DsSettings:
    """Load a DeepSpeed JSON and check the batch triple against the world size.

    DeepSpeed accepts any two of (train_batch_size, micro-batch, accumulation) and derives the third;
    when the three disagree it raises only after the process group exists, so ranks can hang on a
    collective. Checking here, before `init_distributed`, turns that into one clear line.
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise UserError(f"--deepspeed_config {path}: no such file; pick one of ds_configs/*.json")
    raw = read_ds_json(path)  # a FIFO, a device or a folder: one line saying which
    stage = check_ds_values(raw, path)  # "auto", precision blocks, stage, optimizer: one line each

    bf16 = any(raw.get(name, {}).get("enabled", False) for name in ("bf16", "bfloat16"))
    fp16 = bool(raw.get("fp16", {}).get("enabled", False))
    if bf16 and fp16:
        raise UserError(f"{path}: both fp16 and bf16 are enabled; enable one of them")
    dtype = "bf16" if bf16 else "fp16" if fp16 else "fp32"

    total = _positive_int(raw, "train_batch_size", path)
    micro = _positive_int(raw, "train_micro_batch_size_per_gpu", path)
    accum = _positive_int(raw, "gradient_accumulation_steps", path)
    micro, accum = _resolve_batch_triple(path, total, micro, accum, world_size)
    check_with_deepspeed(raw, path)  # DeepSpeed's own config models, scheduler, gradient_clipping
    return DsSettings(
        path=path,
        raw=raw,
        zero_stage=stage,
        dtype=dtype,
        micro_batch=micro,
        grad_accum=accum,
        world_size=world_size,
    )


def _resolve_batch_triple(
    path: Path, total: int | None, micro: int | None, accum: int | None, world: int
) -> tuple[int, int]:
    if micro is not None and accum is not None:
        if total is not None and total != micro * accum * world:
            raise UserError(
                f"{path}: train_batch_size {total} != micro-batch {micro} x gradient_accumulation_steps "
                f"{accum} x world size {world} (= {micro * accum * world}); set train_batch_size to "
                f"{micro * accum * world} or remove it so DeepSpeed derives it"
            )
        return micro, accum
    if total is None:
        if micro is None:
            raise UserError(f"{path}: set train_micro_batch_size_per_gpu (and gradient_accumulation_steps)")
        return micro, 1
    if micro is not None:
        if total % (micro * world):
            raise UserError(
                f"{path}: train_batch_size {total} is not divisible by micro-batch {micro} x world size "
                f"{world}; change one of them or set gradient_accumulation_steps explicitly"
            )
        return micro, total // (micro * world)
    accum = accum or 1
    if total % (accum * world):
        raise UserError(
            f"{path}: train_batch_size {total} is not divisible by gradient_accumulation_steps {accum} x "
            f"world size {world}; set train_micro_batch_size_per_gpu explicitly"
        )
    return total // (accum * world), accum


@dataclass(kw_only=True)
class TrainConfig(*TRAIN_GROUPS):  # the groups in --help order, listed once in sdzero.config.options
    """Run options: what the DeepSpeed JSON does not say. Every field, its default and its help is declared
    once, in the option groups of sdzero.config.options; this class adds the checks and the derived settings."""

    def __post_init__(self) -> None:
        self.deepspeed_config = Path(self.deepspeed_config)
        self.data = Path(self.data)
        self.output_dir = Path(self.output_dir)
        self._check_finite_numbers()
        if self.max_steps < 1:
            raise UserError(f"--max-steps must be at least 1, got {self.max_steps}")
        check_resolution(self.resolution)
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(
                f"--seed must be in [0, {MAX_SEED}] (numpy's and torch's seed range), got {self.seed}"
            )
        if self.lr_warmup_steps < 0:
            raise UserError(f"--lr-warmup-steps must be >= 0 (0: no warm-up), got {self.lr_warmup_steps}")
        if self.lr is not None and not (0 < self.lr < 1):
            raise UserError(f"--lr must be in (0, 1), got {self.lr}")
        if self.lr_scaling not in LR_SCALINGS:
            raise UserError(f"--lr-scaling must be one of {', '.join(LR_SCALINGS)}, got {self.lr_scaling!r}")
        if self.lr_reference_batch is not None and self.lr_reference_batch < 1:
            raise UserError(f"--lr-reference-batch must be at least 1, got {self.lr_reference_batch}")
        if self.prediction_type is not None and self.prediction_type not in PREDICTION_TYPES:
            raise UserError(
                f"--prediction-type must be one of {', '.join(PREDICTION_TYPES)}, got {self.prediction_type!r}"
            )
        if self.snr_gamma is not None and self.snr_gamma <= 0:
            raise UserError(f"--snr-gamma must be positive, got {self.snr_gamma}")
        if not 0 <= self.noise_offset <= MAX_NOISE_OFFSET:
            # finite is not enough: 1e308 times a unit Gaussian overflows the noise, and the loss is NaN
            raise UserError(
                f"--noise-offset must be in [0, {MAX_NOISE_OFFSET}], got {self.noise_offset} (0.05 to 0.1 is usual)"
            )
        self._check_flow_options()
        if not (0 < self.max_bad_fraction <= 1):
            raise UserError(f"--max-bad-fraction must be in (0, 1], got {self.max_bad_fraction}")
        self._check_cache_options()
        if self.num_workers < 0:
            raise UserError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.stall_seconds < 0:
            raise UserError(f"--stall-seconds must be >= 0 (0: off), got {self.stall_seconds}")
        if self.straggler_every < 0:
            raise UserError(f"--straggler-every must be >= 0 (0: off), got {self.straggler_every}")
        self._check_checkpoint_options()
        check_lora_numbers(self)
        if self.profile_out is not None:
            self.profile_out = Path(self.profile_out)
            if not 0 <= self.profile_warmup_steps < self.max_steps:
                raise UserError(
                    f"--profile-warmup-steps {self.profile_warmup_steps} must be >= 0 and below --max-steps "
                    f"{self.max_steps}, so that at least one step is measured"
                )
        if not self.data.is_dir() and not is_shard_source(self.data):
            raise UserError(
                f"--data {self.data}: no such folder; point it at an image folder with metadata.jsonl"
            )
        check_output_dir(self.output_dir)
        local = Path(self.model)
        if local.exists():
            check_model_folder(local, self.model)

    def _check_finite_numbers(self) -> None:
        """NaN passes every `<` and `>` check (`nan < 0` is False): `--noise-offset nan` trained with a NaN
        loss without a word. Every number option must be finite before any bound is checked."""
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, float) and not math.isfinite(value):
                flag = "--" + item.name.replace("_", "-")
                raise UserError(f"{flag} must be a finite number, got {value}")

    def _check_cache_options(self) -> None:
        if self.cache_dir is None:
            return
        self.cache_dir = Path(self.cache_dir)
        if self.random_crop:
            raise UserError(
                "--random-crop cannot be served from --cache-dir: a cache holds one (center) crop per image; "
                "drop --random-crop, or train without --cache-dir"
            )

    def _check_checkpoint_options(self) -> None:
        if self.checkpoint_every < 0:
            raise UserError(
                f"--checkpoint-every must be >= 0 (0: only on preemption), got {self.checkpoint_every}"
            )
        check_keep_last(self.keep_last)
        if self.resume not in ("auto", "none") and not Path(self.resume).exists():
            raise UserError(
                f"--resume {self.resume}: no such checkpoint or folder; pass a checkpoint folder, a run's "
                "output folder, `auto` or `none`"
            )
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise UserError(f"--ema-decay must be in (0, 1) (typically 0.999-0.9999), got {self.ema_decay}")
        if self.validation_every < 0:
            raise UserError(
                f"--validation-every must be >= 0 (0: only at the end), got {self.validation_every}"
            )
        if self.validation_inference_steps < 1:
            raise UserError(
                f"--validation-inference-steps must be at least 1, got {self.validation_inference_steps}"
            )
        if self.preempt_timeout_s <= 0:
            raise UserError(f"--preempt-timeout-s must be positive, got {self.preempt_timeout_s}")
        if self.dist_timeout_s <= 0:
            raise UserError(
                f"--dist-timeout-s must be a positive number of seconds, got {self.dist_timeout_s}"
            )

    def _check_flow_options(self) -> None:
        scheme = self.weighting_scheme
        if scheme is not None and scheme not in WEIGHTING_SCHEMES:
            raise UserError(
                f"--weighting-scheme must be one of {', '.join(WEIGHTING_SCHEMES)}, got {scheme!r}"
            )
        if self.logit_std is not None and not self.logit_std > 0:
            raise UserError(
                f"--logit-std must be positive (the spread of the logit-normal), got {self.logit_std}"
            )
        if self.mode_scale is not None and not -1 <= self.mode_scale <= MODE_SCALE_MAX:
            raise UserError(
                f"--mode-scale must be in [-1, {MODE_SCALE_MAX:.3f}] (2/(pi-2)), where the mode density is a "
                f"valid monotone map; got {self.mode_scale}"
            )
        given = "logit_normal" if scheme is None else scheme
        for flag, value, needs in (
            ("--logit-mean", self.logit_mean, "logit_normal"),
            ("--logit-std", self.logit_std, "logit_normal"),
            ("--mode-scale", self.mode_scale, "mode"),
        ):
            if value is not None and given != needs:
                raise UserError(f"{flag} only applies to --weighting-scheme {needs} (the scheme is {given})")
        if self.max_sequence_length is not None and not 1 <= self.max_sequence_length <= 512:
            raise UserError(
                f"--max-sequence-length must be in [1, 512] (T5 tokens per caption), got {self.max_sequence_length}"
            )

    def base_lr(self, ds: DsSettings) -> float:
        return self.lr if self.lr is not None else base_lr_of(ds.raw)

    def lr_choice(self, ds: DsSettings) -> LrChoice:
        """The one rule (sdzero.config.lr_rule); its cap warning is issued once per process."""
        reference = self.lr_reference_batch or reference_batch(ds.raw, ds.world_size)
        choice = choose_lr(self.base_lr(ds), ds.global_batch, reference, self.lr_scaling)
        if choice.warning:
            warnings.warn(choice.warning, UserWarning, stacklevel=2)
        return choice

    def effective_lr(self, ds: DsSettings) -> float:
        return self.lr_choice(ds).lr


MAX_RESOLUTION = 8192
"""Eight times the largest native side of a supported family (SDXL and SD3: 1024): above any real fine-tune,
below the sizes whose first batch alone exhausts a machine (100000 was accepted; the kernel killed the run)."""
MAX_SEED = 2**32 - 1
"""numpy's RandomState takes seeds in [0, 2**32): the widest range every seeded library accepts."""


def check_resolution(resolution: int | None, flag: str = "--resolution") -> None:
    if resolution is not None and (resolution < 8 or resolution % 8 or resolution > MAX_RESOLUTION):
        raise UserError(
            f"{flag} must be a multiple of 8 between 8 and {MAX_RESOLUTION} pixels, got {resolution}"
        )


def check_output_dir(output_dir: Path, flag: str = "--output-dir") -> None:
    """The folder, or the nearest part of its path that exists, must be a folder: a file there would
    otherwise surface as a traceback from the first write, after the process group started."""
    for part in (output_dir, *output_dir.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                what = "is" if part == output_dir else f"is under {part}, which is"
                raise UserError(f"{flag} {output_dir} {what} a file, not a folder; choose another {flag}")
            return


def check_model_folder(local: Path, model: str) -> None:
    """A local --model has a model_index.json holding a JSON object: every reader of it (family detection,
    the cache, export) assumes one, and a list or non-UTF-8 bytes would end in a traceback there."""
    index = local / "model_index.json"
    pipeline = "pass a diffusers pipeline folder (for example one written by `sdzero tiny-model`) or a hub id"
    if not index.is_file():
        raise UserError(f"--model {model}: folder has no model_index.json; {pipeline}")
    try:
        raw = json.loads(read_user_bytes(index, f"--model {model}:").decode("utf-8"))
    except (
        OSError,
        ValueError,
        RecursionError,
    ) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise UserError(f"--model {model}: model_index.json is unreadable ({first}); {pipeline}") from None
    if not isinstance(raw, dict):
        raise UserError(
            f"--model {model}: model_index.json is a JSON {type(raw).__name__}, not an object; {pipeline}"
        )


def check_keep_last(keep_last: int) -> None:
    """K = 1 is refused: a resume must be able to fall back when the newest checkpoint turns out damaged
    (a truncated shard, a bad disk block), and with one checkpoint kept there is nothing to fall back to."""
    if keep_last == 1 or keep_last < 0:
        raise UserError(
            f"--keep-last {keep_last}: keep at least 2 checkpoints (or 0 for all); with only one, a damaged "
            "newest checkpoint leaves nothing to resume from"
        )


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argv parser, generated from the option groups (sdzero.config.options)."""
    p = argv_parser(
        TRAIN_GROUPS,
        prog="sdzero/train.py",
        description="Fine-tune a Stable Diffusion UNet under DeepSpeed ZeRO. Launch with `deepspeed`.",
    )
    # Set by the deepspeed launcher; the rank is read from the environment instead.
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p


def parse_train_args(argv: list[str] | None = None) -> TrainConfig:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    values.pop("local_rank", None)
    return TrainConfig(**values)


def given_train_options(argv: list[str] | tuple[str, ...], what: str) -> dict[str, str]:
    """The trainer options `argv` sets, as {dest: the spelling used}, checked by the trainer's own parser
    (unknown options, bad values and invalid choices are refused as `sdzero/train.py` would refuse them).
    The required options are not required here: the caller (the advisor) sets those itself."""
    parser = build_parser()
    for action in parser._actions:  # only what argv sets lands in the namespace
        action.default, action.required = argparse.SUPPRESS, False

    def refuse(message: str) -> typing.NoReturn:
        raise UserError(f"{what}: {message} (see `python sdzero/train.py --help`)")

    parser.error = refuse  # type: ignore[method-assign]
    given = vars(parser.parse_args(list(argv)))
    spelled: dict[str, str] = {}
    for arg in argv:
        action = parser._option_string_actions.get(arg.split("=", 1)[0])
        if action is not None and action.dest in given:
            spelled.setdefault(action.dest, arg.split("=", 1)[0])
    return {dest: spelled.get(dest, "--" + dest.replace("_", "-")) for dest in given}
