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


def test_a_config_clearly_slower_per_sample_stops_and_the_launch_ends_with_its_leader(
    tiny_model: Path, synth_data: Path, tmp_path: Path
) -> None:
    base = json.loads((REPO_ROOT / "ds_configs" / "zero2_bf16.json").read_text())
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(trial_ds_config(base, TrialSpec(2, "bf16", 1, "none", 2))))
    args = trainer_args(
        config,
        tiny_model,
        synth_data,
        tmp_path / "run",
        1000,
        "--profile-out",
        str(tmp_path / "profile.json"),
        "--profile-warmup-steps",
        "1",
        "--profile-configs",
        "1:1,8:1",
        "--profile-min-steps",
        "4",
        "--profile-max-seconds",
        str(MEASURE_S),
        "--profile-race",
    )
    proc = subprocess.run(one_host_command(args, 2), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    launch = json.loads((tmp_path / "profile.json").read_text())["launch"]
    assert set(launch["raced"]) == {"mb1-ga1"}
    assert "slower per sample than mb8-ga1" in launch["raced"]["mb1-ga1"]
    # the race decided the launch: it ended with its measuring time mostly unspent
    assert launch["seconds"]["timed"] < MEASURE_S / 2
    profile = json.loads((tmp_path / "profile.json").read_text())["configs"]
    assert profile["mb1-ga1"]["measured_steps"] >= 4  # what it measured before it left is kept
