"""The report stage: <out>/report.html, built from the files the earlier stages wrote (the data contract
in advisor.report.build's docstring) and nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from sdzero.errors import UserError


@dataclass
class ReportOutcome:
    path: Path | None
    """report.html; None when it could not be built."""
    notes: list[str] = field(default_factory=list)
    """Why it was not built: the advice stands without it, so this is a note rather than an error."""


def write_report(out_dir: Path) -> ReportOutcome:
    from advisor.report.build import write_advise_report

    try:
        return ReportOutcome(write_advise_report(out_dir, out_dir / "report.html"))
    except UserError as exc:
        return ReportOutcome(None, [f"report not written: {exc}"])
