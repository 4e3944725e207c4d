"""bench/advisor_share.py's readings of an advise run's own files: the budget it announced, the measured
configs' intervals, and the batch shapes its full-grid check measures."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from bench_scripts import load_bench

share = load_bench("advisor_share")


def test_batch_shapes_reach_the_global_batch_exactly():
    assert share.batch_shapes(8, 2, (1, 2, 4, 8)) == [(1, 4), (2, 2), (4, 1)]
    assert share.batch_shapes(12, 2, (1, 2, 4, 8)) == [(1, 6), (2, 3)]


def test_the_announced_budget_is_read_from_the_budget_line(tmp_path):
    log = ["launch 1: z1-bf16-off-none-r2, 4 configs", "budget: 11.8 min; the first launch measured ..."]
    (tmp_path / "recommendation.json").write_text(json.dumps({"search_log": log}))
    assert share.announced_budget_s(tmp_path) == pytest.approx(708.0)
    (tmp_path / "recommendation.json").write_text(json.dumps({"search_log": log[:1]}))
    assert share.announced_budget_s(tmp_path) is None


def test_measured_halfwidths_take_the_measured_configs_at_one_node(tmp_path):
    pd.DataFrame(
        {
            "node_count": [1, 1, 2],
            "interval_source": ["measured", "model", "measured"],
            "step_time_s": [2.0, 2.0, 1.0],
            "step_time_s_lo": [1.9, 1.0, 0.5],
            "step_time_s_hi": [2.1, 3.0, 1.5],
        }
    ).to_csv(tmp_path / "predictions.csv", index=False)
    assert share.measured_halfwidths(tmp_path) == [pytest.approx(0.05)]
