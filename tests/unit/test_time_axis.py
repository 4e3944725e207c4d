"""The advise page's time-to-train figure reads in the answer's unit: minutes for a run under an hour,
hours under four days, then days; ticks at 1, 2, 5 x 10^k of it (not powers of ten of hours)."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from advisor.report.figures import time_axis_unit, time_to_train_figure


@pytest.mark.parametrize(
    ("seconds", "unit"), [(1500.0, "min"), (3 * 3600.0, "h"), (95 * 3600.0, "h"), (200 * 3600.0, "days")]
)
def test_the_unit_is_the_answers(seconds, unit):
    assert time_axis_unit(seconds)[0] == unit


def test_a_run_of_minutes_is_drawn_in_minutes():
    rows = pd.DataFrame(
        {"node_count": [1, 2, 4], "time_to_train_s": [1500.0, 800.0, 450.0], "gpu_hours": [1.0] * 3}
    )
    svg = time_to_train_figure(rows, 2, 2).decode()
    assert "<!-- time to train (min, log) -->" in svg
    ticks = {int(t) for t in re.findall(r"<!-- (\d+) -->", svg)}
    assert {10, 20} <= ticks  # 7.5-25 minutes: ticks at 10 and 20 min
