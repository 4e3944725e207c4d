"""Reading the advisor's CSV tables whole-rows-only: a row cut short by a killed writer is left out.

The advisor writes its tables atomically (sdzero.atomic), but a trials.csv appended to by an older
version, or copied while a run wrote it, can end in a partial row: a row without its end of line, or a
quoted field (a log tail spans lines) that never closes. pandas reads the first as a row of blanks that
looks like a trial, and fails on the second; both would break the next run's resume. Here such a tail is
dropped and counted (`table.attrs["torn_rows"]`), and everything before it is read as usual.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pandas as pd

from sdzero.config.user_file import read_user_text
from sdzero.errors import UserError


def read_table(path: Path, flag: str, **read_csv: Any) -> pd.DataFrame:
    """A table of an earlier run's folder, read as a regular file within bounds (a FIFO or a device is
    named, sdzero.config.user_file); a file pandas cannot parse is one line naming it."""
    text = read_user_text(path, flag)
    try:
        return pd.read_csv(io.StringIO(text), **read_csv)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    except (pd.errors.ParserError, ValueError) as exc:
        raise UserError(f"{flag} {path}: not a table sdzero wrote ({str(exc).splitlines()[0]})") from None


def read_whole_rows(path: Path, **read_csv: Any) -> pd.DataFrame:
    """pd.read_csv of `path` without a torn last row; `read_csv` are pandas' own options."""
    text = read_user_text(path, "the trials table")
    torn = 0
    while True:
        try:
            table = pd.read_csv(io.StringIO(text), **read_csv)
            break
        except pd.errors.EmptyDataError:
            table = pd.DataFrame()
            break
        except pd.errors.ParserError:  # a quoted field open at the end: cut back to an earlier line end
            cut = text.rfind("\n", 0, max(len(text) - 1, 0))
            if cut < 0:
                table, torn = pd.DataFrame(), torn + 1
                break
            text, torn = text[: cut + 1], 1
    if text and not text.endswith("\n"):  # the last row, or the header itself, has no end of line
        table, torn = (table.iloc[:-1].reset_index(drop=True) if len(table) else pd.DataFrame()), 1
    table.attrs["torn_rows"] = torn
    return table
