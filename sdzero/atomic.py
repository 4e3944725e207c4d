"""Atomic file and folder writes: a reader, or a crash, sees the old content or the new, never a mix.

Every file sdzero rewrites in place (checkpoint pointers, profiles, caches' indexes, reports, the user's
`.deepspeed_env`) goes through here, so the rules hold everywhere: a unique temporary file in the same
folder (same filesystem, so the rename is atomic; unique, so two writers never share one), flushed to disk
before the rename, the temporary removed when anything fails, an existing file's permission bits kept
(a 0600 file of tokens stays 0600).

A link planted where sdzero writes is refused, never followed: run folders on a shared filesystem are where
someone else can plant one, and a `.sdzero.lock` or `ds_config.json` that was a link to a user's file once
had that file overwritten. Every writer here (and the append and lock opens in `open_no_follow`) checks the
final component with lstat / O_NOFOLLOW; only a file the user named themselves (`.deepspeed_env`) may be
written through its link, and only when the caller says so.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the writers of JSON and text need no pandas
    import pandas as pd

from sdzero.config.safe_write import (  # noqa: F401 (the writers' one home: re-exported)
    NEW_FILE_MODE,
    link_refusal,
    open_no_follow,
    planted_link,
    refuse_link,
)
from sdzero.errors import UserError


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX: the directory entry is data of the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path | str, text: str, *, follow_link: bool = False) -> Path:
    """Replace the file at `path` with `text`; returns the path written.

    A symlink at `path` is refused (see the module's docstring), unless `follow_link` (a file the user named,
    such as their `.deepspeed_env`): then its target is replaced. Only a regular file is ever replaced: a
    `.deepspeed_env` that was a symlink to /dev/null once had the device itself replaced by a regular file
    (the rename went through the link), for every program on the machine. A folder, FIFO, socket or device
    at `path` is one UserError, nothing written."""
    if not follow_link:
        refuse_link(path)
    target = Path(os.path.realpath(path)) if follow_link else Path(os.path.abspath(path))
    if target.exists() and not target.is_file():
        from sdzero.config.user_file import describe_mode

        raise UserError(
            f"{path} is {describe_mode(target.stat().st_mode)}, not a regular file; sdzero writes only regular "
            "files (nothing was written)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else NEW_FILE_MODE
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def remove_tree(path: Path | str) -> None:
    """Remove the folder sdzero made at `path` (missing is fine); a link there is refused, not followed or
    left to shutil.rmtree's silent "cannot call rmtree on a symbolic link"."""
    refuse_link(path)
    shutil.rmtree(path, ignore_errors=True)


def write_json_atomic(path: Path | str, obj: Any, indent: int = 2, allow_nan: bool = True) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent, allow_nan=allow_nan) + "\n")


def write_csv_atomic(table: pd.DataFrame, path: Path | str) -> Path:
    return write_text_atomic(path, table.to_csv(index=False))


def publish_dir(tmp: Path, out: Path) -> None:
    """Replace the folder `out` with the finished folder `tmp`; the old `out` is removed only after the move.

    The old folder is moved aside under a new unique name (an empty folder made for it, which a rename of a
    folder may replace), never a fixed one: a user's folder that happens to bear the fixed name
    (`.v1.old` beside `v1`) was once deleted first."""
    refuse_link(out)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def new_dir(out: Path) -> Iterator[Path]:
    """Build a folder next to `out` and move it into place only when complete.

    An existing non-empty `out` is refused rather than overwritten: nothing the user had is lost.
    """
    out = Path(out)
    refuse_link(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} already exists and is not empty; choose a new folder or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
