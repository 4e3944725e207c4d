"""Helpers for the LoRA tests: the trained network rebuilt from a DeepSpeed checkpoint, and inputs that
drive one forward of each family's network."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sdzero.checkpoint.export import consolidated_weights
from sdzero.models.families import detect_family
from sdzero.models.lora import LoraSettings, add_lora


def lora_settings(rank: int, family: Any, alpha: float | None = None) -> LoraSettings:
    cfg = type(
        "Cfg", (), {"lora_rank": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "lora_target_modules": []}
    )
    settings = LoraSettings.of(cfg, family)
    assert settings is not None
    return settings


def trained_network(model: Path, checkpoint: Path, stage: int, rank: int, alpha: float | None = None):
    """The network as the run trained it: the base from the model folder (a LoRA checkpoint leaves the
    frozen base out) + adapters whose weights come from DeepSpeed's own consolidation of the checkpoint
    (zero_to_fp32), independent of sdzero's adapter writer."""
    family = detect_family(str(model))
    net = family.network_class().from_pretrained(str(model), subfolder=family.subfolder)
    add_lora(net, lora_settings(rank, family, alpha))
    saved = consolidated_weights(checkpoint, stage)
    missing, unexpected = net.load_state_dict(saved, strict=False)
    adapters = {n for n, p in net.named_parameters() if p.requires_grad}
    assert not unexpected and adapters <= set(saved), (unexpected[:3], sorted(adapters - set(saved))[:3])
    return net.eval()


def network_inputs(network: torch.nn.Module, family: Any, seed: int = 0) -> dict[str, Any]:
    """One sample's inputs for the family's network, sized from its config."""
    g = torch.Generator().manual_seed(seed)
    c = network.config
    size = int(c.sample_size)
    sample = torch.randn(1, int(c.in_channels), size, size, generator=g)
    t = torch.tensor([500.0])
    if family.network_attr == "transformer":
        return {
            "hidden_states": sample,
            "encoder_hidden_states": torch.randn(1, 8, int(c.joint_attention_dim), generator=g),
            "pooled_projections": torch.randn(1, int(c.pooled_projection_dim), generator=g),
            "timestep": t,
        }
    inputs: dict[str, Any] = {
        "sample": sample,
        "timestep": t,
        "encoder_hidden_states": torch.randn(1, 8, int(c.cross_attention_dim), generator=g),
    }
    if c.addition_embed_type == "text_time":
        text = int(c.projection_class_embeddings_input_dim) - 6 * int(c.addition_time_embed_dim)
        inputs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(1, text, generator=g),
            "time_ids": torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]),
        }
    return inputs


@torch.no_grad()
def output_of(network: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    return network(**inputs, return_dict=False)[0].float()
