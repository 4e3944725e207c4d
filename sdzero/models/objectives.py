"""Denoising objectives: what the network is asked to predict and how each sample's loss is weighted.

DDPM families (SD, SDXL): epsilon or v targets, Min-SNR weights. SD3: flow matching with the loss weights
of diffusers.training_utils (the SD3 paper's schemes). Which family uses which, and the network inputs
each adds, is the family's business (sdzero.models.families); the per-sample draws these read (`noise`,
`timestep`, `flow_u`) come with the micro-batch's StepInput from the data worker (sdzero.data.images).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sdzero.models.step_input import PromptEmbeds, StepInput


@dataclass(frozen=True)
class FlowSettings:
    """SD3 flow matching: how timesteps are drawn and weighted (diffusers' SD3 defaults)."""

    weighting_scheme: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    precondition_outputs: bool = False
    """Turn the velocity prediction into an x0 estimate and compare it with the latents (EDM-style)."""

    @classmethod
    def from_config(cls, cfg: Any) -> FlowSettings:
        """SD3's flow-matching settings from the run options (a TrainConfig), defaults filled in."""
        defaults = cls()
        return cls(
            weighting_scheme=cfg.weighting_scheme or defaults.weighting_scheme,
            logit_mean=defaults.logit_mean if cfg.logit_mean is None else cfg.logit_mean,
            logit_std=defaults.logit_std if cfg.logit_std is None else cfg.logit_std,
            mode_scale=defaults.mode_scale if cfg.mode_scale is None else cfg.mode_scale,
            precondition_outputs=cfg.precondition_outputs,
        )


@dataclass(frozen=True)
class Objective:
    """What a run trains towards, resolved once at start-up (Family.objective)."""

    prediction_type: str
    """"epsilon" or "v_prediction" (DDPM families), "flow_matching" (SD3)."""
    snr_gamma: float | None = None
    """Min-SNR-gamma weighting (DDPM only); None: plain MSE."""
    flow: FlowSettings | None = None
    """SD3's timestep density and loss weighting."""


@dataclass(frozen=True)
class LossInputs:
    """What one micro-batch's loss reads (Family.loss and the objectives below take it whole)."""

    model: Callable[..., Any]
    """The trained network as it is called: the DeepSpeed engine (or, in tests, a stand-in)."""
    model_dtype: torch.dtype
    """The network's parameter dtype: its inputs are cast to it."""
    scheduler: Any
    """The training noise schedule (DDPMScheduler, or SD3's FlowMatchEulerDiscreteScheduler)."""
    latents: torch.Tensor
    """The clean latents, float32 (sdzero.models.encoding.encode_batch)."""
    cond: PromptEmbeds
    """The text conditioning (Family.encode_prompts, or a cache)."""
    step: StepInput
    """The micro-batch itself: its noise, timesteps or flow draws, and SDXL's size/crop inputs."""


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
    from diffusers.training_utils import compute_snr  # diffusers is imported where a loss is formed

    snr = compute_snr(scheduler, timesteps)
    weights = torch.clamp(snr, max=snr_gamma)
    # The paper's weights are for an x0 loss; divide by what turns them into eps- or v-space weights.
    weights = weights / snr if prediction_type == "epsilon" else weights / (snr + 1)
    per_sample = F.mse_loss(model_pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    return (per_sample * weights).mean()


def flow_timesteps(scheduler: Any, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, sigmas) for draws `u`, as diffusers' SD3 scripts pick them: index u * N into the training
    schedule (shift already applied by FlowMatchEulerDiscreteScheduler). The schedule must be the one the
    scheduler holds before any `set_timesteps` (validation samples with a copy)."""
    n = int(scheduler.config.num_train_timesteps)
    index = (u.detach().float() * n).long().clamp(0, n - 1)  # u == 1.0 would index past the end
    timesteps, sigmas = schedule_on(scheduler, index.device)
    return timesteps[index], sigmas[index]


def schedule_on(scheduler: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's (timesteps, sigmas) on `device`, copied there once and kept on the scheduler.

    Not u to the CPU: reading a GPU tensor back waits for every kernel queued before it. Nor the schedule
    to the GPU at every call: a copy from pageable host memory is synchronous, one device sync per
    micro-step. The copy is remade when the scheduler's schedule is replaced (`set_timesteps`)."""
    source = (scheduler.timesteps, scheduler.sigmas)
    kept = getattr(scheduler, "_sdzero_schedule_on", {}).get(device)
    if kept is not None and kept[0] is source[0] and kept[1] is source[1]:
        return kept[2], kept[3]
    timesteps, sigmas = source[0].to(device), source[1].to(device)
    copies = {**getattr(scheduler, "_sdzero_schedule_on", {}), device: (*source, timesteps, sigmas)}
    scheduler._sdzero_schedule_on = copies
    return timesteps, sigmas


def flow_matching_loss(inputs: LossInputs, flow: FlowSettings) -> torch.Tensor:
    """SD3's rectified-flow objective: x_s = (1 - s) x + s noise, the network predicts the velocity
    noise - x; with `precondition_outputs` its output is turned into an x estimate (x_s - s v) and
    compared with x, as diffusers' SD3 scripts do. Per-sample weights from compute_loss_weighting_for_sd3."""
    model, model_dtype, latents, cond = inputs.model, inputs.model_dtype, inputs.latents, inputs.cond
    noise, flow_u = inputs.step.noise, inputs.step.flow_u
    if flow_u is None or cond.pooled_prompt_embeds is None:
        raise ValueError("flow matching needs each sample's flow_u draw and a pooled prompt embedding")
    timesteps, sigmas = flow_timesteps(inputs.scheduler, flow_u)
    timesteps = timesteps.to(latents.device)
    sigmas = sigmas.to(latents.device, torch.float32).view(-1, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    pred = model(
        hidden_states=noisy.to(model_dtype),
        timestep=timesteps,
        encoder_hidden_states=cond.encoder_hidden_states.to(model_dtype),
        pooled_projections=cond.pooled_prompt_embeds.to(model_dtype),
        return_dict=False,
    )[0].float()
    if flow.precondition_outputs:
        pred, target = pred * (-sigmas) + noisy, latents
    else:
        target = noise - latents
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weighting = compute_loss_weighting_for_sd3(flow.weighting_scheme, sigmas).float()
    per_sample = (weighting * (pred - target.float()) ** 2).reshape(latents.shape[0], -1).mean(dim=1)
    return per_sample.mean()


def ddpm_loss(
    inputs: LossInputs, objective: Objective, added_inputs: dict[str, Any] | None = None
) -> torch.Tensor:
    """The DDPM objective (SD, SDXL): noise the latents with each sample's own noise and timestep, predict
    epsilon or v, compare. `added_inputs` are the family's further network inputs (SDXL's
    `added_cond_kwargs`)."""
    scheduler, latents, model_dtype = inputs.scheduler, inputs.latents, inputs.model_dtype
    timesteps, noise = inputs.step.timestep, inputs.step.noise
    noisy = scheduler.add_noise(latents, noise, timesteps)
    text = inputs.cond.encoder_hidden_states.to(model_dtype)
    pred = inputs.model(noisy.to(model_dtype), timesteps, text, return_dict=False, **(added_inputs or {}))[0]
    target = training_target(scheduler, objective.prediction_type, latents, noise, timesteps)
    return diffusion_loss(pred, target, timesteps, scheduler, objective.prediction_type, objective.snr_gamma)
