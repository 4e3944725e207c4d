"""`sdzero report`: one self-contained HTML page per training run or advise run (advisor.report.build)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from advisor.report.build import write_advise_report, write_training_report
from sdzero.errors import UserError


def report_command(
    advise_out: Annotated[
        Path | None,
        typer.Argument(
            metavar="ADVISE_OUT", help="Output folder of sdzero advise, profile or comm.", show_default=False
        ),
    ] = None,
    run: Annotated[
        Path | None,
        typer.Option(
            "--run",
            metavar="TRAIN_OUTPUT_DIR",
            help="A training run's --output-dir (metrics.jsonl, ds_config.json, ...).",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="HTML file to write (default: reports/<folder name>.html).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Render one self-contained HTML report of an advise run or (with --run) of a training run."""
    if (advise_out is None) == (run is None):
        raise UserError(
            "give either ADVISE_OUT (an advise, profile or comm folder) or --run TRAIN_OUTPUT_DIR"
        )
    if run is not None:
        written = write_training_report(run, out)
    else:
        assert advise_out is not None
        written = write_advise_report(advise_out, out)
    typer.echo(f"wrote {written}")
