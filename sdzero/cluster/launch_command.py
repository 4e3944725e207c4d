"""The one builder of `deepspeed` launcher commands (the trainer, `sdzero cache`, the hosts launch, the
advisor's trials and collectives benchmark, the benches and the tests all use `deepspeed_command`), and of
the one-host launch that skips the runner (`one_host_command`)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from sdzero.errors import UserError
from sdzero.process.rendezvous import free_port

__all__ = ["free_port"]  # re-exported: the launch commands' port, picked here

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "train.py"
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
    train_args: Sequence[str],
    num_gpus: int | None = None,
    hostfile: Path | None = None,
    master_port: int | None = None,
    entry: Sequence[str] | None = None,
    *,
    num_nodes: int | None = None,
    master_addr: str | None = None,
    launcher: str | None = None,
    launcher_args: str | None = None,
    executable: str | None = None,
    check_hostfile: bool = True,
    shell_proof: bool | None = None,
    pick_port: bool = True,
) -> list[str]:
    """The one builder of `deepspeed` command lines:

        deepspeed [--hostfile H] [--num_nodes N] [--num_gpus G] [--master_addr A] [--master_port P]
                  [--launcher L] [--launcher_args "..."] ENTRY ARGS

    ENTRY is sdzero/train.py unless given (e.g. `--no_local_rank --module sdzero.cli cache`, or a bench
    script). With a hostfile the ARGS go through `shell_proof_args` (remote ranks start through pdsh's or
    mpirun's shell; the trainer and `sdzero cache` decode the word) unless `shell_proof` says otherwise,
    for an entry that does not decode it. `executable` replaces this environment's launcher (a command
    printed for another cluster says plain `deepspeed`); `check_hostfile=False` accepts a hostfile that is
    not here (that printed command, or a deliberately absent one that keeps DeepSpeed from reading
    /job/hostfile); `pick_port=False` leaves the port to DeepSpeed's default when none is given."""
    cmd = [executable or deepspeed_executable()]
    if hostfile is not None:
        if check_hostfile and not Path(hostfile).is_file():
            raise UserError(f"--hostfile {hostfile}: no such file")
        cmd += ["--hostfile", str(hostfile)]
    if num_nodes is not None:
        cmd += ["--num_nodes", str(num_nodes)]
    if num_gpus is not None:
        if num_gpus < 1:
            raise UserError(f"--num-gpus must be at least 1, got {num_gpus}")
        cmd += ["--num_gpus", str(num_gpus)]
    if master_addr is not None:
        cmd += ["--master_addr", master_addr]
    if master_port is not None or pick_port:
        cmd += ["--master_port", str(master_port or free_port())]
    if launcher is not None:
        cmd += ["--launcher", launcher]
    if launcher_args is not None:
        cmd += ["--launcher_args", launcher_args]
    args = list(train_args)
    if shell_proof if shell_proof is not None else hostfile is not None:
        args = shell_proof_args(args)
    return [*cmd, *(entry or [str(TRAIN_SCRIPT)]), *args]


def one_host_command(
    train_args: Sequence[str],
    ranks: int,
    entry: Sequence[str] | None = None,
    master_port: int | None = None,
) -> list[str]:
    """`ranks` ranks on this host through DeepSpeed's per-node launcher, `deepspeed.launcher.launch`:
    exactly the command `deepspeed --num_gpus RANKS` runs once it has worked out the world.

    On one host the `deepspeed` runner does nothing else (no hostfile, no ssh, no exports), yet it is a
    whole interpreter importing torch and DeepSpeed before the launcher starts: 2-3 s of every launch,
    paid dozens of times by the test suite (and per trial by anything that launches many). Everything a
    rank sees (its environment, `--local_rank`, its siblings killed when it fails, the exit code) comes
    from the launcher itself, as it does under the runner. ENTRY is as for `deepspeed_command`.
    """
    if ranks < 1:
        raise UserError(f"--num-gpus must be at least 1, got {ranks}")
    world = json.dumps({"localhost": list(range(ranks))})  # what the runner encodes for one host
    return [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.launch",
        f"--world_info={base64.urlsafe_b64encode(world.encode()).decode()}",
        "--master_addr=127.0.0.1",
        f"--master_port={master_port or free_port()}",
        *(entry or [str(TRAIN_SCRIPT)]),
        *train_args,
    ]


def shipped_config(name: str) -> Path:
    path = REPO_ROOT / "ds_configs" / name
    if not path.is_file():
        raise UserError(
            f"shipped config {name} not found under {REPO_ROOT / 'ds_configs'}; pass one explicitly"
        )
    return path
