"""A LoRA run's exports. `--export-final`, from the live engine: the gathered, checked adapter in diffusers'
LoRA format (sdzero.checkpoint.adapter) and, with --export-merged, the pipeline with the adapter fused in
(written like a full fine-tune's export, sdzero.checkpoint.export). `sdzero export --merged`, from a
checkpoint: the same merged pipeline, the base from the model and the adapter from DeepSpeed's shards."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sdzero.checkpoint.adapter import checked_adapter, is_lora_checkpoint, write_adapter_export
from sdzero.checkpoint.checkpointer import agree_on_refusal
from sdzero.checkpoint.export import (
    ExportResult,
    consolidated_weights,
    gathered_state_dict,
    located_for_export,
    write_pipeline,
)
from sdzero.errors import UserError
from sdzero.models.lora import ADAPTER_NAME, LORA_WEIGHTS, LoraSettings, add_lora, merged_state

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


def export_merged(
    source: Path, out: Path, model: str | None = None, dtype: str | None = None, overwrite: bool = False
) -> ExportResult:
    """`sdzero export --merged`: the newest complete LoRA checkpoint in `source` as a whole pipeline with the
    adapter fused in; a full fine-tune's checkpoint is refused (its plain export is that pipeline)."""
    from sdzero.models.loading import DTYPES

    out = Path(out)
    path, manifest = located_for_export(source, out, dtype, overwrite)
    if not is_lora_checkpoint(manifest.files):
        raise UserError(
            f"--merged applies to LoRA checkpoints only; {path} is a full fine-tune's, whose export is a whole "
            "pipeline already: run sdzero export without --merged"
        )
    return export_merged_checkpoint(path, manifest, out, model, DTYPES[dtype or "fp32"])


def export_merged_checkpoint(
    path: Path, manifest: Any, out: Path, model: str | None, dtype: torch.dtype
) -> ExportResult:
    """`sdzero export --merged` of a LoRA checkpoint: `out`, a whole pipeline with the adapter fused in (and
    the EMA's adapter fused into unet_ema), written by write_pipeline like any export.

    The checkpoint leaves the frozen base out (it comes from --model, pinned by the run identity): the base
    is loaded from the model, the adapter consolidated from the shards by zero_to_fp32, and the two fused
    by `merged_state`, as --export-merged fuses the live engine's."""
    from sdzero.checkpoint.checkpointer import EMA_DIR, ema_errors_as_user_errors
    from sdzero.models.ema import assemble
    from sdzero.models.loading import load_components

    try:
        comps = load_components(model or manifest.model, "fp32", "cpu", frozen=False)
    except UserError as exc:
        raise UserError(f"{exc}; pass --model with the pipeline the run trained from") from exc
    comps.family.resolve_prediction_type(comps.noise_scheduler, manifest.prediction_type)
    settings = LoraSettings.from_identity(manifest.objective)
    # The base and the adapters under the adapted network's names (`...to_q.base_layer.weight`).
    adapted = add_lora(comps.network, settings)
    base = {k: v for k, v in adapted.state_dict().items() if ".lora_" not in k}
    fused = merged_state(adapted, {**base, **consolidated_weights(path, manifest.zero_stage)}, settings)
    extra = None
    if manifest.ema:
        with ema_errors_as_user_errors(path):
            ema_state, _ = assemble(path / EMA_DIR)
        extra = {"unet_ema": merged_state(adapted, {**base, **ema_state}, settings)}
    marker = {"checkpoint": str(path.resolve()), "step": manifest.step, "lora": "merged"}
    write_pipeline(out, fused, comps, dtype, extra_unets=extra, marker=marker)
    return ExportResult(out=out, checkpoint=path, step=manifest.step, with_ema=extra is not None)
