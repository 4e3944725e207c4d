"""`sdzero shard`: a loose image folder (metadata file + images) written as tar shards in img2dataset's
layout (`key.jpg` + `key.txt` + `key.json`), with webdataset's ShardWriter.

The images' bytes go in as they are (no re-encoding, so training sees the same pixels); an image in a
format webdataset's readers do not name by extension (a .bmp, a .gif) is stored as PNG. The shards are
written into a sibling folder and renamed into place at the end: an interrupted run leaves no folder of
half the shards under the name a training run would read.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from sdzero.config.data_source import IMAGE_EXTENSIONS
from sdzero.data.images import IMAGE_ERRORS, open_rgb, read_metadata
from sdzero.errors import UserError


@dataclass(frozen=True)
class ShardSummary:
    samples: int
    shards: int
    bytes_written: int


def member_image(path: Path) -> tuple[str, bytes]:
    """(extension, bytes) of an image member: the file itself, or PNG for another format."""
    ext = path.suffix.lower().lstrip(".")
    if ext in IMAGE_EXTENSIONS:
        return ("jpg" if ext == "jpeg" else ext), path.read_bytes()
    buffer = io.BytesIO()
    open_rgb(path).save(buffer, format="PNG")
    return "png", buffer.getvalue()


def write_shards(data: Path, out: Path, max_count: int = 1000, max_size_bytes: int = 1 << 30) -> ShardSummary:
    """Shard `data` into `out/000000.tar`, `out/000001.tar`, ...; `out` must not exist."""
    from webdataset import ShardWriter

    if max_count < 1 or max_size_bytes < 1:
        raise UserError("--max-count and --max-size-mb must be at least 1")
    if os.path.lexists(out):
        raise UserError(f"--out {out}: already exists; name a new folder (shards are never overwritten)")
    records = read_metadata(Path(data))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # an earlier interrupted run's leftovers
    partial.mkdir(parents=True)
    written = 0
    with ShardWriter(
        str(partial / "%06d.tar"), maxcount=max_count, maxsize=max_size_bytes, verbose=0
    ) as sink:
        for number, record in enumerate(records):
            try:
                ext, image = member_image(record.path)
            except IMAGE_ERRORS as exc:
                shutil.rmtree(partial, ignore_errors=True)
                raise UserError(
                    f"--data {data}: {record.path} cannot be read ({exc}); fix or remove it"
                ) from None
            name = record.path.relative_to(data).as_posix()
            meta = json.dumps({"caption": record.text, "file_name": name}).encode()
            sink.write({"__key__": f"{number:09d}", ext: image, "txt": record.text.encode(), "json": meta})
            written += len(image)
        shards = sink.shard
    partial.rename(out)
    return ShardSummary(len(records), shards, written)
