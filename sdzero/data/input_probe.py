"""What the input pipeline delivers on this machine: one loader worker's samples/s and the storage's read
rate at the data's location.

- One worker: a DataLoader with one worker process over the run's own dataset (`CaptionedImages`:
  read, decode, resize and crop, flip, noise draws, tokenize; `CachedSamples`: a latent-cache read) and
  its collate, at the run's micro-batch. Measured alone, so it is the worker's rate with a core to
  itself.
- The storage: as many threads as the node runs loader workers read the images' bytes at once (whole
  files, or a shard's members), each file first dropped from the page cache (posix_fadvise DONTNEED), so
  that the figure is the storage's and not the memory's: bytes/s and files/s.

The launch of several configs (sdzero.training.measuring.sweep) records both in its profile under "input";
the advisor turns them into each node count's input rate (advisor.model.input_rate).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sdzero.data.images import EpochSampler, Record

WORKER_SECONDS = 2.0
"""Seconds of items per measurement: several items of even a slow pipeline, a small part of a launch."""
MIN_ITEMS = 4
PREFETCHED = 2
"""DataLoader's default prefetch_factor: batches a worker has ready before the first is taken."""
STORAGE_SECONDS = 2.0


def measure_worker(
    dataset: Any,
    seed: int,
    batch_size: int = 1,
    collate: Callable[[list[Any]], Any] | None = None,
    seconds: float = WORKER_SECONDS,
) -> dict[str, Any]:
    """What one loader worker delivers: a DataLoader with one worker process over the run's dataset (its
    items, the collate and the hand-over to the rank included), in an epoch's order (epoch 1: not the
    samples the launch's first steps read, whose files the page cache may hold). The rank takes each
    batch at once, so the worker never waits: the gap between batches is the worker's time for one."""
    from torch.utils.data import DataLoader

    sampler = EpochSampler(len(dataset), 0, 1, seed=seed)
    sampler.set_epoch(1)
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=1, collate_fn=collate, drop_last=True
    )
    it = iter(loader)
    gaps: list[float] = []
    try:
        began = time.perf_counter()
        next(it)  # the worker's start and first batch: one-off costs (a tokenizer's cache, a file's open)
        start = last = time.perf_counter()
        first_s = start - began
        for _ in it:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if len(gaps) >= MIN_ITEMS + PREFETCHED and now - start >= seconds:
                break
    finally:
        getattr(it, "_shutdown_workers", lambda: None)()
    # the batches fetched ahead while the first was handed over arrive at once: left out; then the median
    # batch, as another process on the machine only ever slows one
    kept = gaps[PREFETCHED:] or gaps or [first_s]  # a data set of one batch: its first, start-up and all
    return {
        "samples_per_s": batch_size / statistics.median(kept),
        "samples": len(gaps) * batch_size,
        "batch_size": batch_size,
        "seconds": sum(gaps),
    }


def _drop_cached(record: Record) -> None:
    """Evict the record's bytes from the page cache (advice only: a no-op where unsupported)."""
    if not hasattr(os, "posix_fadvise"):
        return
    offset, size = (0, 0) if record.member is None else record.member[1:]
    try:
        fd = os.open(record.path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read(record: Record) -> int:
    if record.member is None:
        with open(record.path, "rb", buffering=0) as f:
            return len(f.read())
    return len(record.image_source().getbuffer())


def measure_storage(
    records: Sequence[Record], readers: int, seconds: float = STORAGE_SECONDS
) -> dict[str, Any] | None:
    """Bytes/s and files/s of `readers` concurrent readers over the records (in batches of `readers`
    files, until `seconds` have passed or every record was read once); None for no records."""
    if not records:
        return None
    readers = max(1, readers)
    files = total = 0
    start = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:  # reads release the GIL: threads overlap as processes do
        for first in range(0, len(records), readers):
            batch = records[first : first + readers]
            for record in batch:
                _drop_cached(record)
            total += sum(pool.map(_read, batch))
            files += len(batch)
            if time.perf_counter() - start >= seconds:
                break
    elapsed = time.perf_counter() - start
    return {
        "bytes_per_s": total / elapsed,
        "files_per_s": files / elapsed,
        "bytes_per_file": total / files,
        "readers": readers,
        "files": files,
        "seconds": elapsed,
    }


def measure_input(
    dataset: Any,
    seed: int,
    workers_per_rank: int,
    local_ranks: int,
    batch_size: int = 1,
    collate: Callable[[list[Any]], Any] | None = None,
) -> dict[str, Any]:
    """The launch's "input" section: one worker's rate, the storage's with the node's readers, and the
    settings they were measured under."""
    records = getattr(dataset, "records", None)
    readers = max(1, workers_per_rank) * max(1, local_ranks)
    return {
        "kind": "images" if records is not None else "cache",
        "worker": measure_worker(dataset, seed, batch_size, collate),
        "storage": measure_storage(records, readers) if records is not None else None,
        "workers_per_rank": workers_per_rank,
        "local_ranks": local_ranks,
        "cpu_count": os.cpu_count(),
    }
