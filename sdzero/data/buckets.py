"""Aspect-ratio buckets: a few training resolutions of about equal pixel count, and a batch sampler that
serves one bucket per optimizer step.

Every rank computes the same plan from (seed, epoch) and the bucket of each sample, so the ranks agree on
the bucket of every step without any communication: each step's global batch (micro x accumulation x
world) is one chunk of one bucket's shuffled samples, and rank r's micro-batch m of that step is the
slice (m * world + r) of the chunk. A bucket whose size is not a multiple of the global batch leaves its
remainder out of the epoch (a different remainder each epoch, since each epoch shuffles anew); that count
is what the batch shape forces, and `EpochPlan.dropped` reports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Sampler

from sdzero.errors import UserError

Size = tuple[int, int]  # (height, width) in pixels

MAX_ASPECT = 2.0
"""Widest bucket allowed, as the long side over the short side (SDXL's buckets reach about 1:2)."""
PIXEL_TOLERANCE = 0.1
"""A bucket's pixel count may differ from the base resolution's square by at most this fraction."""


def bucket_sizes(
    resolution: int, granularity: int, max_aspect: float = MAX_ASPECT, max_side: int | None = None
) -> list[Size]:
    """(height, width) pairs, sides multiples of `granularity`, each about `resolution`^2 pixels.

    For every height on the grid the width is the grid value closest to an equal pixel count; pairs too
    far from it (coarse grids at small resolutions) or too elongated are left out. Each size comes with
    its transpose, so portrait and landscape get the same choice. Sides above `max_side` (the largest
    latent a transformer's position embedding covers) are left out. Sorted wide to tall.
    """
    if granularity < 1 or resolution % granularity:
        raise UserError(
            f"--resolution {resolution} is not a multiple of {granularity} (the latent patch granularity of "
            "this model), which aspect-ratio buckets need; pick a resolution that is"
        )
    area = resolution * resolution
    sizes = []
    for height in range(granularity, int(resolution * max_aspect) + 1, granularity):
        width = granularity * max(1, round(area / height / granularity))
        aspect = max(height, width) / min(height, width)
        if aspect <= max_aspect + 1e-9 and abs(height * width - area) <= PIXEL_TOLERANCE * area:
            sizes += [(height, width), (width, height)]  # both orientations: wide and tall sets mirror
    fitting = {s for s in sizes if max_side is None or max(s) <= max_side}
    if (resolution, resolution) not in fitting:
        raise UserError(
            f"--resolution {resolution} is above the {max_side} pixels this model's position embedding covers; "
            "pick a smaller resolution"
        )
    return sorted(fitting, key=lambda s: s[0] / s[1])


def nearest_bucket(image_hw: Size, sizes: Sequence[Size]) -> int:
    """The bucket whose aspect ratio is closest in log space (1:2 and 2:1 are equally far from 1:1)."""
    ratio = math.log(image_hw[0] / image_hw[1])
    return min(range(len(sizes)), key=lambda b: abs(math.log(sizes[b][0] / sizes[b][1]) - ratio))


def image_sizes(paths: Sequence[Path]) -> list[Size]:
    """(height, width) of each image from its header alone (no decode)."""
    out = []
    for path in paths:
        with Image.open(path) as img:
            out.append((img.height, img.width))
    return out


def assign_buckets(image_hw: Sequence[Size], sizes: Sequence[Size]) -> list[int]:
    return [nearest_bucket(hw, sizes) for hw in image_hw]


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's steps: `steps[s]` is (bucket, the global batch of sample indices), the same on every rank."""

    steps: list[tuple[int, list[int]]]
    dropped: int
    """Samples left out of this epoch because their bucket's count is not a multiple of the global batch."""


def plan_epoch(
    bucket_of: Sequence[int], n_buckets: int, global_batch: int, seed: int, epoch: int
) -> EpochPlan:
    """Shuffle each bucket, cut it into whole global batches, and shuffle the order of those batches."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0x6275636B])))
    members: list[list[int]] = [[] for _ in range(n_buckets)]
    for index, bucket in enumerate(bucket_of):
        members[bucket].append(index)
    steps: list[tuple[int, list[int]]] = []
    dropped = 0
    for bucket, indices in enumerate(members):
        order = [indices[i] for i in rng.permutation(len(indices))]
        full = len(order) // global_batch
        dropped += len(order) - full * global_batch
        steps += [(bucket, order[k * global_batch : (k + 1) * global_batch]) for k in range(full)]
    # A random order of the chunks: each step's bucket is drawn in proportion to what the buckets have left.
    return EpochPlan([steps[i] for i in rng.permutation(len(steps))], dropped)


def dropped_per_epoch(bucket_of: Sequence[int], n_buckets: int, global_batch: int) -> int:
    counts = np.bincount(np.asarray(bucket_of, dtype=np.int64), minlength=n_buckets)
    return int((counts % global_batch).sum())


class BucketBatchSampler(Sampler):
    """A DataLoader `batch_sampler`: this rank's micro-batches of (index, epoch) keys, one bucket per step.

    `set_epoch(epoch, start)` takes `start` in samples taken by all ranks, as `EpochSampler` does, so a
    resume skips exactly the steps already trained on (on any world size with the same global batch).
    """

    def __init__(
        self,
        bucket_of: Sequence[int],
        n_buckets: int,
        micro_batch: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
        sizes: Sequence[Size] | None = None,
    ) -> None:
        self.sizes = list(sizes) if sizes is not None else None
        self.bucket_of = list(bucket_of)
        self.n_buckets = n_buckets
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.global_batch = micro_batch * grad_accum * world_size
        if all(c < self.global_batch for c in np.bincount(np.asarray(self.bucket_of), minlength=n_buckets)):
            raise UserError(
                f"no aspect-ratio bucket holds a full global batch of {self.global_batch} images, so an epoch "
                "would have no step; add images, shrink the batch, or train without --buckets"
            )
        self.epoch, self.start_batches = 0, 0

    def describe(self) -> str:
        counts = np.bincount(np.asarray(self.bucket_of), minlength=self.n_buckets)
        names = (
            [f"{h}x{w}" for h, w in self.sizes] if self.sizes else [f"#{b}" for b in range(self.n_buckets)]
        )
        return ", ".join(f"{name}: {int(c)}" for name, c in zip(names, counts, strict=True))

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """`start`: samples of this epoch all ranks have already taken (a resume's data position). Micro-batch
        m of a step takes chunk[m x world x micro : (m + 1) x world x micro] over all ranks, so `start` is
        a whole number of such rounds. The plan itself is cut into global batches: a resume on another
        world size must keep the global batch (sdzero.checkpoint.identity checks it)."""
        per_round = self.micro_batch * self.world_size
        if start % per_round:
            raise UserError(
                f"--buckets: the checkpoint's data position ({start} samples into epoch {epoch}) is not a "
                f"whole number of this run's {per_round} samples per micro-batch round; resume with the "
                "original global batch (micro-batch x accumulation x ranks)"
            )
        self.epoch, self.start_batches = epoch, start // per_round

    def plan(self, epoch: int | None = None) -> EpochPlan:
        return plan_epoch(
            self.bucket_of,
            self.n_buckets,
            self.global_batch,
            self.seed,
            self.epoch if epoch is None else epoch,
        )

    def micro_batches(self, epoch: int) -> Iterator[list[int]]:
        """This rank's micro-batches of the epoch, in order (accumulation steps of one step are adjacent)."""
        for _, chunk in self.plan(epoch).steps:
            for micro in range(self.grad_accum):
                at = (micro * self.world_size + self.rank) * self.micro_batch
                yield chunk[at : at + self.micro_batch]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for pos, indices in enumerate(self.micro_batches(self.epoch)):
            if pos >= self.start_batches:
                yield [(i, self.epoch) for i in indices]

    def __len__(self) -> int:
        full = len(self.bucket_of) - dropped_per_epoch(self.bucket_of, self.n_buckets, self.global_batch)
        return full // self.global_batch * self.grad_accum - self.start_batches


def samples_dropped(sampler: Sampler, n: int, micro_batch: int, world_size: int) -> int:
    """Samples per epoch that no rank trains on because of the batch shape.

    With buckets: each bucket's remainder modulo the global batch. Without: what DistributedSampler's
    drop_last (n mod world) and the loader's drop_last (each rank's share mod micro-batch) leave out.
    """
    if isinstance(sampler, BucketBatchSampler):
        return dropped_per_epoch(sampler.bucket_of, sampler.n_buckets, sampler.global_batch)
    per_rank = n // world_size
    return n - world_size * micro_batch * (per_rank // micro_batch)
