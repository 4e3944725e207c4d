"""The training loop: one DeepSpeed engine around the UNet, frozen encoders beside it, metrics per step."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from sdzero.buckets import BucketBatchSampler, assign_buckets, bucket_sizes, image_sizes, samples_dropped
from sdzero.cache import CachedSamples, CacheIndex, net_geometry, open_cache
from sdzero.checkpoint import find_resume
from sdzero.config import DsSettings, TrainConfig, load_ds_config, world_size_from_env
from sdzero.data import (
    CaptionedImages,
    EpochSampler,
    LateFailures,
    SampleSpec,
    check_bad_fraction,
    find_unreadable,
    read_metadata,
    set_max_image_pixels,
)
from sdzero.environment import environment_snapshot, share_cpu_threads
from sdzero.errors import UserError
from sdzero.inputs import encode_batch
from sdzero.metrics import MetricsWriter, peak_memory_bytes, rotate_previous
from sdzero.models import (
    DTYPES,
    Components,
    detect_family,
    load_components,
    resolve_prediction_type,
    tokenize,
)
from sdzero.monitoring import finish_wandb_run
from sdzero.objectives import denoising_loss
from sdzero.preemption import PreemptionFlag, ignore_preemption_signals
from sdzero.profiling import start_probe
from sdzero.shm import release_shm_buffer
from sdzero.speed import (
    adamw_options,
    apply_backend_flags,
    check_attention,
    check_speed_options,
    compile_engine,
    prepare_network,
    speed_report,
)
from sdzero.step_hooks import StepHooks, adopt_checkpoint_seed
from sdzero.step_log import PendingStep, StepLog, launch_step_stats
from sdzero.storage import check_shared_storage
from sdzero.timing import PhaseTimer, timing_mode

log = logging.getLogger("sdzero")


@dataclass
class RunSummary:
    steps: int
    first_loss: float
    last_loss: float
    mean_samples_per_s: float
    metrics_path: str
    skipped_images: int


def quiet_libraries(rank: int) -> None:
    """DeepSpeed, diffusers and transformers log a lot at INFO; keep warnings, and only on rank 0."""
    import diffusers
    import transformers
    from deepspeed.utils import logger as ds_logger

    level = logging.WARNING if rank == 0 else logging.ERROR
    ds_logger.setLevel(level)
    diffusers.utils.logging.set_verbosity(level)
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity(level)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="[sdzero] %(message)s")


def effective_ds_config(cfg: TrainConfig, ds: DsSettings, universal: bool = False) -> dict[str, Any]:
    """The JSON handed to DeepSpeed: the user's file with the resolved LR written into the optimizer, and
    `checkpoint.load_universal` when resuming on another world size (sdzero.universal)."""
    config = json.loads(json.dumps(ds.raw))
    if "optimizer" in config:
        config["optimizer"].setdefault("params", {})["lr"] = cfg.effective_lr(ds)
    if universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    return config


def build_data(
    cfg: TrainConfig,
    ds: DsSettings,
    comps: Components,
    rank: int,
    world: int,
    cache: CacheIndex | None = None,
):
    """Dataset and loader; unreadable images are found by all ranks together (each checks a share), or
    were found when the cache was built."""
    if cache is None:
        set_max_image_pixels(cfg.max_image_pixels)  # before the check and the workers' fork
        records = read_metadata(cfg.data)
        mine = find_unreadable(records, rank, world)
        shares: list[list[int]] = [[] for _ in range(world)]
        dist.all_gather_object(shares, mine)  # every rank must agree on the dataset, or collectives desync
        bad = {i for share in shares for i in share}
        check_bad_fraction(len(records), len(bad), cfg.max_bad_fraction, cfg.data)
        good = [r for i, r in enumerate(records) if i not in bad]
        n_good, n_bad = len(good), len(bad)
    else:
        n_good, n_bad = len(cache), len(cache.raw["skipped_unreadable"])
    per_step = ds.micro_batch * ds.grad_accum * world
    if n_good < per_step:
        raise UserError(
            f"--data {cfg.data}: {n_good} readable images, fewer than one global batch of {per_step} "
            "(micro-batch x accumulation x world size); add images or shrink the batch in the DeepSpeed JSON"
        )
    resolution = cfg.resolution or comps.native_resolution
    side = resolution // comps.vae_scale_factor
    spec = SampleSpec(
        resolution=resolution,
        latent_shape=(comps.latent_channels, side, side),
        num_train_timesteps=int(comps.noise_scheduler.config.num_train_timesteps),
        seed=cfg.seed,
        random_flip=cfg.random_flip,
        random_crop=cfg.random_crop,
        noise_offset=cfg.noise_offset,
        flow=cfg.flow_settings() if comps.family == "sd3" else None,
    )
    sampler: EpochSampler | BucketBatchSampler = EpochSampler(n_good, rank, world, seed=cfg.seed)
    batching: dict[str, Any] = {"batch_size": ds.micro_batch, "sampler": sampler, "drop_last": True}
    sizes = None
    if cfg.buckets:
        # Every rank computes the same assignment from the same files: no communication needed.
        if cache is not None:
            bucket_list = [(h, w) for h, w in cache.spec.buckets or []]
            image_hw = cache.sizes
        else:
            geometry = net_geometry(cfg.model)
            bucket_list = bucket_sizes(resolution, geometry.granularity, max_side=geometry.max_side)
            image_hw = image_sizes([r.path for r in good])
        bucket_of = assign_buckets(image_hw, bucket_list)
        sizes = [bucket_list[b] for b in bucket_of]
        sampler = BucketBatchSampler(
            bucket_of,
            len(bucket_list),
            ds.micro_batch,
            ds.grad_accum,
            rank,
            world,
            seed=cfg.seed,
            sizes=bucket_list,
        )
        batching = {"batch_sampler": sampler}
    if cache is not None:
        dataset: CaptionedImages | CachedSamples = CachedSamples(cache, spec)
    else:
        dataset = CaptionedImages(good, spec, functools.partial(tokenize, comps), sizes)
    loader = DataLoader(
        dataset,
        **batching,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=ignore_preemption_signals,  # the rank handles SIGTERM; a dead worker can't save
    )
    return dataset, sampler, loader, n_bad


SAMPLE_LOG = "SDZERO_TEST_SAMPLE_LOG"
"""Test hook: a folder; each rank appends the (epoch, sample indices) of every micro-batch it trains on
to rank_<r>.jsonl there, so a test can check that resumes neither repeat nor skip a sample."""


class Batches:
    """Endless micro-batches across epochs, calling `set_epoch` so each epoch gets a new order.

    The data position is kept in samples taken by all ranks together (`samples_in_epoch`), not in this
    rank's batches: a resume starts the sampler there, on any world size, so no sample is read twice or
    skipped, and none is loaded just to be thrown away. `batches_in_epoch` (this rank's micro-batches) is
    what older checkpoints recorded; it stands for `batches x micro-batch x world size` samples.
    """

    def __init__(
        self,
        loader: DataLoader,
        sampler: EpochSampler | BucketBatchSampler,
        epoch: int = 0,
        batches_in_epoch: int = 0,
        samples_in_epoch: int | None = None,
        late: LateFailures | None = None,
    ):
        self.loader, self.sampler, self.late = loader, sampler, late
        per_batch = int(loader.batch_size or getattr(sampler, "micro_batch", 1))  # batch_sampler: buckets
        self.samples_per_batch = per_batch * sampler.world_size  # one micro-batch on every rank
        if samples_in_epoch is None:
            samples_in_epoch = batches_in_epoch * self.samples_per_batch
        self.epoch, self.samples_in_epoch = epoch, samples_in_epoch
        self.batches_in_epoch = samples_in_epoch // self.samples_per_batch
        self.sampler.set_epoch(epoch, start=samples_in_epoch)
        self._it = iter(loader)
        folder = os.environ.get(SAMPLE_LOG)
        self._log = Path(folder) / f"rank_{sampler.rank}.jsonl" if folder else None

    def next(self) -> dict[str, torch.Tensor]:
        try:
            batch = next(self._it)
        except StopIteration:
            self.check_late()  # every rank ends the epoch at the same micro-batch: a safe collective
            self.epoch, self.batches_in_epoch, self.samples_in_epoch = self.epoch + 1, 0, 0
            self.sampler.set_epoch(self.epoch)
            self._it = iter(self.loader)
            batch = next(self._it)
        self.batches_in_epoch += 1
        self.samples_in_epoch += self.samples_per_batch
        if self.late is not None:
            self.late.note(batch)
        if self._log is not None:
            with open(self._log, "a") as f:
                f.write(json.dumps({"epoch": self.epoch, "index": batch["index"].tolist()}) + "\n")
        return batch

    def check_late(self) -> int:
        """Images that failed after the start-up check, on all ranks (a collective; see LateFailures)."""
        return self.late.check() if self.late is not None else 0


def make_lr_scheduler(cfg: TrainConfig, ds: DsSettings):
    if "scheduler" in ds.raw or cfg.lr_warmup_steps <= 0:
        return None  # DeepSpeed's own scheduler section, or a constant LR
    warmup = cfg.lr_warmup_steps
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup)
    )


def init_engine(cfg: TrainConfig, ds: DsSettings, comps: Components, universal: bool = False):
    import deepspeed

    if cfg.gradient_checkpointing:
        comps.unet.enable_gradient_checkpointing()
    params = [p for p in comps.unet.parameters() if p.requires_grad]
    config = effective_ds_config(cfg, ds, universal)
    optimizer = None
    if "optimizer" not in config:
        device_type = get_accelerator_device_type()
        optimizer = torch.optim.AdamW(params, lr=cfg.effective_lr(ds), **adamw_options(device_type))
    engine, _, _, _ = deepspeed.initialize(
        model=comps.unet,
        model_parameters=params,
        optimizer=optimizer,
        lr_scheduler=make_lr_scheduler(cfg, ds),
        config=config,
    )
    prepare_network(cfg, engine.module)  # --channels-last, --attention: hooks on the trained network
    compile_engine(cfg, engine)  # --compile: in place, after ZeRO has laid out the parameters
    return engine, config


def get_accelerator_device_type() -> str:
    from deepspeed.accelerator import get_accelerator

    return str(get_accelerator().device_name())


def loss_scale_of(engine) -> float | None:
    if not engine.fp16_enabled():
        return None
    opt = engine.optimizer
    scale = getattr(opt, "loss_scale", None)
    if scale is None and hasattr(opt, "cur_scale"):
        scale = opt.cur_scale
    return float(scale) if scale is not None else None


def micro_step(
    engine,
    comps: Components,
    batch: dict[str, torch.Tensor],
    prediction_type: str,
    cfg: TrainConfig,
    timer: PhaseTimer,
    device: torch.device,
) -> torch.Tensor:
    with timer.phase("encode_s"):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        latents, cond = encode_batch(comps, batch)
    with timer.phase("forward_s"):
        model_dtype = next(p for p in engine.module.parameters()).dtype
        loss = denoising_loss(
            engine,
            model_dtype,
            comps.noise_scheduler,
            latents,
            cond,
            batch,
            prediction_type,
            cfg.snr_gamma,
            family=comps.family,
            flow=cfg.flow_settings() if comps.family == "sd3" else None,
        )
    with timer.phase("backward_s"):
        engine.backward(loss)
    with timer.phase("optimizer_s"):
        engine.step()  # only the accumulation boundary's call updates weights (and communicates)
    return loss.detach()


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
    (cfg.output_dir / "ds_config.json").write_text(json.dumps(config, indent=2) + "\n")
    run = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    run.update(
        zero_stage=ds.zero_stage,
        dtype=ds.dtype,
        world_size=ds.world_size,
        lr_effective=cfg.effective_lr(ds),
        **(extra or {}),
    )
    (cfg.output_dir / "run_config.json").write_text(json.dumps(run, indent=2) + "\n")
    environment = {**environment_snapshot(), "world_size": ds.world_size}  # rank 0's view, for reports
    if speed is not None:
        environment["speed"] = speed  # what the fast paths really were (sdzero.speed)
    (cfg.output_dir / "environment.json").write_text(json.dumps(environment, indent=2) + "\n")
    return MetricsWriter(cfg.output_dir / "metrics.jsonl")


def gather_step_stats(
    loss_sum: torch.Tensor, micro_steps: int, world: int, stop: bool = False
) -> tuple[float, list[int], bool]:
    """Loss averaged over ranks and micro-steps, every rank's peak memory, and whether any rank was asked
    to stop (SIGTERM/SIGUSR1), so that all stop at this step: one small collective, read back at once (the
    loop itself reads it with the metrics line, see sdzero.step_log)."""
    return launch_step_stats(loss_sum, micro_steps, world, stop, peak_memory_bytes()).resolve()


def run(cfg: TrainConfig) -> RunSummary:
    # Everything that can be wrong with the input is checked before the process group exists.
    ds = load_ds_config(cfg.deepspeed_config, world_size_from_env())
    cfg.check_family(detect_family(cfg.model))  # e.g. SD3-only flags on an SDXL model: one clear line
    read_metadata(cfg.data)
    check_speed_options(cfg, ds)  # e.g. --compile with ZeRO-3 parameter offload: one line
    cache = None
    if cfg.cache_dir is not None:  # a cache made for another model, size, precision or data: refused here
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
    # Installed before the slow start-up, so that an early SIGTERM is honoured at the first step boundary.
    preemption = PreemptionFlag(cfg.preempt_timeout_s).install()
    share_cpu_threads()  # before any torch work: k ranks x all cores threads each thrash a node's CPUs

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # The timeout bounds every collective: when a host dies mid-run, the survivors raise instead of
    # waiting for ever. Under mpirun (no RANK/MASTER_* set) DeepSpeed discovers the ranks through mpi4py
    # and would use port 29500 unless told; a MASTER_PORT given to mpirun (-x) is kept.
    deepspeed.init_distributed(
        timeout=timedelta(seconds=cfg.dist_timeout_s),
        auto_mpi_discovery=True,
        distributed_port=int(os.environ.get("MASTER_PORT", "29500")),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has mapped its peers' shared-memory buffers by now
    release_shm_buffer(rank)
    quiet_libraries(rank)
    accel = get_accelerator()
    # init_distributed does not pick this rank's GPU (the engine does, later): without this, every rank's
    # early collectives (resume discovery, the image census) and frozen models would land on cuda:0.
    accel.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    check_shared_storage(cfg.output_dir, cfg.data, rank, world)  # a node without them: one clear error
    point = find_resume(  # all ranks agree; on another world size with --resume-elastic, converted once
        cfg.resume, cfg.output_dir, ds.zero_stage, ds.dtype, world, cfg.resume_elastic, ds.raw
    )
    adopt_checkpoint_seed(cfg, point, rank)
    device = torch.device(accel.current_device_name())
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DeepSpeed also broadcasts)
    apply_backend_flags(cfg, device.type)  # TF32 (CUDA only)

    # From a cache, the VAE and text encoders are never loaded (validation/export load them when due).
    comps = load_components(
        cfg.model, ds.dtype, device, frozen=cache is None, max_sequence_length=cfg.max_sequence_length
    )
    prediction_type = resolve_prediction_type(comps, cfg.prediction_type)  # "flow_matching" for SD3
    dataset, sampler, loader, n_bad = build_data(cfg, ds, comps, rank, world, cache)
    dropped = samples_dropped(sampler, len(dataset), ds.micro_batch, world)
    attention = check_attention(cfg, comps.unet, DTYPES[ds.dtype], device)  # the SDPA kernel, probed
    engine, config = init_engine(cfg, ds, comps, universal=point is not None and point.universal is not None)
    speed = speed_report(cfg, engine, timing_mode(device, cfg.sync_timing), attention)
    hooks = StepHooks(cfg, ds, engine, comps, prediction_type, device, preemption)
    state = hooks.restore(point)  # a collective when resuming
    writer = prepare_output(cfg, ds, config, rank, {"samples_dropped_per_epoch": dropped}, speed)
    if rank == 0:
        log.info(
            "ZeRO-%d %s | %d ranks x micro-batch %d x accumulation %d = global batch %d | lr %.3g (%s scaling) | "
            "%d images (%d unreadable skipped) | %d samples per epoch left out by the batch shape%s",
            ds.zero_stage,
            ds.dtype,
            world,
            ds.micro_batch,
            ds.grad_accum,
            ds.global_batch,
            cfg.effective_lr(ds),
            cfg.lr_scaling,
            len(dataset),
            n_bad,
            dropped,
            f" | from cache {cfg.cache_dir}" if cache is not None else "",
        )
        if isinstance(sampler, BucketBatchSampler):
            log.info("aspect-ratio buckets (height x width: images): %s", sampler.describe())
    late = LateFailures(len(dataset), n_bad, cfg.max_bad_fraction, cfg.data) if cache is None else None
    batches = Batches(loader, sampler, state.epoch, state.batches_in_epoch, state.samples_in_epoch, late)
    return train_steps(cfg, ds, comps, engine, batches, writer, prediction_type, n_bad, device, hooks)


def export_final(cfg: TrainConfig, engine, comps: Components, rank: int, ema=None) -> None:
    from sdzero.export import gathered_state_dict, write_pipeline
    from sdzero.models import DTYPES

    state = gathered_state_dict(engine)  # collective under ZeRO-3: all ranks take part
    ema_state = ema.gather_full() if ema is not None else None  # collective: EMA slices to rank 0
    if rank == 0 and state is not None:
        extra = {"unet_ema": ema_state} if ema_state is not None else None
        dtype = DTYPES[cfg.export_dtype]  # one dtype for every component (see write_pipeline)
        out = write_pipeline(cfg.output_dir / "final", state, comps, dtype, extra_unets=extra)
        log.info("exported the trained pipeline to %s", out)
    dist.barrier()


def train_steps(
    cfg, ds, comps, engine, batches: Batches, writer, prediction_type, n_bad, device, hooks: StepHooks
) -> RunSummary:
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    # No CPU-GPU sync per phase unless --sync-timing: on CUDA, events timed per phase, read a step late.
    timer = PhaseTimer(timing_mode(device, cfg.sync_timing))
    first = hooks.state.step + 1  # 1, or the step after the resumed checkpoint's
    bar = tqdm(
        total=cfg.max_steps,
        initial=first - 1,
        desc="train",
        unit="step",
        disable=rank != 0,
        dynamic_ncols=True,
    )
    probe = start_probe(cfg, ds, engine, comps)  # --profile-out measurements and test hooks
    log_ = StepLog(1 if timer.mode == "events" else 0, ds.global_batch, writer, engine.monitor, probe, bar)
    fields = {
        "world_size": world,
        "zero_stage": ds.zero_stage,
        "dtype": ds.dtype,
        "micro_batch": ds.micro_batch,
        "grad_accum": ds.grad_accum,
    }
    for step in range(first, cfg.max_steps + 1):
        probe.step_begin(step)
        timer.begin_step()
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=device)
        for _ in range(ds.grad_accum):
            with timer.phase("data_s"):
                batch = batches.next()
            loss_sum += micro_step(engine, comps, batch, prediction_type, cfg, timer, device)
        hooks.after_optimizer_step()  # EMA of this rank's fp32 master slice; no communication
        stats = launch_step_stats(loss_sum, ds.grad_accum, world, hooks.stop_requested, peak_memory_bytes())
        step_fields = {
            "lr": float(engine.get_lr()[0]),
            **fields,
            "loss_scale": loss_scale_of(engine),
            "skipped_steps": int(engine.skipped_steps) if engine.fp16_enabled() else None,
        }
        probe.step_end(step)
        # Writes this step's line (CPU, --sync-timing) or the previous one's (CUDA): its stats read back.
        stop = log_.add(
            PendingStep(
                step, batches.epoch, start, stats, timer.end_step(), step_fields, int(engine.global_samples)
            )
        )
        if stop:
            log_.flush()  # the line of the step about to be saved, before the exit
        hooks.end_of_step(step, batches, stop)  # validation, checkpoint; on stop: save, then exit 143
    log_.flush()
    bar.close()
    n_bad += batches.check_late() if isinstance(batches, Batches) else 0  # the last epoch's late failures
    hooks.finish(max(first - 1, cfg.max_steps), batches)
    probe.finish()  # a collective when profiling: every rank reports its memory figures
    metrics_path = str(cfg.output_dir / "metrics.jsonl")
    if writer is not None:
        writer.close()
        finish_wandb_run()
    if cfg.export_final:
        export_final(cfg, engine, comps, rank, hooks.ema)
    # The first step includes one-off warm-up (allocations, JIT, workers).
    losses, rates = log_.losses, log_.rates
    steady = rates[1:] or rates or [0.0]
    return RunSummary(
        steps=len(losses),
        first_loss=losses[0] if losses else float("nan"),
        last_loss=losses[-1] if losses else float("nan"),
        mean_samples_per_s=sum(steady) / len(steady),
        metrics_path=metrics_path,
        skipped_images=n_bad,
    )
