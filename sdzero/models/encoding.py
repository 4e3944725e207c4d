"""What a micro-step feeds the trained network: latents and text conditioning, either encoded online from
pixels and tokens by the frozen VAE and the family's text encoders, or read from a latent cache
(sdzero.data.cache). The data worker only produces tensors (a `StepInput`); encoding happens here, on the
rank's device."""

from __future__ import annotations

import torch

from sdzero.models.families import Components
from sdzero.models.step_input import LatentPosterior, PromptEmbeds, StepInput


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Sample the VAE posterior with the per-sample `eps` (not the global RNG) so runs are reproducible."""
    posterior = vae.encode(pixels.to(vae.dtype)).latent_dist
    latents = posterior.mean + posterior.std * eps.to(posterior.mean.dtype)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((latents - shift) * vae.config.scaling_factor).float()


def latents_from_posterior(comps: Components, posterior: LatentPosterior, eps: torch.Tensor) -> torch.Tensor:
    """The posterior sample `mean + std * eps`, shifted and scaled, in the same dtype and order of
    operations as `encode_latents`, so cached and online latents agree to the last bit when the VAE's
    outputs do."""
    mean, std = posterior.mean, posterior.std
    # Python floats (from the VAE's config, which a cached run reads without loading the VAE) keep the
    # arithmetic in the posterior's dtype, as the online path does.
    shift, scale = comps.latent_shift_factor, comps.latent_scaling_factor
    latents = mean + std * eps.to(mean.dtype)
    return ((latents - shift) * scale).float()


@torch.no_grad()
def encode_text(text_encoder: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return text_encoder(input_ids)[0]


def encode_batch(comps: Components, batch: StepInput) -> tuple[torch.Tensor, PromptEmbeds]:
    """(latents, text conditioning) for a micro-batch already on the device."""
    if batch.cached:
        assert batch.posterior is not None and batch.prompt_embeds is not None  # StepInput checks it
        return latents_from_posterior(comps, batch.posterior, batch.latent_eps), batch.prompt_embeds
    assert batch.pixel_values is not None
    latents = encode_latents(comps.vae, batch.pixel_values, batch.latent_eps)
    return latents, comps.family.encode_prompts(comps, batch.token_ids)
