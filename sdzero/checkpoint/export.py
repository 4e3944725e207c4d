"""Writing the trained network in diffusers format (safetensors), with the frozen parts beside it: a
StableDiffusionPipeline, StableDiffusionXLPipeline or StableDiffusion3Pipeline folder, by the model's family.

Under ZeRO-3 the engine's module holds empty placeholders: calling `save_pretrained` on it writes near-
empty files (accelerate#2294). The weights are consolidated first by DeepSpeed itself: layer by layer from
the live engine (`--export-final`), or from a checkpoint's shards with DeepSpeed's zero_to_fp32 utilities
(`sdzero export`), which hold about two fp32 copies of the trained network in host memory (DeepSpeed#1062).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdzero.atomic import publish_dir
from sdzero.checkpoint.adapter import is_lora_checkpoint
from sdzero.checkpoint.manifest import load_manifest
from sdzero.checkpoint.safe_load import guarded_loads, inside, load_tensors
from sdzero.config.output_folder import EXPORT_MARKER, check_replaceable_folder
from sdzero.errors import UserError

log = logging.getLogger("sdzero.checkpoint.export")


def gathered_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """The full weights on rank 0 (None elsewhere). A collective under ZeRO-3: every rank must call it."""
    if engine.zero_optimization_partition_weights():
        # Gathers one layer at a time onto rank 0, so no rank ever holds two full copies.
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict() if dist.get_rank() == 0 else None
    if state is None:
        return None
    return {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}


def network_from_state(config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype, cls: Any):
    """The trained network (a UNet, or SD3's transformer: `cls`) rebuilt from its config and `state`."""
    net = cls.from_config(config)
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"export: state dict does not fit the {cls.__name__} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    # A network built from its config is fp32 already; `.to` only when a cast is needed (diffusers warns on it).
    return net if dtype == torch.float32 else net.to(dtype)


def build_pipeline(comps: Any, trained: torch.nn.Module, scheduler: Any = None) -> Any:
    """The family's diffusers pipeline around `trained` and the frozen parts of `comps` (loaded if a cache
    run skipped them). `scheduler` defaults to a fresh one of the pipeline's own sampler class."""
    from sdzero.models.loading import ensure_frozen, sampling_scheduler

    # Beside the trained network: on the rank's device for validation, on the CPU for an export.
    ensure_frozen(comps, next(trained.parameters()).device)
    scheduler = scheduler if scheduler is not None else sampling_scheduler(comps)
    return comps.family.build_pipeline(comps, trained, scheduler)


def frozen_parts_for_export(comps: Any) -> Any:
    """A view of `comps` whose VAE and text encoders are fresh fp32 CPU copies from `comps.model`.

    The loaded ones are in the training precision (bf16 weights rounded from the fp32 originals) and may
    sit on a GPU; an export casts from the originals instead, so an fp32 export holds them unchanged.
    """
    from sdzero.models.loading import ensure_frozen

    fresh = dataclasses.replace(
        comps, compute="fp32", vae=None, **{name: None for name in comps.family.text_encoders}
    )
    return ensure_frozen(fresh, "cpu")


def write_pipeline(
    out: Path,
    network_state: dict[str, torch.Tensor],
    comps: Any,
    dtype: torch.dtype = torch.float32,
    extra_unets: dict[str, dict[str, torch.Tensor]] | None = None,
    marker: dict[str, Any] | None = None,
) -> Path:
    """A complete pipeline folder of the model's family: the trained network from `network_state` (the
    UNet, or SD3's transformer) plus the frozen parts, every component in `dtype`.

    One dtype for all: diffusers loads its models as fp32 and transformers loads text encoders in the dtype
    they were saved in, so a bf16 UNet beside fp32 encoders (or the reverse) fails at the first matmul of
    `from_pretrained(out)`. An fp32 export loads and generates with no arguments; a bf16/fp16 one wants
    `torch_dtype=` at load time.

    `extra_unets` (e.g. {"unet_ema": state}) are written as further folders beside it, "unet" in the name
    becoming the family's folder ("transformer_ema" for SD3); the pipeline's model_index.json does not list
    them, so `from_pretrained(out)` loads the trained network and ignores them.

    The folder holds EXPORT_MARKER (with `marker` in it): what `sdzero export --overwrite` requires of a
    folder before it replaces one.
    """
    out = Path(out)
    # Only an export is ever replaced (a user's `final/` in a run folder was once deleted by --export-final).
    check_replaceable_folder(out, EXPORT_MARKER, "a pipeline sdzero exported")
    cls, config = type(comps.network), comps.network.config
    trained = network_from_state(config, network_state, dtype, cls)
    pipe = build_pipeline(frozen_parts_for_export(comps), trained)
    pipe.to(dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        for name, state in (extra_unets or {}).items():
            folder = name.replace("unet", comps.family.subfolder, 1)
            network_from_state(config, state, dtype, cls).save_pretrained(
                tmp / folder, safe_serialization=True
            )
        mark = {"written_by": "sdzero", "dtype": str(dtype).removeprefix("torch."), **(marker or {})}
        (tmp / EXPORT_MARKER).write_text(json.dumps(mark, indent=1) + "\n")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@dataclass(frozen=True)
class ExportResult:
    out: Path
    checkpoint: Path
    step: int
    with_ema: bool


def consolidated_weights(path: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """Full fp32 weights from one checkpoint's shards, by DeepSpeed's own zero_to_fp32 (ZeRO 1-3).

    Only the files the manifest lists are read, weights-only (sdzero.checkpoint.safe_load): zero_to_fp32
    globs the folder and calls torch.load(weights_only=False) itself, so it runs inside the guard."""
    files = load_manifest(path).files
    if zero_stage == 0:
        # No partitions: the module's full state sits in DeepSpeed's model file.
        name = "mp_rank_00_model_states.pt"
        if name not in files:
            raise UserError(f"{path}: the manifest does not list {name}; not a ZeRO stage 0 checkpoint")
        states = load_tensors(path / name)
        module = states.get("module") if isinstance(states, dict) else None
        if not isinstance(module, dict) or not all(isinstance(v, torch.Tensor) for v in module.values()):
            raise UserError(
                f"{path / name}: holds no module state dict of tensors; not a DeepSpeed checkpoint"
            )
        return {k: v.float() for k, v in module.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    quiet = io.StringIO()  # it prints a line and a progress bar per shard
    with (
        guarded_loads(inside(path, files)),
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
    ):
        try:
            state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
        except (
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            IndexError,
            OSError,
            NotImplementedError,
        ) as exc:
            # Its own checks (shard counts, stage, padding) are ValueErrors, and a state dict missing a
            # key its reader expects a KeyError: each a traceback for a checkpoint a user cannot fix.
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"{path}: DeepSpeed's zero_to_fp32 cannot consolidate this checkpoint ({first}); export "
                "another one (pass its folder, or the run folder for the newest complete one)"
            ) from None
    return {k: v.contiguous() for k, v in state.items()}


def check_export_target(source: Path, checkpoint: Path | None, out: Path, overwrite: bool) -> None:
    """OUT must be a folder apart from what it is exported from, and --overwrite may replace only an export.

    `sdzero export RUN RUN --overwrite` once deleted the run's checkpoints and metrics: OUT equal to, inside
    or holding the source (or the chosen checkpoint), compared after resolving symlinks, is refused."""
    if out.exists() and not out.is_dir():
        raise UserError(
            f"{out} is a file, not a folder; choose a folder for the pipeline (it is left as it is)"
        )
    target = out.resolve()
    for protected in filter(None, (source, checkpoint)):
        real = Path(protected).resolve()
        if target == real or target.is_relative_to(real) or real.is_relative_to(target):
            how = "is" if target == real else "is inside" if target.is_relative_to(real) else "holds"
            raise UserError(
                f"{out} {how} {protected}, which the export reads; choose a folder outside it (nothing was "
                "written)"
            )
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"{out} exists and is not empty; choose a new folder or pass --overwrite")
        if not (out / EXPORT_MARKER).is_file():
            raise UserError(
                f"{out} is not a pipeline sdzero exported (it has no {EXPORT_MARKER}); --overwrite replaces "
                "only those: choose a new folder, or remove it yourself"
            )


def located_for_export(
    source: Path, out: Path, dtype: str | None = None, overwrite: bool = False
) -> tuple[Path, Any]:
    """The checkpoint `sdzero export` writes (the newest complete, verified one in `source`) and its
    manifest, once OUT and --dtype are known to be acceptable."""
    from sdzero.checkpoint.checkpointer import check_ema_files, first_verified, locate, verify_files
    from sdzero.models.loading import DTYPES

    check_export_target(Path(source), None, out, overwrite)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    candidates, _ = locate(Path(source))
    if not candidates:
        raise UserError(
            f"{source}: no complete checkpoint (no folder with a valid manifest.json) found there"
        )
    chosen = first_verified(candidates, lambda p, m: verify_files(p, m), log.warning)
    if chosen is None:
        raise UserError(f"{source}: every checkpoint there is damaged (see the warnings above)")
    path, manifest = chosen
    check_export_target(Path(source), path, out, overwrite)
    check_ema_files(path, manifest)
    return path, manifest


def export_checkpoint(
    source: Path, out: Path, model: str | None = None, dtype: str | None = None, overwrite: bool = False
) -> ExportResult:
    """`sdzero export`: a checkpoint (or the newest complete one in a folder / run) -> diffusers pipeline;
    a LoRA checkpoint's adapter (`sdzero export --merged`: sdzero.checkpoint.lora_export)."""
    from sdzero.checkpoint.checkpointer import EMA_DIR, ema_errors_as_user_errors
    from sdzero.models.ema import assemble
    from sdzero.models.loading import DTYPES, load_components

    out = Path(out)
    path, manifest = located_for_export(source, out, dtype, overwrite)
    if is_lora_checkpoint(manifest.files):  # a LoRA run's: its adapter, not a pipeline (checkpoint.adapter)
        return export_lora(path, manifest, out)
    model = model or manifest.model
    try:
        # The frozen parts are loaded by write_pipeline, in fp32, then cast with the rest to `dtype`.
        comps = load_components(model, "fp32", "cpu", frozen=False)
    except UserError as exc:
        raise UserError(f"{exc}; pass --model with the pipeline the run trained from") from exc
    # Recorded in the exported scheduler's config (SD3 has none: flow matching).
    comps.family.resolve_prediction_type(comps.noise_scheduler, manifest.prediction_type)
    weights = consolidated_weights(path, manifest.zero_stage)
    extra = None
    if manifest.ema:
        with ema_errors_as_user_errors(path):
            ema_state, _ = assemble(path / EMA_DIR)
        extra = {"unet_ema": ema_state}
    marker = {"checkpoint": str(path.resolve()), "step": manifest.step}
    write_pipeline(out, weights, comps, DTYPES[dtype or "fp32"], extra_unets=extra, marker=marker)
    return ExportResult(out=out, checkpoint=path, step=manifest.step, with_ema=extra is not None)


def export_lora(path: Path, manifest: Any, out: Path) -> ExportResult:
    """`sdzero export` of a LoRA checkpoint: its verified adapter file and, with an EMA, the EMA's adapter."""
    from sdzero.checkpoint.adapter import ADAPTER_DIR, checkpoint_lora_config, write_adapter_export
    from sdzero.checkpoint.checkpointer import EMA_DIR, ema_errors_as_user_errors
    from sdzero.models.ema import assemble
    from sdzero.models.families import family_named
    from sdzero.models.lora import LORA_WEIGHTS

    family = family_named(manifest.family)
    ema_state = None
    if manifest.ema:
        with ema_errors_as_user_errors(path):
            ema_state, _ = assemble(path / EMA_DIR)
    config = checkpoint_lora_config(manifest.objective, family)
    marker = {"checkpoint": str(path.resolve()), "step": manifest.step}
    adapter = path / ADAPTER_DIR / LORA_WEIGHTS
    write_adapter_export(out, family, config, adapter, ema_state, marker)
    return ExportResult(out=out, checkpoint=path, step=manifest.step, with_ema=ema_state is not None)
