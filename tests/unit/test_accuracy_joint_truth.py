"""bench/advisor_accuracy.py's ground truth: two grid passes around the advise run, put on the advise
run's machine speed by the reference all three runs re-measured."""

import math
from pathlib import Path

import pandas as pd
import pytest
from bench_scripts import load_bench
from trial_rows import ok_trial

from advisor.measure.drift import Bracket, Drift, write_drift

REFERENCE = "z1-bf16-mb4"


@pytest.fixture(scope="module")
def bench():
    return load_bench("advisor_accuracy")


def run(folder: Path, brackets: list[tuple[float, float]], reference: str = REFERENCE) -> Path:
    """A run folder whose drift.json holds the reference measured at (time, step) pairs, +-2% each."""
    folder.mkdir(parents=True)
    drift = Drift(reference, "setup", [Bracket(at, step, step * 0.98, step * 1.02) for at, step in brackets])
    write_drift(folder / "drift.json", drift)
    return folder


def trials(*rows: tuple[int, int, float, float]) -> pd.DataFrame:
    """Grid rows (stage, micro-batch, measured at, raw median step), each with a +-4% interval."""
    return pd.DataFrame(
        [
            ok_trial(
                stage,
                mb,
                measured_at=at,
                step_s_raw=step,
                step_s_raw_lo=step * 0.96,
                step_s_raw_hi=step * 1.04,
            )
            for stage, mb, at, step in rows
        ]
    )


def test_passes_on_the_advise_machine_cancel_the_drift_between_them(bench, tmp_path):
    # The machine runs at 0.9 during the first pass, 1.0 at the advise run's first bracket, 1.2 during the
    # second pass: the same config measured 0.45 s and 0.60 s is 0.5 s on the advise run's machine twice.
    advise = run(tmp_path / "advise", [(100, 1.0), (150, 1.1)])
    first = run(tmp_path / "grid", [(0, 0.9), (50, 0.9)])
    second = run(tmp_path / "grid-after", [(200, 1.2), (250, 1.2)])
    truth, agreement = bench.joint_truth(
        advise, [(first, trials((2, 8, 25, 0.45))), (second, trials((2, 8, 225, 0.60)))]
    )
    row = truth.iloc[0]
    # (the timeline is fitted with the least smoothing here: within a percent of the brackets)
    assert row["truth_s"] == pytest.approx(0.5, rel=0.01)
    assert agreement["pass_ratios"] == [pytest.approx(1.0, rel=0.01)]
    assert agreement["grid_noise_floor"] == pytest.approx(0.0, abs=0.01)
    # the interval: at least the two passes' own +-4% (the brackets' +-2% in each correction) over two,
    # with the fitted timeline's own doubt beside it; no disagreement to add
    own = math.hypot(0.04, 0.02) / math.sqrt(2)
    assert own <= row["step_s_hi"] / row["truth_s"] - 1 < 3 * own
    assert agreement["joint_range"] == [pytest.approx(1.0), pytest.approx(1.2 / 0.9)]


def test_a_disagreement_between_passes_widens_the_truth_and_is_its_floor(bench, tmp_path):
    advise = run(tmp_path / "advise", [(100, 1.0)])
    first = run(tmp_path / "grid", [(0, 1.0), (50, 1.0)])
    second = run(tmp_path / "grid-after", [(200, 1.0), (250, 1.0)])
    a = trials((1, 1, 25, 0.20), (3, 2, 30, 0.40))
    b = trials((1, 1, 225, 0.22), (3, 2, 230, 0.40))
    truth, agreement = bench.joint_truth(advise, [(first, a), (second, b)])
    fast = truth[truth["zero_stage"] == 1].iloc[0]
    assert fast["truth_s"] == pytest.approx(math.sqrt(0.20 * 0.22))
    half = fast["step_s_hi"] / fast["truth_s"] - 1
    assert half > math.log(0.22 / 0.20) / 2  # the disagreement is in it, beside the passes' own
    assert sorted(agreement["pass_ratios"]) == [pytest.approx(1.0), pytest.approx(1.1)]
    # pooled sigma of ln(step) over the two configs (one dof each), as a mean |deviation|
    sigma = math.sqrt((math.log(1.1) ** 2 / 2) / 2)
    assert agreement["grid_noise_floor"] == pytest.approx(sigma / math.sqrt(math.pi / 2))
    assert agreement["grid_noise_dof"] == 2


def test_runs_without_a_shared_reference_or_a_second_pass_fall_back(bench, tmp_path):
    advise = run(tmp_path / "advise", [(100, 1.0)], reference="z2-bf16-mb4")
    first = run(tmp_path / "grid", [(0, 1.0)])
    second = run(tmp_path / "grid-after", [(200, 1.0)])
    rows = trials((1, 1, 25, 0.2))
    assert bench.joint_truth(advise, [(first, rows), (second, rows)]) is None  # another reference
    assert bench.joint_truth(first, [(second, rows)]) is None  # one pass: the earlier protocol
