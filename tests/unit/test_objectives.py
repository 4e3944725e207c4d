"""Targets and Min-SNR weights against values computed independently from the noise schedule."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler

from sdzero.models.objectives import diffusion_loss, training_target


@pytest.fixture
def scheduler() -> DDPMScheduler:
    return DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012
    )


def test_targets(scheduler):
    torch.manual_seed(0)
    latents, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    t = torch.tensor([1, 500, 999])
    assert torch.equal(training_target(scheduler, "epsilon", latents, noise, t), noise)
    a = scheduler.alphas_cumprod[t].sqrt().view(-1, 1, 1, 1)
    s = (1 - scheduler.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
    v = training_target(scheduler, "v_prediction", latents, noise, t)
    torch.testing.assert_close(v, a * noise - s * latents)
    with pytest.raises(ValueError):
        training_target(scheduler, "sample_x0", latents, noise, t)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights(scheduler, prediction_type):
    torch.manual_seed(1)
    pred, target = torch.randn(4, 4, 8, 8), torch.randn(4, 4, 8, 8)
    t = torch.tensor([0, 100, 600, 999])
    gamma = 5.0
    alpha_bar = scheduler.alphas_cumprod[t]
    snr = alpha_bar / (1 - alpha_bar)
    weight = torch.minimum(snr, torch.full_like(snr, gamma))
    weight = weight / snr if prediction_type == "epsilon" else weight / (snr + 1)
    expected = (((pred - target) ** 2).mean(dim=(1, 2, 3)) * weight).mean()
    got = diffusion_loss(pred, target, t, scheduler, prediction_type, gamma)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    plain = diffusion_loss(pred, target, t, scheduler, prediction_type, None)
    torch.testing.assert_close(plain, ((pred - target) ** 2).mean())
    assert not torch.isclose(got, plain)


def test_loss_is_fp32_for_low_precision_predictions(scheduler):
    pred = torch.randn(2, 4, 8, 8).to(torch.bfloat16)
    loss = diffusion_loss(pred, torch.zeros(2, 4, 8, 8), torch.tensor([3, 4]), scheduler, "epsilon", None)
    assert loss.dtype == torch.float32
