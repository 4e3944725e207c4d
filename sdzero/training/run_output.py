"""What a run writes besides checkpoints and metrics lines: its resolved configuration and environment
(rank 0, at the start), the metrics writer, and the exported pipeline (at the end); and how loudly the
libraries log on each rank."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sdzero.atomic import write_json_atomic
from sdzero.config.train_config import DsSettings, TrainConfig
from sdzero.models.families import Components
from sdzero.models.loading import DTYPES
from sdzero.telemetry.environment import environment_snapshot
from sdzero.telemetry.metrics import MetricsWriter, rotate_previous

log = logging.getLogger("sdzero")


LIBRARY_LOG = "library.log"
"""Rank 0's library chatter, in the run's output folder (sdzero.library_logs)."""


def quiet_libraries(rank: int, output_dir: Path | None) -> None:
    """DeepSpeed, diffusers and transformers log a lot at INFO; keep warnings, and only on rank 0. Their
    chatter (deprecation warnings, torchvision fallbacks, progress bars of weights loaded and written) goes
    to <output_dir>/library.log on rank 0 (dropped on the other ranks, and where `output_dir` is None);
    library errors and sdzero's own warnings still show. `output_dir` has no default: a caller that left it
    out silently dropped rank 0's chatter (the trainer did, #24)."""
    import diffusers
    import transformers
    from deepspeed.utils import logger as ds_logger

    from sdzero.library_logs import ChatterLog, quiet_library_loggers

    level = logging.WARNING if rank == 0 else logging.ERROR
    ds_logger.setLevel(level)
    diffusers.utils.logging.set_verbosity(level)
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="[sdzero] %(message)s")
    quiet_library_loggers(ChatterLog(output_dir / LIBRARY_LOG if rank == 0 and output_dir else None))


def prepare_output(
    cfg: TrainConfig,
    ds: DsSettings,
    config: dict[str, Any],
    rank: int,
    extra: dict[str, Any] | None = None,
    speed: dict[str, Any] | None = None,
) -> MetricsWriter | None:
    if rank != 0:
        return None
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    moved = rotate_previous(cfg.output_dir / "metrics.jsonl")
    if moved:
        log.info("an earlier run's metrics were moved to %s", moved)
    write_json_atomic(cfg.output_dir / "ds_config.json", config)  # never through a link planted there
    run = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    run.update(
        zero_stage=ds.zero_stage,
        dtype=ds.dtype,
        world_size=ds.world_size,
        lr_effective=cfg.effective_lr(ds),
        **(extra or {}),
    )
    write_json_atomic(cfg.output_dir / "run_config.json", run)
    environment = {**environment_snapshot(), "world_size": ds.world_size}  # rank 0's view, for reports
    if speed is not None:
        environment["speed"] = speed  # what the fast paths really were (sdzero.training.fast_paths)
    write_json_atomic(cfg.output_dir / "environment.json", environment)
    return MetricsWriter(cfg.output_dir / "metrics.jsonl")


FROZEN_PARTS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
"""Components attributes that may hold frozen models the export writes beside the trained network."""


def export_bytes(engine: Any, comps: Any, dtype: Any, copies: int) -> float:
    """Bytes rank 0 reads and writes exporting the pipeline: `copies` of the trained network (its EMA is
    another) and the frozen parts, each written once in `dtype` and the frozen parts read once. Every rank
    computes the same figure (ZeRO-3 parameters count their full `ds_numel`)."""

    def numel(module: Any) -> int:
        return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())

    frozen = sum(
        numel(m) for m in (getattr(comps, n, None) for n in FROZEN_PARTS) if hasattr(m, "parameters")
    )
    return float((copies * numel(engine.module) + 2 * frozen) * dtype.itemsize)


def export_final(cfg: TrainConfig, engine, comps: Components, rank: int, ema=None) -> None:
    """Gather the weights (a collective), then rank 0 writes the pipeline to `<output-dir>/final` while the
    others wait under a timeout sized for its bytes (sdzero.process.rank0_wait): a shared filesystem can
    take longer to write an SDXL-size fp32 export than --dist-timeout-s allows a collective."""
    from sdzero.checkpoint.export import gathered_state_dict, write_pipeline
    from sdzero.models.lora import is_lora
    from sdzero.process.rank0_wait import waiting_for_rank0

    if is_lora(
        engine.module
    ):  # --lora-rank: the adapter in diffusers' LoRA format (sdzero.checkpoint.adapter)
        from sdzero.checkpoint.lora_export import export_final_adapter

        merged = DTYPES[cfg.export_dtype] if getattr(cfg, "export_merged", False) else None
        export_final_adapter(cfg.output_dir / "final", engine, comps, ema, merged)
        return
    state = gathered_state_dict(engine)  # collective under ZeRO-3: all ranks take part
    ema_state = ema.gather_full() if ema is not None else None  # collective: EMA slices to rank 0
    dtype = DTYPES[cfg.export_dtype]  # one dtype for every component (see write_pipeline)
    with waiting_for_rank0(export_bytes(engine, comps, dtype, 2 if ema is not None else 1)) as share:
        failure = None
        if rank == 0 and state is not None:
            extra = {"unet_ema": ema_state} if ema_state is not None else None
            try:
                out = write_pipeline(cfg.output_dir / "final", state, comps, dtype, extra_unets=extra)
                log.info("exported the trained pipeline to %s", out)
            except Exception as exc:  # every rank must still reach share(), or the others wait it out
                failure = exc
        cause = share(None if failure is None else f"{type(failure).__name__}: {failure}")
        if cause is not None and failure is None:
            raise RuntimeError(f"rank 0 could not export the trained pipeline ({cause})")
    if failure is not None:
        raise failure
