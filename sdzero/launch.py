"""Building `deepspeed` launcher commands for the trainer (used by `sdzero train` and `sdzero demo`)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import socket
import sys
from pathlib import Path

from sdzero.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"
ARGV_FLAG = "--sdzero-argv-b64"
"""The trainer's options as one base64 word (JSON list inside), for launches through a remote shell."""
SHELL_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")
"""Words that no POSIX shell changes: DeepSpeed's pdsh runner joins the options into one remote command
line and only wraps those with spaces in double quotes, so `$`, backticks, quotes and `;` would be expanded
or run by every node's shell."""


def shell_proof_args(args: list[str]) -> list[str]:
    """`args` as they are when every one is shell-safe; otherwise all of them as one base64 word (whose
    alphabet no shell touches), which the rank decodes with `decode_argv`: byte for byte, whatever the
    remote shell is (sh, bash, zsh) and whatever DeepSpeed's runner adds or wraps."""
    if all(SHELL_SAFE.match(a) for a in args):
        return list(args)
    payload = json.dumps(list(args), ensure_ascii=True).encode()
    return [ARGV_FLAG, base64.b64encode(payload).decode("ascii")]


def decode_argv(argv: list[str]) -> list[str]:
    """The trainer's argv with an `ARGV_FLAG WORD` pair replaced by the options it carries (the launcher's
    own `--local_rank=N` stays where it was)."""
    if ARGV_FLAG not in argv:
        return list(argv)
    i = argv.index(ARGV_FLAG)
    try:
        decoded = json.loads(base64.b64decode(argv[i + 1], validate=True))
    except (IndexError, ValueError) as exc:
        raise UserError(f"{ARGV_FLAG}: not a word written by sdzero's launcher ({exc})") from None
    if not isinstance(decoded, list) or not all(isinstance(a, str) for a in decoded):
        raise UserError(f"{ARGV_FLAG}: not a list of options")
    return [*argv[:i], *decoded, *argv[i + 2 :]]


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
    if hostfile is not None:
        # Remote ranks start through pdsh's shell; train.py and `python -m sdzero.cli` decode the word.
        train_args = shell_proof_args(train_args)
    cmd += ["--master_port", str(master_port or free_port()), *(entry or [str(TRAIN_SCRIPT)]), *train_args]
    return cmd


def shipped_config(name: str) -> Path:
    path = REPO_ROOT / "ds_configs" / name
    if not path.is_file():
        raise UserError(
            f"shipped config {name} not found under {REPO_ROOT / 'ds_configs'}; pass one explicitly"
        )
    return path
