"""`sdzero advise` in the terminal: where the figures come from, the scaling table, the recommendation with
its LR, the errors, and whether the recommended config was measured. Reads recommendation.json's payload
(advisor.outcome) only, so it says what the JSON and the report say."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from advisor.model.scaling_table import short_provenance
from sdzero.constants import GIB


def _percent(value: Any) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def scaling_rich_table(rec: dict[str, Any]) -> Table:
    choice = rec.get("node_choice", {})
    table = Table(title=f"Scaling, global batch {rec.get('global_batch_rule', '')}", title_justify="left")
    for name in (
        "nodes",
        "config",
        "mb x accum",
        "samples/s",
        "step (s)",
        "efficiency",
        "exposed comm",
        "limited by",
        "",
        "provenance",
    ):
        table.add_column(name, justify="right" if name in {"nodes", "samples/s", "step (s)"} else "left")
    for row in rec.get("scaling_table", []):
        n = row["node_count"]
        marks = []
        if n == rec.get("node_count"):
            marks.append("<- recommended")
        if row.get("knee") and n != rec.get("node_count"):
            marks.append(f"knee (>= {choice.get('min_efficiency', 0):.0%})")
        if n == choice.get("fastest") and n != rec.get("node_count"):
            marks.append("fastest")
        if row["status"] != "ok":
            why = "global batch not reachable" if row["status"] == "unreachable" else "out of memory"
            table.add_row(str(n), f"[dim]{why}[/dim]", *[""] * 8)
            continue
        table.add_row(
            str(n),
            str(row["config_id"]),
            f"{int(row['micro_batch'])} x {int(row['grad_accum'])}",
            f"{row['samples_per_s']:.4g}",
            f"{row['step_time_s']:.4g}",
            _percent(row.get("efficiency")),
            _percent(row.get("exposed_comm_share")),
            str(row.get("limiting_link", "-")),
            " ".join(marks),
            short_provenance(str(row.get("provenance", ""))),
            style="bold" if n == rec.get("node_count") else None,
        )
    return table


def print_advice(
    rec: dict[str, Any],
    trials_run: int,
    full_grid: int,
    out_dir: Any,
    report: Any,
    console: Console | None = None,
) -> None:
    """Everything a user needs to act on, on stdout."""
    # piped (CI logs, files): wide enough for the table instead of rich's 80 columns
    out = console or Console(width=None if sys.stdout.isatty() else 200)
    prov = rec.get("provenance", {})
    if prov.get("headline"):
        out.print(("[bold yellow]" if prov.get("target_differs") else "") + prov["headline"], highlight=False)
    out.print(scaling_rich_table(rec))
    choice = rec.get("node_choice", {})
    out.print(
        f"[bold]recommended:[/bold] {rec['config_id']} on {rec['node_count']} nodes x {rec['gpus_per_node']} ranks "
        f"({choice.get('rule', '')}); micro-batch {rec['micro_batch']} x accumulation {rec['grad_accum']} = "
        f"global batch {rec['global_batch']}; fastest: {choice.get('fastest')} nodes, most efficient: "
        f"{choice.get('most_efficient')} nodes",
        highlight=False,
    )
    out.print(
        f"predicted {rec['samples_per_s']:.4g} samples/s, {rec['step_time_s']:.4g} s/step, "
        f"{rec['mem_per_rank_bytes'] / GIB:.3f} GiB per rank of {rec['usable_memory_bytes'] / GIB:.3g} usable "
        f"(device memory {prov.get('device_memory', '?')})",
        highlight=False,
    )
    out.print(f"[bold]learning rate:[/bold] {rec.get('lr_rule', rec['lr'])}", highlight=False)
    if rec.get("lr_warning"):
        out.print(f"[bold red]warning:[/bold red] {rec['lr_warning']}", highlight=False)
    measured = rec.get("measured", {})
    if measured and not measured.get("recommended_config_measured", True):
        out.print(f"[bold yellow]not measured:[/bold yellow] {measured['message']}", highlight=False)
    out.print(error_line(rec), highlight=False)
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
    if report:
        out.print(f"report: {report}", highlight=False, soft_wrap=True)


def error_line(rec: dict[str, Any]) -> str:
    """The one held-out figure, and leave-one-out under its own name."""
    error, loo = rec.get("error", {}), rec.get("leave_one_out", {})
    if error.get("trials"):
        held = (
            f"held-out error on {error['trials']} configs run after the fit: step time "
            f"{_percent(error.get('step_time_mape'))}, memory {_percent(error.get('memory_mape'))}"
        )
    else:
        held = "held-out error: none (no check trial ran within the budget)"
    if loo.get("trials"):
        held += (
            f"; leave-one-out over the {loo['trials']} search trials: step time "
            f"{_percent(loo.get('step_time_mape'))}, memory {_percent(loo.get('memory_mape'))} (see the report)"
        )
    return held
