"""`sdzero doctor --data`: every node reads a sample of the data location at the same time (each node its
own sample, from one agreed wall-clock second: sdzero.data.read_rate), and the table gives each node's read
rate, the aggregate (all bytes over the time from the common start to the last node's end) and the
slowest node: the storage's rate when the whole job reads at once, which one node alone does not show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sdzero.constants import MIB

START_DELAY_S = 10.0
"""From the orchestrator's clock to the nodes' common start: ssh and an interpreter importing torch on each
node fit in it, so that no node begins before the others."""
SLOW_NODE_FRACTION = 0.5
"""A node reading at under this fraction of the median node's rate is named: it starves its GPUs first."""

Remote = Callable[..., dict[str, Any]]
"""doctor's `_remote(host, args, module=...)`: run a node-side module over ssh and parse its JSON line."""


def read_everywhere(
    hosts: list[str | None], data: Path, remote: Remote, files: int = 64, readers: int = 8
) -> list[dict[str, Any]]:
    """Every node's read of its own sample, all from the same second."""
    start_at = time.time() + START_DELAY_S
    args = [
        "--data",
        str(data),
        "--files",
        str(files),
        "--readers",
        str(readers),
        "--start-at",
        str(start_at),
    ]
    with ThreadPoolExecutor(min(32, len(hosts))) as pool:
        jobs = [
            pool.submit(remote, host, [*args, "--sample", str(i)], module="sdzero.data.read_rate")
            for i, host in enumerate(hosts)
        ]
        return [j.result() for j in jobs]


def aggregate(reads: list[dict[str, Any]]) -> dict[str, float]:
    """All nodes' bytes and files over the span from the first start to the last end."""
    span = max(r["ended"] for r in reads) - min(r["started"] for r in reads)
    return {
        "bytes_per_s": sum(r["bytes"] for r in reads) / span,
        "files_per_s": sum(r["files"] for r in reads) / span,
        "span_s": span,
    }


def slowest_note(reads: list[dict[str, Any]]) -> str:
    """'slowest node: h (x MiB/s, under half the median node's y)' or the slowest named without a warning."""
    ordered = sorted(reads, key=lambda r: r["bytes_per_s"])
    slow, median = ordered[0], ordered[len(ordered) // 2]["bytes_per_s"]
    text = f"slowest node: {slow['host']} ({slow['bytes_per_s'] / MIB:.1f} MiB/s"
    if len(reads) > 1 and slow["bytes_per_s"] < SLOW_NODE_FRACTION * median:
        return text + f", under half the median node's {median / MIB:.1f} MiB/s: it starves its GPUs first)"
    return text + ")"


def render_reads(reads: list[dict[str, Any]], data: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"data read at once by every node: {data}")
    for column in ("node", "files", "readers", "MiB/s", "files/s"):
        table.add_column(column, justify="left" if column == "node" else "right")
    for r in sorted(reads, key=lambda r: str(r["host"])):
        table.add_row(
            str(r["host"]),
            str(r["files"]),
            str(r["readers"]),
            f"{r['bytes_per_s'] / MIB:.1f}",
            f"{r['files_per_s']:.0f}",
        )
    total = aggregate(reads)
    table.add_row(
        "aggregate",
        str(sum(r["files"] for r in reads)),
        "",
        f"{total['bytes_per_s'] / MIB:.1f}",
        f"{total['files_per_s']:.0f}",
    )
    console = Console()
    console.print(table)
    console.print(slowest_note(reads), markup=False, soft_wrap=True)
