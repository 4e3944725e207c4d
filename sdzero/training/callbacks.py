"""What happens around the training step besides the step itself, as Trainer callbacks: EMA, validation,
checkpoints and preemption here; profiling in sdzero.training.measuring.probe (`Probe`); extra callbacks named in
SDZERO_CALLBACKS (the tests inject their faults this way). docs/trainer.md lists the events and their order.

A callback subclasses `Callback` and overrides the events it needs; every event receives the Trainer (seen as a
`TrainerView`), which holds the run's state (`trainer.cfg`, `.engine`, `.batches`, `.state`, `.rank`, ...). The Trainer calls
only the methods a callback overrides, so an unused event costs nothing per step.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from sdzero.checkpoint.checkpointer import Checkpointer, ResumePoint, TrainState
from sdzero.config.train_config import TrainConfig
from sdzero.errors import UserError
from sdzero.models.ema import ShardedEMA
from sdzero.models.step_input import StepInput
from sdzero.process.preemption import Preempted, PreemptionFlag
from sdzero.telemetry import progress
from sdzero.training.validation import Validator

log = logging.getLogger("sdzero")

CALLBACKS_ENV = "SDZERO_CALLBACKS"
"""Extra callbacks for every rank: comma-separated `module:attribute` names of factories, each called with
no arguments and returning a Callback (or None: nothing to add). The module must be importable by the
ranks (on their PYTHONPATH). Loaded before the process group forms, so a wrong name fails at once."""


class TrainerView(Protocol):
    """What a callback sees of the Trainer: its run state. Declared here, beside the callbacks, so that
    they never import the Trainer (which imports them); sdzero.training.trainer.Trainer satisfies it."""

    cfg: TrainConfig
    comps: Any
    """The pipeline's parts (sdzero.models.families.Components)."""
    engine: Any
    """The DeepSpeed engine around the trained network."""
    batches: Any
    """The micro-batch feed (sdzero.data.feed.Batches): its epoch and position in it."""
    state: TrainState
    rank: int
    device: torch.device
    step_extras: dict[str, Any]
    """Fields added to the current step's metrics line (filled before `on_step_queued`)."""

    def emit_checkpoint_staged(self, step: int, folder: Path) -> None: ...


class Callback:
    """The Trainer's events, in the order they happen; every method is a no-op here.

    Per run: `on_setup` once, then per optimizer step `on_step_begin`, `on_batch` (each micro-batch),
    `on_optimizer_step`, `wants_stop`, `on_step_queued`, `on_metrics` (when a step's line is read back:
    at its own end on a CPU, one step later on CUDA), then `on_step_end`, or `on_stop` when the ranks
    agreed to stop at this step; `on_checkpoint_staged` inside every checkpoint save; `on_finish` once
    after the last step.
    """

    def on_setup(self, trainer: TrainerView) -> None:
        """The Trainer is built: engine, data and the (resumed) state are in place."""

    def on_step_begin(self, trainer: TrainerView, step: int) -> None:
        """Before the step's first micro-batch is drawn."""

    def on_batch(self, trainer: TrainerView, batch: StepInput) -> None:
        """A micro-batch was drawn (`trainer.batches` holds its data position), still on the host (its
        `index` says which samples it holds); inside the data phase."""

    def on_optimizer_step(self, trainer: TrainerView, step: int) -> None:
        """The step's micro-steps are queued and the weights updated (at the accumulation boundary)."""

    def wants_stop(self, trainer: TrainerView) -> bool:
        """This rank's vote to stop; the votes travel with the step's statistics, so that every rank stops
        at the same step (one step later on CUDA, where the statistics are read a step late)."""
        return False

    def on_step_queued(self, trainer: TrainerView, step: int) -> None:
        """The step's work is queued and its statistics launched; its metrics line is not read yet."""

    def on_metrics(self, trainer: TrainerView, step: int, record: dict[str, Any]) -> None:
        """The metrics line of `step` was read back (and written on rank 0)."""

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        """The step is over and no rank asked to stop: `trainer.state` is its data position."""

    def on_stop(self, trainer: TrainerView, step: int) -> None:
        """Every rank agreed to stop at `step` (its metrics line is written): save, then leave."""

    def on_checkpoint_staged(self, trainer: TrainerView, step: int, folder: Path) -> None:
        """Every rank's shards of `step`'s checkpoint are written and hashed in `folder`, not committed."""

    def on_finish(self, trainer: TrainerView) -> None:
        """After the last step (`trainer.state.step`), before the metrics file closes."""


def overrides(callback: Any, event: str) -> bool:
    """True if `callback` has its own `event` method (not Callback's no-op)."""
    own = getattr(type(callback), event, None)
    return own is not None and own is not getattr(Callback, event)


def load_callbacks(spec: str | None) -> list[Callback]:
    """The callbacks named by SDZERO_CALLBACKS (see CALLBACKS_ENV); [] when it is unset or empty."""
    found: list[Callback] = []
    for name in filter(None, (part.strip() for part in (spec or "").split(","))):
        module_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise UserError(
                f"{CALLBACKS_ENV}: cannot load {name!r} ({exc}); expected module:attribute"
            ) from None
        callback = factory()
        if callback is not None:
            found.append(callback)
    return found


def extra_callbacks() -> list[Callback]:
    return load_callbacks(os.environ.get(CALLBACKS_ENV))


def model_reference(model: str) -> str:
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


def make_ema(cfg: TrainConfig, engine: Any) -> ShardedEMA | None:
    """The EMA of this rank's fp32 master slice (--ema-decay), on the CPU when ZeRO offloads the optimizer."""
    if cfg.ema_decay is None:
        return None
    host = torch.device("cpu") if engine.zero_use_cpu_optimizer() else None
    return ShardedEMA(engine, cfg.ema_decay, device=host)


class EmaCallback(Callback):
    def __init__(self, ema: ShardedEMA) -> None:
        self.ema = ema

    def on_optimizer_step(self, trainer: TrainerView, step: int) -> None:
        self.ema.update()  # this rank's fp32 master slice; no communication


class ValidationCallback(Callback):
    """Validation images every --validation-every steps and at the end (all ranks take part)."""

    def __init__(self, validator: Validator) -> None:
        self.validator = validator

    def _run(self, trainer: TrainerView, step: int) -> None:
        with progress.phase("validation"):  # a stall here is named as one (sdzero.telemetry.progress)
            self.validator.run(step, trainer.engine, trainer.comps, trainer.rank, trainer.device)

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        if self.validator.due(step, final=False):
            self._run(trainer, step)

    def on_finish(self, trainer: TrainerView) -> None:
        if self.validator.due(trainer.state.step, final=True):
            self._run(trainer, trainer.state.step)


def ends_as_a_trial(trainer: TrainerView) -> bool:
    """A profiled run without --checkpoint-every is an advisor trial (sdzero.training.measuring.probe): nothing resumes
    it, so a stop (its probe's measurement is done, or the advisor ends it) ends it as its last step would:
    no checkpoint (a real model's states would cost more than the trial), no preemption exit, the profile
    written. The same on every rank: the options are."""
    cfg = getattr(trainer, "cfg", None)
    return getattr(cfg, "profile_out", None) is not None and not getattr(cfg, "checkpoint_every", 0)


class CheckpointCallback(Callback):
    """Checkpoints every --checkpoint-every steps, at the end, and when stopping; and the resume."""

    def __init__(self, checkpointer: Checkpointer, every: int) -> None:
        self.checkpointer, self.every = checkpointer, every
        self.saved_step: int | None = None

    def restore(self, point: ResumePoint | None) -> TrainState:
        """Load the checkpoint (a collective) or start at step 0."""
        if point is None:
            return TrainState()
        state = self.checkpointer.load(point)
        self.saved_step = state.step
        return state

    def on_setup(self, trainer: TrainerView) -> None:
        def staged(step: int, folder: Path) -> None:
            trainer.emit_checkpoint_staged(step, folder)

        self.checkpointer.before_commit = staged

    def save(self, trainer: TrainerView) -> None:
        with progress.phase("checkpoint"):  # a save that hangs is named as one (sdzero.telemetry.progress)
            self.checkpointer.save(trainer.state)
        self.saved_step = trainer.state.step

    def on_step_end(self, trainer: TrainerView, step: int) -> None:
        if self.every and step % self.every == 0:
            self.save(trainer)

    def on_stop(self, trainer: TrainerView, step: int) -> None:
        if not ends_as_a_trial(trainer):
            self.save(trainer)

    def on_finish(self, trainer: TrainerView) -> None:
        """The final checkpoint, unless the last step already has one."""
        if self.every and self.saved_step != trainer.state.step:
            self.save(trainer)


class PreemptionCallback(Callback):
    """SIGTERM/SIGUSR1 on any rank: every rank stops at the same step, saves (CheckpointCallback, which
    must come before this one) and exits with 143 (sdzero.process.preemption); an advisor trial just ends
    (`ends_as_a_trial`)."""

    def __init__(self, flag: PreemptionFlag) -> None:
        self.flag = flag

    def wants_stop(self, trainer: TrainerView) -> bool:
        return self.flag.requested

    def on_stop(self, trainer: TrainerView, step: int) -> None:
        self.flag.disarm()
        if ends_as_a_trial(trainer):
            return  # the loop ends here and the run finishes as after its last step
        if trainer.rank == 0:
            log.warning(
                "preempted: checkpoint of step %d committed; exiting with 143 (continue with --resume auto)",
                step,
            )
        raise Preempted()
