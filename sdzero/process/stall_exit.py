"""The launching side of a named stall: `sdzero train` and `sdzero launch` end the launch and exit with
EXIT_STALLED once the ranks' watcher wrote stall.json (sdzero.process.stall_watch).

The ranks that can still run exit by themselves with that code; a rank that cannot (a stopped process, one
in uninterruptible I/O on a dead disk) would keep its node's launcher, and with it the whole launch,
waiting. So after STALL_GRACE_S the launch is ended here (SIGKILL to its process group and, for a hosts
launch, to the ranks on every host), and the command exits with EXIT_STALLED whatever code the launcher
had: a peer that failed first in a collective makes it 1.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sdzero.process.stall_watch import EXIT_STALLED, STALL_FILE

STALL_GRACE_S = 5.0
"""How long the ranks get to exit by themselves once stall.json is written."""
OUTPUT_FLAGS = ("--output-dir", "--output_dir")


def output_dir_of(train_args: Sequence[str]) -> Path | None:
    """The trainer's --output-dir among the launch's arguments, or None."""
    args = list(train_args)
    for i, arg in enumerate(args):
        for flag in OUTPUT_FLAGS:
            if arg == flag and i + 1 < len(args):
                return Path(args[i + 1])
            if arg.startswith(flag + "="):
                return Path(arg.split("=", 1)[1])
    return None


class StallCheck:
    """Polled by the launching command while it waits: did this launch's ranks name a stall?"""

    def __init__(self, output_dir: Path | None, started: float | None = None) -> None:
        self.path = None if output_dir is None else Path(output_dir) / STALL_FILE
        self.started = time.time() if started is None else started
        self.seen_at: float | None = None

    def named(self) -> bool:
        """stall.json was written since the launch started (an older one is another run's)."""
        if self.path is None:
            return False
        try:
            written = self.path.stat().st_mtime
        except OSError:
            return False
        if written + 1.0 < self.started:
            return False
        if self.seen_at is None:
            self.seen_at = time.monotonic()
        return True

    def overdue(self) -> bool:
        return self.seen_at is not None and time.monotonic() - self.seen_at > STALL_GRACE_S

    def report(self) -> int:
        """Say what stalled and how to go on; the code the command exits with."""
        summary = ""
        if self.path is not None:
            with contextlib.suppress(OSError, ValueError):
                summary = json.loads(self.path.read_text()).get("summary", "")
        print(
            f"sdzero: the run stalled: {summary} (details in {self.path}); exit {EXIT_STALLED}: restart "
            "with --resume auto to continue from the newest complete checkpoint",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_STALLED
