"""The Trainer: one DeepSpeed engine around the trained network, frozen encoders beside it, metrics per step.

`Trainer.setup(cfg)` checks the inputs, starts the process group (sdzero.process.distributed), loads the model,
builds the data feed and the engine, resumes, and returns a Trainer that holds all of it on itself;
`train()` runs `train_step(step)` up to --max-steps and returns a RunSummary. Everything around the step
(EMA, validation, checkpoints, preemption, profiling, extra callbacks from SDZERO_CALLBACKS) is a callback
on the Trainer's events (sdzero.training.callbacks; docs/trainer.md). The benches build a Trainer too: from a
config (`setup`), or from parts they made themselves (the constructor).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdzero.checkpoint.adapter import AdapterCheckpoint
from sdzero.checkpoint.checkpointer import Checkpointer, ResumePoint, TrainState, find_resume
from sdzero.checkpoint.identity import describe_run
from sdzero.cluster.shared_storage import check_shared_storage
from sdzero.config.train_config import DsSettings, TrainConfig, load_ds_config, world_size_from_env
from sdzero.data.buckets import BucketBatchSampler, samples_dropped
from sdzero.data.cache import CacheIndex, open_cache
from sdzero.data.feed import Batches, BatchSource, build_data
from sdzero.data.images import LateFailures
from sdzero.data.shards import read_records
from sdzero.models.encoding import encode_batch
from sdzero.models.families import Components
from sdzero.models.loading import DTYPES, detect_family, load_components, resolve_prediction_type
from sdzero.models.lora import check_targets_on_model, is_lora
from sdzero.models.objectives import LossInputs, Objective
from sdzero.models.step_input import StepInput
from sdzero.process.distributed import Ranks, start_distributed
from sdzero.process.preemption import PreemptionFlag
from sdzero.telemetry import progress
from sdzero.telemetry.environment import share_cpu_threads
from sdzero.telemetry.metrics import MetricsWriter, peak_memory_bytes
from sdzero.telemetry.monitoring import finish_wandb_run
from sdzero.telemetry.phase_timers import PhaseTimer, timing_mode
from sdzero.telemetry.step_stats import PendingStep, StepLog, launch_step_stats
from sdzero.training import run_watch
from sdzero.training.callbacks import (
    Callback,
    CheckpointCallback,
    EmaCallback,
    PreemptionCallback,
    ValidationCallback,
    adopt_checkpoint_seed,
    extra_callbacks,
    make_ema,
    model_reference,
    overrides,
)
from sdzero.training.engine import init_engine, loss_scale_of
from sdzero.training.fast_paths import apply_backend_flags, check_attention, check_speed_options, speed_report
from sdzero.training.link_probe import LinkProbeCallback
from sdzero.training.measuring.configs import plan_sweep
from sdzero.training.measuring.probe import start_probe
from sdzero.training.measuring.sweep import ConfigSweep
from sdzero.training.run_output import export_final, prepare_output, quiet_libraries
from sdzero.training.startup import StartupRecord
from sdzero.training.straggler import StragglerCallback
from sdzero.training.trainer_parts import DataSide, ModelSide, RunSettings
from sdzero.training.validation import Validator

log = logging.getLogger("sdzero")

EVENTS = tuple(name for name in vars(Callback) if name.startswith("on_") or name == "wants_stop")


def handlers_of(callbacks: list[Callback]) -> dict[str, list[Any]]:
    """Per event, the bound methods of the callbacks that override it, in list order: an event no callback
    overrides costs nothing per step."""
    return {e: [getattr(c, e) for c in callbacks if overrides(c, e)] for e in EVENTS}


@dataclass
class RunSummary:
    steps: int
    first_loss: float
    last_loss: float
    mean_samples_per_s: float
    metrics_path: str
    skipped_images: int


class Trainer:
    """A training run's state and its step. Build with `Trainer.setup(cfg)` for a real run, or from its parts
    (sdzero.training.trainer_parts) where there is no pipeline folder or dataset to set a run up from."""

    def __init__(
        self,
        run: RunSettings,
        model: ModelSide,
        data: DataSide,
        *,
        callbacks: Iterable[Callback] = (),
        writer: MetricsWriter | None = None,
        measuring: Callback | None = None,
    ) -> None:
        import torch.distributed as dist

        cfg, ds, comps, engine = run.cfg, run.ds, model.comps, model.engine
        # Held flat: the callbacks see these names (TrainerView); ds and batches change per config in a
        # sweep, the benches swap batches and writer between timed blocks.
        self.cfg, self.ds, self.device = cfg, ds, run.device
        self.comps, self.engine, self.prediction_type, self.ema = (
            comps,
            engine,
            model.prediction_type,
            model.ema,
        )
        self.batches, self.state, self.skipped_images = data.batches, data.start, data.skipped_images
        self.writer = writer
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Constant for the run, so computed here and not per micro-step.
        self.objective = Objective(model.prediction_type, cfg.snr_gamma, comps.family.flow_settings(cfg))
        self.model_dtype = next(p for p in engine.module.parameters()).dtype
        # No CPU-GPU sync per phase unless --sync-timing: on CUDA, events timed per phase, read a step late.
        self.timer = PhaseTimer(timing_mode(run.device, cfg.sync_timing))
        self.shape = {
            "world_size": self.world,
            "zero_stage": ds.zero_stage,
            "dtype": ds.dtype,
            "micro_batch": ds.micro_batch,
            "grad_accum": ds.grad_accum,
        }
        self.callbacks = list(callbacks)
        self.measuring = measuring
        """The callback among `callbacks` that measures the steps (`measure_with` gives its place to another)."""
        self._handlers = handlers_of(self.callbacks)
        self.step_log: StepLog | None = None
        self.step_extras: dict[str, Any] = {}
        """Fields a callback adds to this step's metrics line (set before `on_step_queued`)."""
        self._emit("on_setup")

    # ------------------------------------------------------------------------------------------ events

    def _emit(self, event: str, *args: Any) -> None:
        for handler in self._handlers[event]:
            handler(self, *args)

    def measure_with(self, probe: Callback) -> None:
        """Put `probe` in the measuring callback's place, keeping the callbacks' order: a launch of several
        configs installs each config's probe there for its steps (sdzero.training.measuring.sweep)."""
        if self.measuring is None:
            raise ValueError("this Trainer has no measuring slot (Trainer.setup makes one)")
        self.callbacks[self.callbacks.index(self.measuring)] = probe
        self.measuring = probe
        self._handlers = handlers_of(self.callbacks)

    def use_batch_shape(self, ds: DsSettings, batches: BatchSource) -> None:
        """From the next step, draw from `batches` and take `ds`'s micro-batch and accumulation (the engine
        is told apart): a launch of several configs switches between them on one engine."""
        self.ds, self.batches = ds, batches
        self.shape.update(micro_batch=ds.micro_batch, grad_accum=ds.grad_accum)

    def open_step_log(self, bar: Any) -> StepLog:
        """A fresh log of the steps about to run: each step's metrics line read back, written, on `bar`."""
        lag = 1 if self.timer.mode == "events" else 0  # on CUDA a step's line is read a step late
        self.step_log = StepLog(
            lag, self.ds.global_batch, self.writer, self.engine.monitor, self._on_record, bar
        )
        return self.step_log

    def emit_checkpoint_staged(self, step: int, folder: Path) -> None:
        """Raised by the Checkpointer inside a save (see CheckpointCallback.on_setup)."""
        self._emit("on_checkpoint_staged", step, folder)

    def _on_record(self, step: int, record: dict[str, Any]) -> None:
        self._emit("on_metrics", step, record)

    # -------------------------------------------------------------------------------------------- step

    def micro_step(self, batch: StepInput) -> torch.Tensor:
        timer = self.timer
        with timer.phase("encode_s"):
            batch = batch.to(self.device, non_blocking=True)
            latents, cond = encode_batch(self.comps, batch)
        with timer.phase("forward_s"):
            inputs = LossInputs(
                self.engine, self.model_dtype, self.comps.noise_scheduler, latents, cond, batch
            )
            loss = self.comps.family.loss(inputs, self.objective)
        with timer.phase("backward_s"):
            self.engine.backward(loss)
        with timer.phase("optimizer_s"):
            self.engine.step()  # only the accumulation boundary's call updates weights (and communicates)
        return loss.detach()

    def train_step(self, step: int) -> bool:
        """One optimizer step (grad_accum micro-steps) and its events; True if the ranks agreed to stop
        here and no callback ended the run (the PreemptionCallback raises Preempted)."""
        assert self.step_log is not None, "train_step runs inside train()"
        engine, batches, timer = self.engine, self.batches, self.timer
        progress.set_step(step)
        self._emit("on_step_begin", step)
        timer.begin_step()
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        on_batch = self._handlers["on_batch"]
        for _ in range(self.ds.grad_accum):
            with timer.phase("data_s"):
                batch = batches.next()
                for handler in on_batch:
                    handler(self, batch)
            loss_sum += self.micro_step(batch)
        self._emit("on_optimizer_step", step)
        vote = any(wants(self) for wants in self._handlers["wants_stop"])
        progress.enter("step statistics")
        stats = launch_step_stats(loss_sum, self.ds.grad_accum, self.world, vote, peak_memory_bytes())
        fields = {
            "lr": float(engine.get_lr()[0]),
            **self.shape,
            "loss_scale": loss_scale_of(engine),
            "skipped_steps": int(engine.skipped_steps) if engine.fp16_enabled() else None,
            **self.step_extras,
        }
        self.step_extras = {}
        self._emit("on_step_queued", step)
        # Writes this step's line (CPU, --sync-timing) or the previous one's (CUDA): its stats read back.
        pending = PendingStep(
            step, batches.epoch, start, stats, timer.end_step(), fields, int(engine.global_samples)
        )
        stop = self.step_log.add(pending)
        self.state = TrainState(step, batches.epoch, batches.batches_in_epoch, batches.samples_in_epoch)
        if stop:
            self.step_log.flush()  # the line of the step about to be saved, before the exit
            self._emit("on_stop", step)
        else:
            self._emit("on_step_end", step)
        return stop

    def train(self, until: int | None = None) -> RunSummary:
        """Train from the step after `state.step` through step `until` (default --max-steps)."""
        from tqdm import tqdm

        last = self.cfg.max_steps if until is None else until
        first = self.state.step + 1  # 1, or the step after the resumed checkpoint's
        bar = tqdm(
            total=last,
            initial=first - 1,
            desc="train",
            unit="step",
            disable=self.rank != 0,
            dynamic_ncols=True,
        )
        self.open_step_log(bar)
        try:
            for step in range(first, last + 1):
                if self.train_step(step):
                    break
            self.step_log.flush()
        finally:
            bar.close()  # on a step that raises too (a preemption): not left to the garbage collector
        self.skipped_images += self.batches.check_late()  # the last epoch's late failures
        self._emit("on_finish")
        metrics_path = str(self.cfg.output_dir / "metrics.jsonl")
        if self.writer is not None:
            self.writer.close()
            finish_wandb_run()
        if self.cfg.export_final:
            progress.enter("export")
            export_final(self.cfg, self.engine, self.comps, self.rank, self.ema)
        progress.enter("finished")
        # The first step includes one-off warm-up (allocations, JIT, workers).
        losses, rates = self.step_log.losses, self.step_log.rates
        steady = rates[1:] or rates or [0.0]
        return RunSummary(
            steps=len(losses),
            first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"),
            mean_samples_per_s=sum(steady) / len(steady),
            metrics_path=metrics_path,
            skipped_images=self.skipped_images,
        )

    def close(self) -> None:
        """Stop the data loader's worker processes: call it after the last `train()` (see Batches.close;
        an exit without it waits on them for ever)."""
        run_watch.stop_watch()
        self.batches.close()

    # ------------------------------------------------------------------------------------------- setup

    @classmethod
    def setup(cls, cfg: TrainConfig) -> Trainer:
        """Everything before the first step, in the order that makes errors cheap: the inputs are checked
        before the process group exists, the slow parts (model, data, engine) come after it."""
        ds, cache = check_inputs(cfg)
        extras = extra_callbacks()  # SDZERO_CALLBACKS: a wrong name fails before the slow start-up
        # Installed before the slow start-up, so that an early SIGTERM is honoured at the first step boundary.
        preemption = PreemptionFlag(cfg.preempt_timeout_s).install()
        share_cpu_threads()  # before any torch work: k ranks x all cores threads each thrash a node's CPUs
        ranks, point = join_run(cfg, ds)
        rank, world, device = ranks.rank, ranks.world, ranks.device

        # From a cache, the VAE and text encoders are never loaded (validation/export load them when due).
        run_watch.mark("model load")
        comps = load_components(
            cfg.model, ds.dtype, device, frozen=cache is None, max_sequence_length=cfg.max_sequence_length
        )
        prediction_type = resolve_prediction_type(comps, cfg.prediction_type)  # "flow_matching" for SD3
        run_watch.mark("data listing")
        dataset, sampler, loader, n_bad = build_data(cfg, ds, comps, rank, world, cache)
        dropped = samples_dropped(sampler, len(dataset), ds.micro_batch, world)
        attention = check_attention(cfg, comps.network, DTYPES[ds.dtype], device)  # the SDPA kernel, probed
        universal = point is not None and point.universal is not None
        run_watch.mark("engine build")
        engine, config = init_engine(cfg, ds, comps, universal=universal)
        speed = speed_report(cfg, engine, timing_mode(device, cfg.sync_timing), attention)
        ema = make_ema(cfg, engine)
        ident = describe_run(cfg, ds, comps, prediction_type, model_reference(cfg.model))
        checkpoints = CheckpointCallback(
            Checkpointer(cfg.output_dir, cfg.keep_last, engine, ema, ident, adapter_parts(engine, comps)),
            cfg.checkpoint_every,
        )
        validator = make_validator(cfg, comps)
        run_watch.mark("resume")
        state = checkpoints.restore(point)  # a collective when resuming
        writer = prepare_output(cfg, ds, config, rank, {"samples_dropped_per_epoch": dropped}, speed)
        if rank == 0:
            log_run_shape(cfg, ds, world, len(dataset), n_bad, dropped, sampler, from_cache=cache is not None)
        late = LateFailures(len(dataset), n_bad, cfg.max_bad_fraction, cfg.data) if cache is None else None
        batches = Batches(loader, sampler, state.epoch, state.batches_in_epoch, state.samples_in_epoch, late)
        # The measuring slot: --profile-out's probe, or a callback with no events that a launch of several
        # configs fills with each config's probe in turn (sdzero.training.measuring.sweep).
        measuring = start_probe(cfg, ds, engine, comps) or Callback()
        # Order matters where two act on one event: validation before the checkpoint of the same step, the
        # profile after the final validation and checkpoint, and the preemption exit after its checkpoint.
        callbacks: list[Callback] = [
            *([EmaCallback(ema)] if ema is not None else []),
            ValidationCallback(validator),
            checkpoints,
            measuring,
            *extras,
            *([StragglerCallback(cfg.straggler_every)] if cfg.straggler_every else []),
            *([LinkProbeCallback(cfg.straggler_every)] if cfg.straggler_every else []),
            PreemptionCallback(preemption),
        ]
        # every rank's start-up phases, shared once; the first step's metrics line carries them
        callbacks.append(StartupRecord(run_watch.startup_done(rank)))
        return cls(
            RunSettings(cfg, ds, device),
            ModelSide(comps, engine, prediction_type, ema),
            DataSide(batches, state, skipped_images=n_bad),
            callbacks=callbacks,
            writer=writer,
            measuring=measuring,
        )


# ----------------------------------------------------------------------------------- setup's parts


def check_inputs(cfg: TrainConfig) -> tuple[DsSettings, CacheIndex | None]:
    """(the DeepSpeed JSON's settings, the latent cache or None), after checking everything that can be
    wrong with the input: run before the process group exists, so that a mistake is one clear line."""
    ds = load_ds_config(cfg.deepspeed_config, world_size_from_env())
    family = detect_family(cfg.model)
    family.check_options(cfg)  # e.g. SD3-only flags on an SDXL model: one clear line
    check_targets_on_model(cfg, family)  # --lora-target-modules naming no layer of the network: one line
    read_records(cfg.data)  # a folder's metadata or the tar shards' index: one line if either is wrong
    check_speed_options(cfg, ds)  # e.g. --compile with ZeRO-3 parameter offload: one line
    if cfg.cache_dir is None:
        return ds, None
    # A cache made for another model, size, precision or data: refused.
    cache = open_cache(
        cfg.cache_dir,
        cfg.model,
        cfg.data,
        cfg.resolution,
        cfg.buckets,
        ds.dtype,
        cfg.random_flip,
        cfg.max_sequence_length,
    )
    return ds, cache


def join_run(cfg: TrainConfig, ds: DsSettings) -> tuple[Ranks, ResumePoint | None]:
    """Start the process group and agree on where the run starts: (this rank's place, the checkpoint to
    resume from or None). Seeds torch for identical initial weights on every rank."""
    run_watch.start_watch(cfg)  # this rank's progress and the stall watch, start-up included
    ranks = start_distributed(cfg.dist_timeout_s)
    run_watch.joined(ranks.world)
    quiet_libraries(ranks.rank, cfg.output_dir)  # rank 0's library chatter into <output_dir>/library.log
    # A node without the output or data folders: one clear error.
    run_watch.mark("storage checks")
    check_shared_storage(cfg.output_dir, cfg.data, ranks.rank, ranks.world)
    point = find_resume(  # all ranks agree; on another world size with --resume-elastic, converted once
        cfg.resume, cfg.output_dir, ds.zero_stage, ds.dtype, ranks.world, cfg.resume_elastic, ds.raw
    )
    run_watch.output_ready()  # claimed by find_resume: the watch's host files may go there now
    adopt_checkpoint_seed(cfg, point, ranks.rank)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DeepSpeed also broadcasts)
    apply_backend_flags(cfg, ranks.device.type)  # TF32 (CUDA only)
    return ranks, point


def adapter_parts(engine: Any, comps: Components) -> tuple[AdapterCheckpoint, ...]:
    """A LoRA run's checkpoints also hold the gathered adapter (sdzero.checkpoint.adapter)."""
    return (AdapterCheckpoint(engine, comps.family),) if is_lora(engine.module) else ()


def make_validator(cfg: TrainConfig, comps: Components) -> Validator:
    return Validator(
        cfg.validation_prompts,
        cfg.validation_every,
        cfg.validation_inference_steps,
        cfg.resolution or comps.native_resolution,
        cfg.seed,
        cfg.output_dir / "validation",
    )


def log_run_shape(
    cfg: TrainConfig,
    ds: DsSettings,
    world: int,
    n_images: int,
    n_bad: int,
    dropped: int,
    sampler: Any,
    from_cache: bool,
) -> None:
    """Rank 0's start-up line: the batch shape, the learning rate, the data, and the buckets."""
    log.info(
        "ZeRO-%d %s | %d ranks x micro-batch %d x accumulation %d = global batch %d | lr %.3g (%s "
        "scaling) | %d images (%d unreadable skipped) | %d samples per epoch left out by the batch "
        "shape%s",
        ds.zero_stage,
        ds.dtype,
        world,
        ds.micro_batch,
        ds.grad_accum,
        ds.global_batch,
        cfg.effective_lr(ds),
        cfg.lr_scaling,
        n_images,
        n_bad,
        dropped,
        f" | from cache {cfg.cache_dir}" if from_cache else "",
    )
    if isinstance(sampler, BucketBatchSampler):
        log.info("aspect-ratio buckets (height x width: images): %s", sampler.describe())


def run(cfg: TrainConfig) -> RunSummary:
    """A whole run from its options: what `sdzero/train.py` does. Its driver is the Trainer's own loop, or
    for --profile-configs the launch that measures several configs (sdzero.training.measuring.sweep)."""
    sweep = plan_sweep(cfg)  # its options checked before the slow start-up
    trainer = Trainer.setup(cfg)
    try:
        return RunSummary(**ConfigSweep(trainer, sweep).run()) if sweep else trainer.train()
    finally:
        trainer.close()
