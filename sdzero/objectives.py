"""Denoising objectives: what the network is asked to predict and how each sample's loss is weighted.

DDPM families (SD, SDXL): epsilon or v targets, Min-SNR weights. SD3: flow matching with the timestep
densities and loss weights of diffusers.training_utils (the SD3 paper's schemes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.training_utils import (
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
    compute_snr,
)

from sdzero.config import FlowSettings


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


def sdxl_added_cond(
    cond: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """SDXL's micro-conditioning: the pooled text embedding and six numbers per sample, (original height,
    width, crop top, left, target height, width), which the UNet embeds like timesteps."""
    time_ids = torch.cat([batch["original_size"], batch["crop_top_left"], batch["target_size"]], dim=1)
    return {"text_embeds": cond["pooled_prompt_embeds"].to(dtype), "time_ids": time_ids.to(dtype)}


def flow_u(flow: FlowSettings, generator: torch.Generator) -> float:
    """One sample's draw from the timestep density of `flow.weighting_scheme` (diffusers' own sampler),
    in [0, 1]; the sample's generator makes it a function of (seed, epoch, index)."""
    u = compute_density_for_timestep_sampling(
        weighting_scheme=flow.weighting_scheme,
        batch_size=1,
        logit_mean=flow.logit_mean,
        logit_std=flow.logit_std,
        mode_scale=flow.mode_scale,
        generator=generator,
    )
    return float(u[0])


def flow_timesteps(scheduler: Any, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, sigmas) for draws `u`, as diffusers' SD3 scripts pick them: index u * N into the training
    schedule (shift already applied by FlowMatchEulerDiscreteScheduler). The schedule must be the one the
    scheduler holds before any `set_timesteps` (validation samples with a copy)."""
    n = int(scheduler.config.num_train_timesteps)
    index = (u.detach().float() * n).long().clamp(0, n - 1)  # u == 1.0 would index past the end
    # The schedule (1000 values) goes to u's device, not u to the CPU: reading a GPU tensor back would
    # wait for every kernel queued before it, once per micro-step.
    return scheduler.timesteps.to(index.device)[index], scheduler.sigmas.to(index.device)[index]


def flow_matching_loss(
    model: Callable[..., Any],
    model_dtype: torch.dtype,
    scheduler: Any,
    latents: torch.Tensor,
    cond: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    flow: FlowSettings,
) -> torch.Tensor:
    """SD3's rectified-flow objective: x_s = (1 - s) x + s noise, the network predicts the velocity
    noise - x; with `precondition_outputs` its output is turned into an x estimate (x_s - s v) and
    compared with x, as diffusers' SD3 scripts do. Per-sample weights from compute_loss_weighting_for_sd3."""
    noise = batch["noise"]
    timesteps, sigmas = flow_timesteps(scheduler, batch["flow_u"])
    timesteps = timesteps.to(latents.device)
    sigmas = sigmas.to(latents.device, torch.float32).view(-1, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    pred = model(
        hidden_states=noisy.to(model_dtype),
        timestep=timesteps,
        encoder_hidden_states=cond["encoder_hidden_states"].to(model_dtype),
        pooled_projections=cond["pooled_prompt_embeds"].to(model_dtype),
        return_dict=False,
    )[0].float()
    if flow.precondition_outputs:
        pred, target = pred * (-sigmas) + noisy, latents
    else:
        target = noise - latents
    weighting = compute_loss_weighting_for_sd3(flow.weighting_scheme, sigmas).float()
    per_sample = (weighting * (pred - target.float()) ** 2).reshape(latents.shape[0], -1).mean(dim=1)
    return per_sample.mean()


def denoising_loss(
    model: Callable[..., Any],
    model_dtype: torch.dtype,
    scheduler: Any,
    latents: torch.Tensor,
    cond: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    prediction_type: str,
    snr_gamma: float | None,
    family: str = "sd",
    flow: FlowSettings | None = None,
) -> torch.Tensor:
    """One micro-batch's loss: noise the latents with the sample's own noise and timestep, predict, compare.

    `cond` is the text conditioning by name (models.encode_prompts, or a cache); `batch` carries the
    per-sample randomness (`noise`, `timestep`, SD3's `flow_u`) and SDXL's size/crop inputs.
    """
    if family == "sd3":
        if flow is None:
            raise ValueError("SD3 trains by flow matching: pass its FlowSettings")
        return flow_matching_loss(model, model_dtype, scheduler, latents, cond, batch, flow)
    timesteps, noise = batch["timestep"], batch["noise"]
    noisy = scheduler.add_noise(latents, noise, timesteps)
    text = cond["encoder_hidden_states"].to(model_dtype)
    extra = {"added_cond_kwargs": sdxl_added_cond(cond, batch, model_dtype)} if family == "sdxl" else {}
    pred = model(noisy.to(model_dtype), timesteps, text, return_dict=False, **extra)[0]
    target = training_target(scheduler, prediction_type, latents, noise, timesteps)
    return diffusion_loss(pred, target, timesteps, scheduler, prediction_type, snr_gamma)
