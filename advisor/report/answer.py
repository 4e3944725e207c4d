"""The parts of the advise report that read the answer in recommendation.json (advisor.decide.outcome): where the
figures come from, the scaling table, how the config was chosen and the one held-out error."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from advisor.decide.scaling_table import short_provenance
from advisor.model.interval_words import NOT_MEASURED_WELL, duration_range, range_text, too_wide
from advisor.model.time_to_train import hours, money
from advisor.report.page import FigureItem, Item, NoteItem, Section, frame_table, mapping_table

SCALING_CAPTION = (
    "Per node count, the fastest config that fits and keeps the global batch (in brackets its 95% "
    "interval, advisor.model.uncertainty; 'not measured well enough' where that interval spans more than "
    "the figure itself: run again on a quiet machine or raise --budget-minutes); efficiency is "
    "samples/s per node against the smallest node count; comm is the share of the step spent in "
    "communication not hidden behind compute, and link the limiting link (intra- or inter-node): the one that "
    "share mostly waits on. The knee is the largest node count keeping the minimum efficiency. Provenance: every "
    "row is modelled; 'measured' when a trial ran that config, 'link assumed' when the inter-node "
    "link is a preset or your figure."
)


def _percent(value: Any) -> str:
    return f"{100 * value:.1f} %" if isinstance(value, (int, float)) else str(value)


def _floor(rec: dict[str, Any]) -> str:
    floor = rec.get("noise_floor")
    return f" (this machine's noise floor {_percent(floor)})" if isinstance(floor, (int, float)) else ""


def beyond_clause(error: dict[str, Any]) -> str:
    """' (2 of them beyond the micro-batches their stage was measured at: extrapolations)' where checks
    were; their error is the harsher test, and the intervals count it for less (advisor.model.leverage)."""
    beyond = error.get("beyond")
    if not isinstance(beyond, int) or not beyond:
        return ""
    them = (
        "it"
        if error.get("trials") == 1
        else ("all of them" if beyond == error.get("trials") else f"{beyond} of them")
    )
    return f" ({them} beyond the micro-batches their stage was measured at: extrapolations)"


def held_out_sentence(rec: dict[str, Any]) -> str:
    """The one held-out error, as the terminal and recommendation.json give it."""
    error = rec.get("error") or {}
    if error.get("trials"):
        return (
            f"Held-out error on {error['trials']} configs run after the fit{beyond_clause(error)}: step time "
            f"{_percent(error.get('step_time_mape'))}{_floor(rec)}, memory {_percent(error.get('memory_mape'))}."
        )
    if error.get("step_time_mape") is not None:  # a recommendation.json from before the trial count
        return f"Prediction error on held-out trials: step time {_percent(error['step_time_mape'])}."
    return "No held-out error: no check trial ran within the budget (see Predicted vs measured)."


def recommendation_notes(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """The node-count rule, the global batch, the LR and how it was reached, and the budget note."""
    notes = []
    choice = rec.get("node_choice") or {}
    if choice:
        notes.append(
            (
                "node count",
                f"{choice.get('chosen')} ({choice.get('rule')}); fastest "
                f"{choice.get('fastest')} nodes, most efficient {choice.get('most_efficient')}",
            )
        )
    if rec.get("global_batch_rule"):
        notes.append(("global batch", str(rec["global_batch_rule"])))
    if rec.get("lr_rule"):
        notes.append(
            (
                "learning rate",
                str(rec["lr_rule"]) + (f". Warning: {rec['lr_warning']}" if rec.get("lr_warning") else ""),
            )
        )
    t = rec.get("time_to_train") or {}
    if t:
        notes.append(("time to train", f"{t.get('amount')}; {t.get('startup')}"))
    if choice.get("trade"):
        notes.append(("trade", str(choice["trade"])))
    if choice.get("confidence"):
        notes.append(("how sure", str(choice["confidence"])))
    if rec.get("tie"):
        notes.append(("tie", str(rec["tie"])))
    if rec.get("unmeasured_stages"):
        notes.append(("stages not measured", str(rec["unmeasured_stages"])))
    if rec.get("intervals_from"):
        notes.append(
            (
                "intervals",
                str(rec["intervals_from"]) + "".join(f"; {n}" for n in rec.get("interval_notes") or []),
            )
        )
    measured = rec.get("measured") or {}
    if measured:
        notes.append(
            (
                "measured",
                "yes: the recommended config ran as a trial"
                if measured.get("recommended_config_measured")
                else f"no: {measured.get('message')}",
            )
        )
    return notes


def provenance_section(rec: dict[str, Any] | None) -> Section | None:
    """At the top: what was measured, what is modelled, what is assumed, and whether the target differs."""
    prov = (rec or {}).get("provenance")
    if not prov:
        return None
    rows = {k.replace("_", " "): v for k, v in prov.items() if k not in {"headline", "target_differs"}}
    items: list[Item] = [
        NoteItem("provenance-headline", str(prov.get("headline", ""))),
        mapping_table(
            "provenance",
            "Where each figure comes from",
            "measured: a trial or the benchmark ran "
            "it; modelled: fitted to those measurements; assumed: a preset or a figure you gave.",
            rows,
        ),
    ]
    return Section("provenance", "Where the figures come from", items)


SCALING_SHOWN = (
    "nodes",
    "config",
    "accum",
    "samples/s",
    "input",
    "step (s)",
    "time to train",
    "GPU-h",
    "efficiency",
    "comm",
    "link",
    "provenance",
)


def _scaling_cells(row: dict[str, Any], rec: dict[str, Any]) -> list[Any]:
    n = row["node_count"]
    if row["status"] != "ok":
        why = (
            row.get("reach_note") or "global batch unreachable"
            if row["status"] == "unreachable"
            else "out of memory"
        )
        return [n, why, *[""] * (len(SCALING_SHOWN) - 2)]
    marks = [
        m
        for m, on in (
            ("recommended", n == rec.get("node_count")),
            ("knee", bool(row.get("knee"))),
            ("fastest", n == (rec.get("node_choice") or {}).get("fastest")),
            (f"larger batch {row.get('global_batch')}", row.get("larger_batch") is True),
        )
        if on
    ]
    return [
        f"{int(n)} ({', '.join(marks)})" if marks else int(n),
        row["config_id"],
        int(row["grad_accum"]),
        "withheld"
        if row.get("samples_per_s") is None
        else figure_cell(row, "samples_per_s", lambda v: f"{v:.4g}"),
        input_cell(row),
        row.get("step_time_s") if interval_text(row, "step_time_s") != NOT_MEASURED_WELL else "",
        figure_cell(row, "time_to_train_s", lambda v: hours(float(v)))
        if row.get("time_to_train_s") is not None
        else "",
        row.get("gpu_hours", "") if interval_text(row, "gpu_hours") != NOT_MEASURED_WELL else "",
        _percent(row.get("efficiency")),
        _percent(row.get("exposed_comm_share")),
        row.get("limiting_link", ""),
        short_provenance(str(row.get("provenance") or "")),
    ]


def input_cell(row: dict[str, Any]) -> str:
    """What the input sustains at the row's node count (advisor.model.input_rate): 'input-bound (loader
    workers)' where it holds the row back, its samples/s where it does not, empty where not measured."""
    rate = row.get("input_samples_per_s")
    if not isinstance(rate, (int, float)) or not math.isfinite(rate):
        return ""
    return f"input-bound ({row.get('input_link')})" if row.get("input_bound") else f"{rate:.4g}"


def bounds(row: dict[str, Any] | None, figure: str) -> tuple[float, float, float] | None:
    """(value, lo, hi) of a figure and its 95% interval (`figure`_lo, `figure`_hi); None where the row has
    no positive figure or no interval for it."""
    values = [(row or {}).get(k) for k in (figure, f"{figure}_lo", f"{figure}_hi")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    value, lo, hi = (float(v) for v in values)  # type: ignore[arg-type]
    return (value, lo, hi) if value > 0 else None


DURATIONS = frozenset({"time_to_train_s"})
"""Figures in seconds that read as a duration (minutes, hours, days: advisor.model.time_to_train.hours)."""


def interval_text(row: dict[str, Any] | None, figure: str, unit: str = "") -> str | None:
    """A figure's 95% interval as a range ('41-47', '2.9-3.4 min' for seconds), TOO_WIDE's words where
    it spans more than the figure, None where the row has no interval for it."""
    known = bounds(row, figure)
    if known is None:
        return None
    value, lo, hi = known
    if too_wide(value, lo, hi):
        return NOT_MEASURED_WELL
    if figure in DURATIONS:
        return duration_range(value, lo, hi)
    return range_text(lo, hi, unit)


def plus_minus(row: dict[str, Any], figure: str) -> str:
    """' (41-47)': a figure's 95% interval beside it, as a range; '' where the row has none (the exact
    bounds are in recommendation.json and predictions.csv). A figure whose interval spans more than the
    figure is not printed beside it: see `figure_cell`."""
    text = interval_text(row, figure)
    return "" if text is None or text == NOT_MEASURED_WELL else f" ({text})"


def figure_cell(row: dict[str, Any], figure: str, show: Any) -> str:
    """A table cell: the figure shown by `show` and its range, or NOT_MEASURED_WELL where the interval
    spans more than the figure."""
    if interval_text(row, figure) == NOT_MEASURED_WELL:
        return NOT_MEASURED_WELL
    return show(row[figure]) + plus_minus(row, figure)


def modelled_note(rec: dict[str, Any] | None) -> str:
    """The provenance of a predicted figure, one sentence."""
    prov = (rec or {}).get("provenance") or {}
    if not prov:
        return " Provenance: modelled."
    intra, inter = (str(prov.get(k, "?")).split(":")[0] for k in ("intra_node_link", "inter_node_link"))
    return f" Provenance: modelled from trials on {prov.get('trials_ran_on')}; intra-node link {intra}, inter-node link {inter}."


def scaling_table_item(rec: dict[str, Any] | None) -> Item | None:
    rows = (rec or {}).get("scaling_table")
    if not rec or not rows:
        return None
    table = pd.DataFrame([_scaling_cells(row, rec) for row in rows], columns=list(SCALING_SHOWN))
    price = (rec.get("time_to_train") or {}).get("gpu_hour_price")
    if price is not None:
        table.insert(
            table.columns.get_loc("GPU-h") + 1,
            "cost",
            [money(g * price) if isinstance(g, (int, float)) else "" for g in table["GPU-h"]],
        )
    title = f"Scaling table (global batch {rec.get('global_batch_rule', '')})"
    amount = (rec.get("time_to_train") or {}).get("amount")
    caption = SCALING_CAPTION + (f" Time to train: {amount}; {TIME_CAPTION}" if amount else "")
    return frame_table("scaling-table", title, caption, table)


TIME_CAPTION = (
    "the predicted step time x the optimizer steps, plus the start-up the trials measured; GPU-h are "
    "that time x the ranks held."
)


def verdict_sentence(rec: dict[str, Any] | None) -> str | None:
    """The answer in one line, as the terminal leads with it: the page's subtitle."""
    if not rec or not rec.get("verdict"):
        return None
    return f"Answer: {rec['verdict']}."


def time_to_train_item(rec: dict[str, Any] | None) -> Item | None:
    """Hours and GPU-hours to train against node count, the knee and the recommendation marked."""
    from advisor.report.figures import time_to_train_figure

    rows = [r for r in (rec or {}).get("scaling_table") or [] if r.get("time_to_train_s") is not None]
    if not rec or not rows:
        return None
    frame = pd.DataFrame(rows).rename(
        columns={"time_to_train_s_lo": "time_lo_s", "time_to_train_s_hi": "time_hi_s"}
    )
    frame = frame.dropna(axis=1, how="all")  # a band only where the rows carry intervals
    choice = rec.get("node_choice") or {}
    caption = (
        "Time to train (left, log) and GPU-hours (right) of the scaling table's rows: right of the knee each "
        f"added node buys less than {choice.get('min_efficiency', 0.8):.0%} of a node's throughput, so the "
        "time falls slower than the GPU-hours climb. Shaded: the 95% intervals. "
        + TIME_CAPTION
        + modelled_note(rec)
    )
    svg = time_to_train_figure(frame, choice.get("knee"), rec.get("node_count"))
    return FigureItem("time-to-train", "Time and GPU-hours to train vs nodes", caption, svg)
