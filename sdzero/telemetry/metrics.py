"""Per-step measurements: peak memory and the metrics.jsonl writer (phase timers: sdzero.telemetry.phase_timers)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import torch

from sdzero.atomic import open_no_follow, refuse_link
from sdzero.config.user_file import read_json_lines


def peak_memory_bytes() -> int:
    """Peak bytes this rank held: accelerator allocations on CUDA, else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    # ru_maxrss is KiB on Linux (bytes on macOS).
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kib if sys.platform == "darwin" else kib * 1024)


class MetricsWriter:
    """Appends one JSON object per optimizer step; flushed per line so a killed run keeps its history."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open_no_follow(self.path, "a")  # held open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def rotate_previous(path: Path) -> Path | None:
    """Move an earlier run's file aside (metrics.1.jsonl, ...) so a new run never overwrites it."""
    path = Path(path)
    refuse_link(path)  # a planted link is named, not moved aside and later read as this run's history
    if not path.exists():
        return None
    n = 1
    while (moved := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(moved)
    return moved


def read_metric_lines(path: Path, flag: str) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """(line number, record) of each step line of a metrics.jsonl, and the count of lines skipped
    (sdzero.config.user_file.read_json_lines: a line cut by a kill, or nested beyond reason)."""
    return read_json_lines(path, flag)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
