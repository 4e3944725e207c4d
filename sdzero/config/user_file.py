"""Reading a file the user named: a regular file only, checked before and after it is opened.

A FIFO named `.deepspeed_env` made `sdzero launch` block for ever; a symlink to /dev/zero read until memory
ran out; a FIFO or device node given as the DeepSpeed JSON or the hostfile was reported as "no such file".
Every reader of a user's file goes through `read_user_bytes` (or `check_regular_file`, where a library
opens the file itself): anything but a regular file is one line naming what it is, before a byte is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sdzero.errors import UserError

MAX_TEXT_BYTES = 64 * 1024 * 1024
"""Larger than any config, hostfile or env file sdzero reads; a bound, so a huge file is one line too."""


def describe_mode(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def check_regular_file(path: Path | str, flag: str) -> None:
    """Refuse `path` unless it exists and is a regular file once symlinks are followed (no open)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UserError(f"{flag} {path}: no such file") from None
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise UserError(
            f"{flag} {path} is {describe_mode(mode)}, not a regular file; sdzero reads only regular files there"
        )


def read_user_bytes(path: Path | str, flag: str, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, else one UserError naming `flag` and the path.

    Opened non-blocking (a FIFO swapped in after the check cannot block the open) and checked again on the
    open descriptor, so what is read is what was checked."""
    check_regular_file(path, flag)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{flag} {path} is {describe_mode(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise UserError(
                f"{flag} {path}: {info.st_size} bytes, more than the {limit} bytes such a file can sensibly "
                "hold; check the path"
            )
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{flag} {path}: more than {limit} bytes; check the path")
    return data
