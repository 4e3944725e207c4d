"""sdzero: fine-tune Stable Diffusion with DeepSpeed ZeRO on one machine or many."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import MutableMapping
from pathlib import Path

__version__ = "0.1.0"


def venv_extensions_dir() -> Path | None:
    """Where `make venv` builds DeepSpeed's JIT ops: `<venv>/torch_extensions`; None outside a venv."""
    if sys.prefix == sys.base_prefix:
        return None
    return Path(sys.prefix) / "torch_extensions"


def use_venv_build_tools(environ: MutableMapping[str, str] = os.environ) -> None:
    """Point DeepSpeed at the ops `make venv` built, for every process that imports sdzero.

    Every process that loads an op imports sdzero first (the trainer's ranks, the launcher's remote ranks
    through .deepspeed_env, the advisor's trials, the cache builder), so this is the one place. Without it a
    command run from a plain shell (no make, venv not activated) rebuilds CPU Adam into
    ~/.cache/torch_extensions, minutes of compiling inside a first timed trial. Loading even a prebuilt op
    runs `ninja` (torch checks the build is current), which pip installs into the venv's bin: that folder
    goes at the END of PATH, so it never shadows the user's own tools. A user's own TORCH_EXTENSIONS_DIR
    is kept.
    """
    folder = venv_extensions_dir()
    if folder is None or not folder.is_dir():
        return
    environ.setdefault("TORCH_EXTENSIONS_DIR", str(folder))
    bin_dir = str(Path(sys.prefix) / "bin")
    path = environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        environ["PATH"] = f"{path}{os.pathsep}{bin_dir}" if path else bin_dir


def thread_only_progress_lock() -> None:
    """Give tqdm (our bars, and diffusers' and the hub's, which share its lock) a lock of this process's
    threads only. Its default adds a multiprocessing semaphore that forked children (the data loader's
    workers) share: one that dies holding it leaves every later bar of the parent waiting for ever, at
    any line where the garbage collector closes an old bar (a unit-test worker hung so for 45 minutes,
    in tqdm.__del__). No bar of ours is drawn from two processes at once."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


use_venv_build_tools()
thread_only_progress_lock()
