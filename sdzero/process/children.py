"""Commands that start process trees (`sdzero advise`, `profile`, `comm`) end them on SIGINT, SIGTERM and
SIGHUP too, not only on Ctrl-C.

Their launchers run in sessions of their own (so that a hung trial can be killed whole), which also means
a terminal's or a scheduler's signal to the command never reaches the ranks. By default SIGTERM and SIGHUP
end the Python process at once, skipping the `finally` blocks that kill those sessions, and the ranks run
on as orphans. Here each of the three signals becomes an exception in the main thread instead, so every
`finally` on the way out runs; the command then exits with 128 + the signal's number.
"""

from __future__ import annotations

import functools
import signal
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
F = TypeVar("F", bound=Callable[..., Any])


class Interrupted(SystemExit):
    """Raised in the main thread by one of ENDING_SIGNALS; exits with 128 + its number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def _raise(signum: int, frame: types.FrameType | None) -> None:
    for sig in ENDING_SIGNALS:  # a second signal while cleaning up must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


@contextmanager
def signals_end_children() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM/SIGHUP raise Interrupted; the old handlers come back after it."""
    saved = {sig: signal.getsignal(sig) for sig in ENDING_SIGNALS}
    for sig in ENDING_SIGNALS:
        signal.signal(sig, _raise)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def ending_children_on_signals(command: F) -> F:
    """Wrap a Typer command (its signature is kept, so the CLI sees the same options)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with signals_end_children():
            return command(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
