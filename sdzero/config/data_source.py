"""What --data names: a loose image folder (metadata.jsonl and image files) or tar shards, as a brace
pattern (`shards/{000000..000099}.tar`), one `.tar` file or a folder of `.tar` files without a metadata
file. Only paths here, no tar is opened (sdzero.data.shards reads them): the option checks, the shared
storage check and the doctor all need to know which kind a --data is and which files it names."""

from __future__ import annotations

import os
from pathlib import Path

from sdzero.errors import UserError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
"""Member extensions that hold a shard sample's image (img2dataset writes one of these per key)."""


def is_shard_source(data: Path | str) -> bool:
    """True for a brace pattern, a `.tar` file, or a folder of `.tar` files without a metadata file."""
    text = str(data)
    if "{" in text or text.endswith(".tar"):
        return True
    folder = Path(data)
    if not folder.is_dir():
        return False
    if any(folder.glob("metadata.*")):
        return False
    return any(p.suffix == ".tar" for p in folder.iterdir())


def shard_paths(data: Path | str) -> list[Path]:
    """The shard files of `data` in order; UserError naming the first missing one."""
    from braceexpand import braceexpand

    text = str(data)
    if Path(text).is_dir():
        paths = sorted(p for p in Path(text).iterdir() if p.suffix == ".tar" and p.is_file())
    else:
        try:
            paths = [Path(p) for p in braceexpand(text)]
        except Exception as exc:  # braceexpand raises its own error type for an unbalanced brace
            raise UserError(f"--data {text}: not a valid brace pattern ({exc})") from None
    paths = [Path(os.path.abspath(p)) for p in paths]  # names are taken relative to data_root's folder
    if not paths:
        raise UserError(f"--data {text}: no .tar shards there; see docs/data.md to make them")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise UserError(
            f"--data {text}: {len(missing)} of {len(paths)} shards do not exist (first: {missing[0]}); "
            "fix the pattern's range or copy the shards"
        )
    return paths


def data_root(data: Path | str) -> Path:
    """The folder that names in listings, fingerprints and the cache index are relative to."""
    if not is_shard_source(data):
        return Path(data)
    return Path(os.path.commonpath([p.parent for p in shard_paths(data)]))
