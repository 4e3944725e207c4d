"""The target's compute when the trials ran on another device: FLOPs per sample over the target's rate.

A CPU is 100-1000x slower than a datacenter GPU, and not uniformly so, so its step times say how configs rank
and nothing about the target's absolute speed. The target's compute per sample is instead the model's FLOPs
per sample (advisor.model.model_cost, counted here) over a sustained rate per GPU, which is either:

- declared by the user (--target-tflops: sustained TFLOP/s per GPU on this kind of network), or
- anchored on a published per-GPU training throughput for a named model shape (GPU_ANCHORS): the rate is
  that throughput times the shape's FLOPs per sample, counted here the same way as the user's model's.

Both are labelled assumed: an anchor carries its utilisation over to another network shape, which holds only
as far as the two keep the GPU as busy. Without either, an answer for another device has no time, GPU-hours
or node count (ComputeBasis.kind == "none"). The same compute per sample is charged to every ZeRO stage:
they differ in communication and memory, which are costed on the target's links.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from advisor.model.gpu_catalogue import GPUS, Anchor
from advisor.model.model_cost import ModelCost, count_network
from sdzero.atomic import write_json_atomic

MEASURED, ASSUMED, PROFILE, NONE = "measured", "assumed", "profile", "none"
CACHE_VERSION = 2
"""What a cached shape entry holds (2: with its kernel count)."""
LAUNCH_S = 5e-6
"""Seconds a GPU kernel launch costs the host, whatever the kernel's size: 4-6 us measured through the CUDA
driver (susun-blog.com, "pegainfer (3): From Launch Overhead to CUDA Graph", 2025; PyTorch's own dispatch
adds to it, so this is a floor). A micro-step takes at least its kernels' launches: a small network is
bound by them, not by its FLOPs."""


@dataclass(frozen=True)
class ModelShape:
    """A published network's shape, to count its FLOPs with the same counter as the user's model."""

    class_name: str
    config: dict[str, Any]
    latent: int
    text_tokens: int
    source: str


SD2_BASE_UNET = ModelShape(
    "UNet2DConditionModel",
    {
        "sample_size": 64,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 2,
        "block_out_channels": [320, 640, 1280, 1280],
        "attention_head_dim": [5, 10, 20, 20],
        "cross_attention_dim": 1024,
        "use_linear_projection": True,
        "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
        "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    },
    64,
    77,
    "stabilityai/stable-diffusion-2-base unet/config.json (865.9M parameters), 512 px = 64 x 64 latent",
)
MODEL_SHAPES = {"sd2-base-unet": SD2_BASE_UNET}
"""Named shapes a profile file or the anchor table may use instead of a diffusers folder."""


GPU_ANCHORS: dict[str, Anchor] = {name: gpu.anchor for name, gpu in GPUS.items() if gpu.anchor is not None}
"""--target-gpu names with a published rate (advisor.model.gpu_catalogue); others need --target-tflops."""


def shape_cost(name: str) -> ModelCost:
    """A named shape's FLOPs per sample, counted here (advisor.model.model_cost)."""
    return shape_facts(name)[0]


def shape_numels(name: str) -> tuple[int, ...]:
    """A named shape's trained parameter sizes, in module order."""
    return shape_facts(name)[1]


@lru_cache(maxsize=4)
def shape_facts(name: str) -> tuple[ModelCost, tuple[int, ...]]:
    """(FLOPs per sample, parameter sizes) of a named shape from one build on the meta device, kept in
    the user's cache under the torch and diffusers versions that counted them: importing diffusers and
    building the network cost seconds that a replan, answered in seconds, should not pay every time."""
    key = f"{name} v{CACHE_VERSION} torch {_version('torch')} diffusers {_version('diffusers')}"
    cache = _cache_path()
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        entry = known[key]
        cost = ModelCost(entry["forward"], entry["backward"], entry["resolution"], kernels=entry["kernels"])
        return cost, tuple(entry["numels"])
    import diffusers

    shape = MODEL_SHAPES[name]
    net_class = getattr(diffusers, shape.class_name)
    forward, backward, numels, kernels = count_network(
        net_class, shape.config, shape.latent, shape.text_tokens
    )
    cost = ModelCost(forward, backward, shape.latent * 8, kernels=kernels)
    entry = {"forward": forward, "backward": backward, "resolution": cost.resolution, "numels": list(numels)}
    entry["kernels"] = kernels
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache, known | {key: entry})
    except OSError:
        pass  # a read-only home: counted again next time
    return cost, numels


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "sdzero" / "model_shapes.json"


@dataclass(frozen=True)
class TargetCompute:
    """Compute per sample on the target, the same for every config, and where it comes from."""

    seconds_per_sample: float
    forward_share: float
    """The forward pass's share of a micro-step (overlap windows), from the FLOP counts."""
    label: str
    once_per_step_s: float = 0.0
    """Per-step compute outside the micro-steps (not in a FLOP count: 0 unless a profile measured it)."""
    micro_floor_s: float = 0.0
    """The least a micro-step takes whatever its micro-batch: its kernels' launches (LAUNCH_S); 0 where a
    profile measured the step."""
    by_group: dict[tuple[int, str, str], float] = field(default_factory=dict)
    """Seconds per sample of each (ZeRO stage, precision, offload) a profile measured; the others take
    their precision's, else `seconds_per_sample`."""

    def per_sample(self, stage: int, precision: str, offload: str) -> float:
        if (stage, precision, offload) in self.by_group:
            return self.by_group[(stage, precision, offload)]
        same = [v for g, v in self.by_group.items() if g[1] == precision]
        return min(same) if same else self.seconds_per_sample


@dataclass(frozen=True)
class ComputeBasis:
    """Where the target's compute figures come from, in one line the answer prints."""

    kind: str
    """MEASURED (the trials' device is the target's), ASSUMED (a rate), PROFILE (measured on the target's
    own node) or NONE (no rate: ranking and communication only)."""
    line: str
    target: TargetCompute | None = None

    @property
    def timed(self) -> bool:
        """Whether time, GPU-hours and node counts can be given."""
        return self.kind != NONE


def target_rate(target_gpu: str | None, target_tflops: float | None) -> tuple[float, str] | None:
    """(FLOP/s per GPU, its label) declared or from GPU_ANCHORS; None when neither gives one."""
    if target_tflops:
        return (
            target_tflops * 1e12,
            f"{ASSUMED} (--target-tflops {target_tflops:g}: the user's sustained rate)",
        )
    anchor = GPU_ANCHORS.get((target_gpu or "").lower())
    if anchor is None:
        return None
    cost = shape_cost(anchor.shape)
    rate = anchor.samples_per_s_per_gpu * cost.flops_per_sample
    return rate, (
        f"{ASSUMED} ({target_gpu}: {anchor.samples_per_s_per_gpu:.4g} samples/s per GPU on {anchor.shape} x "
        f"{cost.flops_per_sample / 1e12:.3g} TFLOP per sample counted here = {rate / 1e12:.0f} TFLOP/s sustained; "
        f"source: {anchor.source})"
    )


def compute_basis(
    other_device: str | None,
    target_gpu: str | None,
    target_tflops: float | None,
    cost: ModelCost | None,
) -> ComputeBasis:
    """The target's compute: the trials' own when they ran on the target's kind of device and no rate was
    declared; else FLOPs per sample over the target's rate; else none (`other_device` says why the trials'
    device is not the target's)."""
    rate = target_rate(target_gpu, target_tflops)
    if rate is None or cost is None:
        if other_device is None:
            return ComputeBasis(MEASURED, "compute measured here, on the target's kind of device")
        missing = (
            "the model's FLOPs were not counted"
            if rate is not None
            else "the target's compute rate is unknown"
        )
        known = ", ".join(GPU_ANCHORS)
        return ComputeBasis(
            NONE,
            f"no time, GPU-hours or node count: {other_device}, and {missing}; give --target-tflops (sustained "
            f"TFLOP/s per GPU) or a --target-gpu with a published rate ({known})",
        )
    flops_per_s, label = rate
    seconds = cost.flops_per_sample / flops_per_s
    floor = cost.kernels * LAUNCH_S
    line = f"target compute {ASSUMED}: {cost.describe()} over {label}"
    if floor:
        line += (
            f"; at least {floor * 1e3:.3g} ms per micro-step: {cost.kernels} kernel launches x "
            f"{LAUNCH_S * 1e6:g} us ({ASSUMED})"
        )
    return ComputeBasis(ASSUMED, line, TargetCompute(seconds, cost.forward_share, label, micro_floor_s=floor))
