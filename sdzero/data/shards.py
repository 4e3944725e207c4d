"""Tar shards as training data: img2dataset's layout (`key.jpg|png|webp` with `key.txt` and/or `key.json`
holding the caption), named by a brace pattern (`shards/{000000..000099}.tar`) or a folder of `.tar` files.

The shards are indexed once into records (shard, key, the image member's byte offset and size, the
caption), so the data set is map-style like a loose folder: the same EpochSampler gives every sample once
per epoch across ranks x workers, the (seed, epoch) order and exact or elastic resume, with no per-worker
shard assignment to get wrong. The index is remembered next to the image listing, per shard, keyed by the
shard's size and mtime: a restart reads no tar header of an unchanged shard.

What --data names (a pattern, a folder of shards) is read in sdzero.config.data_source. Members are
located with the standard library's tarfile (what webdataset itself reads tars with) and read
with one positioned read (`os.pread`), which needs no shared file offset between DataLoader workers.
Samples are grouped by key with webdataset's own rule (`base_plus_ext`); patterns expand with braceexpand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tarfile
from pathlib import Path
from typing import Any

from sdzero.atomic import write_json_atomic
from sdzero.config.data_source import IMAGE_EXTENSIONS, is_shard_source, shard_paths
from sdzero.data.images import Record, read_metadata
from sdzero.errors import UserError

log = logging.getLogger("sdzero.data.shards")

SHARD_INDEX_FORMAT = 1
Sample = list[Any]
"""[key, image member name or None, offset, size, caption or None] of one sample of a shard."""


def index_shard(path: Path) -> list[Sample]:
    """The samples of one shard, in member order, from its tar headers and its caption members. A sample
    without an image or a caption is kept with None there: it is counted as damaged, not silently lost."""
    from webdataset.tariterators import base_plus_ext

    samples: dict[str, Sample] = {}
    try:
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                if not info.isreg():
                    continue
                key, ext = base_plus_ext(info.name)
                if key is None or key.startswith("__"):
                    continue
                sample = samples.setdefault(key, [key, None, 0, 0, None])
                ext = ext.lower()
                if ext in IMAGE_EXTENSIONS and sample[1] is None:
                    sample[1:4] = [info.name, info.offset_data, info.size]
                elif ext == "txt" or (ext == "json" and sample[4] is None):
                    raw = tar.extractfile(info)
                    sample[4] = caption_of(ext, raw.read() if raw else b"")
    except (tarfile.TarError, OSError) as exc:
        raise UserError(f"--data: shard {path} cannot be read as a tar file ({exc}); rewrite it") from None
    return list(samples.values())


def caption_of(ext: str, raw: bytes) -> str | None:
    """The caption in a `.txt` member, or the `caption` (else `text`) field of a `.json` one."""
    try:
        text = raw.decode("utf-8")
        if ext == "txt":
            return text.strip()
        meta = json.loads(text)
    except (UnicodeDecodeError, ValueError):
        return None
    value = meta.get("caption", meta.get("text")) if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def index_path(data: Path | str) -> Path:
    """One remembered index per data source (its resolved pattern or folder), beside the image listings."""
    from sdzero.data.listing import listing_dir

    digest = hashlib.sha256(str(Path(data).resolve()).encode()).hexdigest()[:20]
    return listing_dir() / f"{digest}.shards.json"


def read_index(data: Path | str) -> dict[Path, list[Sample]]:
    """Every shard's samples, from the remembered index where a shard's size and mtime match, else read
    now (and remembered: a folder that cannot be written costs the next start its speed, not this run)."""
    where = index_path(data)
    try:
        known = json.loads(where.read_text())
        if known.get("format") != SHARD_INDEX_FORMAT:
            known = {}
    except (OSError, ValueError, AttributeError):
        known = {}
    shards = known.get("shards", {}) if isinstance(known, dict) else {}
    out: dict[Path, list[Sample]] = {}
    changed = False
    for path in shard_paths(data):
        st = path.stat()
        name = str(path.resolve())
        entry = shards.get(name)
        if not (isinstance(entry, dict) and entry.get("stat") == [st.st_size, st.st_mtime_ns]):
            entry = {"stat": [st.st_size, st.st_mtime_ns], "samples": index_shard(path)}
            shards[name], changed = entry, True
        out[path] = entry["samples"]
    if changed:
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(where, {"format": SHARD_INDEX_FORMAT, "data": str(data), "shards": shards})
        except OSError as exc:
            log.warning(
                "could not remember the shard index in %s (%s); the next start reads it again", where, exc
            )
    return out


def read_records(data: Path | str) -> list[Record]:
    """The records of any --data: a loose folder's metadata file, or the samples of its tar shards."""
    if not is_shard_source(data):
        return read_metadata(Path(data))
    records = []
    for path, samples in read_index(data).items():
        for key, image, offset, size, caption in samples:
            problem = None
            if image is None:
                problem = f"no image member ({'/'.join(IMAGE_EXTENSIONS)}) for key {key}"
            elif caption is None:
                problem = f"no caption (.txt, or .json with a caption) for key {key}"
            records.append(Record(path, caption or "", (key, offset, size), problem))
    if not records:
        raise UserError(f"--data {data}: the shards hold no samples; see docs/data.md to make them")
    return records
