"""The training report's view of the hosts: each host's own compute time per step over the run, and the
slow host the ranks named (sdzero.training.straggler writes both into metrics.jsonl every
--straggler-every steps: `host_compute_s` and `straggler`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from advisor.report import figures
from advisor.report.page import FigureItem, Item, NoteItem

CAPTION = (
    "Each host's own compute time per step (data loading, encoding and forward: the phases where a rank "
    "waits for nobody), as the ranks shared it every --straggler-every steps. A host above the others "
    "slows every rank's step: the others wait for it in the gradient reduction."
)


def host_series(m: pd.DataFrame) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(steps with a sharing, {host: seconds per step at those steps}; NaN where a host is missing)."""
    if "host_compute_s" not in m:
        return np.array([]), {}
    rows = m[m["host_compute_s"].apply(lambda v: isinstance(v, dict) and bool(v))]
    hosts = sorted({h for v in rows["host_compute_s"] for h in v})
    series = {h: np.array([float(v.get(h, np.nan)) for v in rows["host_compute_s"]]) for h in hosts}
    return rows["step"].to_numpy(float), series


def straggler_note(m: pd.DataFrame) -> str | None:
    """The slow host the run named (the latest naming), as one sentence; None if none was."""
    if "straggler" not in m:
        return None
    named = [v for v in m["straggler"] if isinstance(v, dict)]
    if not named:
        return None
    last: dict[str, Any] = named[-1]
    share = last.get("wait_share")
    waits = (
        f"; every other rank spent at least {100 * share:.0f} % of its step waiting for it"
        if isinstance(share, (int, float))
        else ""
    )
    return (
        f"Slow host: {last['host']} (ranks {', '.join(str(r) for r in last['ranks'])}) took "
        f"{1e3 * last['compute_s']:.0f} ms of own compute per step against {1e3 * last['others_compute_s']:.0f} "
        f"ms on the other hosts (+{100 * last['slower_by']:.0f} %), named at {len(named)} sharing step(s)"
        f"{waits}."
    )


def slow_link_note(m: pd.DataFrame) -> str | None:
    """The host whose links the run named slow (the latest naming), as one sentence; None if none was."""
    if "slow_link" not in m:
        return None
    named = [v for v in m["slow_link"] if isinstance(v, dict)]
    if not named:
        return None
    last: dict[str, Any] = named[-1]
    return (
        f"Slow link: {last['host']} (ranks {', '.join(str(r) for r in last['ranks'])}) reached "
        f"{last['gbps']:.3g} Gbit/s at best to any other host against {last['others_gbps']:.3g} Gbit/s "
        f"between the other hosts, named at {len(named)} probe step(s)."
    )


def hosts_figure(steps: np.ndarray, series: dict[str, np.ndarray]) -> bytes:
    fig, axes = figures.new_figure()
    ax = axes[0, 0]
    for host, values in series.items():
        ax.plot(steps, 1e3 * values, marker="o", markersize=3, linewidth=1.5, label=host)
    figures._step_axis(ax)
    ax.set_ylabel("own compute per step (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", ncol=4)
    return figures.to_svg(fig)


def hosts_items(m: pd.DataFrame) -> list[Item]:
    """The figure and the slow host's line; nothing for a run that shared no host times."""
    steps, series = host_series(m)
    if not series:
        return []
    items: list[Item] = [FigureItem("hosts", "Compute time per host", CAPTION, hosts_figure(steps, series))]
    note = straggler_note(m)
    items.append(NoteItem("straggler", note or "No host was persistently slower than the others."))
    link = slow_link_note(m)
    if link:
        items.append(NoteItem("slow_link", link))
    return items
