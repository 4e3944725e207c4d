"""A LoRA run's adapter in every checkpoint and export, gathered from every rank and checked whole.

Each checkpoint holds `adapter/pytorch_lora_weights.safetensors` beside DeepSpeed's files (listed and
hashed by the manifest like them): the adapter gathered from every rank (under ZeRO-3 its parameters are
partitioned placeholders until gathered), in the diffusers LoRA format. Before anything is written, rank 0
checks the adapter against the network's own list of adapter tensors; a missing, empty or partial one stops
every rank with one line (`AgreedError`), so a run never reports success over an adapter that does nothing.
`sdzero export` of a LoRA checkpoint copies that file out; `--export-final` writes it from the live engine.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from sdzero.atomic import publish_dir
from sdzero.checkpoint.checkpointer import agree_on_refusal
from sdzero.config.output_folder import EXPORT_MARKER, check_replaceable_folder
from sdzero.models.families import Family
from sdzero.models.lora import (
    ADAPTER_NAME,
    LORA_EMA_WEIGHTS,
    LORA_WEIGHTS,
    LoraSettings,
    adapter_key,
    adapter_problem,
    expected_adapter,
    gathered_adapter,
    write_lora,
)

ADAPTER_DIR = "adapter"
"""The adapter's folder in a checkpoint."""


def checked_adapter(engine: Any) -> dict[str, torch.Tensor] | None:
    """The gathered adapter on rank 0 (None elsewhere), refused on every rank when it is not whole.
    A collective: every rank must call it."""
    import torch.distributed as dist

    state = gathered_adapter(engine)
    problem = None
    if dist.get_rank() == 0:
        assert state is not None
        problem = adapter_problem(state, expected_adapter(engine.module))
    agree_on_refusal(problem)
    return state


class AdapterCheckpoint:
    """The Checkpointer's part for a LoRA run: writes the adapter into the staging folder."""

    def __init__(self, engine: Any, family: Family) -> None:
        self.engine, self.family = engine, family

    def save(self, staging: Path, rank: int) -> None:
        state = checked_adapter(self.engine)  # collective
        if rank == 0 and state is not None:
            write_lora(
                staging / ADAPTER_DIR, self.family, state, self.engine.module.peft_config[ADAPTER_NAME]
            )


def write_adapter_export(
    out: Path,
    family: Family,
    config: Any,
    adapter: dict[str, torch.Tensor] | Path,
    ema_state: dict[str, torch.Tensor] | None = None,
    marker: dict[str, Any] | None = None,
) -> Path:
    """`out/` with the adapter (a state dict, or a checkpoint's adapter file copied as it is) and its EMA in
    the diffusers LoRA format, published whole: written into a temporary folder beside it, then renamed
    over `out` (only an earlier export is ever replaced)."""
    check_replaceable_folder(out, EXPORT_MARKER, "a LoRA adapter sdzero exported")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if isinstance(adapter, Path):
            shutil.copyfile(adapter, tmp / LORA_WEIGHTS)
        else:
            write_lora(tmp, family, adapter, config)
        if ema_state is not None:
            write_lora(tmp, family, ema_adapter(ema_state), config, name=LORA_EMA_WEIGHTS)
        mark = {"written_by": "sdzero", "kind": "lora", "family": family.name, **(marker or {})}
        (tmp / EXPORT_MARKER).write_text(json.dumps(mark, indent=1) + "\n")
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ema_adapter(ema_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EMA's full weights (module parameter names: every one an adapter tensor in a LoRA run) under
    peft's state-dict names, as `get_peft_model_state_dict` names the live adapter."""
    return {adapter_key(k): v.detach().cpu().contiguous() for k, v in ema_state.items() if ".lora_" in k}


def is_lora_checkpoint(files: dict[str, Any]) -> bool:
    return f"{ADAPTER_DIR}/{LORA_WEIGHTS}" in files


def checkpoint_lora_config(objective: dict[str, Any], family: Family) -> Any:
    """The LoraConfig a checkpoint was trained with, from its manifest's identity (sdzero.models.lora)."""
    return LoraSettings.from_identity(objective).peft_config()
