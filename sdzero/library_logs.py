"""Library chatter off the terminal and into a log file: what a user can do nothing about.

DeepSpeed, transformers, diffusers and torch talk at start-up: accelerator detection ("Setting
accelerator to CPU"), deprecation and future warnings, torchvision fallbacks, op builds, progress bars for
writing and loading weights. `sdzero advise`, `profile`, `demo` and the trainer's rank-0 console send it
to a log file instead (advise.log, profile.log, demo.log, the run's library.log), where it is kept whole.
What still shows: every record a library logs at ERROR or above, every warning raised by sdzero's or the
advisor's own code, and everything sdzero prints itself.

Two ways in, for the two places chatter is made:

- in this process, `library_chatter_to(path)`: library loggers' records below ERROR and warnings raised
  inside installed packages go to the file, and the libraries' progress bars are switched off;
- in a child's output (the `deepspeed` launcher and its ranks, whose start-up runs before any sdzero
  code), `ChatterFilter`: line by line, the known chatter to the file, the rest to the terminal.

Stdlib only: the advisor imports it without torch.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from sdzero.atomic import open_no_follow

LIBRARY_LOGGERS = ("DeepSpeed", "deepspeed", "transformers", "diffusers", "huggingface_hub", "torch")
"""Library root loggers: DeepSpeed logs on "DeepSpeed" itself (no propagation); the others' modules log on
children that propagate to their root's handler."""
CONSOLE_LEVEL = logging.ERROR
"""A library record at or above this still shows: an error is never chatter."""
QUIET_CATEGORIES = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)

CHATTER_LINE = re.compile(
    r"\[(?:INFO|WARNING|DEBUG)\] \[[\w.]+\.py:\d+:"  # DeepSpeed's logger format: launcher, accelerator, ...
    r"|^DeepSpeed [\w.]+ built successfully"  # op builds (a print)
    r"|requires torchvision \(not installed\); falling back"
    r"|^(?:Writing model shards|Loading weights|Loading pipeline components|Fetching \d+ files)\b"
    r"|/(?:site|dist)-packages/.*: (?:\w*Warning): "  # a warning raised inside an installed package
)
"""A line of a child's output that is chatter (see the module doc)."""
WARNING_SOURCE_LINE = re.compile(r"^  \S")
"""The source line Python prints under a warning: chatter when the warning was."""


class ChatterLog:
    """An append-only log file, opened (with its folder) at its first line; None: chatter is dropped."""

    def __init__(self, path: Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        if self.path is None:
            return
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open_no_follow(self.path, "a")
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            self._file.write(f"{stamp} {text.rstrip()}\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class _Divert(logging.Filter):
    """Passes a library's errors on; writes the rest to the log and stops them there."""

    def __init__(self, log: ChatterLog) -> None:
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= CONSOLE_LEVEL:
            return True
        self.log.write(f"[{record.name}] {record.levelname}: {record.getMessage()}")
        return False


def is_library_file(filename: str) -> bool:
    """A file of an installed package or of Python itself, not of this project."""
    path = os.path.abspath(filename)
    return "site-packages" in path or "dist-packages" in path or path.startswith(sys.base_prefix)


def _show_warning(log: ChatterLog, original: Callable[..., None]) -> Callable[..., None]:
    def show(
        message: Any, category: type[Warning], filename: str, lineno: int, *args: Any, **kwargs: Any
    ) -> None:
        if issubclass(category, QUIET_CATEGORIES) or is_library_file(filename):
            log.write(warnings.formatwarning(message, category, filename, lineno).strip())
            return
        original(message, category, filename, lineno, *args, **kwargs)

    return show


def _progress_bars_off() -> None:
    """The libraries' own switches: the environment for those not imported yet, the call for the others."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    for module, call in (
        ("transformers.utils.logging", "disable_progress_bar"),
        ("diffusers.utils.logging", "disable_progress_bar"),
        ("huggingface_hub.utils", "disable_progress_bars"),
    ):
        if module in sys.modules:
            getattr(sys.modules[module], call)()


@contextmanager
def library_chatter_to(path: Path | None) -> Iterator[ChatterLog]:
    """In this process, while the block runs: library chatter into `path` (None: dropped). Yields the log,
    for the caller's own lines too."""
    log = ChatterLog(path)
    divert = _Divert(log)
    touched: list[tuple[Any, Any]] = []  # (logger or handler, original addHandler or None)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.addFilter(divert)  # records logged on the library's root logger itself
        for handler in logger.handlers:  # records of its modules, propagated to its handler
            handler.addFilter(divert)
            touched.append((handler, None))
        touched.append((logger, _filter_new_handlers(logger, divert)))
    original_show = warnings.showwarning
    warnings.showwarning = _show_warning(log, original_show)
    _progress_bars_off()
    try:
        yield log
    finally:
        warnings.showwarning = original_show
        for thing, added in touched:
            thing.removeFilter(divert)
            for handler in getattr(thing, "handlers", []):
                handler.removeFilter(divert)
            if added is not None:
                thing.__dict__.pop("addHandler", None)
        log.close()


def _filter_new_handlers(logger: logging.Logger, divert: _Divert) -> bool:
    """A library imported later adds its handler to its root logger then (transformers, diffusers): that
    handler gets the filter too. Returns True (an instance attribute to remove afterwards)."""
    add = logging.Logger.addHandler

    def add_filtered(handler: logging.Handler) -> None:
        handler.addFilter(divert)
        add(logger, handler)

    logger.addHandler = add_filtered  # type: ignore[method-assign]
    return True


def quiet_library_loggers(log: ChatterLog) -> None:
    """For the rest of this process (a trainer's rank): what library_chatter_to does, without an end."""
    divert = _Divert(log)
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.addFilter(divert)
        for handler in logger.handlers:
            handler.addFilter(divert)
        _filter_new_handlers(logger, divert)
    warnings.showwarning = _show_warning(log, warnings.showwarning)
    _progress_bars_off()


class ChatterFilter:
    """A child's output, pumped line by line: chatter (CHATTER_LINE, and the source line under a chatter
    warning) to the log, the rest to `out` as it came, progress-bar redraws (carriage returns) included."""

    def __init__(self, log: ChatterLog, out: IO[str]) -> None:
        self.log, self.out = log, out
        self._after_warning = False

    def segment(self, text: str, end: str) -> None:
        """One line or progress-bar redraw (`end` is its newline or carriage return)."""
        chatter = bool(CHATTER_LINE.search(text)) or (
            self._after_warning and bool(WARNING_SOURCE_LINE.match(text))
        )
        self._after_warning = chatter and "Warning: " in text
        if chatter:
            self.log.write(text)
            return
        self.out.write(text + end)
        self.out.flush()

    def pump(self, stream: IO[bytes]) -> None:
        """Read `stream` to its end."""
        pending = ""
        while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
            pending += chunk.decode(errors="replace")
            parts = re.split(r"(\r\n|\n|\r)", pending)
            pending = parts.pop()  # an unfinished line waits for more
            for text, end in zip(parts[::2], parts[1::2], strict=True):
                self.segment(text, end)
        if pending:
            self.segment(pending, "")
