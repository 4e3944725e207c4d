"""What one training sample costs the trained network, in floating-point operations, counted on this machine.

One forward and one backward pass of the trained network (the UNet, or SD3's transformer) at micro-batch 1
and the run's resolution, built on the meta device (no weights, no arithmetic: shapes only) and counted
with torch's own `torch.utils.flop_counter.FlopCounterMode`. The count is the same for every ZeRO stage
and precision: what differs between configs is communication and memory, not the network's arithmetic.
With --gradient-checkpointing the backward pass recomputes the forward, so the forward is counted twice.

A target's compute per sample is then this count over the target's sustained rate (advisor.model.target_compute).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COUNTED_WITH = (
    "torch.utils.flop_counter.FlopCounterMode, one forward + backward at micro-batch 1, meta device"
)
SD3_CLIP_TOKENS = 77
"""SD3 conditions on 77 CLIP tokens joined to the T5 tokens (diffusers' SD3 pipeline)."""


@dataclass(frozen=True)
class ModelCost:
    """FLOPs per sample of one training step's network passes."""

    forward_flops: float
    backward_flops: float
    resolution: int
    """Pixels per side the count is for."""
    recompute: bool = False
    """Gradient checkpointing: the forward runs again inside the backward."""
    counted_with: str = COUNTED_WITH
    kernels: int = 0
    """Operators of one forward + backward that launch work (views and aliases left out): on a GPU each is a
    kernel launch, a cost per micro-step whatever its size (advisor.model.target_compute.LAUNCH_S)."""

    @property
    def flops_per_sample(self) -> float:
        return self.forward_flops * (2 if self.recompute else 1) + self.backward_flops

    @property
    def forward_share(self) -> float:
        """The forward pass's share of a micro-step's arithmetic (the overlap account's first window)."""
        return self.forward_flops / self.flops_per_sample

    def describe(self) -> str:
        again = ", forward counted twice (gradient checkpointing)" if self.recompute else ""
        return (
            f"{self.flops_per_sample / 1e12:.3g} TFLOP per sample at {self.resolution} px (forward "
            f"{self.forward_flops / 1e12:.3g}, backward {self.backward_flops / 1e12:.3g}{again}; {self.counted_with})"
        )

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> ModelCost | None:
        if not record:
            return None
        return cls(**{k: record[k] for k in cls.__dataclass_fields__ if k in record})


def network_inputs(config: Any, latent: int, text_tokens: int) -> dict[str, Any]:
    """Dummy inputs of micro-batch 1 for the network whose config this is (on the current device)."""
    import torch

    channels = int(config.in_channels)
    sample = torch.randn(1, channels, latent, latent)
    timestep = torch.tensor([500])
    if hasattr(config, "joint_attention_dim"):  # SD3's MMDiT
        return {
            "hidden_states": sample,
            "encoder_hidden_states": torch.randn(1, text_tokens, int(config.joint_attention_dim)),
            "pooled_projections": torch.randn(1, int(config.pooled_projection_dim)),
            "timestep": timestep,
        }
    inputs: dict[str, Any] = {
        "sample": sample,
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(1, text_tokens, int(config.cross_attention_dim)),
    }
    if getattr(config, "addition_embed_type", None) == "text_time":  # SDXL: pooled text and 6 time ids
        time_dim = int(config.addition_time_embed_dim)
        pooled = int(config.projection_class_embeddings_input_dim) - 6 * time_dim
        inputs["added_cond_kwargs"] = {"text_embeds": torch.randn(1, pooled), "time_ids": torch.randn(1, 6)}
    return inputs


def count_network(
    net_class: Any, config: dict[str, Any], latent: int, text_tokens: int
) -> tuple[float, float, tuple[int, ...], int]:
    """(forward, backward) FLOPs of one sample through a network built from `config` on the meta device,
    its trained parameter sizes, and the kernels one forward + backward launches."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        net = net_class.from_config(config)
        inputs = network_inputs(net.config, latent, text_tokens)
        with KernelCounter() as kernels:
            with FlopCounterMode(display=False) as forward:
                out = net(**inputs, return_dict=False)[0]
            with FlopCounterMode(display=False) as backward:
                out.float().sum().backward()
    numels = tuple(int(p.numel()) for p in net.parameters() if p.requires_grad)
    return float(forward.get_total_flops()), float(backward.get_total_flops()), numels, kernels.count


class KernelCounter:
    """Counts the operators dispatched inside it that are not views (a view launches no kernel)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if not getattr(func, "is_view", False):
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self._mode = _Mode()

    def __enter__(self) -> KernelCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def count_model_cost(model: str | Path, train_args: tuple[str, ...] = ()) -> ModelCost:
    """The trained network of a diffusers pipeline folder at the resolution the trials ran (--resolution in
    the trainer options, else the model's native size)."""
    from diffusers import AutoencoderKL

    from sdzero.models.families import DEFAULT_MAX_SEQUENCE_LENGTH, detect_family

    family = detect_family(str(model))
    cls = family.network_class()
    config = cls.load_config(str(model), subfolder=family.subfolder)
    vae = AutoencoderKL.load_config(str(model), subfolder="vae")
    scale = 2 ** (len(vae["block_out_channels"]) - 1)
    resolution = _option(train_args, "--resolution") or int(config["sample_size"]) * scale
    if "joint_attention_dim" in config:
        tokens = SD3_CLIP_TOKENS + (
            _option(train_args, "--max-sequence-length") or DEFAULT_MAX_SEQUENCE_LENGTH
        )
    else:
        tokens = DEFAULT_MAX_SEQUENCE_LENGTH
    forward, backward, _, kernels = count_network(cls, dict(config), resolution // scale, tokens)
    return ModelCost(forward, backward, resolution, "--gradient-checkpointing" in train_args, kernels=kernels)


def _option(args: tuple[str, ...], flag: str) -> int | None:
    """The last value of an integer option in the trainer's words ('--resolution 512' or '--resolution=512')."""
    value = None
    for i, word in enumerate(args):
        if word == flag and i + 1 < len(args):
            value = args[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return int(value) if value is not None else None
