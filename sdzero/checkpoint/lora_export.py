"""`--export-final` of a LoRA run, from the live engine: the gathered, checked adapter in diffusers' LoRA
format (sdzero.checkpoint.adapter) and, with --export-merged, the pipeline with the adapter fused in
(written like a full fine-tune's export, sdzero.checkpoint.export)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sdzero.checkpoint.adapter import checked_adapter, write_adapter_export
from sdzero.checkpoint.checkpointer import agree_on_refusal
from sdzero.checkpoint.export import gathered_state_dict, write_pipeline
from sdzero.models.lora import ADAPTER_NAME, LORA_WEIGHTS, LoraSettings, merged_state

log = logging.getLogger("sdzero")


def export_final_adapter(
    out: Path, engine: Any, comps: Any, ema: Any = None, merged_dtype: torch.dtype | None = None
) -> None:
    """`--export-final` of a LoRA run: the gathered, checked adapter (and the EMA's) written by rank 0 into
    `out`; with `merged_dtype` (--export-merged) also `out/merged`, the pipeline with the adapter fused in.
    A collective: every rank gathers, and every rank learns whether rank 0's write failed."""
    import torch.distributed as dist

    state = checked_adapter(engine)
    ema_state = ema.gather_full() if ema is not None else None  # collective: EMA slices to rank 0
    full = gathered_state_dict(engine) if merged_dtype is not None else None  # collective at ZeRO-3
    failure = None
    if dist.get_rank() == 0 and state is not None:
        try:
            config = engine.module.peft_config[ADAPTER_NAME]
            write_adapter_export(out, comps.family, config, state, ema_state)
            log.info("exported the LoRA adapter to %s", out / LORA_WEIGHTS)
            if full is not None and merged_dtype is not None:
                targets = tuple(sorted(config.target_modules))
                settings = LoraSettings(
                    config.r, float(config.lora_alpha), float(config.lora_dropout), targets
                )
                fused = merged_state(engine.module, full, settings)
                write_pipeline(out / "merged", fused, comps, merged_dtype)
                log.info("exported the merged pipeline to %s", out / "merged")
        except Exception as exc:  # every rank must still reach the agreement, or the others wait it out
            failure = f"--export-final: writing the adapter to {out} failed ({type(exc).__name__}: {exc})"
    agree_on_refusal(failure)
