"""Writing the trained network in diffusers format (safetensors), with the frozen parts beside it.

Under ZeRO-3 the engine's module holds empty placeholders: calling `save_pretrained` on it writes near-
empty files (accelerate#2294). The weights are consolidated first, layer by layer, by DeepSpeed itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


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


def atomic_publish(tmp: Path, out: Path) -> None:
    """Replace `out` with the finished folder `tmp`; the old `out` is removed only after the move."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_pipeline(out: Path, unet_state: dict[str, torch.Tensor], comps: Any, dtype: torch.dtype) -> Path:
    """A complete pipeline folder: the trained UNet from `unet_state` plus the frozen parts as loaded."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    unet = UNet2DConditionModel.from_config(comps.unet.config)
    missing, unexpected = unet.load_state_dict(unet_state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"export: state dict does not fit the UNet (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    pipe = StableDiffusionPipeline(
        vae=comps.vae,
        text_encoder=comps.text_encoder,
        tokenizer=comps.tokenizer,
        unet=unet.to(dtype),
        scheduler=comps.noise_scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        atomic_publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
