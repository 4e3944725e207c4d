"""`sdzero advise`'s terminal answer, read in ten seconds: the verdict, the table and at most five short
lines fit 25 lines at 160 columns; every printed interval is a range that never reaches zero and never
spans more than its figure, and a figure whose interval does is said to be not measured well enough;
--explain prints the detail the short answer leaves to the report.

The payloads are tests/report_fixtures.advise_answer: the shape of the embedded default's answer at
--max-nodes 32, its figures made up; "cut" intervals are the symmetric ones, cut at 5% of the step, that
older recommendation.json files hold."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
from report_fixtures import advise_answer
from rich.console import Console
from typer.testing import CliRunner

from advisor.decide.outcome import UNMEASURED_PICK
from advisor.model.interval_words import (
    MEASURE_AGAIN,
    NOT_MEASURED_WELL,
    TOO_WIDE,
    duration_range,
    range_text,
    significant,
)
from advisor.report.answer import interval_text
from advisor.report.terminal import ANSWER_LINES, print_advice

WIDTH = 160

QUIET = {}
NOISY = {
    "wide_half": 1.05,  # the issue's: 3.13 min "(0.313 min-6.42 min)", samples/s "+-976%"
    "measured": False,
    "stages": ("ZeRO-1 bf16", "ZeRO-3 bf16"),
    "lr_warning": "lr capped at 8x the base: warm up over 100 steps",
}
PAYLOADS = {
    "quiet": QUIET,
    "noisy": NOISY,
    "noisy, old intervals": NOISY | {"style": "cut"},
    "every row noisy": NOISY | {"wide_from": 1},
}


def answer(rec: dict, explain: bool = False, width: int = WIDTH) -> str:
    console = Console(record=True, width=width, file=open("/dev/null", "w"))  # noqa: SIM115
    print_advice(rec, 15, 12, "out", "out/report.html", console=console, explain=explain)
    return console.export_text()


RANGE = re.compile(
    r"(?<![\w.,])(\d[\d,]*(?:\.\d+)?)(%| min| h| days)?-(\d[\d,]*(?:\.\d+)?)(%| min| h| days)?(?![\w.,])"
)
"""A printed interval: '2.9-3.4 min', '2,300-3,000', '85.5%-88.8%', the old '0.313 min-6.42 min'."""


def printed_ranges(text: str) -> list[tuple[float, float]]:
    return [
        (float(m.group(1).replace(",", "")), float(m.group(3).replace(",", ""))) for m in RANGE.finditer(text)
    ]


@pytest.mark.parametrize("kind", list(PAYLOADS))
def test_the_answer_fits_25_lines_at_160_columns(kind):
    rec = advise_answer(**PAYLOADS[kind])
    text = answer(rec)
    lines = text.rstrip("\n").splitlines()
    assert len(lines) <= 25, text
    assert max(len(line.rstrip()) for line in lines) <= WIDTH
    # the verdict first (opening with it when the pick was not measured), the report last, at most five
    # labelled lines after the table
    opening = "" if rec["measured"]["recommended_config_measured"] else UNMEASURED_PICK
    assert lines[0].startswith(f"answer: {opening}") and "16 nodes x 2 ranks" in lines[0]
    assert lines[-1].startswith("report: out/report.html")
    last_row = max(i for i, line in enumerate(lines) if re.match(r"^\s+\d+\s+z\d", line))
    labelled = [line for line in lines[last_row + 1 :] if re.match(r"^[a-z][a-z ]+: ", line)]
    assert 1 <= len(labelled) <= ANSWER_LINES, labelled
    for gone in (
        "learning rate:",
        "held-out error on",
        "runner-up",
        "launch:",
        "95% intervals",
        "trials run:",
    ):
        assert gone not in text, gone  # the detail is under --explain and in the report


@pytest.mark.parametrize("kind", list(PAYLOADS))
def test_no_printed_interval_reaches_zero_or_spans_more_than_its_figure(kind):
    text = answer(advise_answer(**PAYLOADS[kind]), explain=True)
    assert "±" not in text  # a symmetric half-width is no range
    ranges = printed_ranges(text)
    assert ranges, text
    for lo, hi in ranges:
        assert 0 < lo < hi, (lo, hi)
        # the figure is the ranges' geometric middle; rounding to 2 figures moves the ends a little
        assert hi - lo <= 1.1 * math.sqrt(lo * hi), (lo, hi, text)


def test_a_too_wide_interval_is_printed_as_words_not_a_figure():
    rec = advise_answer(**NOISY)
    text = answer(rec)
    assert TOO_WIDE in rec["verdict"] and " min" not in rec["verdict"]  # no time the user could act on
    rows = {line.split()[0]: line for line in text.splitlines() if re.match(r"^\s+\d+\s+z\d", line)}
    assert set(rows) == {"1", "2", "4", "8", "16", "32"}
    for n in ("16", "32"):
        assert NOT_MEASURED_WELL in rows[n] and " min" not in rows[n], rows[n]
    for n in ("1", "2", "4", "8"):
        assert NOT_MEASURED_WELL not in rows[n] and " min" in rows[n], rows[n]
    line = next(line for line in text.splitlines() if line.startswith("not measured:"))
    assert "16, 32 nodes" in text and MEASURE_AGAIN in text.replace("\n", " ")
    assert "z2-bf16-mb8-off-none" in line and "--budget-minutes 9" in line
    # the trade between 16 and 32 nodes would print the figures the table withholds: left to --explain
    assert "trade:" not in text
    quiet = answer(advise_answer())
    assert NOT_MEASURED_WELL not in quiet and "not measured:" not in quiet and "trade: 16 nodes" in quiet


def test_explain_prints_the_detail_after_the_short_answer():
    rec = advise_answer(**NOISY)
    short, full = answer(rec), answer(rec, explain=True)
    assert full.startswith(short.rsplit("report:", 1)[0])  # the same answer first
    detail = full.split("detail", 1)[1]
    for line in (
        "global batch: 256, the embedded default",
        "node count: 16, by the largest node count",
        "learning rate: lr 0.0001",
        "held-out error on 3 configs",
        "95% intervals:",
        "interval: the inter-node link is assumed",
        "trials run: 15 of a full grid of 12",
        "runner-up z1-bf16-mb4-off-none",
        "launch: deepspeed",
        "was not measured (--budget-minutes ran out)",
    ):
        assert line in detail, line
    assert f"samples/s {NOT_MEASURED_WELL}" in detail  # the predicted rate: words, not a figure
    assert "trade (model's figures, not measured well enough): 16 nodes" in detail  # the short answer's gap
    assert "2,400-2,900" in answer(advise_answer(), explain=True)  # the quiet one's rate, as a range


def test_the_advise_command_takes_explain(monkeypatch, tmp_path):
    """`sdzero advise --explain` prints the detail after the answer; without it, the short answer only."""
    from types import SimpleNamespace

    import advisor.cli as advise_cli
    import advisor.commands.advise as advise_module

    rec = advise_answer()

    def run_advise(request):
        return SimpleNamespace(
            recommendation=rec, trials_run=15, full_grid=12, out_dir=request.out_dir, report=None
        )

    monkeypatch.setattr(advise_module, "run_advise", run_advise)
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    runner = CliRunner()
    short = runner.invoke(advise_cli.app, ["advise", "--out", str(tmp_path / "a")])
    assert short.exit_code == 0, short.output
    assert "how sure:" in short.output and "launch:" not in short.output
    full = runner.invoke(advise_cli.app, ["advise", "--explain", "--out", str(tmp_path / "b")])
    assert full.exit_code == 0, full.output
    assert "how sure:" in full.output and "launch: deepspeed" in full.output
    assert "learning rate:" in full.output


def test_ranges_read_in_one_unit_to_the_figures_that_tell_their_ends_apart():
    assert duration_range(3.13 * 60, 2.9 * 60, 3.4 * 60) == "2.9-3.4 min"
    assert duration_range(5 * 3600, 4.1 * 3600, 6.2 * 3600) == "4.1-6.2 h"
    assert duration_range(50 * 60, 41 * 60, 70 * 60) == "41-70 min"  # the figure's unit, not the end's
    assert range_text(3.121, 3.139) == "3.12-3.14"  # a third figure only where two do not tell them apart
    assert range_text(2299.1, 3007.9) == "2,300-3,000"
    assert significant(12345, 2) == "12,000" and significant(0.05234, 2) == "0.052"
    row = {"x": 100.0, "x_lo": 40.0, "x_hi": 150.0}
    assert interval_text(row, "x") == NOT_MEASURED_WELL  # 110 wide about 100
    assert interval_text(row | {"x_lo": 0.0, "x_hi": 101.0}, "x") == NOT_MEASURED_WELL  # reaches zero
    assert interval_text(row | {"x_lo": 80.0, "x_hi": 126.0}, "x") == "80-130"
    assert interval_text({"x": 100.0}, "x") is None


def test_the_report_shows_the_same_ranges_and_words(tmp_path):
    from advisor.report.answer import scaling_table_item

    item = scaling_table_item(advise_answer(**NOISY))
    rows = {row[0].split()[0]: row for row in item.rows}
    at = {name: item.columns.index(name) for name in ("samples/s", "step (s)", "time to train", "GPU-h")}
    assert not any("±" in cell for row in item.rows for cell in row)
    assert rows["16"][at["samples/s"]] == rows["32"][at["samples/s"]] == NOT_MEASURED_WELL
    assert rows["16"][at["time to train"]] == NOT_MEASURED_WELL
    assert rows["16"][at["step (s)"]] == rows["16"][at["GPU-h"]] == ""  # no figure where none is known
    assert (
        rows["8"][at["samples/s"]] == "1399 (1,300-1,500)"
        and "min (1.3-1.5 min)" in rows["8"][at["time to train"]]
    )
    assert "not measured well enough" in item.caption


def test_an_interval_is_a_ratio_that_never_reaches_zero():
    """add_intervals: a 95% half-width h of 105% (a noisy machine) puts the step's bounds at step / 2.05
    and step x 2.05, never at a cut; throughput's bounds are the step's, swapped, with the same ratio."""
    from advisor.model.uncertainty import Spread, add_intervals, interval_ratio
    from advisor.stats import Z95

    row = {
        "node_count": 16,
        "config_id": "z2-mb8",
        "zero_stage": 2,
        "dtype": "bf16",
        "micro_batch": 8,
        "offload": "none",
        "global_batch": 256,
        "step_time_s": 0.1,
        "samples_per_s": 2560.0,
        "mem_per_rank_bytes": 2e8,
        "optimizer_steps": 391,
        "time_to_train_s": 12 + 39.1,
        "gpu_hours": (12 + 39.1) / 3600 * 32,
    }
    spread = Spread(noise=1.05 / Z95)  # a config no trial ran, on a machine this noisy: h = 1.05
    table = add_intervals(pd.DataFrame([row]), spread).iloc[0]
    ratio = table["step_time_s_hi"] / table["step_time_s"]
    assert ratio == pytest.approx(interval_ratio(1.05)) == pytest.approx(2.05)
    assert table["step_time_s_lo"] == pytest.approx(0.1 / ratio)
    assert table["samples_per_s_lo"] == pytest.approx(2560 / ratio)
    assert table["samples_per_s_hi"] == pytest.approx(2560 * ratio)
    for figure in ("step_time_s", "samples_per_s", "time_to_train_s", "gpu_hours", "mem_per_rank_bytes"):
        assert 0 < table[f"{figure}_lo"] < table[figure] < table[f"{figure}_hi"], figure
    assert np.isclose(table["step_time_s_lo"] * table["step_time_s_hi"], 0.1**2)
