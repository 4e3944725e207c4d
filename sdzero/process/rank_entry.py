"""The first program of every remote rank that `sdzero launch` starts: it puts the rank where the user
launched from, with the values the user forwarded, then becomes the real rank command (exec, same pid).

Why it exists: DeepSpeed's pdsh runner builds each node's command as one shell line,
`export K=V; ...; cd <folder>; python -m deepspeed.launcher.launch ... SCRIPT ARGS`, with the folder
unquoted and each value wrapped in double quotes (so `$`, backticks and `\\` are expanded there and a
folder named `my runs` or `x$(touch f)` is split or run). sdzero therefore gives that line only words no
shell changes: the runner starts in a shell-safe folder, no `export` carries a user's value, and everything
else travels in one base64 word (the payload: folder, command, values) plus, for secrets, a file only the
user can read. Nothing here imports torch: this runs once per rank before the real interpreter starts.

    python -m sdzero.process.rank_entry [--local_rank=N] PAYLOAD_WORD
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import stat
import sys
from dataclasses import dataclass

from sdzero.errors import EXIT_USER_ERROR, UserError

MODULE = "sdzero.process.rank_entry"
LAUNCH_ID = re.compile(r"[0-9a-f]{1,64}")
PER_RANK_KEYS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_SIZE",
        "CROSS_RANK",
        "CROSS_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "ZE_AFFINITY_MASK",
        "HABANA_VISIBLE_MODULES",
        "ASCEND_RT_VISIBLE_DEVICES",
    }
)
"""What deepspeed.launcher.launch sets for each rank after the exports ran: under DeepSpeed's own
forwarding these overrule a `.deepspeed_env` line, so a forwarded value never replaces them here either."""


@dataclass(frozen=True)
class Payload:
    """What the launching host hands each rank."""

    cwd: str
    """The folder the user launched from (any bytes a path may hold)."""
    command: list[str]
    """The rank command after the interpreter: `[SCRIPT, ARGS...]` or `["-m", MODULE, ARGS...]`; the
    per-node launcher's `--local_rank=N` goes right after SCRIPT or MODULE, where DeepSpeed puts it."""
    env: dict[str, str]
    """Forwarded values that are not secret."""
    secrets_file: str | None
    """A 0600 file of the secret values (JSON object), or None when there are none."""
    launch_id: str | None = None
    """Put on the rank's command line as `-X sdzero_launch=ID`, where a signal's `pkill` finds it
    (sdzero.process.launch_signals); Python keeps unknown -X options in sys._xoptions, unused."""


def encode_payload(payload: Payload) -> str:
    # ensure_ascii: a value of non-UTF-8 bytes (a surrogate escape in os.environ) survives as \\udcXX.
    text = json.dumps(
        {
            "cwd": payload.cwd,
            "command": payload.command,
            "env": payload.env,
            "secrets_file": payload.secrets_file,
            "launch_id": payload.launch_id,
        },
        ensure_ascii=True,
    )
    return base64.b64encode(text.encode("ascii")).decode("ascii")


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _string_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def decode_payload(word: str) -> Payload:
    try:
        data = json.loads(base64.b64decode(word, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise UserError(f"{MODULE}: the payload is not a word written by `sdzero launch` ({exc})") from None
    if not (
        isinstance(data, dict)
        and isinstance(data.get("cwd"), str)
        and _strings(data.get("command"))
        and data["command"]
        and _string_map(data.get("env"))
        and (data.get("secrets_file") is None or isinstance(data.get("secrets_file"), str))
        and (data.get("launch_id") is None or LAUNCH_ID.fullmatch(str(data.get("launch_id"))))
    ):
        raise UserError(f"{MODULE}: the payload lacks cwd, command or env; relaunch with `sdzero launch`")
    return Payload(data["cwd"], data["command"], data["env"], data["secrets_file"], data.get("launch_id"))


def read_secrets(path: str) -> dict[str, str]:
    """The secret values, from a file that only this user can read (anything else is refused: a file
    others can write could plant variables such as LD_PRELOAD into every rank)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a planted FIFO cannot block
    except FileNotFoundError:
        raise UserError(
            f"{path}: the launch's secrets file is not on this host; the folder you launch from must be on "
            "storage every host shares (`sdzero doctor --hostfile H` checks it)"
        ) from None
    except OSError as exc:
        raise UserError(f"{path}: cannot open the launch's secrets file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: the launch's secrets file is not a regular file; not used")
        if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise UserError(
                f"{path}: the secrets file must be this user's with mode 0600, found owner "
                f"{info.st_uid} mode {stat.S_IMODE(info.st_mode):o}; not used"
            )
        raw = handle.read()
    try:
        data = json.loads(raw)
    except ValueError:
        raise UserError(f"{path}: the secrets file is not JSON written by `sdzero launch`") from None
    if not _string_map(data):
        raise UserError(f"{path}: the secrets file is not a JSON object of strings")
    return data


def rank_argv(payload: Payload, local_rank_args: list[str], interpreter: str) -> list[str]:
    """The real rank command: the interpreter, then the command with the launcher's `--local_rank=N` after
    the script or module, exactly as deepspeed.launcher.launch would have placed it."""
    command = payload.command
    head = 2 if command[0] == "-m" else 1
    mark = ["-X", f"sdzero_launch={payload.launch_id}"] if payload.launch_id else []
    return [interpreter, "-u", *mark, *command[:head], *local_rank_args, *command[head:]]


def prepare(argv: list[str], environ: dict[str, str]) -> tuple[str, list[str], dict[str, str]]:
    """(folder, command, environment) for this rank, from the entry's own argv and environment."""
    local_rank_args = [a for a in argv if a.startswith("--local_rank")]
    words = [a for a in argv if not a.startswith("--local_rank")]
    if len(words) != 1:
        raise UserError(f"{MODULE}: expected one payload word, got {len(words)} arguments")
    payload = decode_payload(words[0])
    values = dict(payload.env)
    if payload.secrets_file is not None:
        values.update(read_secrets(payload.secrets_file))
    env = dict(environ)
    env.update({k: v for k, v in values.items() if k not in PER_RANK_KEYS})
    return payload.cwd, rank_argv(payload, local_rank_args, sys.executable), env


def main(argv: list[str] | None = None) -> None:
    try:
        cwd, command, env = prepare(sys.argv[1:] if argv is None else argv, dict(os.environ))
        try:
            os.chdir(cwd)
        except OSError as exc:
            raise UserError(
                f"{cwd!r}: the launch folder is not usable on this host ({exc.strerror}); launch from a "
                "folder that every host has at the same path (shared storage)"
            ) from None
    except UserError as exc:
        print(f"sdzero: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    sys.stdout.flush()
    sys.stderr.flush()
    from sdzero.process.session_watch import watch_ssh_session

    watch_ssh_session()  # a remote rank ends with the ssh session of its launcher (no orphans)
    # exec, not a child: the per-node launcher watches and signals this pid, and the rank's exit code is
    # the launcher's verdict; an os.environ-only env passes non-UTF-8 values back as their bytes.
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
