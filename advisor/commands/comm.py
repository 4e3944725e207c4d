"""`sdzero comm`: benchmark the collectives (advisor.measure.collectives_launch.run_comm) and print the
largest message per backend and the alpha-beta fits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
import typer

from advisor.measure.alphabeta import NOISY_SPREAD, AlphaBetaFit
from advisor.measure.collectives_launch import parse_bytes, run_comm
from sdzero.config.options import cli_option


def comm_command(
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for comm.csv, comm_fit.json and logs.")
    ] = Path("reports/comm"),
    ranks: Annotated[
        int, typer.Option("--ranks", "-n", help="Ranks per node (all ranks without --hostfile).")
    ] = 2,
    hostfile: Annotated[
        Path | None,
        cli_option("hostfile", note="Open MPI reads it too; adds the across-nodes level"),
    ] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend",
            "-b",
            help="torch (deepspeed launcher: nccl/gloo) and/or mpi (mpirun); repeat. "
            "Default: every one installed here (a missing one is skipped, and said so).",
        ),
    ] = None,
    min_bytes: Annotated[str, typer.Option(help="Smallest message, e.g. 4KiB.")] = "4KiB",
    max_bytes: Annotated[
        str, typer.Option(help="Largest message, e.g. 256MiB; the budget may stop earlier.")
    ] = "256MiB",
    budget_s: Annotated[float, typer.Option(help="Seconds of measuring, all backends together.")] = 120.0,
    torch_backend: Annotated[
        str, typer.Option(help="auto (nccl on GPUs, gloo on CPUs), gloo or nccl.")
    ] = "auto",
) -> None:
    """Benchmark all-reduce, reduce-scatter and all-gather (nccl-tests style) and fit alpha-beta models."""
    from rich.console import Console

    console = Console()
    result = run_comm(
        out_dir=out,
        num_ranks=ranks,
        hostfile=hostfile,
        backends=backend or None,  # none named: what is installed here
        min_bytes=parse_bytes(min_bytes, "--min-bytes"),
        max_bytes=parse_bytes(max_bytes, "--max-bytes"),
        budget_s=budget_s,
        torch_backend=torch_backend,
        log=lambda message: console.print(f"[dim]{message}[/dim]"),
    )
    console.print(largest_size_table(result.table))
    console.print(fits_table(result.fits))
    for name, why in result.skipped.items():
        console.print(f"[yellow]{name}: not measured: {why}[/yellow]")
    console.print(f"wrote {result.csv_path} and {result.fit_path}")
    if result.noisy_fraction > 0.1:
        console.print(
            f"[yellow]{result.noisy_fraction:.0%} of the points were noisy (repeats disagreed by more than "
            f"{NOISY_SPREAD:.0%}): other processes are likely sharing these cores or links; rerun on an idle "
            "machine for numbers to plan with[/yellow]"
        )
    if not result.all_correct:
        console.print(f"[red]some reductions were wrong: see the 'correct' column of {result.csv_path}[/red]")
        raise typer.Exit(1)


def largest_size_table(table: pd.DataFrame) -> Any:
    """A rich table of each backend's largest measured size, nccl-tests' columns."""
    from rich.table import Table

    view = Table(title="largest message per backend (GB/s = 1e9 bytes/s)")
    for name in ("backend", "library", "level", "collective", "bytes", "time us", "algbw", "busbw", "ok"):
        view.add_column(name)
    keys = ["backend", "library", "link_level", "collective"]
    for _, row in table.loc[table.groupby(keys)["size_bytes"].idxmax()].iterrows():
        view.add_row(
            row["backend"],
            row["library"],
            row["link_level"],
            row["collective"] + (" *" if row["emulated"] else ""),
            f"{row['size_bytes']:,}",
            f"{row['time_s'] * 1e6:,.1f}",
            f"{row['algbw_gbps']:.3f}",
            f"{row['busbw_gbps']:.3f}",
            "yes" if row["correct"] else "NO",
        )
    view.caption = "* emulated: see the note column of comm.csv"
    return view


def fits_table(fits: Sequence[AlphaBetaFit]) -> Any:
    from rich.table import Table

    view = Table(title="alpha-beta fits: t = alpha + bytes * beta")
    for name in (
        "backend",
        "level",
        "collective",
        "ranks",
        "latency us",
        "burst us",
        "busbw GB/s",
        "rel rmse",
        "clamped",
    ):
        view.add_column(name)
    for fit in fits:
        view.add_row(
            fit.backend,
            fit.link_level,
            fit.collective,
            str(fit.ranks),
            f"{fit.latency_us:.1f}",
            "-" if fit.burst_alpha_s is None else f"{fit.burst_alpha_s * 1e6:.1f}",
            f"{fit.bandwidth_gbps:.3f}",
            f"{fit.rel_rmse:.2f}",
            ",".join(fit.clamped) or "-",
        )
    return view
