"""What happens between optimizer steps besides the step: EMA, validation, checkpoints, preemption.

The loop calls three methods (`after_optimizer_step`, `end_of_step`, `finish`); the logic lives here and in
sdzero.checkpoint / sdzero.ema / sdzero.validation so the loop stays short.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sdzero.checkpoint import Checkpointer, ResumePoint, TrainState
from sdzero.config import DsSettings, TrainConfig
from sdzero.ema import ShardedEMA
from sdzero.preemption import Preempted, PreemptionFlag
from sdzero.run_identity import describe_run
from sdzero.validation import Validator

log = logging.getLogger("sdzero")


def _model_reference(model: str) -> str:
    """What `sdzero export` will load the frozen parts from: an absolute path for a local folder (the
    export may run from another directory), the hub id otherwise."""
    local = Path(model)
    return str(local.resolve()) if local.exists() else model


def adopt_checkpoint_seed(cfg: TrainConfig, point: ResumePoint | None, rank: int) -> None:
    """The data order and per-sample noise are keyed by the seed: a resume must use the checkpoint's."""
    if point is not None and point.manifest.seed != cfg.seed:
        if rank == 0:
            log.warning(
                "--seed %d ignored: resuming %s, which was trained with seed %d",
                cfg.seed,
                point.path,
                point.manifest.seed,
            )
        cfg.seed = point.manifest.seed


class StepHooks:
    def __init__(
        self,
        cfg: TrainConfig,
        ds: DsSettings,
        engine: Any,
        comps: Any,
        prediction_type: str,
        device: torch.device,
        preemption: PreemptionFlag,
    ) -> None:
        import torch.distributed as dist

        self.cfg, self.engine, self.comps, self.device = cfg, engine, comps, device
        self.rank = dist.get_rank()
        self.preemption = preemption
        self.ema: ShardedEMA | None = None
        if cfg.ema_decay is not None:
            host = torch.device("cpu") if engine.zero_use_cpu_optimizer() else None
            self.ema = ShardedEMA(engine, cfg.ema_decay, device=host)
        ident = describe_run(cfg, ds, comps, prediction_type, _model_reference(cfg.model))
        self.checkpointer = Checkpointer(cfg.output_dir, cfg.keep_last, engine, self.ema, ident)
        self.validator = Validator(
            cfg.validation_prompts,
            cfg.validation_every,
            cfg.validation_inference_steps,
            cfg.resolution or comps.native_resolution,
            cfg.seed,
            cfg.output_dir / "validation",
        )
        self.state = TrainState()
        self.saved_step: int | None = None

    def restore(self, point: ResumePoint | None) -> TrainState:
        """Load the checkpoint (a collective) or start at step 0."""
        if point is not None:
            self.state = self.checkpointer.load(point)
            self.saved_step = self.state.step
        return self.state

    @property
    def stop_requested(self) -> bool:
        """This rank's vote; the loop all-reduces it so that every rank stops at the same step."""
        return self.preemption.requested

    def after_optimizer_step(self) -> None:
        if self.ema is not None:
            self.ema.update()

    def end_of_step(self, step: int, batches: Any, stop: bool) -> None:
        """Validation and checkpoint when due; on an agreed stop, save and raise Preempted (exit 143)."""
        state = TrainState(step, batches.epoch, batches.batches_in_epoch, batches.samples_in_epoch)
        if not stop and self.validator.due(step, final=False):
            self.validator.run(step, self.engine, self.comps, self.rank, self.device)
        every = self.cfg.checkpoint_every
        if stop or (every and step % every == 0):
            self.checkpointer.save(state)
            self.saved_step = step
        if stop:
            self.preemption.disarm()
            if self.rank == 0:
                log.warning(
                    "preempted: checkpoint of step %d committed; exiting with 143 (continue with --resume auto)",
                    step,
                )
            raise Preempted()

    def finish(self, step: int, batches: Any) -> None:
        """After the last step: the final validation and checkpoint, unless that step already had them."""
        if self.validator.due(step, final=True):
            self.validator.run(step, self.engine, self.comps, self.rank, self.device)
        if self.cfg.checkpoint_every and self.saved_step != step:
            self.checkpointer.save(
                TrainState(step, batches.epoch, batches.batches_in_epoch, batches.samples_in_epoch)
            )
            self.saved_step = step
