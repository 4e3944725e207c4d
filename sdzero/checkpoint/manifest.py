"""The manifest of a checkpoint: what a complete checkpoint holds and the run that made it.

A leaf: the checkpointer (sdzero.checkpoint.checkpointer), the run identity rules
(sdzero.checkpoint.identity) and universal resume (sdzero.checkpoint.universal) all import it, and it
imports none of them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import types
import typing
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
LATEST = "latest"
STAGING_PREFIX = ".incoming-"
UNIVERSAL_PREFIX = ".universal-"
"""`.universal-step_N/step_N/`: DeepSpeed's universal form of checkpoint step_N, made by --resume-elastic."""
UNIVERSAL_SOURCE = "source.json"
EMA_DIR = "ema"
MANIFEST_FORMAT = 1


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


# ---------------------------------------------------------------------------------------------- files


def describe_file(path: Path, fsync: bool = False) -> dict[str, Any]:
    """Size and sha256 of one file, read in 8 MiB blocks; `fsync` first makes the bytes durable."""
    digest = hashlib.sha256()
    # Non-blocking and checked on the open descriptor: a FIFO or device planted under a listed name is an
    # error (OSError, as for a missing file), never a read that blocks or does not end.
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if fsync:
            os.fsync(f.fileno())
        while block := f.read(8 << 20):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def list_files(folder: Path) -> list[str]:
    """Every file under `folder` except the manifest, as sorted POSIX paths relative to it."""
    folder = Path(folder)
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
    )


# ------------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True, kw_only=True)
class RunIdentity:
    """What the manifest records about the run, and what a resume must match (sdzero.checkpoint.identity).
    Fields after `prediction_type` are None in manifests of older sdzero versions: not checked then."""

    zero_stage: int
    dtype: str
    world_size: int
    seed: int
    model: str
    prediction_type: str
    family: str | None = None
    model_fingerprint: str | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    resolution: int | None = None
    buckets: bool | None = None
    objective: dict[str, Any] | None = None
    """Loss, weighting, transforms and LR schedule, keyed by the flag that sets each."""
    data_fingerprint: str | None = None


@dataclass(frozen=True, kw_only=True)
class Manifest(RunIdentity):
    """What a complete checkpoint holds, and the run that made it (the inherited fields); written last,
    by rank 0."""

    tag: str
    step: int
    serial: int
    """Commit order within the folder: newest = highest serial (a run resumed from an older step writes
    checkpoints with lower steps that are nevertheless newer)."""
    ema: bool
    files: dict[str, dict[str, Any]]
    created_unix_s: float = 0.0
    format: int = MANIFEST_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @property
    def total_bytes(self) -> int:
        return sum(int(f["bytes"]) for f in self.files.values())


class ManifestError(ValueError):
    pass


_JSON_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (int, float),
    str: (str,),
    bool: (bool,),
    dict: (dict,),
}


def _wrong_type(cls: type, raw: dict[str, Any]) -> str | None:
    """The first field of `raw` whose JSON value is not of the type `cls` declares, as a phrase."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name not in raw:
            continue
        value, hint = raw[f.name], hints[f.name]
        options = (
            typing.get_args(hint) if typing.get_origin(hint) in (types.UnionType, typing.Union) else (hint,)
        )
        allowed = tuple(t for o in options for t in _JSON_TYPES.get(typing.get_origin(o) or o, ()))
        if value is None and type(None) in options:
            continue
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f'"{f.name}" is {type(value).__name__} {value!r:.40}, not {" or ".join(t.__name__ for t in allowed)}'
    return None


def safe_relative(name: str) -> bool:
    """A file name a manifest may list: relative, POSIX, no `..` or empty parts, no NUL."""
    parts = name.split("/")
    return (
        bool(name)
        and "\0" not in name
        and not name.startswith("/")
        and all(p not in ("", ".", "..") for p in parts)
    )


def load_manifest(folder: Path) -> Manifest:
    """The folder's manifest, or ManifestError saying why it is missing or invalid.

    Each value must have the type the field declares (a hand-edited or hostile manifest would otherwise
    fail later, far from here), and each listed file must be a plain relative path that stays inside the
    folder once symlinks are resolved: nothing outside a checkpoint is ever hashed or loaded as part of it.
    """
    folder = Path(folder)
    path = folder / MANIFEST
    if path.exists() and not path.is_file():  # a FIFO would block the read, a device never end it
        raise ManifestError(f"{path} is not a regular file; not an sdzero manifest")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as exc:
        raise ManifestError(f"{path} is missing (the save never committed)") from exc
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError(f"{path} is unreadable ({str(exc).splitlines()[0][:120]})") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{path}: not an sdzero manifest (a JSON {type(raw).__name__}, not an object)")
    unknown = sorted(set(raw) - {f.name for f in fields(Manifest)})
    missing = sorted(f.name for f in fields(Manifest) if f.name not in raw and f.default is MISSING)
    if unknown or missing:
        what = "; ".join(filter(None, [unknown and f"unknown {unknown}", missing and f"missing {missing}"]))
        raise ManifestError(f"{path}: not an sdzero manifest ({what})")
    wrong = _wrong_type(Manifest, raw)
    if wrong:
        raise ManifestError(f"{path}: not an sdzero manifest ({wrong})")
    manifest = Manifest(**raw)
    if manifest.format != MANIFEST_FORMAT:
        raise ManifestError(f"{path}: format {manifest.format}, this sdzero reads {MANIFEST_FORMAT}")
    if not manifest.files or not all(
        isinstance(v, dict)
        and isinstance(v.get("bytes"), int)
        and not isinstance(v.get("bytes"), bool)
        and isinstance(v.get("sha256"), str)
        for v in manifest.files.values()
    ):
        raise ManifestError(f"{path}: the file list is empty or malformed")
    root = folder.resolve()
    for name in manifest.files:
        if not safe_relative(name) or not (root / name).resolve().is_relative_to(root):
            raise ManifestError(
                f"{path}: lists {name!r}, which is not a file inside the checkpoint folder (refused: a "
                "checkpoint never reads beyond its own folder)"
            )
    return manifest


def read_manifest(folder: Path) -> Manifest | None:
    try:
        return load_manifest(folder)
    except ManifestError:
        return None


def verify_files(folder: Path, manifest: Manifest, names: Iterable[str] | None = None) -> list[str]:
    """Problems, one line each naming the file, for `names` (default: all files in the manifest)."""
    folder = Path(folder)
    problems = []
    for name in manifest.files if names is None else names:
        expected = manifest.files[name]
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != int(expected["bytes"]):
            problems.append(f"{path} has {size} bytes, the manifest says {expected['bytes']} (truncated?)")
        elif describe_file(path)["sha256"] != expected["sha256"]:
            problems.append(f"{path} does not match its sha256 in the manifest (corrupted)")
    return problems
