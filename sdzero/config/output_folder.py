"""The one rule for everything sdzero writes: it never deletes or replaces what it did not write.

Every writer (the trainer's --output-dir, `sdzero cache --out`, `advise --out`, `profile --out`, `export OUT`,
`--export-final`, `report --out`, `k8s --out`) asks here before it writes:

- a folder must be new, empty, or one sdzero made: it holds sdzero's mark (the lock file every writer
  of a folder takes, or an export's marker). A folder of the user's files is refused in one line naming
  it and a few of its files, before anything is created in it.
- a folder or file sdzero would replace (an export, `final/`, a report, a manifest file) must carry the
  mark of the sdzero command that wrote it.
- a user's input file is never an output: an input that is a file the command writes is refused.

It lives in sdzero.config, the lowest layer, so that the cache build, the checkpoint code and the advisor
all reach it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from sdzero.errors import UserError

LOCK_NAME = ".sdzero.lock"
"""The one-live-run lock (sdzero.config.output_lock); every folder sdzero writes holds one."""
EXPORT_MARKER = ".sdzero-export.json"
"""Written into every pipeline folder sdzero exports: only a folder holding one is ever replaced."""
FOLDER_MARKS = (LOCK_NAME, EXPORT_MARKER)
SHOWN_NAMES = 3


def _kind(path: Path) -> str:
    """What a non-folder path is, in words, for a refusal."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a broken symlink"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a folder"


_passed: set[Path] = set()
"""Folders this process found new, empty or sdzero's: what the run itself writes into one afterwards (its
library.log, the shared-storage check's tokens) happens before it takes the lock, and is its own."""


def check_output_folder(
    folder: Path | str,
    flag: str,
    marks: Iterable[str] = FOLDER_MARKS,
    made_by_sdzero: Callable[[Path], bool] | None = None,
) -> None:
    """Refuse `folder` unless it is new, empty or holds one of sdzero's `marks`; nothing is created here.
    `made_by_sdzero` recognises other contents of sdzero's own that a caller knows (the trainer: committed
    checkpoints copied into a fresh folder to resume from). A folder this process already let through is
    not judged again (see `_passed`)."""
    folder = Path(folder)
    key = Path(os.path.realpath(folder))
    if key in _passed:
        return
    if made_by_sdzero is None or not (folder.is_dir() and made_by_sdzero(folder)):
        _check_output_folder(folder, flag, marks)
    _passed.add(key)


def _check_output_folder(folder: Path, flag: str, marks: Iterable[str]) -> None:
    if not os.path.lexists(folder):
        return
    if not folder.is_dir():
        raise UserError(
            f"{flag} {folder} is {_kind(folder)}, not a folder; choose a folder (it is left as it is)"
        )
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise UserError(f"{flag} {folder}: cannot be read ({exc.strerror}); choose another folder") from None
    if not names or any(mark in names for mark in marks):
        return
    shown = ", ".join(names[:SHOWN_NAMES]) + (", ..." if len(names) > SHOWN_NAMES else "")
    raise UserError(
        f"{flag} {folder} holds files sdzero did not write ({shown}); choose a new or empty folder "
        "(nothing in it was changed)"
    )


def check_replaceable_folder(folder: Path, marker: str, what: str) -> None:
    """A folder sdzero is about to replace whole (an export, a run's `final/`) must hold `marker`."""
    if not os.path.lexists(folder):
        return
    if not folder.is_dir() or folder.is_symlink():
        raise UserError(f"{folder} is {_kind(folder)}, not {what}; move it away or choose another name")
    if not (folder / marker).is_file() and any(folder.iterdir()):
        raise UserError(
            f"{folder} is not {what} (it has no {marker}): sdzero replaces only its own; move it away or "
            "choose another name (it is left as it is)"
        )


def check_replaceable_file(path: Path, flag: str, signature: str, what: str) -> None:
    """A file sdzero is about to write: new, or a regular file of its own (holding `signature` in its
    first KiB); a folder, a special file or a file of the user's is refused."""
    if not os.path.lexists(path):
        return
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder; give the name of {what} to write, e.g. {path}/NAME")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0  # a broken symlink
    if not stat.S_ISREG(mode):
        raise UserError(f"{flag} {path} is {_kind(path)}, not a regular file; choose another name")
    with open(path, "rb") as handle:
        head = handle.read(1024)
    if signature.encode() not in head:
        raise UserError(
            f"{flag} {path} exists and is not {what} sdzero wrote; choose another name or remove it "
            "yourself (it is left as it is)"
        )


def same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(os.path.realpath(a)) == Path(os.path.realpath(b))


def refuse_inputs_among_outputs(outputs: Iterable[Path], inputs: Mapping[str, Path | None]) -> None:
    """A user's input file is never an output: `inputs` (flag -> path) that are one of `outputs` (the
    files a command writes) are refused, naming both."""
    written = [Path(p) for p in outputs]
    for flag, given in inputs.items():
        if given is None or not Path(given).exists():
            continue
        for out in written:
            if out.exists() and same_file(Path(given), out):
                raise UserError(
                    f"{flag} {given} is {out}, a file this command writes (it would be overwritten); pass a "
                    "copy kept elsewhere"
                )
