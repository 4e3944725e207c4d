"""Matplotlib figures for the HTML reports, each returned as SVG bytes.

Figures are built on `matplotlib.figure.Figure` directly (no pyplot): no global state, no GUI backend,
nothing left open between reports. Text is drawn as paths (`svg.fonttype: path`), so a figure looks the
same on a machine without the fonts, and a hostile label (a run name, a config id) ends up as outlines,
never as markup. Figures keep a white background: in the page's dark mode they sit on light cards, which
stays readable without drawing every figure twice.

Every function takes plain arrays or DataFrames and returns `bytes`; the report decides captions.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from advisor.model.time_to_train import HOUR_S
from sdzero.constants import BINARY_UNITS, GIB

WIDTH_IN = 9.0
STAGE_COLOURS = {0: "#7f7f7f", 1: "#1f77b4", 2: "#ff7f0e", 3: "#2ca02c"}
DTYPE_STYLES = {"bf16": "-", "fp16": "--", "fp32": ":"}
COLLECTIVE_COLOURS = {"all_reduce": "#1f77b4", "reduce_scatter": "#d62728", "all_gather": "#2ca02c"}
PHASE_COLOURS = {
    "data_s": "#8c564b",
    "encode_s": "#9467bd",
    "forward_s": "#1f77b4",
    "backward_s": "#ff7f0e",
    "optimizer_s": "#2ca02c",
    "other_s": "#c7c7c7",
}
_RC = {
    "svg.fonttype": "path",
    "svg.hashsalt": "sdzero-report",  # stable element ids: the same data gives the same bytes
    "font.size": 9.5,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8.5,
    "legend.framealpha": 0.85,
}
_DOCTYPE = re.compile(rb"<!DOCTYPE[^>]*>\s*", re.DOTALL)


def new_figure(
    rows: int = 1, cols: int = 1, height_in: float = 3.6, sharex: bool = False, sharey: bool = False
) -> tuple[Figure, np.ndarray]:
    """A figure of the report's width with a grid of axes (always returned as a 2-D array)."""
    with matplotlib.rc_context(_RC):
        fig = Figure(figsize=(WIDTH_IN, height_in), layout="constrained")
        axes = fig.subplots(rows, cols, sharex=sharex, sharey=sharey, squeeze=False)
    return fig, axes


def to_svg(fig: Figure) -> bytes:
    """SVG bytes without the DOCTYPE (its DTD address is never fetched, but a report names no URL)."""
    buffer = io.BytesIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(
            buffer, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None}
        )
    return _DOCTYPE.sub(b"", buffer.getvalue(), count=1)


def style_label(stage: int, dtype: str) -> str:
    return f"ZeRO-{stage} {dtype}"


def _line_style(stage: int, dtype: str) -> dict[str, object]:
    return {"color": STAGE_COLOURS.get(int(stage), "#17becf"), "linestyle": DTYPE_STYLES.get(dtype, "-.")}


def _bytes_tick(value: float, _pos: int | None = None) -> str:
    """4096 -> '4 KiB'; binary multiples, as message sizes are chosen."""
    for unit, scale in BINARY_UNITS:
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


def _log2_axis(ax: Axes, values: Sequence[float], bytes_labels: bool = False) -> None:
    """Log2 x axis with a tick at every power of two in range (thinned to at most ~12 labels)."""
    ax.set_xscale("log", base=2)
    lo, hi = math.floor(math.log2(min(values))), math.ceil(math.log2(max(values)))
    step = max(1, math.ceil((hi - lo + 1) / 12))
    ticks = [2.0**k for k in range(lo, hi + 1, step)]
    ax.set_xticks(ticks)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_formatter(FuncFormatter(_bytes_tick if bytes_labels else lambda v, _p: f"{v:g}"))
    if lo == hi:
        ax.set_xlim(2.0 ** (lo - 1), 2.0 ** (hi + 1))


def _step_axis(ax: Axes) -> None:
    """x is the optimizer step: whole numbers only."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step (#)")


def _mark_events(ax: Axes, checkpoint_steps: Sequence[int], resume_steps: Sequence[int]) -> None:
    for i, step in enumerate(checkpoint_steps):
        ax.axvline(
            step, color="#6e7781", linestyle=":", linewidth=1, label="checkpoint saved" if i == 0 else None
        )
    for i, step in enumerate(resume_steps):
        ax.axvline(step, color="#cf222e", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)


# ------------------------------------------------------------------------------------------ training


def loss_figure(
    steps: np.ndarray,
    loss: np.ndarray,
    smoothed: np.ndarray,
    span: int,
    checkpoint_steps: Sequence[int] = (),
    resume_steps: Sequence[int] = (),
    band: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """Raw and smoothed loss; with `band` (per-bin min and max of a long run) the raw loss is that band."""
    fig, axes = new_figure()
    ax = axes[0, 0]
    if band is None:
        marker = "." if len(steps) < 60 else None
        ax.plot(
            steps, loss, color="#1f77b4", alpha=0.35, linewidth=1, marker=marker, label="loss per step (raw)"
        )
    else:
        ax.fill_between(
            steps,
            band[0],
            band[1],
            color="#1f77b4",
            alpha=0.25,
            linewidth=0,
            label="raw loss, min-max per bin",
        )
    ax.plot(steps, smoothed, color="#1f77b4", linewidth=2, label=f"EMA, span {span} steps")
    _mark_events(ax, checkpoint_steps, resume_steps)
    finite = loss[np.isfinite(loss)]
    if finite.size and finite.min() > 0 and finite.max() / finite.min() > 30:
        ax.set_yscale("log")  # early losses dwarf the later ones otherwise
    _step_axis(ax)
    ax.set_ylabel("training loss (objective value, unitless)")
    ax.legend(loc="upper right")
    return to_svg(fig)


def throughput_figure(
    steps: np.ndarray,
    samples_per_s: np.ndarray,
    step_time_s: np.ndarray,
    phases: dict[str, np.ndarray],
    median: float,
) -> bytes:
    """Top: samples/s with the steady-state `median` (after step 1); bottom: step time stacked by phase."""
    fig, axes = new_figure(2, 1, height_in=5.4, sharex=True)
    top, bottom = axes[0, 0], axes[1, 0]
    top.plot(steps, samples_per_s, color="#1f77b4", marker="." if len(steps) < 60 else None, linewidth=1.2)
    top.axhline(median, color="#444", linestyle="--", linewidth=1, label=f"median after step 1: {median:.3g}")
    top.set_ylabel("throughput (samples/s, global)")
    top.set_ylim(bottom=0)
    top.legend(loc="lower right")
    names = list(phases)
    bottom.stackplot(
        steps,
        *[phases[n] for n in names],
        labels=[n.removesuffix("_s") for n in names],
        colors=[PHASE_COLOURS.get(n, "#bbbbbb") for n in names],
        alpha=0.9,
    )
    bottom.plot(steps, step_time_s, color="black", linewidth=1, label="step time")
    bottom.set_ylabel("time per optimizer step (s)")
    _step_axis(bottom)
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="upper right", ncol=4)
    return to_svg(fig)


def loss_scale_figure(steps: np.ndarray, loss_scale: np.ndarray, skipped_total: np.ndarray) -> bytes:
    """Top: fp16 dynamic loss scale (log2 axis); bottom: cumulative skipped steps, new skips marked."""
    fig, axes = new_figure(2, 1, height_in=4.6, sharex=True)
    top, bottom = axes[0, 0], axes[1, 0]
    top.step(steps, loss_scale, where="post", color="#9467bd", linewidth=1.5)
    top.set_yscale("log", base=2)
    top.set_ylabel("loss scale (multiplier, log2)")
    bottom.step(steps, skipped_total, where="post", color="#d62728", linewidth=1.5, label="skipped so far")
    new = np.flatnonzero(np.diff(np.concatenate([[0], skipped_total])) > 0)
    if new.size:
        bottom.plot(
            steps[new],
            skipped_total[new],
            "x",
            color="#d62728",
            markersize=7,
            label="step skipped (gradient overflow)",
        )
    bottom.set_ylabel("skipped optimizer steps (count)")
    _step_axis(bottom)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylim(0, max(1.0, float(np.nanmax(skipped_total))) * 1.15)
    bottom.legend(loc="lower right")
    return to_svg(fig)


def memory_figure(steps: np.ndarray, per_rank_bytes: np.ndarray) -> bytes:
    """Peak memory per rank (columns of `per_rank_bytes`) over steps; a min/median/max band past 8 ranks."""
    fig, axes = new_figure()
    ax = axes[0, 0]
    gib = per_rank_bytes / GIB
    if gib.shape[1] <= 8:
        for rank in range(gib.shape[1]):
            ax.plot(steps, gib[:, rank], linewidth=1.5, label=f"rank {rank}")
    else:
        ax.fill_between(
            steps, gib.min(axis=1), gib.max(axis=1), alpha=0.3, label=f"min-max of {gib.shape[1]} ranks"
        )
        ax.plot(steps, np.median(gib, axis=1), linewidth=1.5, label="median rank")
    _step_axis(ax)
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", ncol=4)
    return to_svg(fig)


# -------------------------------------------------------------------------------------------- advise


def scaling_figure(best: pd.DataFrame, measured: pd.DataFrame) -> bytes:
    """Predicted samples/s vs nodes per (stage, dtype), the ideal linear line, measured trials on top; the
    predictions' 95% intervals shaded where `best` carries samples_per_s_lo/_hi.

    `best`: node_count, zero_stage, dtype, samples_per_s (one row per group and node count);
    `measured`: nodes, zero_stage, dtype, samples_per_s (may be empty).
    """
    fig, axes = new_figure(height_in=4.2)
    ax = axes[0, 0]
    for (stage, dtype), group in best.groupby(["zero_stage", "dtype"], sort=True):
        group = group.sort_values("node_count")
        style = _line_style(stage, dtype)
        x, y = group["node_count"].to_numpy(float), group["samples_per_s"].to_numpy(float)
        ax.plot(x, y, marker="o", markersize=4, linewidth=1.8, label=style_label(stage, dtype), **style)
        ax.plot(x, y[0] * x / x[0], color=style["color"], linewidth=0.9, alpha=0.5, linestyle=(0, (1, 2)))
        if {"samples_per_s_lo", "samples_per_s_hi"} <= set(group.columns):  # the 95% interval, shaded
            lo, hi = (
                pd.to_numeric(group[c], errors="coerce").to_numpy(float)
                for c in ("samples_per_s_lo", "samples_per_s_hi")
            )
            ax.fill_between(x, lo, hi, color=style["color"], alpha=0.12, linewidth=0)
    if not measured.empty:
        for (stage, dtype), group in measured.groupby(["zero_stage", "dtype"], sort=True):
            ax.scatter(
                group["nodes"],
                group["samples_per_s"],
                s=70,
                facecolors="none",
                linewidths=1.6,
                edgecolors=_line_style(stage, dtype)["color"],
                zorder=5,
            )
        ax.scatter([], [], s=70, facecolors="none", edgecolors="black", label="measured trial")
    ax.plot([], [], color="grey", linewidth=0.9, linestyle=(0, (1, 2)), label="ideal linear scaling")
    _log2_axis(ax, best["node_count"].tolist())
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.set_xlabel("nodes (log2)")
    ax.set_ylabel("throughput (samples/s, log)")
    ax.legend(loc="upper left", ncol=2)
    return to_svg(fig)


def efficiency_figure(best: pd.DataFrame) -> bytes:
    """Scaling efficiency (fraction of linear, in %) vs nodes per (stage, dtype)."""
    fig, axes = new_figure(height_in=3.4)
    ax = axes[0, 0]
    for (stage, dtype), group in best.groupby(["zero_stage", "dtype"], sort=True):
        group = group.sort_values("node_count")
        ax.plot(
            group["node_count"],
            100 * group["efficiency"],
            marker="o",
            markersize=4,
            linewidth=1.8,
            label=style_label(stage, dtype),
            **_line_style(stage, dtype),
        )
    ax.axhline(100, color="grey", linewidth=0.9, linestyle=(0, (1, 2)), label="linear (100 %)")
    _log2_axis(ax, best["node_count"].tolist())
    # Zoom to the data (whole tens) so a 95 % vs 85 % difference is visible; 100 % stays in view.
    low = float(100 * best["efficiency"].min())
    ax.set_ylim(
        max(0.0, math.floor(low / 10) * 10 - 10), max(105.0, float(100 * best["efficiency"].max()) + 5)
    )
    ax.set_xlabel("nodes (log2)")
    ax.set_ylabel("scaling efficiency (% of linear)")
    ax.legend(loc="best", ncol=2)
    return to_svg(fig)


def time_to_train_figure(
    rows: pd.DataFrame, knee: int | None, chosen: int | None, unit: str = "GPU-h"
) -> bytes:
    """Hours to train (left axis) and GPU-hours (right axis) against nodes, the knee and the chosen node
    count marked: the trade a team makes, on one plot.

    `rows`: node_count, time_to_train_s, gpu_hours; optional time_lo_s/time_hi_s and gpu_hours_lo/hi for
    a band (the prediction's interval)."""
    fig, axes = new_figure(height_in=3.8)
    ax = axes[0, 0]
    rows = rows.sort_values("node_count")
    x = rows["node_count"].to_numpy(float)
    seconds = rows["time_to_train_s"].to_numpy(float)
    unit_name, per = time_axis_unit(float(np.nanmax(seconds)) if len(seconds) else 0.0)
    hours = seconds / per  # in the answer's unit (minutes, hours or days), whatever the variable's name
    gpu_hours = rows["gpu_hours"].to_numpy(float)
    time_colour, cost_colour = "#1f77b4", "#d62728"
    ax.plot(x, hours, marker="o", markersize=4, linewidth=1.8, color=time_colour, label="time to train")
    if {"time_lo_s", "time_hi_s"} <= set(rows.columns):
        ax.fill_between(
            x,
            rows["time_lo_s"].to_numpy(float) / per,
            rows["time_hi_s"].to_numpy(float) / per,
            color=time_colour,
            alpha=0.15,
            linewidth=0,
            label="time, interval",
        )
    right = ax.twinx()
    right.plot(
        x, gpu_hours, marker="s", markersize=4, linewidth=1.8, color=cost_colour, linestyle="--", label=unit
    )
    if {"gpu_hours_lo", "gpu_hours_hi"} <= set(rows.columns):
        right.fill_between(
            x,
            rows["gpu_hours_lo"].to_numpy(float),
            rows["gpu_hours_hi"].to_numpy(float),
            color=cost_colour,
            alpha=0.12,
            linewidth=0,
        )
    right.grid(False)
    right.spines["right"].set_visible(True)
    for n, label, style in ((knee, "knee", (0, (4, 3))), (chosen, "recommended", "-")):
        if n is not None and n in set(rows["node_count"].astype(int)):
            ax.axvline(n, color="#6e7781", linewidth=1.2, linestyle=style, label=f"{label} ({n} nodes)")
    _log2_axis(ax, rows["node_count"].tolist())
    ax.set_yscale("log")
    # ticks at 1, 2, 5 x 10^k of the unit the answer reads in: "20 min", not "0.3 h" or "10^-1"
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.set_xlabel("nodes (log2)")
    ax.set_ylabel(f"time to train ({unit_name}, log)", color=time_colour)
    right.set_ylabel(f"{unit} (hours x ranks)", color=cost_colour)
    right.set_ylim(0, float(np.nanmax(gpu_hours)) * 1.15 if len(gpu_hours) else 1)
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = right.get_legend_handles_labels()
    ax.legend(handles + more, labels + more_labels, loc="upper center", ncol=3)
    return to_svg(fig)


def time_axis_unit(seconds: float) -> tuple[str, float]:
    """(unit, seconds per unit) the answer states a duration in (advisor.model.time_to_train.hours):
    minutes under an hour, hours under four days, then days."""
    if seconds < HOUR_S:
        return "min", 60.0
    return ("h", HOUR_S) if seconds < 96 * HOUR_S else ("days", 24 * HOUR_S)


def breakdown_figure(rows: pd.DataFrame) -> bytes:
    """Stacked bars per node count: compute and exposed communication seconds per optimizer step."""
    rows = rows.sort_values("node_count")
    fig, axes = new_figure(height_in=3.4)
    ax = axes[0, 0]
    x = np.arange(len(rows))
    compute, comm = rows["compute_s"].to_numpy(float), rows["exposed_comm_s"].to_numpy(float)
    ax.bar(x, compute, color="#1f77b4", label="compute (forward, backward, optimizer)")
    ax.bar(x, comm, bottom=compute, color="#d62728", label="exposed communication (not overlapped)")
    ax.set_xticks(x, [str(n) for n in rows["node_count"]])
    share = comm / np.maximum(compute + comm, 1e-30)
    for xi, top, s in zip(x, compute + comm, share, strict=True):
        ax.annotate(
            f"{100 * s:.0f}%",
            (xi, top),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            fontsize=7.5,
            color="#d62728",
        )
    ax.set_ylim(0, float((compute + comm).max()) * 1.3)  # room for the legend and the share labels
    ax.set_xlabel("nodes (count)")
    ax.set_ylabel("time per optimizer step (s)")
    ax.legend(loc="upper left", ncol=2)
    return to_svg(fig)


def trial_memory_figure(trials: pd.DataFrame, capacity_bytes: float | None) -> bytes:
    """Measured memory per rank vs micro-batch per (stage, dtype); OOM trials as red crosses.

    `trials`: zero_stage, dtype, micro_batch, mem_bytes (NaN when unknown), oom (bool).
    """
    fig, axes = new_figure(height_in=4.0)
    ax = axes[0, 0]
    fine = trials[~trials["oom"] & trials["mem_bytes"].notna()]
    for (stage, dtype), group in fine.groupby(["zero_stage", "dtype"], sort=True):
        group = group.groupby("micro_batch", as_index=False)["mem_bytes"].max()
        ax.plot(
            group["micro_batch"],
            group["mem_bytes"] / GIB,
            marker="o",
            markersize=4,
            linewidth=1.6,
            label=style_label(stage, dtype),
            **_line_style(stage, dtype),
        )
    oom = trials[trials["oom"]]
    if not oom.empty:
        # An OOM trial's own peak is drawn where it was measured; without one, at the capacity line.
        fallback = (
            capacity_bytes if capacity_bytes else float(fine["mem_bytes"].max() if not fine.empty else GIB)
        )
        y = oom["mem_bytes"].fillna(fallback) / GIB
        ax.scatter(
            oom["micro_batch"],
            y,
            marker="x",
            s=60,
            color="#cf222e",
            linewidths=2,
            zorder=5,
            label="out of memory",
        )
    if capacity_bytes:
        ax.axhline(
            capacity_bytes / GIB,
            color="#cf222e",
            linestyle="--",
            linewidth=1.2,
            label=f"device capacity {capacity_bytes / GIB:.3g} GiB",
        )
    _log2_axis(ax, trials["micro_batch"].astype(float).tolist())
    ax.set_ylim(bottom=0)
    ax.set_xlabel("micro-batch per rank (samples, log2)")
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.legend(loc="upper left", ncol=2)
    return to_svg(fig)


def bandwidth_figure(points: pd.DataFrame, curves: pd.DataFrame) -> bytes:
    """Bus bandwidth vs message size, one panel per backend side by side; points measured, lines fitted.

    `points`: backend, collective, link_level, size_bytes, busbw_gbps;
    `curves`: backend, collective, link_level, size_bytes, busbw_gbps (the alpha-beta model, dense sizes).
    """
    backends = sorted(set(points["backend"]) | set(curves["backend"]))
    fig, axes = new_figure(1, len(backends), height_in=3.8, sharey=True)
    for ax, backend in zip(axes[0], backends, strict=True):
        mine = points[points["backend"] == backend]
        for (collective, level), group in mine.groupby(["collective", "link_level"], sort=True):
            ax.scatter(
                group["size_bytes"],
                group["busbw_gbps"],
                s=14,
                color=COLLECTIVE_COLOURS.get(collective),
                marker="o" if level == "intra" else "s",
                label=f"{collective} ({level}) measured",
            )
        fitted = curves[curves["backend"] == backend]
        for (collective, level), group in fitted.groupby(["collective", "link_level"], sort=True):
            ax.plot(
                group["size_bytes"],
                group["busbw_gbps"],
                color=COLLECTIVE_COLOURS.get(collective),
                linestyle="-" if level == "intra" else "--",
                linewidth=1.4,
            )
        ax.plot([], [], color="grey", linewidth=1.4, label="alpha-beta fit")
        sizes = pd.concat([mine["size_bytes"], fitted["size_bytes"]]).astype(float).tolist()
        _log2_axis(ax, sizes, bytes_labels=True)
        ax.tick_params(axis="x", labelrotation=45)
        ax.set_title(str(backend), fontsize=10)
        ax.set_xlabel("message size (bytes, log2)")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        ax.legend(loc="lower right", fontsize=7.5)
    axes[0, 0].set_ylabel("bus bandwidth (GB/s, 1 GB = 1e9 bytes, log)")
    return to_svg(fig)


def validation_figure(pairs: pd.DataFrame) -> bytes:
    """Predicted vs measured, one panel per quantity, with y = x and a +-10 % band.

    `pairs`: quantity, predicted, measured, held_out (bool); quantities step_time_s and mem_per_rank_bytes.
    """
    panels = [("step_time_s", "step time (s)", 1.0), ("mem_per_rank_bytes", "memory per rank (GiB)", GIB)]
    panels = [p for p in panels if (pairs["quantity"] == p[0]).any()]
    fig, axes = new_figure(1, len(panels), height_in=3.8)
    for ax, (quantity, label, scale) in zip(axes[0], panels, strict=True):
        rows = pairs[pairs["quantity"] == quantity]
        lo = float(min(rows["predicted"].min(), rows["measured"].min())) / scale
        hi = float(max(rows["predicted"].max(), rows["measured"].max())) / scale
        span = np.linspace(lo * 0.9, hi * 1.1, 50)
        ax.plot(span, span, color="black", linewidth=1, label="predicted = measured")
        ax.fill_between(span, span * 0.9, span * 1.1, color="grey", alpha=0.2, label="within 10 %")
        for held_out, marker in ((True, "o"), (False, "^")):
            part = rows[rows["held_out"] == held_out]
            if not part.empty:
                ax.scatter(
                    part["measured"] / scale,
                    part["predicted"] / scale,
                    marker=marker,
                    s=30,
                    zorder=5,
                    label="held out of the fit" if held_out else "used in the fit",
                )
        error = 100 * float(np.mean(np.abs(rows["predicted"] / rows["measured"] - 1)))
        ax.set_title(f"{label}: MAPE {error:.1f} %", fontsize=10)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(loc="upper left", fontsize=7.5)
    return to_svg(fig)
