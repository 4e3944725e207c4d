"""What a micro-step feeds the trained network: latents and text conditioning, either encoded online from
pixels and tokens by the frozen VAE and the family's text encoders, or read from a latent cache
(sdzero.data.cache). The data worker only produces tensors; encoding happens here, on the rank's device."""

from __future__ import annotations

import torch

from sdzero.models.families import Components
from sdzero.models.loading import encode_latents

COND_PREFIX = "cond."
"""Batch keys of cached text conditioning: `cond.encoder_hidden_states`, `cond.pooled_prompt_embeds`, ..."""


def is_cached(batch: dict[str, torch.Tensor]) -> bool:
    return "latent_mean" in batch


def latents_from_posterior(comps: Components, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The posterior sample `mean + std * latent_eps`, shifted and scaled, in the same dtype and order of
    operations as `models.encode_latents`, so cached and online latents agree to the last bit when the
    VAE's outputs do."""
    mean, std = batch["latent_mean"], batch["latent_std"]
    # Python floats (from the VAE's config, which a cached run reads without loading the VAE) keep the
    # arithmetic in the posterior's dtype, as the online path does.
    shift, scale = comps.latent_shift_factor, comps.latent_scaling_factor
    latents = mean + std * batch["latent_eps"].to(mean.dtype)
    return ((latents - shift) * scale).float()


def encode_batch(
    comps: Components, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(latents, text conditioning by name) for a micro-batch already on the device."""
    if is_cached(batch):
        cond = {k[len(COND_PREFIX) :]: v for k, v in batch.items() if k.startswith(COND_PREFIX)}
        return latents_from_posterior(comps, batch), cond
    latents = encode_latents(comps.vae, batch["pixel_values"], batch["latent_eps"])
    return latents, comps.family.encode_prompts(comps, batch)
