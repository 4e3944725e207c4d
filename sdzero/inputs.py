"""What a micro-step feeds the trained network: latents and text conditioning, encoded online from pixels
and tokens by the frozen VAE and text encoders."""

from __future__ import annotations

import torch

from sdzero.models import Components, encode_latents, encode_prompts


def encode_batch(
    comps: Components, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(latents, text conditioning by name) for a micro-batch already on the device."""
    latents = encode_latents(comps.vae, batch["pixel_values"], batch["latent_eps"])
    return latents, encode_prompts(comps, batch)
