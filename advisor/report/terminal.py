"""`sdzero advise` in the terminal, read in ten seconds: the verdict in one line (nodes, config, time and
GPU-hours to train, where the figures come from), the scaling table, and at most ANSWER_LINES short lines
after it: how sure the node count is, the trade, what was not measured (or not well enough), and where
the report is. The rest (the LR, the errors, the intervals' sources, the runners-up, the launch) is in
the report and under --explain (`print_explain`). Reads recommendation.json's payload (advisor.decide.outcome)
only, so it says what the JSON and the report say."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from advisor.decide.scaling_table import short_provenance
from advisor.model.interval_words import (
    MEASURE_AGAIN,
    NOT_MEASURED_WELL,
    duration_range,
    range_text,
    too_wide,
)
from advisor.model.time_to_train import cost_of, hours, money
from advisor.report.answer import beyond_clause, bounds, interval_text
from sdzero.constants import GIB


def _percent(value: Any) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _sure(row: dict[str, Any], figure: str = "samples_per_s") -> bool:
    """Whether the row's interval of `figure` (by default its throughput, which its time and GPU-hours
    rest on) is narrow enough to print (advisor.report.answer.too_wide); without one, the figure prints."""
    known = bounds(row, figure)
    return known is None or not too_wide(*known)


def _rate_cell(row: dict[str, Any]) -> str:
    text = interval_text(row, "samples_per_s")
    if text == NOT_MEASURED_WELL:
        return NOT_MEASURED_WELL
    return text if text is not None else f"{row['samples_per_s']:.4g}"


def _hours_cell(row: dict[str, Any]) -> str:
    seconds = row.get("time_to_train_s")
    if seconds is None or not _sure(row):
        return "" if seconds is None else "-"
    known = bounds(row, "time_to_train_s")
    if known is None:
        return hours(float(seconds))
    return NOT_MEASURED_WELL if too_wide(*known) else duration_range(*known)


def _gpu_hours_cell(row: dict[str, Any]) -> str:
    if row.get("gpu_hours") is None:
        return ""
    if not _sure(row):
        return "-"
    known = bounds(row, "gpu_hours")
    if known is None:
        return f"{row['gpu_hours']:.3g}"
    return NOT_MEASURED_WELL if too_wide(*known) else range_text(known[1], known[2])


def _cost_cell(row: dict[str, Any], price: float) -> str:
    if not _sure(row):
        return "-"
    known = bounds(row, "gpu_hours")
    if known is None:
        return money(cost_of(float(row.get("gpu_hours") or 0.0), price) or 0.0)
    return "-" if too_wide(*known) else f"{money(known[1] * price)}-{money(known[2] * price)}"


def scaling_rich_table(rec: dict[str, Any]) -> Table:
    """The scaling table, one row per node count: throughput, time and GPU-hours to train as their 95%
    ranges (a row whose range spans more than its figure says so instead of a figure)."""
    choice = rec.get("node_choice", {})
    t = rec.get("time_to_train") or {}
    price = t.get("gpu_hour_price")
    unit = t.get("unit", "GPU-h")
    if rec.get("timed") is False:
        return untimed_table(rec)
    # one line: the batch rule and the amount's detail are under --explain and in the report
    title = f"Scaling at global batch {rec.get('global_batch_target') or rec.get('global_batch', '')}"
    if t:
        title += (
            f"; time to train {t['samples']:,} samples" if t.get("samples") else f"; {t.get('amount', '')}"
        )
    title += " (95% ranges)"
    # no outer edges, no padding twice between columns: the table fits 160 columns and two lines less
    table = Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True
    )
    columns = ["nodes", "config", "mb x accum", "samples/s", "time", unit]
    columns += ["cost"] if price is not None else []
    columns += ["efficiency", "comm", "link", "", "provenance"]
    right = {"nodes", "samples/s", "time", unit, "cost"}
    for name in columns:
        table.add_column(name, justify="right" if name in right else "left")
    for row in rec.get("scaling_table", []):
        n = row["node_count"]
        if row["status"] != "ok":
            why = (
                row.get("reach_note") or "global batch not reachable"
                if row["status"] == "unreachable"
                else "out of memory"
            )
            table.add_row(str(n), f"[dim]{why}[/dim]", *[""] * (len(columns) - 2))
            continue
        table.add_row(
            str(n),
            str(row["config_id"]),
            f"{int(row['micro_batch'])} x {int(row['grad_accum'])}",
            _rate_cell(row),
            _hours_cell(row),
            _gpu_hours_cell(row),
            *([_cost_cell(row, price)] if price is not None else []),
            _percent(row.get("efficiency")),
            _percent(row.get("exposed_comm_share")),
            str(row.get("limiting_link", "-")),
            " ".join(_marks(row, rec, choice)),
            short_provenance(str(row.get("provenance", ""))),
            style="bold" if n == rec.get("node_count") else None,
        )
    return table


def untimed_table(rec: dict[str, Any]) -> Table:
    """Without the target's compute: each node count's first-ranked config and the communication a step
    needs on the target's links, nothing that rests on the target's speed (advisor.decide.withheld)."""
    table = Table(
        title=f"Ranking and communication, global batch {rec.get('global_batch_rule', '')}",
        title_justify="left",
    )
    for name in (
        "nodes",
        "config ranked first",
        "mb x accum",
        "global batch",
        "comm per step (s)",
        "link",
        "",
    ):
        table.add_column(
            name, justify="right" if name in {"nodes", "global batch", "comm per step (s)"} else "left"
        )
    for row in rec.get("scaling_table", []):
        if row["status"] != "ok":
            table.add_row(
                str(row["node_count"]), f"[dim]{row.get('reach_note') or row['status']}[/dim]", *[""] * 5
            )
            continue
        comm = row.get("comm_s")
        table.add_row(
            str(row["node_count"]),
            str(row["config_id"]),
            f"{int(row['micro_batch'])} x {int(row['grad_accum'])}",
            str(int(row["global_batch"])),
            "" if comm is None else f"{float(comm):.4g}",
            str(row.get("limiting_link", "-")),
            "larger batch" if row.get("larger_batch") is True else "",
        )
    return table


def _marks(row: dict[str, Any], rec: dict[str, Any], choice: dict[str, Any]) -> list[str]:
    n = row["node_count"]
    marks = []
    if n == rec.get("node_count"):
        marks.append("<- recommended")
    if row.get("knee") and n != rec.get("node_count"):
        marks.append(f"knee (>= {choice.get('min_efficiency', 0):.0%})")
    if n == choice.get("fastest") and n != rec.get("node_count"):
        marks.append("fastest")
    if row.get("input_bound"):  # the samples/s is the input's, not the GPUs' (advisor.model.input_rate)
        marks.append(f"input-bound ({row.get('input_link')})")
    return marks


ANSWER_LINES = 5
"""At most this many lines after the table (how sure, the trade, what was not measured, a warning, the
report); everything else is under --explain."""


def _console(console: Console | None) -> Console:
    # piped (CI logs, files): wide enough for the table instead of rich's 80 columns, unless COLUMNS says
    wide = sys.stdout.isatty() or os.environ.get("COLUMNS", "").isdigit()
    return console or Console(width=None if wide else 200)


def print_advice(
    rec: dict[str, Any],
    trials_run: int,
    full_grid: int,
    out_dir: Any,
    report: Any,
    console: Console | None = None,
    explain: bool = False,
) -> None:
    """On stdout: the verdict in one line, the table, at most ANSWER_LINES short lines, and with `explain`
    the full detail after them (`print_explain`)."""
    out = _console(console)
    prov = rec.get("provenance", {})
    if rec.get("verdict"):
        out.print(f"[bold]answer:[/bold] {rec['verdict']}", highlight=False)
    if prov.get("headline") and prov.get("target_differs"):  # the verdict says where the figures come from
        out.print(f"[bold yellow]{prov['headline']}", highlight=False)
    basis = rec.get("compute_basis") or {}
    if basis.get("kind") == "profile":  # measured on the target's own node: said once, under the headline
        out.print(
            f"[dim]{basis['line']}; {rec['notes'][0] if rec.get('notes') else ''}[/dim]", highlight=False
        )
    out.print(scaling_rich_table(rec))
    for line in answer_lines(rec, out_dir, report, explain)[:ANSWER_LINES]:
        out.print(line, highlight=False, soft_wrap=line.startswith("[bold]report:"))
    if explain:
        print_explain(rec, trials_run, full_grid, out_dir, out)


def answer_lines(rec: dict[str, Any], out_dir: Any, report: Any, explain: bool = False) -> list[str]:
    """The short lines after the table, in rich markup: how sure, the trade, what was not measured, an LR
    warning, and where the report is."""
    choice = rec.get("node_choice") or {}
    lines = []
    if rec.get("timed") is False:
        lines.append(
            f"[bold yellow]not timed:[/bold yellow] {(rec.get('compute_basis') or {}).get('line', '')}"
        )
    elif choice.get("confidence"):
        lines.append(f"[bold]how sure:[/bold] {choice['confidence']}")
    if choice.get("trade") and not set(_counts_in(choice["trade"])) & set(_wide_counts(rec)):
        # a trade between figures the table withholds would print them after all: the not-measured line
        # names those node counts instead
        lines.append(f"[bold]trade:[/bold] {choice['trade']}")
    missing = not_measured(rec)
    if missing:
        lines.append(f"[bold yellow]not measured:[/bold yellow] {missing}")
    if rec.get("lr_warning"):
        lines.append(f"[bold red]warning:[/bold red] {rec['lr_warning']}")
    if (rec.get("checkpointing") or {}).get("line") and len(lines) < ANSWER_LINES - 1:
        lines.append(f"[bold]checkpointing:[/bold] {rec['checkpointing']['line']}")
    where = f"[bold]report:[/bold] {report}" if report else f"[bold]folder:[/bold] {out_dir}"
    lines.append(
        where + ("" if explain else " (the launch command and the full detail: there, or --explain)")
    )
    return lines


WIDE_FIGURES = ("samples_per_s", "time_to_train_s", "gpu_hours")
"""The figures a row prints with their ranges: any of them too wide puts the row on the not-measured line."""


def _wide_counts(rec: dict[str, Any]) -> list[str]:
    """The node counts whose figures are too uncertain to print (WIDE_FIGURES)."""
    return [
        str(row["node_count"])
        for row in rec.get("scaling_table") or []
        if row.get("status") == "ok" and not all(_sure(row, f) for f in WIDE_FIGURES)
    ]


def _counts_in(trade: str) -> list[str]:
    """The node counts a trade line compares ('16 nodes: 0.8 min, ...; 32 nodes: ...')."""
    return re.findall(r"(\d+) nodes?: ", trade)


def not_measured(rec: dict[str, Any]) -> str:
    """One line: the recommended config if no trial ran it, the stages no trial measured and the budget
    that measures them, and the node counts whose figures are too uncertain to print."""
    parts = []
    measured = rec.get("measured") or {}
    groups = rec.get("unmeasured_groups") or {}
    minutes = [
        m
        for m in (
            measured.get("suggested_budget_minutes"),
            groups.get("budget_minutes") if groups.get("stages") else None,
        )
        if isinstance(m, (int, float))
    ]
    if measured and not measured.get("recommended_config_measured", True):
        parts.append(f"{rec.get('config_id')} (its figures are the model's)")
    if groups.get("stages"):
        parts.append(f"{', '.join(groups['stages'])} (costs borrowed from the measured stages)")
    elif rec.get("unmeasured_stages") and not groups:  # a recommendation.json from before the groups
        parts.append(str(rec["unmeasured_stages"]).split(":")[0].removeprefix("no trial measured "))
    text = "; ".join(parts)
    if minutes:
        text += f": --budget-minutes {max(minutes)} with the same --out measures {'it' if len(parts) == 1 else 'them'}"
    wide = _wide_counts(rec)
    if wide:
        counts = f"{', '.join(wide)} node{'s' if wide != ['1'] else ''}"
        text += ("; " if text else "") + f"{counts}: {NOT_MEASURED_WELL} ({MEASURE_AGAIN})"
    return text


def print_explain(rec: dict[str, Any], trials_run: int, full_grid: int, out_dir: Any, out: Console) -> None:
    """--explain: the detail the short answer leaves to the report, one labelled line each."""
    out.rule("[bold]detail[/bold] (recommendation.json and the report hold the same)", align="left")
    prov = rec.get("provenance", {})
    if prov.get("headline") and not prov.get("target_differs"):
        out.print(f"[dim]{prov['headline']}[/dim]", highlight=False)
    if rec.get("global_batch_rule"):
        out.print(f"global batch: {rec['global_batch_rule']}", highlight=False)
    choice = rec.get("node_choice", {})
    if rec.get("timed") is not False:
        out.print(
            f"[bold]node count:[/bold] {rec['node_count']}, by {choice.get('rule', '')}; fastest "
            f"{choice.get('fastest')}, most efficient {choice.get('most_efficient')}"
            + (f", fewest GPU-h {choice['fewest_gpu_hours']}" if choice.get("fewest_gpu_hours") else ""),
            highlight=False,
        )
    if choice.get("trade") and set(_counts_in(choice["trade"])) & set(_wide_counts(rec)):
        out.print(
            f"[bold]trade[/bold] (model's figures, not measured well enough): {choice['trade']}",
            highlight=False,
        )
    if rec.get("tie"):
        out.print(f"[bold]tie:[/bold] {rec['tie']}", highlight=False)
    out.print(predicted_line(rec), highlight=False)
    t = rec.get("time_to_train") or {}
    if t:
        out.print(
            f"time to train: {t['amount']}, {t['optimizer_steps']:,} optimizer steps; {t['startup']}",
            highlight=False,
        )
    out.print(f"[bold]learning rate:[/bold] {rec.get('lr_rule', rec['lr'])}", highlight=False)
    measured = rec.get("measured", {})
    if measured and not measured.get("recommended_config_measured", True):
        out.print(f"[bold yellow]not measured:[/bold yellow] {measured['message']}", highlight=False)
    if rec.get("unmeasured_stages"):
        out.print(f"[bold yellow]not measured:[/bold yellow] {rec['unmeasured_stages']}", highlight=False)
    out.print(error_line(rec), highlight=False)
    if rec.get("intervals_from"):
        out.print(f"[dim]{rec['intervals_from']}[/dim]", highlight=False)
    for note in rec.get("interval_notes", []):
        out.print(f"[yellow]interval:[/yellow] {note}", highlight=False)
    out.print(
        f"trials run: {trials_run} of a full grid of {full_grid}"
        + (f" ({len(rec['check_trials'])} of them to check the model)" if rec.get("check_trials") else ""),
        highlight=False,
    )
    for runner in rec.get("runners_up", []):
        out.print(
            f"  runner-up {runner['config_id']} @ {runner['node_count']} nodes: {runner['why_not']}",
            highlight=False,
        )
    out.print(f"config: {out_dir}/recommended_ds_config.json", highlight=False, soft_wrap=True)
    out.print(f"launch: {rec['launch_command']}", highlight=False, soft_wrap=True)


def predicted_line(rec: dict[str, Any]) -> str:
    """The recommended row's throughput (as its range), step and memory per rank."""
    prov = rec.get("provenance", {})
    speed = ""
    if rec.get("samples_per_s") is not None:
        rate = (rec.get("intervals") or {}).get("samples_per_s")
        row = {"samples_per_s": rec["samples_per_s"]}
        if rate:
            row |= {"samples_per_s_lo": rate[0], "samples_per_s_hi": rate[1]}
        text = interval_text(row, "samples_per_s")
        shown = (
            f"samples/s {NOT_MEASURED_WELL} ({MEASURE_AGAIN})"
            if text == NOT_MEASURED_WELL
            else f"{rec['samples_per_s']:.4g} samples/s" + (f" ({text})" if text else "")
        )
        speed = f"predicted {shown}, {rec['step_time_s']:.4g} s/step, "
    return (
        speed
        + f"{rec['mem_per_rank_bytes'] / GIB:.3f} GiB per rank of {rec['usable_memory_bytes'] / GIB:.3g} "
        f"usable (device memory {prov.get('device_memory', '?')})"
    )


def floor_clause(rec: dict[str, Any]) -> str:
    """' (this machine's noise floor 5.0%)' beside a step-time error, when the run measured one."""
    floor = rec.get("noise_floor")
    return f" (this machine's noise floor {floor:.1%})" if isinstance(floor, (int, float)) else ""


def error_line(rec: dict[str, Any]) -> str:
    """The one held-out figure, and leave-one-out under its own name."""
    error, loo = rec.get("error", {}), rec.get("leave_one_out", {})
    if error.get("trials"):
        held = (
            f"held-out error on {error['trials']} configs run after the fit{beyond_clause(error)}: step time "
            f"{_percent(error.get('step_time_mape'))}{floor_clause(rec)}, memory {_percent(error.get('memory_mape'))}"
        )
    else:
        held = "held-out error: none (no check trial ran within the budget)"
    if loo.get("trials"):
        held += (
            f"; leave-one-out over the {loo['trials']} search trials: step time "
            f"{_percent(loo.get('step_time_mape'))}, memory {_percent(loo.get('memory_mape'))} (see the report)"
        )
    return held
