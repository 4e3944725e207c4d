"""Denoising objectives: what the network is asked to predict and how each sample's loss is weighted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.training_utils import compute_snr


def training_target(
    scheduler: Any, prediction_type: str, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"unknown prediction type {prediction_type!r}")


def diffusion_loss(
    model_pred: torch.Tensor,
    target: torch.Tensor,
    timesteps: torch.Tensor,
    scheduler: Any,
    prediction_type: str,
    snr_gamma: float | None,
) -> torch.Tensor:
    """Mean squared error in fp32, optionally with Min-SNR-gamma weights (Hang et al., 2023)."""
    if snr_gamma is None:
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    snr = compute_snr(scheduler, timesteps)
    weights = torch.clamp(snr, max=snr_gamma)
    # The paper's weights are for an x0 loss; divide by what turns them into eps- or v-space weights.
    weights = weights / snr if prediction_type == "epsilon" else weights / (snr + 1)
    per_sample = F.mse_loss(model_pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    return (per_sample * weights).mean()


def denoising_loss(
    model: Callable[..., Any],
    model_dtype: torch.dtype,
    scheduler: Any,
    latents: torch.Tensor,
    cond: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    prediction_type: str,
    snr_gamma: float | None,
) -> torch.Tensor:
    """One micro-batch's loss: noise the latents with the sample's own noise and timestep, predict, compare.

    `cond` is the text conditioning by name (models.encode_prompts, or a cache); `batch` carries the
    per-sample randomness (`noise`, `timestep`) and any family-specific inputs.
    """
    timesteps, noise = batch["timestep"], batch["noise"]
    noisy = scheduler.add_noise(latents, noise, timesteps)
    text = cond["encoder_hidden_states"].to(model_dtype)
    pred = model(noisy.to(model_dtype), timesteps, text, return_dict=False)[0]
    target = training_target(scheduler, prediction_type, latents, noise, timesteps)
    return diffusion_loss(pred, target, timesteps, scheduler, prediction_type, snr_gamma)
