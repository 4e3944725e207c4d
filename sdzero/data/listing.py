"""The image listing: each image of a data folder checked once, from its header and PIL's integrity check
(no pixel decode), and remembered by (path, size, mtime), so that a restart re-reads only the files that
changed.

Decoding every image at every start is minutes of idle GPUs on a large folder on NFS. Here the ranks
share the work: rank 0 reads the remembered listing and sends it to all, each rank stats its share of the
records (i % world == rank) and inspects only the files whose size or mtime changed or that are new, the
ranks exchange their shares, and rank 0 writes the listing back. Every rank then holds every image's
(height, width), which aspect-ratio buckets need, read once over all ranks rather than once per rank.

Tar shards' members are checked the same way (sdzero.data.shards), each remembered under
`shard.tar#key` with its shard's size and mtime.

A file that breaks later, past the header (a truncated JPEG), is met by a DataLoader worker, skipped, and
counted against --max-bad-fraction (sdzero.data.images.LateFailures).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from sdzero.atomic import write_json_atomic
from sdzero.config.data_source import data_root
from sdzero.data.images import (
    IMAGE_ERRORS,
    Record,
    check_bad_fraction,
    max_image_pixels,
    warn_unlisted,
    warn_unreadable,
)

log = logging.getLogger("sdzero.data.listing")

LISTING_FORMAT = 1
Entry = list[Any]
"""[size_bytes, mtime_ns, height, width, error, decoded]: height/width None and error a reason for an
unreadable file, error None for a readable one; decoded: checked by a full decode, not the header alone."""


class Collectives(Protocol):
    """What the listing needs of the ranks: a process group's rank and size, rank 0's object on every rank,
    and every rank's object on every rank (lists indexed by rank)."""

    rank: int
    world: int

    def broadcast(self, obj: Any) -> Any: ...

    def gather(self, obj: Any) -> list[Any]: ...


@dataclass(frozen=True)
class CheckedImages:
    """The outcome of the start-up check: indices of unreadable records and each record's (h, w)."""

    bad: list[int]
    sizes: list[tuple[int, int] | None]
    """Each record's (height, width); None for an unreadable one."""
    inspected: int
    """Files read this time over all ranks (new or changed since the listing was remembered)."""


def listing_dir() -> Path:
    """Where listings are remembered: $SDZERO_LISTING_DIR, else sdzero's folder in the user's cache."""
    if os.environ.get("SDZERO_LISTING_DIR"):
        return Path(os.environ["SDZERO_LISTING_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sdzero" / "listings"


def listing_path(folder: Path) -> Path:
    """One listing per data folder (its resolved path), outside the folder, which may be read-only."""
    digest = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:20]
    return listing_dir() / f"{digest}.json"


def inspect_image(record: Record, decode: bool = False) -> tuple[int, int]:
    """(height, width) from the header, after PIL's `verify` (chunk checksums and structure, no pixel
    decode), or after a full decode with `decode`; raises one of IMAGE_ERRORS for a file that is missing,
    empty or not an image (or, decoded, truncated past its header)."""
    if record.problem:  # a shard's sample without an image or a caption
        raise OSError(record.problem)
    if record.size_bytes() == 0:
        raise OSError("zero-byte file")
    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # sizes are remembered whatever the limit
    try:
        with Image.open(record.image_source()) as img:
            size = (img.height, img.width)
            img.load() if decode else img.verify()
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    return size


def _entry(record: Record, stat: os.stat_result, decode: bool) -> Entry:
    try:
        height, width = inspect_image(record, decode)
        return [stat.st_size, stat.st_mtime_ns, height, width, None, decode]
    except IMAGE_ERRORS as exc:
        return [stat.st_size, stat.st_mtime_ns, None, None, f"{type(exc).__name__}: {exc}", decode]


def _read_listing(path: Path) -> dict[str, Entry]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if (
        not isinstance(raw, dict)
        or raw.get("format") != LISTING_FORMAT
        or not isinstance(raw.get("images"), dict)
    ):
        return {}
    return raw["images"]


def check_share(
    records: Sequence[Record], folder: Path, rank: int, world: int, known: dict[str, Entry], decode: bool
) -> tuple[dict[int, Entry], int]:
    """This rank's share of the records, each from the remembered entry when its size and mtime match (and,
    with `decode`, it was decoded then), else inspected now; and how many were inspected. A missing file
    gets an entry of its own (size -1), never remembered."""
    mine: dict[int, Entry] = {}
    inspected = 0
    for i in range(rank, len(records), world):
        path = records[i].path
        try:
            stat = path.stat()
        except OSError as exc:
            mine[i] = [-1, -1, None, None, f"{type(exc).__name__}: {exc}", False]
            continue
        # a shard's members carry the shard's size and mtime: a rewritten shard is inspected again
        entry = known.get(records[i].name_in(folder))
        if entry is not None and entry[:2] == [stat.st_size, stat.st_mtime_ns] and (entry[5] or not decode):
            mine[i] = entry
        else:
            mine[i] = _entry(records[i], stat, decode)
            inspected += 1
    return mine, inspected


def check_images(
    records: Sequence[Record], folder: Path, ranks: Collectives, max_bad_fraction: float, decode: bool = False
) -> CheckedImages:
    """The start-up check of every record, shared by the ranks (a collective), remembered for the next
    start; refuses (UserError) a folder with more unreadable images than `max_bad_fraction`. `decode`: a
    full decode of what was not decoded before (a cache build, which must not meet a bad file later)."""
    folder = Path(folder)
    where = listing_path(folder)
    root = data_root(folder)  # tar shards: their common folder (a brace pattern is no folder)
    known = ranks.broadcast(_read_listing(where) if ranks.rank == 0 else None)
    entries: dict[int, Entry] = {}
    inspected = 0
    for share, count in ranks.gather(check_share(records, root, ranks.rank, ranks.world, known, decode)):
        entries.update(share)
        inspected += count
    limit = max_image_pixels()
    bad, sizes = [], []
    for i, record in enumerate(records):
        _size, _mtime, height, width, error = entries[i][:5]
        if error is None and height * width > limit:
            error = f"{width}x{height} pixels, over --max-image-pixels {limit}"
        if error is not None:
            bad.append(i)
            warn_unreadable(len(bad), record.label, error)
            sizes.append(None)
        else:
            sizes.append((height, width))
    warn_unlisted(len(bad))
    if ranks.rank == 0 and inspected:
        remember(where, root, records, entries)
    check_bad_fraction(len(records), len(bad), max_bad_fraction, folder)
    return CheckedImages(bad, sizes, inspected)


def remember(where: Path, folder: Path, records: Sequence[Record], entries: dict[int, Entry]) -> None:
    """Rank 0 writes the listing (atomically); a cache folder that cannot be written costs the next start
    its speed, not this run."""
    known = {records[i].name_in(folder): entry for i, entry in entries.items() if entry[0] >= 0}
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(where, {"format": LISTING_FORMAT, "folder": str(folder.resolve()), "images": known})
    except OSError as exc:
        log.warning(
            "could not remember the image listing in %s (%s); the next start checks again", where, exc
        )


class TorchRanks:
    """Collectives over torch.distributed's default group (the trainer's)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def good_sizes(checked: CheckedImages) -> list[tuple[int, int]]:
    """(height, width) of each readable record, in order (what `--buckets` assigns from)."""
    return [s for s in checked.sizes if s is not None]
