"""A tiny diffusers UNet and the fast-path options the trainer reads, for the fast-path tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def tiny_unet():
    """A two-block SD 1.x-shaped UNet with cross-attention, small enough for a unit test's backward."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
    )


def fast_path_options(**kw) -> SimpleNamespace:
    """The trainer's fast-path options at their defaults, with `kw` changed."""
    base = {"tf32": True, "channels_last": False, "compile": False, "attention": "auto", "sync_timing": False}
    return SimpleNamespace(**{**base, **kw})
