"""Loading checkpoint files without unpickling anything but tensors and DeepSpeed's own state types.

A checkpoint is passed around (shared storage, buckets, a colleague's run), and its manifest sits in the
same folder: matching sha256 sums prove the bytes are what *someone* committed, not who. `torch.load` with
`weights_only=False` (what DeepSpeed's checkpoint engine, zero_to_fp32 and ds_to_universal all call)
runs whatever a pickle's `__reduce__` names. So every load of a checkpoint file goes through torch's
weights-only unpickler, which builds tensors, containers and plain values and, beyond those, only the
types allowed here; anything else is refused before it is built, in one line naming the file and the type.

Where DeepSpeed itself calls `torch.load`, it is called inside `guarded_loads`: for the duration every
`torch.load` in the process is the weights-only one, and opens only the files the caller allows (the
manifest's, inside the checkpoint folder). sdzero's own files are safetensors (EMA, caches), which hold no
code by design; `check_safetensors` turns a damaged or planted one into the same kind of one line.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from sdzero.errors import UserError

DEEPSPEED_STATE_TYPES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""Every type beyond tensors and plain values that DeepSpeed 0.19 pickles into the checkpoints sdzero
writes (ZeRO 0-3, fp32/bf16/fp16, offload; found with torch.serialization.get_unsafe_globals_in_checkpoint):
an enum, two loss scalers (plain attribute bags) and a two-int dataclass. The weights-only unpickler makes
them with `__new__` and sets their attributes; none of their code runs."""


class UnsafeFileError(UserError):
    """A checkpoint file that needs more than the weights-only unpickler allows, or one not allowed at all."""


def _deepspeed_types() -> list[type]:
    import importlib

    found = []
    for dotted in DEEPSPEED_STATE_TYPES:
        module, _, name = dotted.rpartition(".")
        found.append(getattr(importlib.import_module(module), name))
    return found


def _unsafe_types(path: Path, message: str) -> str:
    """The types the file names that are not allowed: read from the pickle's opcodes without running it."""
    try:
        allowed = set(DEEPSPEED_STATE_TYPES)
        named = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
    except Exception:  # not a zip checkpoint: the unpickler's own words
        named = []
    if named:
        return ", ".join(named)
    match = re.search(r"GLOBAL (\S+)", message) or re.search(r"WeightsUnpickler error: ([^\n.]+)", message)
    return match.group(1) if match else "an object outside tensors and plain values"


_ORIGINAL_LOAD = torch.serialization.load


def load_tensors(path: Path | str, map_location: Any = "cpu", **kwargs: Any) -> Any:
    """`torch.load(path, weights_only=True)` with DeepSpeed's state types allowed; any other type (a
    pickled payload) or a file torch cannot read is a one-line UnsafeFileError naming file and type."""
    path = Path(path)
    kwargs.pop("weights_only", None)
    kwargs.pop("pickle_module", None)
    with torch.serialization.safe_globals(_deepspeed_types()):
        try:
            return _ORIGINAL_LOAD(path, map_location=map_location, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            raise _refusal(path, _unsafe_types(path, str(exc))) from None
        except (RuntimeError, EOFError, ValueError, OSError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsafeFileError(f"{path}: not a readable torch checkpoint file ({first})") from None


def scan_for_code(path: Path | str) -> None:
    """Refuse, in load_tensors' one line, a file whose pickle names any type load_tensors would refuse,
    reading only its opcodes (no object is built, no tensor data read). A check every rank can make on
    files another rank will load, before any of them enters DeepSpeed's loader (see
    sdzero.checkpoint.checkpointer.prescan)."""
    path = Path(path)
    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # not a zip checkpoint: load_tensors says what it is, when it is loaded
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeFileError(f"{path}: not a readable torch checkpoint file ({first})") from None
    unsafe = [g for g in named if g not in DEEPSPEED_STATE_TYPES]
    if unsafe:
        raise _refusal(path, ", ".join(unsafe))


def _refusal(path: Path, types: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{path}: needs {types} to load, which is neither a tensor, a plain value nor one of DeepSpeed's "
        "state types; refused without running it (DeepSpeed never writes one: the file was altered after "
        "it was saved)"
    )


Allow = Callable[[Path], bool]


def inside(folder: Path, names: Any) -> Allow:
    """Allow the files `names` (relative to `folder`) and nothing else, each resolved (symlinks too)."""
    root = Path(folder).resolve()
    wanted = {(root / n).resolve() for n in names}
    return lambda path: path in wanted


def under(folder: Path) -> Allow:
    """Allow any file below `folder` (one this process is writing, e.g. a conversion's own temp files)."""
    root = Path(folder).resolve()
    return lambda path: path.is_relative_to(root)


@contextlib.contextmanager
def guarded_loads(*allow: Allow, what: str = "checkpoint") -> Iterator[None]:
    """Within the block every `torch.load` in this process, DeepSpeed's included, is `load_tensors`, and
    opens only a path some `allow` accepts: a file that the manifest does not list (planted beside the
    listed ones, where DeepSpeed's globs would find it) or a file object is refused in one line."""

    def guarded(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(f, str | Path):
            raise UnsafeFileError(
                f"{what}: DeepSpeed asked to load from a {type(f).__name__}, not a file; refused"
            )
        path = Path(f).resolve()
        if not any(a(path) for a in allow):
            raise UnsafeFileError(
                f"{f}: not one of the files the {what}'s manifest lists; refused without opening it "
                "(remove it, or get the checkpoint again from whoever wrote it)"
            )
        return load_tensors(path, map_location=map_location, **kwargs)

    before = torch.load, torch.serialization.load
    torch.load = torch.serialization.load = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load, torch.serialization.load = before  # type: ignore[assignment]


def check_safetensors(path: Path) -> None:
    """Open a safetensors file's header (its tensor names, dtypes and offsets; no code, by the format) or
    raise a one-line UnsafeFileError naming it: a damaged or planted file, before a library trips on it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # SafetensorError, OSError: the format is refused whatever the cause
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeFileError(f"{path}: not a readable safetensors file ({first})") from None
