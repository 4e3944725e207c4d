"""The GPUs a plan can be for, each named once: its memory, its usual machine and its published training
rate, with where each figure comes from.

A `--target-gpu` name (or a profile file's `device:`) is looked up here and nowhere else: the target's
memory (advisor.stages.target), the NVLink of its machine when no --preset names one
(advisor.model.network.MACHINES) and the rate its compute is anchored on (advisor.model.target_compute).
Adding a GPU is one entry below; tests/unit/test_gpu_catalogue.py checks that every name it gives resolves.
"""

from __future__ import annotations

from dataclasses import dataclass

NOMINAL_MEMORY = "the vendor's nominal memory per GPU"
"""Where every memory figure comes from; the usable part is smaller, which --headroom accounts for."""


@dataclass(frozen=True)
class Anchor:
    """A published per-GPU training throughput of a named shape (advisor.model.target_compute.MODEL_SHAPES)."""

    samples_per_s_per_gpu: float
    shape: str
    micro_batch: int
    source: str


@dataclass(frozen=True)
class Gpu:
    """One GPU a plan can be for."""

    memory_gib: float
    """Device memory in GiB (NOMINAL_MEMORY)."""
    machine: str | None = None
    """The advisor.model.network.MACHINES name of its usual node, whose NVLink is the intra-node link when
    no --preset names a machine; None: no such machine is described (the link is then assumed)."""
    anchor: Anchor | None = None
    """Its published training rate; None: the user gives --target-tflops."""

    @property
    def sources(self) -> list[str]:
        """Where its figures come from, one line each."""
        return [
            f"memory: {NOMINAL_MEMORY}",
            *([f"machine: advisor.model.network.MACHINES[{self.machine!r}]"] if self.machine else []),
            *([f"rate: {self.anchor.source}"] if self.anchor else []),
        ]


_A100_80GB_RATE = Anchor(
    290 / 8,
    "sd2-base-unet",
    16,
    "mosaicml/diffusion README, 'How many GPUs do I need?': 8 x A100-80GB, SD2 base UNet at 512x512 with "
    "precomputed latents, 290 images/s (micro-batch 16, yamls/hydra-yamls/SD-2-base-512.yaml)",
)
_H100_80GB_RATE = Anchor(
    119.1,
    "sd2-base-unet",
    32,
    "MLPerf Training v4.1, Lambda 1-Click Cluster, 2 x 8 H100 SXM (results/lambda_1cc_n2_H100-SXM-80GB_"
    "ngc24.04_nemo/stable_diffusion, config_1cc_02x08x32): 119.1 samples/s per GPU (a 2-node figure)",
)
_H200_RATE = Anchor(
    143.5,
    "sd2-base-unet",
    32,
    "MLPerf Training v5.0, Dell XE9680L 8 x H200-SXM-141GB (config_XE9680lx8H200-SXM-141GB_01x08x32): "
    "143.5 samples/s per GPU",
)

GPUS: dict[str, Gpu] = {
    "a100-40gb": Gpu(40.0, "dgx-a100"),
    "a100-80gb": Gpu(80.0, "dgx-a100", _A100_80GB_RATE),
    "h100-80gb": Gpu(80.0, "dgx-h100", _H100_80GB_RATE),
    "h100-94gb": Gpu(94.0, "dgx-h100"),
    "h200": Gpu(141.0, "hgx-h200", _H200_RATE),
    "l40s": Gpu(48.0),
    "a10g": Gpu(24.0),
    "l4": Gpu(24.0),
    "v100-32gb": Gpu(32.0),
    "rtx4090": Gpu(24.0),
    "b200": Gpu(180.0, "dgx-b200"),
    "gb200": Gpu(186.0, "gb200-nvl72"),
}
"""--target-gpu names, in the order --help lists them."""


def gpu_named(name: str | None) -> Gpu | None:
    """The catalogue's entry for a --target-gpu name (any case); None for no name or an unknown one."""
    return GPUS.get((name or "").lower())
