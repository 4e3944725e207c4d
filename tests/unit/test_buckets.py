"""Aspect-ratio buckets: sizes, assignment, and the batch sampler's properties (ranks agree on every step's
bucket, coverage per epoch, the reported drop count, resume mid-epoch)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from sdzero.data.buckets import (
    BucketBatchSampler,
    assign_buckets,
    bucket_sizes,
    dropped_per_epoch,
    nearest_bucket,
    samples_dropped,
)
from sdzero.data.images import EpochSampler
from sdzero.errors import UserError


@pytest.mark.parametrize(("resolution", "granularity"), [(1024, 64), (512, 64), (64, 16), (32, 4)])
def test_sizes_are_on_the_grid_with_about_equal_pixels(resolution, granularity):
    sizes = bucket_sizes(resolution, granularity)
    assert (resolution, resolution) in sizes and len(sizes) >= 3
    for h, w in sizes:
        assert h % granularity == 0 and w % granularity == 0
        assert abs(h * w / resolution**2 - 1) <= 0.1
        assert max(h, w) / min(h, w) <= 2.0
        assert (w, h) in sizes  # portrait and landscape mirror each other
    ratios = [h / w for h, w in sizes]
    assert ratios == sorted(ratios)


def test_sdxl_like_set_and_refused_grid():
    assert {(1024, 1024), (896, 1152), (1152, 896), (768, 1344)} <= set(bucket_sizes(1024, 64))
    with pytest.raises(UserError, match="multiple of 64"):
        bucket_sizes(1000, 64)
    # SD3 at 1024: its position embedding covers 192 patches x 2 x 8 = 3072 px, so nothing is cut; a
    # smaller grid cuts the elongated sizes and keeps the rest.
    assert bucket_sizes(1024, 16, max_side=3072) == bucket_sizes(1024, 16)
    capped = bucket_sizes(1024, 64, max_side=1280)
    assert max(max(s) for s in capped) <= 1280 and (832, 1280) in capped and (768, 1344) not in capped
    with pytest.raises(UserError, match="above the 512 pixels"):
        bucket_sizes(1024, 64, max_side=512)


def test_images_go_to_the_nearest_aspect_ratio():
    sizes = bucket_sizes(64, 16)  # (48, 80), (64, 64), (80, 48)
    assert sizes == [(48, 80), (64, 64), (80, 48)]
    assert nearest_bucket((300, 500), sizes) == 0  # wide
    assert nearest_bucket((512, 500), sizes) == 1
    assert nearest_bucket((1000, 520), sizes) == 2  # tall
    assert assign_buckets([(10, 10), (10, 30), (30, 10)], sizes) == [1, 0, 2]


def rank_batches(bucket_of, n_buckets, micro, accum, world, seed, epoch):
    out = []
    for rank in range(world):
        s = BucketBatchSampler(bucket_of, n_buckets, micro, accum, rank, world, seed)
        s.set_epoch(epoch)
        out.append([[i for i, _ in b] for b in s])
    return out


@pytest.mark.parametrize(("micro", "accum", "world"), [(2, 1, 2), (3, 2, 2), (1, 1, 3)])
def test_ranks_agree_on_each_steps_bucket_and_cover_the_epoch(micro, accum, world):
    rng = np.random.default_rng(1)
    bucket_of = list(rng.choice(3, size=101, p=[0.5, 0.3, 0.2]))
    per_rank = rank_batches(bucket_of, 3, micro, accum, world, seed=7, epoch=2)
    lengths = {len(b) for b in per_rank}
    assert len(lengths) == 1  # every rank takes the same number of micro-batches
    n_batches = lengths.pop()
    assert n_batches % accum == 0
    seen = []
    for step in range(n_batches // accum):
        micro_batches = [per_rank[r][step * accum + m] for r in range(world) for m in range(accum)]
        step_buckets = {bucket_of[i] for mb in micro_batches for i in mb}
        assert len(step_buckets) == 1, step_buckets  # one bucket per optimizer step, on every rank
        assert all(len(mb) == micro for mb in micro_batches)
        seen += [i for mb in micro_batches for i in mb]
    assert len(seen) == len(set(seen))  # nothing twice, within a rank or across ranks
    dropped = dropped_per_epoch(bucket_of, 3, micro * accum * world)
    assert len(seen) + dropped == len(bucket_of)
    # What is left out is only each bucket's remainder below one global batch.
    missing = Counter(bucket_of[i] for i in set(range(len(bucket_of))) - set(seen))
    assert all(missing[b] < micro * accum * world for b in range(3))
    sampler = BucketBatchSampler(bucket_of, 3, micro, accum, 0, world, seed=7)
    assert samples_dropped(sampler, len(bucket_of), micro, world) == dropped
    assert len(sampler) == n_batches


def test_each_epoch_shuffles_anew_and_seed_decides():
    bucket_of = [0] * 20 + [1] * 13
    a = rank_batches(bucket_of, 2, 2, 1, 2, seed=0, epoch=0)
    assert a == rank_batches(bucket_of, 2, 2, 1, 2, seed=0, epoch=0)
    assert a != rank_batches(bucket_of, 2, 2, 1, 2, seed=0, epoch=1)
    assert a != rank_batches(bucket_of, 2, 2, 1, 2, seed=1, epoch=0)
    # Over a few epochs, samples left out in one epoch are trained on in another.
    seen = {
        i
        for e in range(6)
        for b in rank_batches(bucket_of, 2, 2, 1, 2, seed=0, epoch=e)
        for mb in b
        for i in mb
    }
    assert seen == set(range(33))


def test_drop_count_without_buckets_matches_the_distributed_sampler():
    n, micro, world = 61, 4, 2
    used = 0
    for rank in range(world):
        s = EpochSampler(n, rank, world, seed=0)
        used += len(list(s)) // micro * micro  # the loader's drop_last
    assert samples_dropped(EpochSampler(n, 0, world, seed=0), n, micro, world) == n - used == 5


def test_no_bucket_with_a_full_batch_is_refused():
    with pytest.raises(UserError, match="no aspect-ratio bucket holds a full global batch of 8"):
        BucketBatchSampler([0, 1, 2] * 2, 3, 4, 1, 0, 2, seed=0)


class Keys(Dataset):
    def __getitem__(self, key):
        return {"index": torch.tensor(key[0]), "epoch": torch.tensor(key[1])}

    def __len__(self):
        return 50


def test_resume_mid_epoch_continues_the_same_sequence():
    """loop.Batches with a bucket loader: a resume at (epoch, batches_in_epoch) yields what an
    uninterrupted run would have, across the epoch boundary too."""
    from sdzero.data.feed import Batches

    bucket_of = [i % 3 for i in range(50)]

    def batches(epoch=0, done=0):
        sampler = BucketBatchSampler(bucket_of, 3, 2, 2, 1, 2, seed=3)
        return Batches(DataLoader(Keys(), batch_sampler=sampler), sampler, epoch, done)

    full = batches()
    seq = [(full.epoch, full.batches_in_epoch, full.next()["index"].tolist()) for _ in range(30)]
    assert len({e for e, _, _ in seq}) >= 2  # crosses an epoch boundary
    for at in (3, 9):
        epoch, done, _ = seq[at]
        resumed = batches(epoch, done)
        assert [resumed.next()["index"].tolist() for _ in range(30 - at)] == [b for _, _, b in seq[at:]]
