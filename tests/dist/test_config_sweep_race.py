"""A launch that races its configs (issue #53, item 3): `--profile-race` on a real 2-rank ZeRO-2 launch.
Micro-batches 1 and 8 at accumulation 1 (the once-per-step costs spread over 8x the samples): the first
is clearly slower per sample, leaves the rounds once its interval lies below the leader's, and the launch
ends then, long before its measuring time."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from launch import trainer_args

from advisor.measure.grid import TrialSpec, trial_ds_config
from sdzero.cluster.launch_command import REPO_ROOT, one_host_command

pytestmark = pytest.mark.dist

MEASURE_S = 120.0


def _launch(tiny_model: Path, synth_data: Path, folder: Path, *extra: str) -> dict:
    base = json.loads((REPO_ROOT / "ds_configs" / "zero2_bf16.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "ds.json"
    config.write_text(json.dumps(trial_ds_config(base, TrialSpec(2, "bf16", 1, "none", 2))))
    args = trainer_args(
        config,
        tiny_model,
        synth_data,
        folder / "run",
        1000,
        "--profile-out",
        str(folder / "profile.json"),
        "--profile-warmup-steps",
        "1",
        "--profile-configs",
        "1:1,8:1",
        "--profile-min-steps",
        "4",
        "--profile-max-seconds",
        str(MEASURE_S),
        "--profile-race",
        *extra,
    )
    proc = subprocess.run(one_host_command(args, 2), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((folder / "profile.json").read_text())


@pytest.fixture(scope="module")
def raced(tiny_model: Path, synth_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _launch(tiny_model, synth_data, tmp_path_factory.mktemp("raced"))


def test_a_config_clearly_slower_per_sample_stops_and_the_launch_ends_with_its_leader(raced: dict) -> None:
    launch = raced["launch"]
    assert set(launch["raced"]) == {"mb1-ga1"}
    assert "slower per sample than mb8-ga1" in launch["raced"]["mb1-ga1"]
    # the race decided the launch: it ended with its measuring time mostly unspent
    assert launch["seconds"]["timed"] < MEASURE_S / 2
    assert raced["configs"]["mb1-ga1"]["measured_steps"] >= 4  # what it measured before it left is kept


def test_a_faster_config_over_the_memory_cap_does_not_race_out_one_that_fits(
    raced: dict, tiny_model: Path, synth_data: Path, tmp_path: Path
) -> None:
    """The cap between the two configs' measured device peaks: micro-batch 8, faster per sample, cannot be
    the pick; it leaves the race for its memory and micro-batch 1, which fits, leads and stays measured."""
    peaks = {key: raced["configs"][key]["device_peak_bytes"] for key in ("mb1-ga1", "mb8-ga1")}
    assert peaks["mb1-ga1"] < peaks["mb8-ga1"]
    cap_gib = (peaks["mb1-ga1"] * peaks["mb8-ga1"]) ** 0.5 / 2**30
    capped = _launch(tiny_model, synth_data, tmp_path, "--profile-memory-cap-gib", f"{cap_gib:.9g}")
    launch = capped["launch"]
    assert launch["over_cap"] == ["mb8-ga1"]
    assert set(launch["raced"]) == {"mb8-ga1"}
    assert "over the memory cap" in launch["raced"]["mb8-ga1"]
    assert capped["configs"]["mb1-ga1"]["measured_steps"] >= capped["configs"]["mb8-ga1"]["measured_steps"]
