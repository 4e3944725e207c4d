"""`sdzero advise` in the terminal, read in ten seconds: the verdict in one line (nodes, config, time and
GPU-hours to train, where the figures come from), the scaling table, the trade and what to act on (LR,
errors, launch), and last where the report is. Reads recommendation.json's payload (advisor.outcome)
only, so it says what the JSON and the report say."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from advisor.model.scaling_table import short_provenance
from advisor.model.time_to_train import cost_of, hours, money
from advisor.report.answer import beyond_clause, plus_minus
from sdzero.constants import GIB


def _percent(value: Any) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _hours_cell(row: dict[str, Any]) -> str:
    seconds = row.get("time_to_train_s")
    return "" if seconds is None else hours(float(seconds)) + plus_minus(row, "time_to_train_s")


def scaling_rich_table(rec: dict[str, Any]) -> Table:
    """The scaling table, one row per node count, time and GPU-hours to train beside the throughput."""
    choice = rec.get("node_choice", {})
    t = rec.get("time_to_train") or {}
    price = t.get("gpu_hour_price")
    unit = t.get("unit", "GPU-h")
    title = f"Scaling, global batch {rec.get('global_batch_rule', '')}"
    if t:
        title += f"; time to train {t.get('amount', '')}"
    if rec.get("timed") is False:
        return untimed_table(rec)
    table = Table(title=title, title_justify="left")
    columns = ["nodes", "config", "mb x accum", "step (s)", "samples/s", "time", unit]
    columns += ["cost"] if price is not None else []
    columns += ["efficiency", "exposed comm", "link", "", "provenance"]
    right = {"nodes", "step (s)", "samples/s", "time", unit, "cost"}
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
        cost = cost_of(float(row.get("gpu_hours") or 0.0), price)
        table.add_row(
            str(n),
            str(row["config_id"]),
            f"{int(row['micro_batch'])} x {int(row['grad_accum'])}",
            f"{row['step_time_s']:.4g}",
            f"{row['samples_per_s']:.4g}{plus_minus(row, 'samples_per_s')}",
            _hours_cell(row),
            "" if row.get("gpu_hours") is None else f"{row['gpu_hours']:.3g}",
            *([money(cost)] if cost is not None else []),
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
    needs on the target's links, nothing that rests on the target's speed (advisor.report.withheld)."""
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
    return marks


def print_advice(
    rec: dict[str, Any],
    trials_run: int,
    full_grid: int,
    out_dir: Any,
    report: Any,
    console: Console | None = None,
) -> None:
    """On stdout: the verdict in one line, the table, what to act on, and last where the report is."""
    # piped (CI logs, files): wide enough for the table instead of rich's 80 columns
    out = console or Console(width=None if sys.stdout.isatty() else 200)
    prov = rec.get("provenance", {})
    if rec.get("verdict"):
        out.print(f"[bold]answer:[/bold] {rec['verdict']}", highlight=False)
    if prov.get("headline"):
        out.print(
            ("[bold yellow]" if prov.get("target_differs") else "[dim]") + prov["headline"], highlight=False
        )
    basis = rec.get("compute_basis") or {}
    if basis.get("kind") == "profile":  # measured on the target's own node: said once, under the headline
        out.print(
            f"[dim]{basis['line']}; {rec['notes'][0] if rec.get('notes') else ''}[/dim]", highlight=False
        )
    out.print(scaling_rich_table(rec))
    choice = rec.get("node_choice", {})
    if rec.get("timed") is False:
        out.print(f"[bold yellow]not timed:[/bold yellow] {rec['compute_basis']['line']}", highlight=False)
    else:
        out.print(
            f"[bold]node count:[/bold] {rec['node_count']}, by {choice.get('rule', '')}; fastest "
            f"{choice.get('fastest')}, most efficient {choice.get('most_efficient')}"
            + (f", fewest GPU-h {choice['fewest_gpu_hours']}" if choice.get("fewest_gpu_hours") else ""),
            highlight=False,
        )
    if choice.get("confidence"):
        out.print(f"[bold]how sure:[/bold] {choice['confidence']}", highlight=False)
    if choice.get("trade"):
        out.print(f"[bold]trade:[/bold] {choice['trade']}", highlight=False)
    if rec.get("tie"):
        out.print(f"[bold]tie:[/bold] {rec['tie']}", highlight=False)
    intervals = rec.get("intervals") or {}
    rate = intervals.get("samples_per_s")
    speed = (
        f"predicted {rec['samples_per_s']:.4g} samples/s"
        + (f" ({rate[0]:.4g}-{rate[1]:.4g})" if rate else "")
        + f", {rec['step_time_s']:.4g} s/step, "
        if rec.get("samples_per_s") is not None
        else ""
    )
    out.print(
        speed
        + f"{rec['mem_per_rank_bytes'] / GIB:.3f} GiB per rank of {rec['usable_memory_bytes'] / GIB:.3g} "
        f"usable (device memory {prov.get('device_memory', '?')})",
        highlight=False,
    )
    t = rec.get("time_to_train") or {}
    if t:
        out.print(
            f"time to train: {t['amount']}, {t['optimizer_steps']:,} optimizer steps; {t['startup']}",
            highlight=False,
        )
    out.print(f"[bold]learning rate:[/bold] {rec.get('lr_rule', rec['lr'])}", highlight=False)
    if rec.get("lr_warning"):
        out.print(f"[bold red]warning:[/bold red] {rec['lr_warning']}", highlight=False)
    measured = rec.get("measured", {})
    if measured and not measured.get("recommended_config_measured", True):
        out.print(f"[bold yellow]not measured:[/bold yellow] {measured['message']}", highlight=False)
    out.print(error_line(rec), highlight=False)
    if rec.get("unmeasured_stages"):
        out.print(f"[bold yellow]not measured:[/bold yellow] {rec['unmeasured_stages']}", highlight=False)
    if rec.get("intervals_from"):
        out.print(f"[dim]{rec['intervals_from']}[/dim]", highlight=False)
    for note in rec.get("interval_notes", []):
        out.print(f"[yellow]interval:[/yellow] {note}", highlight=False)
    out.print(
        f"trials run: {trials_run} of a full grid of {full_grid}"
        + (f" ({len(rec['check_trials'])} of them to check the model)" if rec.get("check_trials") else ""),
        highlight=False,
    )
    for runner in rec.get("runners_up", [])[:RUNNERS_SHOWN]:
        out.print(
            f"  runner-up {runner['config_id']} @ {runner['node_count']} nodes: {runner['why_not']}",
            highlight=False,
        )
    out.print(f"config: {out_dir}/recommended_ds_config.json", highlight=False, soft_wrap=True)
    out.print(f"launch: {rec['launch_command']}", highlight=False, soft_wrap=True)
    if report:
        out.print(f"[bold]report:[/bold] {report}", highlight=False, soft_wrap=True)


RUNNERS_SHOWN = 3
"""Runners-up in the terminal (recommendation.json and the report have them all)."""


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
