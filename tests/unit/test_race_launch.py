"""The advisor's launches race their configs (issue #53, item 3): advise asks the sweep for it, and what a
launch raced out is said in its progress line, its trials' notes and launches.json."""

from __future__ import annotations

from pathlib import Path

from advisor.measure.launch import LaunchRecord, LaunchRunner
from advisor.measure.trials import TrialOutcome, TrialSettings, sweep_args
from advisor.stages.inputs import _trial_settings


def test_advise_launches_race_and_profile_launches_do_not(tiny_model, synth_data):
    settings = _trial_settings(str(tiny_model), synth_data, True, ())
    assert settings.race
    args = sweep_args(settings)
    assert "--profile-race" in args
    plain = TrialSettings("model", Path("data"), 5, 1, 900.0, None, sweep="1:1")
    assert "--profile-race" not in sweep_args(plain)


def test_a_launch_line_names_the_configs_it_raced_out(tmp_path: Path):
    record = LaunchRecord(
        "z2-bf16-off-none-r2",
        str(tmp_path),
        ["a", "b"],
        "ok",
        40.0,
        10.0,
        28.0,
        20.0,
        60,
        0.01,
        0.0,
        raced={"mb1-ga1": "round 4: slower per sample than mb8-ga1 (...)"},
    )
    outcome = TrialOutcome("ok", "", None, 40.0, 0, tmp_path / "log")
    line = LaunchRunner._line(None, record, outcome)  # type: ignore[arg-type]
    assert line.endswith("; raced out: mb1-ga1 (slower per sample than the launch's leader)")
