"""The parts a Trainer is built from: what the run is (`RunSettings`), what it trains (`ModelSide`) and what it
trains on (`DataSide`). `Trainer.setup` makes them from the run's options; the benches and unit tests make
them from pieces of their own (an in-memory network, pre-made batches) and build the Trainer the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sdzero.checkpoint.checkpointer import TrainState
from sdzero.config.train_config import DsSettings, TrainConfig
from sdzero.data.feed import BatchSource
from sdzero.models.families import Components


@dataclass(frozen=True)
class RunSettings:
    """What the run is and where this rank runs it."""

    cfg: TrainConfig
    """The run's options (sdzero.config.options)."""
    ds: DsSettings
    """The DeepSpeed JSON's settings: ZeRO stage, precision, micro-batch, accumulation."""
    device: torch.device
    """This rank's device (its GPU, or the CPU)."""


@dataclass(frozen=True)
class ModelSide:
    """What is trained and how its loss is made."""

    comps: Components
    """The pipeline's parts: the trained network, the frozen encoders (None from a cache), the scheduler."""
    engine: Any
    """The DeepSpeed engine around `comps.network`."""
    prediction_type: str
    """What the network predicts: "epsilon", "v_prediction" or "flow_matching"."""
    ema: Any = None
    """The EMA copy of the weights (sdzero.models.ema.ShardedEMA), or None without --ema."""


@dataclass(frozen=True)
class DataSide:
    """The micro-batches and where the run starts in them."""

    batches: BatchSource
    """The micro-batch feed (sdzero.data.feed.Batches, or a bench's pre-made batches)."""
    start: TrainState = field(default_factory=TrainState)
    """The last finished step and its data position: a resumed checkpoint's, else step 0."""
    skipped_images: int = 0
    """Images found unreadable at start-up and left out."""
