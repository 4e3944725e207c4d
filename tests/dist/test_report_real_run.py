"""The training report of a real 2-rank fp16 run of the trainer (fp16 patched onto the CPU for tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from report_page_reader import SVG_NS, TRAINING_CODE, TRAINING_FIGURES, TRAINING_TABLES, Page, svg_of

from advisor.report.build import write_training_report
from advisor.report.train_page import load_run


@pytest.fixture(scope="module")
def real_fp16_run(shipped_run) -> Path:
    """The shipped ZeRO-2 fp16 config's 2-rank run (fp16 patched onto the CPU for tests): 6 steps,
    checkpoints at 3 and 6 (conftest.RUN_SHAPES; tests/dist/test_train.py checks the same run's metrics)."""
    from launch import check_ok

    proc, out = shipped_run("zero2_fp16.json")
    check_ok(proc)
    return out


def test_report_of_a_real_fp16_run(real_fp16_run, tmp_path):
    out = write_training_report(real_fp16_run, tmp_path / "real.html")
    page = Page(out.read_text())
    assert page.ids("fig-") == TRAINING_FIGURES  # the loss scale is there: a real fp16 run
    assert page.ids("table-") == TRAINING_TABLES and page.ids("code-") == TRAINING_CODE
    for img in page.images():
        assert svg_of(img).tag == f"{SVG_NS}svg"
    run = load_run(real_fp16_run)
    assert run.metrics["step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert run.metrics["loss_scale"].notna().all()
    assert run.checkpoints["step"].tolist() == [3, 6]
    assert run.checkpoints["state"].tolist() == ["committed", "committed, latest"]
    text = " ".join(page.text)
    assert "ZeRO-2 fp16" in text and "2 ranks × 4 × 1 = 8" in text
