"""Gradient checkpointing measured as a config of the sweep (issue #53): one launch of ZeRO-2 bf16 measures
micro-batch 2 with and without recomputation, switched on the built network between configs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from launch import trainer_args

from advisor.measure.grid import TrialSpec, trial_ds_config
from sdzero.cluster.launch_command import REPO_ROOT, one_host_command

pytestmark = pytest.mark.dist


def test_checkpointing_is_switched_between_configs_of_one_launch(
    tiny_model: Path, synth_data: Path, tmp_path: Path
) -> None:
    base = json.loads((REPO_ROOT / "ds_configs" / "zero2_bf16.json").read_text())
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(trial_ds_config(base, TrialSpec(2, "bf16", 2, "none", 2))))
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
        "2:1,2:1:gc",
        "--profile-min-steps",
        "3",
        "--profile-max-seconds",
        "2",
    )
    proc = subprocess.run(one_host_command(args, 2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    profile = json.loads((tmp_path / "profile.json").read_text())
    plain, recomputed = profile["configs"]["mb2-ga1"], profile["configs"]["mb2-ga1-gc"]
    assert (plain["checkpointing"], recomputed["checkpointing"]) == (False, True)
    # one launch, interleaved: both configs in every round after the first
    medians = profile["launch"]["round_medians_s"]
    assert len(medians["mb2-ga1"]) >= 1 and len(medians["mb2-ga1-gc"]) >= 1
    # recomputation keeps only the checkpointed blocks' inputs for the backward: fewer saved bytes
    saved = [c["ranks"][0]["activation_bytes"] for c in (plain, recomputed)]
    assert 0 < saved[1] < saved[0]
    # and the same model states (checkpointing changes no ZeRO partition)
    assert plain["ranks"][0]["model_state_bytes"] == recomputed["ranks"][0]["model_state_bytes"]
