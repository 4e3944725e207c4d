"""The page model of a report (sections of figures, tables, code and notes), its rendering and its write.

A report is built completely in memory first (every figure drawn, every table formatted), then rendered
by one Jinja2 template with autoescaping on, then written atomically. So bad input fails before anything
touches the disk, and a crash mid-write leaves the previous report where it was.

Escaping is the template's job alone: builders hand over plain strings (run names, paths, config values,
captions), never HTML, and no `|safe` or `Markup` appears anywhere. Figures are SVG documents shown
through `<img src="data:...">`: a browser runs no script inside an image, and the page's
Content-Security-Policy forbids scripts, connections and every non-`data:` image outright.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd

from sdzero.config.user_file import read_user_json
from sdzero.constants import BINARY_UNITS
from sdzero.errors import UserError
from sdzero.telemetry.environment import environment_snapshot

TEMPLATES = Path(__file__).resolve().parent / "templates"
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
"""No scripts, no fetches: the page is data, and stays inert even if a hostile string slipped through."""


@dataclass(frozen=True)
class FigureItem:
    key: str
    """Unique within the report; the element id is `fig-<key>`."""
    title: str
    caption: str
    """One line: what to read from the figure."""
    svg: bytes
    kind: str = "figure"

    @property
    def data_uri(self) -> str:
        return "data:image/svg+xml;base64," + base64.b64encode(self.svg).decode("ascii")


@dataclass(frozen=True)
class TableItem:
    key: str
    title: str
    caption: str
    columns: list[str]
    rows: list[list[str]]
    numeric: list[bool] = field(default_factory=list)
    """Per column: right-align (numbers)."""
    kind: str = "table"


@dataclass(frozen=True)
class CodeItem:
    key: str
    title: str
    caption: str
    text: str
    kind: str = "code"


@dataclass(frozen=True)
class NoteItem:
    """One line in place of a section's content whose input is absent."""

    key: str
    text: str
    kind: str = "note"


@dataclass(frozen=True)
class GalleryItem:
    """Images in a grid: a row per `rows` label (e.g. a step), a column per `columns` label (e.g. a prompt)."""

    key: str
    title: str
    caption: str
    columns: list[str]
    rows: list[tuple[str, list[str | None]]]
    """(row label, one `data:image/...` URI per column, None where that cell has no image)."""
    kind: str = "gallery"


Item = FigureItem | TableItem | CodeItem | NoteItem | GalleryItem


@dataclass
class Section:
    key: str
    title: str
    items: list[Item]
    intro: str = ""


@dataclass
class Report:
    title: str
    subtitle: str
    source: str
    """The folder the report was made from, shown as text."""
    facts: list[tuple[str, str]]
    """Key figures shown under the title."""
    sections: list[Section]
    notes: list[str] = field(default_factory=list)
    """Warnings about the input that did not stop the report (a cut-short last line, ...)."""
    generated: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    def items(self) -> Iterable[Item]:
        for section in self.sections:
            yield from section.items


# ---------------------------------------------------------------------------------------------- tables


def format_value(value: Any) -> str:
    """A cell as text: floats to 4 significant digits, containers as compact JSON, None as an en dash."""
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return str(value)


def frame_table(key: str, title: str, caption: str, frame: pd.DataFrame) -> TableItem:
    """A TableItem from a DataFrame; numeric columns are right-aligned."""
    numeric = [
        pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
        for c in frame.columns
    ]
    rows = [[format_value(v) for v in row] for row in frame.itertuples(index=False, name=None)]
    return TableItem(key, title, caption, [str(c) for c in frame.columns], rows, numeric)


def mapping_table(key: str, title: str, caption: str, values: Mapping[str, Any]) -> TableItem:
    """A two-column setting/value table, nested keys flattened with dots."""
    rows = [[name, setting_value(name, value)] for name, value in flatten(values)]
    return TableItem(key, title, caption, ["setting", "value"], rows, [False, False])


def setting_value(name: str, value: Any) -> str:
    """Like format_value, with units read from the name: `*_unix_s` as a date, `*_bytes` as GiB/MiB too."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        if name.endswith("_unix_s"):
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
        if name.endswith("_bytes"):
            return f"{human_bytes(value)} ({int(value)} bytes)"
    return format_value(value)


def flatten(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, value in values.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            out += flatten(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, None when the file is absent; UserError when it is not one."""
    if not os.path.lexists(path):
        return None
    data = read_user_json(path, "--run file")  # a FIFO, a device, a huge or non-JSON file: one line
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def human_bytes(value: float | None) -> str:
    if value is None or pd.isna(value):
        return "–"
    for unit, scale in BINARY_UNITS:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


# ------------------------------------------------------------------------------------------ environment


def environment_table(recorded: Mapping[str, Any] | None, where: str) -> TableItem:
    """The environment a run recorded, else this machine's at report time (and the caption says which)."""
    if recorded:
        return mapping_table("environment", "Environment", f"As recorded in {where}.", recorded)
    snapshot = environment_snapshot()
    caption = f"No {where}: these are the versions and devices of the machine that made this report."
    return mapping_table("environment", "Environment", caption, snapshot)


# ------------------------------------------------------------------------------------------- rendering


def _environment() -> jinja2.Environment:
    # autoescape=True for every template, whatever its file name: `select_autoescape` goes by extension
    # and would leave a `.html.j2` template unescaped.
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def check_unique_keys(report: Report) -> None:
    keys = [f"{item.kind}-{item.key}" for item in report.items()] + [s.key for s in report.sections]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"report element ids repeat: {', '.join(repeated)}")


def render_html(report: Report) -> str:
    """The whole page as one string: CSS inline, figures as data URIs, nothing fetched."""
    check_unique_keys(report)
    return _environment().get_template("report.html.j2").render(report=report, csp=CSP)
