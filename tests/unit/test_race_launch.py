"""The advisor's launches race their configs (issue #53, item 3): advise asks the sweep for it, and what a
launch raced out is said in its progress line, its trials' notes and launches.json."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from advisor.measure.launch import LaunchRecord, LaunchRunner
from advisor.measure.trials import TrialOutcome, TrialSettings, sweep_args
from advisor.stages.inputs import _trial_settings
from sdzero.config.train_config import parse_train_args
from sdzero.constants import GIB


def test_advise_launches_race_and_profile_launches_do_not(tiny_model, synth_data):
    settings = _trial_settings(str(tiny_model), synth_data, True, ())
    assert settings.race
    args = sweep_args(settings)
    assert "--profile-race" in args
    plain = TrialSettings("model", Path("data"), 5, 1, 900.0, None, sweep="1:1")
    assert "--profile-race" not in sweep_args(plain)


def test_a_racing_launch_is_told_the_memory_cap_and_the_target_half_width(tiny_model, synth_data, tmp_path):
    """advise's launch passes the plan's usable memory per rank (the race's leader must fit it) and the
    trials' target half-width (what the race's saved time measures the configs left to)."""
    settings = replace(
        _trial_settings(str(tiny_model), synth_data, True, ()), race_memory_cap_bytes=1.5 * GIB
    )
    args = sweep_args(settings)
    assert args[args.index("--profile-memory-cap-gib") + 1] == "1.5"
    assert float(args[args.index("--profile-target-halfwidth") + 1]) == settings.target_rel_halfwidth
    (tmp_path / "d").mkdir()
    where = [
        "--model",
        str(tmp_path / "m"),
        "--data",
        str(tmp_path / "d"),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    cfg = parse_train_args(["--deepspeed-config", "c.json", *where, *args])  # the trainer takes them
    assert cfg.profile_memory_cap_gib == 1.5 and cfg.profile_race


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


def test_a_launch_line_says_a_config_left_for_its_memory_was_not_slower(tmp_path: Path):
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
        raced={
            "mb8-ga1": "round 2: over the memory cap (it cannot be the pick; mb4-ga1-gc leads those that fit)"
        },
    )
    outcome = TrialOutcome("ok", "", None, 40.0, 0, tmp_path / "log")
    line = LaunchRunner._line(None, record, outcome)  # type: ignore[arg-type]
    assert line.endswith("; left the race over the memory cap: mb8-ga1")
    assert "slower" not in line
