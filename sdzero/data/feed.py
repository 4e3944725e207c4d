"""The training data feed: the dataset and loader (`build_data`) and the endless micro-batches (StepInputs)
the Trainer draws from them (`Batches`), with the data position a checkpoint records."""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from sdzero.config.train_config import DsSettings, TrainConfig
from sdzero.data.buckets import BucketBatchSampler, assign_buckets, bucket_sizes
from sdzero.data.cache import CachedSamples, CacheIndex, net_geometry
from sdzero.data.images import (
    CaptionedImages,
    EpochSampler,
    LateFailures,
    SampleSpec,
    set_max_image_pixels,
)
from sdzero.data.listing import TorchRanks, check_images, good_sizes
from sdzero.data.shards import read_records
from sdzero.errors import UserError
from sdzero.models.families import Components
from sdzero.models.loading import tokenize
from sdzero.models.step_input import StepInput
from sdzero.process.preemption import ignore_preemption_signals


class BatchSource(Protocol):
    """What the Trainer draws micro-batches from: `Batches`, or a bench's pre-made batches."""

    epoch: int
    batches_in_epoch: int
    samples_in_epoch: int

    def next(self) -> StepInput: ...

    def check_late(self) -> int:
        """Images that failed after the start-up check (a collective for `Batches`)."""
        ...

    def close(self) -> None:
        """Stop any worker processes (after the last `train()`)."""
        ...


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
        records = read_records(cfg.data)  # a loose folder's metadata, or the tar shards' index
        # every rank must agree on the dataset, or collectives desync: checked together, from headers, and
        # remembered for the next start (sdzero.data.listing)
        checked = check_images(records, cfg.data, TorchRanks(rank, world), cfg.max_bad_fraction)
        bad = set(checked.bad)
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
        flow=comps.family.flow_settings(cfg),
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
            image_hw = good_sizes(checked)  # read once over all ranks by the start-up check
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
        collate_fn=StepInput.collate,  # a micro-batch is one StepInput, made here
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        worker_init_fn=ignore_preemption_signals,  # the rank handles SIGTERM; a dead worker can't save
    )
    return dataset, sampler, loader, n_bad


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

    def next(self) -> StepInput:
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
        return batch

    def check_late(self) -> int:
        """Images that failed after the start-up check, on all ranks (a collective; see LateFailures)."""
        return self.late.check() if self.late is not None else 0

    def close(self) -> None:
        """Stop the loader's worker processes now.

        They ignore SIGTERM (sdzero.process.preemption), so if they were still alive at interpreter exit,
        multiprocessing's exit handler would terminate them (no effect) and then wait on them for ever.
        Dropping the last reference to the loader's iterator would stop them too, but only if nothing
        else (a reference cycle) keeps it alive: this does not depend on that.
        """
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)  # multi-process iterators only
        if shutdown is not None:
            shutdown()
