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
from typing import Any

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


MAX_DEPTH = 64
"""Deeper than any file sdzero writes nests; a line nested 100,000 deep is named, never a RecursionError."""


def nesting_depth(value: object, limit: int = MAX_DEPTH) -> int:
    """How deep lists and objects nest in `value` (a scalar is 0), counted without recursion and given up
    at `limit` + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def read_user_text(path: Path | str, flag: str, limit: int = MAX_TEXT_BYTES) -> str:
    """`read_user_bytes` decoded as UTF-8; a byte that is not is one line naming where it is."""
    data = read_user_bytes(path, flag, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{flag} {path}: not UTF-8 text (byte {exc.start}); check the path") from None


def parse_json_text(text: str, where: str, max_depth: int = MAX_DEPTH) -> object:
    """`text` as JSON nested at most `max_depth` deep, else one UserError starting with `where`."""
    import json

    try:
        value = json.loads(text)
    except RecursionError:
        raise UserError(f"{where}: nested deeper than {max_depth} levels; not a file sdzero wrote") from None
    except ValueError as exc:
        raise UserError(f"{where}: not JSON ({exc})") from None
    if nesting_depth(value, max_depth) > max_depth:
        raise UserError(f"{where}: nested deeper than {max_depth} levels; not a file sdzero wrote")
    return value


def read_user_json(
    path: Path | str, flag: str, limit: int = MAX_TEXT_BYTES, max_depth: int = MAX_DEPTH
) -> object:
    """A regular file of at most `limit` bytes, UTF-8, JSON nested at most `max_depth` deep; anything else
    (a FIFO, a device, a link loop, an oversized or non-JSON file) is one UserError naming `flag` and the path."""
    return parse_json_text(read_user_text(path, flag, limit), f"{flag} {path}", max_depth)


def read_json_lines(path: Path | str, flag: str) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """(line number, object) of each JSON object line of a JSON-lines file (metrics.jsonl), and how many
    lines were skipped: a line cut by a kill, not JSON, or nested beyond reason (one nested 100,000 deep
    was a RecursionError). The file itself must be a regular file within the reader's bounds."""
    records, skipped = [], 0
    for number, line in enumerate(read_user_text(path, flag).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = parse_json_text(line, f"{path} line {number}")
        except UserError:
            skipped += 1
            continue
        if isinstance(record, dict):
            records.append((number, record))
        else:
            skipped += 1
    return records, skipped
