"""Per-rank memory of a ZeRO config at any world size: model states, buckets, frozen parts, activations.

Model states follow the ZeRO formulas with DeepSpeed's real partitioning, element for element (the same
rules tests/dist/test_profile.py checks against the engine):

- ZeRO-1/2 flatten the trained parameters, in module order, into one 16-bit buffer padded to a multiple of
  2N elements (Ψp) and give rank r the slice [r·Ψp/N, (r+1)·Ψp/N) for fp32 master weights and Adam's m, v.
  ZeRO-1 (overlap_comm off) holds every full gradient until the reduction; ZeRO-2, and ZeRO-1 with
  overlap_comm, keep the whole gradient of every parameter that overlaps its slice (a parameter cut by a partition boundary is held by both).
- ZeRO-3 splits every parameter into N shards of ceil(numel/N) elements; a parameter below
  stage3_param_persistence_threshold is also kept whole, in 16 bits, on every rank.

Bytes per element are the formulas' (16-bit params and grads 2, fp32 master 4, Adam 8); trials that show
another integer (an optimizer without moments, say) override it for their stage and precision, and the
override is reported. Buckets come from the config (reduce_bucket_size x 2 bytes, twice with overlap_comm
at ZeRO-1/2) plus any constant the trials show beyond it. Activations are fitted to the trials as
a + b x micro_batch (one micro-batch's saved tensors; ZeRO does not change them). Frozen encoders are
replicated per rank, as measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

STATE_KINDS: tuple[str, ...] = ("params", "grads", "master", "optimizer")
DEFAULT_BYTES_PER_ELEMENT: dict[str, int] = {"params": 2, "grads": 2, "master": 4, "optimizer": 8}
"""Mixed precision with Adam: the 2 + 2 + 12 bytes per parameter of the ZeRO paper."""
DEFAULT_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size default


@dataclass(frozen=True)
class ZeroSettings:
    """What of the DeepSpeed JSON changes memory besides stage, precision, micro-batch and offload."""

    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS
    overlap_comm: bool = False
    persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ZeroSettings:
        zero = config.get("zero_optimization", {}) or {}
        stage = int(zero.get("stage", 0))
        return cls(
            reduce_bucket_size=int(zero.get("reduce_bucket_size", DEFAULT_BUCKET_ELEMENTS)),
            # DeepSpeed turns overlap_comm on by default at ZeRO-3 only
            overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
            persistence_threshold=int(
                zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)
            ),
        )


def trained_numels(model: str | Path) -> tuple[int, ...]:
    """Element counts of the trained network's parameters in module order (the UNet, or SD3's transformer),
    built on the meta device (no weights)."""
    import torch

    from sdzero.models import TRAINED_SUBFOLDER, detect_family, trained_network_class

    family = detect_family(str(model))
    cls = trained_network_class(family)
    config = cls.load_config(str(model), subfolder=TRAINED_SUBFOLDER[family])
    with torch.device("meta"):
        net = cls.from_config(config)
    return tuple(int(p.numel()) for p in net.parameters() if p.requires_grad)


def state_elements(numels: tuple[int, ...] | np.ndarray, stage: int, world: int,
                   persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD, overlap_comm: bool = False) -> dict[str, int]:  # fmt: skip
    """Elements of each model-state kind held by the rank that holds the most, at `world` ranks."""
    sizes = np.asarray(numels, dtype=np.int64)
    psi = int(sizes.sum())
    if stage == 3:
        shard = int(np.sum(-(-sizes // world)))  # ceil per parameter
        persistent = int(sizes[sizes < persistence_threshold].sum())
        return {"params": shard + persistent, "grads": shard, "master": shard, "optimizer": shard}
    padded = math.ceil(psi / (2 * world)) * 2 * world
    part = padded // world
    # ZeRO-1 without overlap_comm reduces at the boundary and holds every full gradient until then; with it
    # (and at ZeRO-2) gradients are reduced in backward hooks and only those overlapping the slice stay
    full = stage == 1 and not overlap_comm
    grads = psi if full else _largest_boundary_overlap(sizes, part, world)
    return {"params": padded, "grads": grads, "master": part, "optimizer": part}


def _largest_boundary_overlap(sizes: np.ndarray, part: int, world: int) -> int:
    """ZeRO-2: the most gradient elements one rank keeps (whole parameters overlapping its slice)."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    lo = np.arange(world, dtype=np.int64) * part
    hi = lo + part
    first = np.searchsorted(ends, lo, side="right")  # first parameter ending after lo
    last = np.searchsorted(starts, hi, side="left") - 1  # last parameter starting before hi
    first = np.minimum(first, len(sizes) - 1)
    overlap = np.where(last >= first, ends[np.maximum(last, 0)] - starts[first], 0)
    return int(overlap.max())


@dataclass
class ActivationFit:
    """activation_bytes = intercept + slope x micro_batch, least squares over the trials given."""

    intercept: float
    slope: float

    def predict(self, micro_batch: float) -> float:
        return max(self.intercept + self.slope * micro_batch, 0.0)

    @classmethod
    def fit(cls, micro_batch: np.ndarray, activation_bytes: np.ndarray) -> ActivationFit:
        mb = np.asarray(micro_batch, dtype=float)
        act = np.asarray(activation_bytes, dtype=float)
        if len(np.unique(mb)) < 2:  # one micro-batch: proportional, the autotuner's own assumption
            return cls(0.0, float(np.mean(act / mb)))
        slope, intercept = np.polyfit(mb, act, 1)
        return cls(float(intercept), float(slope))


@dataclass
class MemoryModel:
    numels: tuple[int, ...]
    zero: ZeroSettings
    frozen_bytes: float
    activations: ActivationFit
    bytes_per_element: dict[tuple[int, str, str], int] = field(default_factory=dict)
    """(stage, precision, kind) -> bytes, where trials showed other than DEFAULT_BYTES_PER_ELEMENT."""
    bucket_extra_bytes: dict[int, float] = field(default_factory=dict)
    """Per stage: measured bucket bytes beyond the config's (ZeRO-3's bucket also holds its last params)."""
    notes: list[str] = field(default_factory=list)

    @property
    def psi(self) -> int:
        return sum(self.numels)

    def element_bytes(self, stage: int, precision: str, kind: str) -> int:
        return self.bytes_per_element.get((stage, precision, kind), DEFAULT_BYTES_PER_ELEMENT[kind])

    def state_bytes(self, stage: int, precision: str, world: int) -> dict[str, int]:
        elements = state_elements(
            self.numels, stage, world, self.zero.persistence_threshold, self.zero.overlap_comm
        )
        return {k: elements[k] * self.element_bytes(stage, precision, k) for k in STATE_KINDS}

    def bucket_bytes(self, stage: int) -> float:
        copies = 2 if stage in (1, 2) and self.zero.overlap_comm else 1
        return copies * 2 * self.zero.reduce_bucket_size + self.bucket_extra_bytes.get(stage, 0.0)

    def per_rank_bytes(
        self, stage: int, precision: str, micro_batch: int, offload: str, world: int
    ) -> dict[str, float]:
        """Device bytes per rank by part; `total` is what must fit (offloaded states excluded)."""
        states = self.state_bytes(stage, precision, world)
        offloaded = 0
        if offload != "none":  # CPU offload moves fp32 master weights and Adam's moments off the device
            offloaded += states["master"] + states["optimizer"]
        if offload == "optimizer+params":
            offloaded += states["params"]
        parts = {
            "model_states": float(sum(states.values()) - offloaded),
            "buckets": self.bucket_bytes(stage),
            "frozen": self.frozen_bytes,
            "activations": self.activations.predict(micro_batch),
        }
        return {**parts, "total": sum(parts.values()), "offloaded": float(offloaded)}


def fit_memory_model(trials: pd.DataFrame, numels: tuple[int, ...], zero: ZeroSettings) -> MemoryModel:
    """Fit activations and calibrate bytes per element and buckets on the ok trials given."""
    ok = trials[trials["status"] == "ok"]
    if ok.empty:
        raise ValueError("no successful trial to fit the memory model on")
    model = MemoryModel(numels, zero, float(ok["frozen_bytes"].median()),
                        ActivationFit.fit(ok["micro_batch"].to_numpy(), ok["activation_bytes"].to_numpy()))  # fmt: skip
    for (stage, precision), rows in ok.groupby(["zero_stage", "precision"]):
        row = rows.iloc[0]
        elements = state_elements(
            numels, int(stage), int(row["world_size"]), zero.persistence_threshold, zero.overlap_comm
        )
        for kind in STATE_KINDS:
            measured = int(row[f"{kind}_bytes"])
            per, rest = divmod(measured, max(elements[kind], 1))
            if rest == 0 and per != DEFAULT_BYTES_PER_ELEMENT[kind]:
                model.bytes_per_element[(int(stage), str(precision), kind)] = per
                model.notes.append(f"ZeRO-{stage} {precision}: {kind} measured at {per} bytes per element")
            elif rest:
                model.notes.append(f"ZeRO-{stage} {precision}: {kind} measured {measured} bytes, not a whole "
                                   f"number of bytes per element of the formula's {elements[kind]}")  # fmt: skip
        model.bucket_extra_bytes.pop(int(stage), None)  # measured against the config's bytes alone
        model.bucket_extra_bytes[int(stage)] = float(rows["bucket_bytes"].median()) - model.bucket_bytes(
            int(stage)
        )
    return model
