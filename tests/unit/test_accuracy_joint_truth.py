"""bench/advisor_accuracy.py's ground truth: two grid passes around the advise run, put on the advise
run's machine speed by the tie every launch of the three runs timed (advisor.measure.launch)."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from bench_scripts import load_bench
from trial_rows import ok_trial


@pytest.fixture(scope="module")
def bench():
    return load_bench("advisor_accuracy")


def run(folder: Path, ties: list[float]) -> Path:
    """A run folder whose launches.json holds launches `launch-0`, `launch-1`, ... with these ties."""
    folder.mkdir(parents=True)
    launches = [
        {
            "name": "z",
            "folder": str(folder / f"launch-{n}"),
            "configs": [],
            "status": "ok",
            "wall_s": 60.0,
            "startup_s": 10.0,
            "steps_s": 50.0,
            "timed_s": 45.0,
            "timed_steps": 100,
            "tie_s": tie,
            "others_cpu_share": 0.0,
        }
        for n, tie in enumerate(ties)
    ]
    (folder / "launches.json").write_text(json.dumps({"setup": "s", "launches": launches}))
    return folder


def trials(folder: Path, *rows: tuple[int, int, int, float]) -> pd.DataFrame:
    """Grid rows (stage, micro-batch, the launch they ran in, raw median step), each +-4%."""
    return pd.DataFrame(
        [
            ok_trial(
                stage,
                mb,
                trial_dir=str(folder / f"launch-{launch}"),
                step_s_raw=step,
                step_s_raw_lo=step * 0.96,
                step_s_raw_hi=step * 1.04,
            )
            for stage, mb, launch, step in rows
        ]
    )


def test_passes_on_the_advise_machine_cancel_the_drift_between_them(bench, tmp_path):
    # The machine runs at 0.9 during the first pass, 1.0 in the advise run's first launch, 1.2 during the
    # second pass (each launch's tie says so): the same config measured 0.45 s and 0.60 s is 0.5 s twice.
    advise = run(tmp_path / "advise", [0.010, 0.011])
    first = run(tmp_path / "grid", [0.009])
    second = run(tmp_path / "grid-after", [0.012])
    truth, agreement = bench.joint_truth(
        advise, [(first, trials(first, (2, 8, 0, 0.45))), (second, trials(second, (2, 8, 0, 0.60)))]
    )
    row = truth.iloc[0]
    assert row["truth_s"] == pytest.approx(0.5)
    assert agreement["pass_ratios"] == [pytest.approx(1.0)]
    assert agreement["grid_noise_floor"] == pytest.approx(0.0, abs=1e-9)
    # the interval: the two passes' own +-4% over two, no disagreement to add
    assert row["step_s_hi"] / row["truth_s"] - 1 == pytest.approx(math.hypot(0.04, 0.04) / 2)
    assert agreement["tie_range"] == [pytest.approx(0.9), pytest.approx(1.2)]


def test_a_disagreement_between_passes_widens_the_truth_and_is_its_floor(bench, tmp_path):
    advise = run(tmp_path / "advise", [0.01])
    first = run(tmp_path / "grid", [0.01, 0.01])
    second = run(tmp_path / "grid-after", [0.01, 0.01])
    a = trials(first, (1, 1, 0, 0.20), (3, 2, 1, 0.40))
    b = trials(second, (1, 1, 0, 0.22), (3, 2, 1, 0.40))
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


def test_runs_without_ties_or_a_second_pass_fall_back(bench, tmp_path):
    advise = run(tmp_path / "advise", [0.01])
    first = run(tmp_path / "grid", [0.01])
    untied = tmp_path / "grid-after"
    untied.mkdir()
    rows = trials(first, (1, 1, 0, 0.2))
    assert bench.joint_truth(advise, [(first, rows), (untied, rows)]) is None  # a run without launches
    assert bench.joint_truth(first, [(first, rows)]) is None  # one pass: the earlier protocol
