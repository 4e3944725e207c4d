"""StepInputs made by hand, for unit tests that need a micro-batch but no dataset (the Trainer's loop, the
families' losses)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sdzero.models.step_input import LatentPosterior, PromptEmbeds, StepInput


def step_input(batch: int = 2, latent_shape: tuple[int, int, int] = (4, 8, 8), **given: Any) -> StepInput:
    """A micro-batch of `batch` samples with the fields `given`; every other field zeros of its shape.
    Cached (posterior and prompt embeddings) unless `pixel_values` is given."""
    latents = torch.zeros(batch, *latent_shape)
    sizes = torch.zeros(batch, 2, dtype=torch.long)
    fields: dict[str, Any] = {
        "noise": latents,
        "latent_eps": latents,
        "timestep": torch.zeros(batch, dtype=torch.long),
        "index": torch.arange(batch),
        "original_size": sizes,
        "crop_top_left": sizes,
        "target_size": sizes,
    }
    if "pixel_values" not in given:
        fields["posterior"] = LatentPosterior(latents, latents)
        fields["prompt_embeds"] = PromptEmbeds(torch.zeros(batch, 1, 8))
    return StepInput(**{**fields, **given})


def tensors_of(value: Any, name: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a StepInput (or a part of one) by its path (`noise`, `token_ids.0`,
    `posterior.mean`, ...): what two samples are compared on, field by field."""
    if isinstance(value, torch.Tensor):
        return {name: value}
    if isinstance(value, tuple):
        parts = {f"{name}.{k}": v for k, v in enumerate(value)}
    elif dataclasses.is_dataclass(value):
        parts = {f"{name}.{f.name}".lstrip("."): getattr(value, f.name) for f in dataclasses.fields(value)}
    else:
        return {}
    return {key: t for part, v in parts.items() for key, t in tensors_of(v, part).items()}
