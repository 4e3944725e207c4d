"""Each rank's random number generators (torch, the accelerator, numpy, Python), saved in a checkpoint and
restored by its resume, so that a resumed run draws the same noise and timesteps as an uninterrupted one."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """This process's RNG states in types that torch.load(weights_only=True) accepts (no numpy objects)."""
    from deepspeed.accelerator import get_accelerator

    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "accelerator": get_accelerator().get_rng_state(),
        "numpy": [
            str(name),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "python": random.getstate(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    from deepspeed.accelerator import get_accelerator

    torch.set_rng_state(state["torch"])
    get_accelerator().set_rng_state(state["accelerator"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
