"""One live run per output folder: `<output-dir>/.sdzero.lock`, held by rank 0 for the run's life.

Two runs in one folder delete each other's staging folders and interleave metrics and checkpoints. The
lock is an advisory `flock` on the file, which the kernel drops when the holder dies however it dies
(SIGKILL, os._exit, a node's OOM killer): a stale lock of a dead run is taken over without a word. The file
holds the owner's host and pid only so that the refusal can name them.

The trainer, `sdzero cache --out`, `sdzero advise --out` and `sdzero profile --out` take it. It lives in sdzero.config, the lowest
layer, so that sdzero.data (the cache build) can take it too: sdzero.checkpoint imports sdzero.data, and
sdzero.checkpoint.output_lock re-exports it for its older importers.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO

from sdzero.config.output_folder import LOCK_NAME, check_output_folder
from sdzero.config.safe_write import open_no_follow
from sdzero.errors import UserError

_held: dict[Path, IO[str]] = {}
"""Open lock files of this process; closing one (or exiting) releases its lock."""


def claim_output_dir(output_dir: Path | str, flag: str = "--output-dir") -> Path:
    """Take `output_dir`'s lock for this process, or raise UserError naming the live run that holds it
    (`flag`: the option the folder was given with, for the message). A folder of the user's files (no
    mark of sdzero's, see sdzero.config.output_folder) is refused before the lock file is made in it."""
    output_dir = Path(output_dir).resolve()
    path = output_dir / LOCK_NAME
    if output_dir in _held:
        return path
    check_output_folder(output_dir, flag)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        f = open_no_follow(path, "a+")  # kept open: the lock lives as long as the file is open
    except OSError as exc:  # on rank 0 only: an error here must reach every rank as a UserError
        raise UserError(f"{flag} {output_dir}: cannot write there ({exc.strerror}); choose another") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = _owner(f.read())
        f.close()
        raise UserError(
            f"{flag} {output_dir} is in use by a live run ({owner}); wait for it to end, stop it, or "
            f"choose another {flag}"
        ) from None
    except OSError as exc:  # a filesystem without locks: say so and go on rather than refuse every run
        f.close()
        import logging

        logging.getLogger("sdzero").warning(
            "%s: cannot lock (%s); not guarded against a second run", path, exc
        )
        return path
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n")
    f.flush()
    _held[output_dir] = f
    return path


def release_output_dir(output_dir: Path | str) -> None:
    f = _held.pop(Path(output_dir).resolve(), None)
    if f is not None:
        f.close()


def _owner(text: str) -> str:
    try:
        raw = json.loads(text)
        return f"host {raw['host']}, pid {raw['pid']}"
    except (ValueError, KeyError, TypeError):
        return "owner unknown"
