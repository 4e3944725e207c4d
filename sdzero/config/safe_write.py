"""Never through a planted link: the checks every writer of sdzero makes on the final component of a path.

Run folders on a shared filesystem are where someone else can plant a link: a `.sdzero.lock` or a
`ds_config.json` that was a symlink to a user's file once had that file truncated and overwritten. A link at
a path sdzero writes is refused in one line naming it and where it points, before a byte is written; the
atomic writers (sdzero.atomic) and the opens for appending and locking here share the check. It lives in
sdzero.config, the lowest layer, so that the output lock can use it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO

from sdzero.config.user_file import describe_mode
from sdzero.errors import UserError

NEW_FILE_MODE = 0o644  # mkstemp makes 0600; results are meant to be read by the team


def link_refusal(path: Path | str) -> str:
    try:
        points_to = os.readlink(path)
    except OSError:
        points_to = "?"
    return (
        f"{path} is a symbolic link (to {points_to}); sdzero never writes through a link in a folder it "
        "writes to: remove the link and rerun (nothing was written)"
    )


def planted_link(*paths: Path | str) -> str | None:
    """The refusal of the first of `paths` that is a symbolic link, else None (for a collective verdict)."""
    return next((link_refusal(p) for p in paths if os.path.islink(p)), None)


def refuse_link(path: Path | str) -> None:
    """UserError when `path` itself (its final component), or a folder between it and the nearest folder
    sdzero holds the lock of, is a symbolic link."""
    if os.path.islink(path):
        raise UserError(link_refusal(path))
    refuse_linked_subfolder(path)


OWNED_MARK = ".sdzero.lock"
"""The lock every writer of a folder takes (sdzero.config.output_folder.LOCK_NAME, named here too because
that module imports this one's layer): the mark of a folder sdzero writes into."""


def linked_subfolder(path: Path | str) -> Path | None:
    """The first folder between `path`'s parent and the nearest enclosing folder holding sdzero's lock that
    is a symbolic link (a `trials/` or `comm/` planted as a link to somewhere else), else None.

    Links above the locked folder are the user's own layout (/shared -> /mnt/nfs) and are followed; below
    it, inside a folder sdzero owns, none is: a rename through one would land outside the folder. Only
    lexical parents are looked at (no resolve), a handful of lstat calls per write."""
    below: list[Path] = []
    folder = Path(os.path.abspath(path)).parent
    while True:
        if os.path.isfile(folder / OWNED_MARK) and not os.path.islink(folder / OWNED_MARK):
            return next((p for p in reversed(below) if os.path.islink(p)), None)
        if folder.parent == folder:
            return None  # no locked folder encloses it: the final component's check is the whole rule
        below.append(folder)
        folder = folder.parent


def refuse_linked_subfolder(path: Path | str) -> None:
    linked = linked_subfolder(path)
    if linked is not None:
        raise UserError(link_refusal(linked))


def open_no_follow(path: Path | str, mode: str) -> IO[str]:
    """Open `path` for text without following a link at its final component: "a" appends (metrics, logs),
    "w" truncates (a launch's log), "a+" reads and appends (the output lock). A link is one UserError
    naming it, and so is anything that is not a regular file (a FIFO would block the open: O_NONBLOCK)."""
    # "w" truncates only once the descriptor is known to be a regular file (a device is never truncated)
    flags = {"a": os.O_WRONLY | os.O_APPEND, "w": os.O_WRONLY, "a+": os.O_RDWR | os.O_APPEND}
    if mode not in flags:
        raise ValueError(f"open_no_follow: mode {mode!r}")
    refuse_linked_subfolder(path)
    how = flags[mode] | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, how, NEW_FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(link_refusal(path)) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UserError(
            f"{path} is {describe_mode(info.st_mode)}, not a regular file; sdzero writes only regular files"
        )
    if mode == "w":
        os.ftruncate(fd, 0)
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode, encoding="utf-8")
