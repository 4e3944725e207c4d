"""`.deepspeed_env`: the KEY=VALUE file DeepSpeed's runner reads (from $HOME, then the working folder) to
forward variables to remote ranks; sdzero reads it, and adds the keys remote ranks need.

A value is the text after the first '=' with surrounding blanks removed (as DeepSpeed reads it), taken
literally: sdzero writes values unquoted, and `sdzero launch` hands them to the ranks byte for byte (see
sdzero.process.rank_entry). Plain `deepspeed` differs only where its runner wraps a value in double
quotes for the remote shell: there `$`, backticks and backslashes are still expanded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from sdzero.atomic import write_text_atomic
from sdzero.config.user_file import read_user_bytes
from sdzero.errors import UserError

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$", re.ASCII)
"""What DeepSpeed puts after `export ` in every remote command line: a shell variable name."""
ENV_FILE = ".deepspeed_env"


def env_file_name(environ: dict[str, str] | None = None) -> str:
    """The file name DeepSpeed's runner looks for (its DS_ENV_FILE setting, else .deepspeed_env)."""
    return (os.environ if environ is None else environ).get("DS_ENV_FILE", ENV_FILE)


@dataclass(frozen=True)
class EnvMerge:
    added: dict[str, str]
    kept: dict[str, tuple[str, str]]
    """key -> (the user's value, the value sdzero would have written), where they differ."""
    not_written: dict[str, str]
    """Values a KEY=VALUE line cannot hold (a line break, blanks at either end, which DeepSpeed strips);
    `sdzero launch` forwards them anyway."""


def _quoted(value: str) -> bool:
    return len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""


def read_env_file(path: Path) -> dict[str, str]:
    """The KEY=VALUE lines of a `.deepspeed_env`, every line that DeepSpeed would misread refused by number.

    DeepSpeed splits each line at its first '=' and writes `export KEY=VALUE; ` into every remote command
    line: a blank line crashes it, and `# X=1` becomes `export # X=1; ...`, commenting out the rest of the
    remote command. So: no blank lines, no comments, a shell variable name before the '='. A value wrapped
    in quotes is refused too: the quotes would reach the ranks as part of the value (older sdzero wrote
    such lines itself).
    """
    try:
        text = read_user_bytes(path, "the env file").decode("utf-8")  # a FIFO here once blocked for ever
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{path}: byte {exc.start} is not UTF-8; write the file as UTF-8 text (KEY=VALUE lines)"
        ) from None
    existing: dict[str, str] = {}
    bad: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        key, sep, value = raw.partition("=")
        if not raw.strip():
            bad.append(f"line {number} is blank")
        elif not sep:
            bad.append(f"line {number} {raw.strip()!r} is not KEY=VALUE")
        elif not ENV_KEY.match(key.strip()):
            bad.append(f"line {number} {raw.strip()!r}: {key.strip()!r} is not a variable name")
        elif _quoted(value.strip()):
            bad.append(
                f"line {number}: the value of {key.strip()} is wrapped in quotes, which would reach the "
                f"ranks as part of it (values are taken literally: write {key.strip()}={value.strip()[1:-1]})"
            )
        else:
            existing[key.strip()] = value.strip()
    if bad:
        raise UserError(
            f"{path}: {'; '.join(bad)}. DeepSpeed turns every line into `export LINE;` on each node, so "
            "comments, blank lines and quoting break or change what the ranks get: fix those lines"
        )
    return existing


def merge_env_file(path: Path, wanted: dict[str, str]) -> EnvMerge:
    """Add the missing keys to `path`, unquoted; the user's own keys and lines are never changed."""
    present = os.path.lexists(path)
    existing = read_env_file(path) if present else {}  # checked to be a regular file before it is read
    text = read_user_bytes(path, "the env file").decode("utf-8") if present else ""
    missing = {k: v for k, v in wanted.items() if k not in existing}
    # A line break would end the line early (and start a bogus one), and blanks at the ends are stripped
    # on reading: such a value stays out of the file.
    not_written = {k: v for k, v in missing.items() if len(v.splitlines()) > 1 or v != v.strip()}
    added = {k: v for k, v in missing.items() if k not in not_written}
    kept = {k: (existing[k], v) for k, v in wanted.items() if k in existing and existing[k] != v}
    if added:
        body = text if not text or text.endswith("\n") else text + "\n"
        body += "".join(f"{k}={v}\n" for k, v in added.items())
        write_text_atomic(path, body, follow_link=True)  # the user's own file: a dotfile link is theirs
    return EnvMerge(added, kept, not_written)
