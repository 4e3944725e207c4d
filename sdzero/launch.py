"""Building `deepspeed` launcher commands for the trainer (used by `sdzero train` and `sdzero demo`)."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

from sdzero.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"


def free_port() -> int:
    """A port nobody listens on now (tests and the demo run side by side with other jobs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def deepspeed_executable() -> str:
    # Prefer the launcher next to this interpreter, so a venv's deepspeed is used even if not on PATH.
    local = Path(sys.executable).with_name("deepspeed")
    if local.exists():
        return str(local)
    found = shutil.which("deepspeed")
    if not found:
        raise UserError("the `deepspeed` launcher is not on PATH; install deepspeed in this environment")
    return found


def deepspeed_command(
    train_args: list[str],
    num_gpus: int | None = None,
    hostfile: Path | None = None,
    master_port: int | None = None,
    entry: list[str] | None = None,
) -> list[str]:
    """`deepspeed [--num_gpus N | --hostfile H] --master_port P ENTRY ARGS`; ENTRY is sdzero/train.py unless
    given (e.g. `--no_local_rank --module sdzero.cli cache` for the cache build)."""
    cmd = [deepspeed_executable()]
    if hostfile is not None:
        if not Path(hostfile).is_file():
            raise UserError(f"--hostfile {hostfile}: no such file")
        cmd += ["--hostfile", str(hostfile)]
    if num_gpus is not None:
        if num_gpus < 1:
            raise UserError(f"--num-gpus must be at least 1, got {num_gpus}")
        cmd += ["--num_gpus", str(num_gpus)]
    cmd += ["--master_port", str(master_port or free_port()), *(entry or [str(TRAIN_SCRIPT)]), *train_args]
    return cmd


def shipped_config(name: str) -> Path:
    path = REPO_ROOT / "ds_configs" / name
    if not path.is_file():
        raise UserError(
            f"shipped config {name} not found under {REPO_ROOT / 'ds_configs'}; pass one explicitly"
        )
    return path
