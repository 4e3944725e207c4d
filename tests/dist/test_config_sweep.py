"""One launch, several configs: `--profile-configs` for real, 2 ranks through the deepspeed launcher.

One launch of ZeRO-2 bf16 measures micro-batches 1, 2, 4 and 8 and micro-batch 2 at accumulation 2 in
interleaved rounds, with micro-batch 4 made to run out of memory (a test fault): the launch goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from launch import trainer_args
from support.fault_callbacks import OOM_FROM, fault_env

from advisor.measure.grid import TrialSpec, trial_ds_config
from sdzero.cluster.launch_command import REPO_ROOT, one_host_command

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def swept(tiny_model: Path, synth_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("sweep")
    base = json.loads((REPO_ROOT / "ds_configs" / "zero2_bf16.json").read_text())
    config = out / "ds.json"
    config.write_text(json.dumps(trial_ds_config(base, TrialSpec(2, "bf16", 1, "none", 2))))
    args = trainer_args(
        config,
        tiny_model,
        synth_data,
        out / "run",
        1000,
        "--profile-out",
        str(out / "profile.json"),
        "--profile-warmup-steps",
        "1",
        "--profile-configs",
        "1:1,2:1,4:1,8:1,2:2",
        "--profile-min-steps",
        "4",
        "--profile-max-seconds",
        "3",
    )
    env = {**os.environ, **fault_env({OOM_FROM: "4"})}
    proc = subprocess.run(one_host_command(args, 2), capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "profile.json").read_text()), (out / "run" / "metrics.jsonl").read_text()


def test_every_config_that_fits_is_measured_in_interleaved_rounds(swept: tuple[dict, str]) -> None:
    profile, _ = swept
    configs = profile["configs"]
    assert set(configs) == {"mb1-ga1", "mb2-ga1", "mb2-ga2"}
    launch = profile["launch"]
    assert launch["rounds"] >= 2
    for key, config in configs.items():
        mb, ga = (int(p[2:]) for p in key.split("-"))
        assert (config["micro_batch"], config["grad_accum"], config["world_size"]) == (mb, ga, 2)
        assert config["global_batch"] == mb * ga * 2
        assert config["measured_steps"] >= 4 and len(config["step_times_s"]) == config["measured_steps"]
        # every round measured every config: their medians are spread over the whole launch
        # every round but the first (warm-up) and perhaps the last (the time ran out mid-round)
        assert launch["rounds"] - 2 <= len(launch["round_medians_s"][key]) <= launch["rounds"] - 1
        assert config["comm"]["ops"], "the instrumented step logged the collectives"
        assert config["ranks"][0]["activation_bytes"] > 0
    assert (
        configs["mb2-ga1"]["ranks"][0]["activation_bytes"]
        > configs["mb1-ga1"]["ranks"][0]["activation_bytes"]
    )
    # accumulation 2 runs two micro-steps a step
    assert configs["mb2-ga2"]["step_time_median_s"] > configs["mb2-ga1"]["step_time_median_s"]
    assert len(launch["tie_s"]) == launch["rounds"]


def test_the_launch_measures_one_loader_worker_and_the_storage(swept: tuple[dict, str]) -> None:
    measured = swept[0]["input"]
    assert measured["kind"] == "images" and measured["workers_per_rank"] == 1 and measured["local_ranks"] == 2
    assert measured["worker"]["samples"] >= 4 and measured["worker"]["samples_per_s"] > 0
    assert measured["rank_cpu_s_per_sample"] > 0  # the rank's own CPU in its timed steps
    assert 0 <= measured["loader_wait_share"] < 1
    storage = measured["storage"]
    assert storage["readers"] == 2 and storage["files"] >= 2 and storage["bytes_per_s"] > 0
    assert storage["bytes_per_file"] == pytest.approx(storage["bytes_per_s"] / storage["files_per_s"])


def test_a_config_out_of_memory_ends_itself_and_the_larger_ones_not_the_launch(
    swept: tuple[dict, str],
) -> None:
    profile, _ = swept
    oom = profile["launch"]["oom"]
    assert set(oom) == {"mb4-ga1", "mb8-ga1"}
    assert "out of memory" in oom["mb4-ga1"] and "above mb4-ga1" in oom["mb8-ga1"]


def test_only_the_instrumented_steps_carry_deepspeeds_instruments(swept: tuple[dict, str]) -> None:
    """Timed steps run with comms_logger and the wall-clock timers off; each config's one instrumented
    step has them (its DeepSpeed breakdown and collectives are in the profile)."""
    profile, _ = swept
    seconds = profile["launch"]["seconds"]
    assert seconds["timed"] > seconds["instrumented"] > 0
    for config in profile["configs"].values():
        assert config["ds_breakdown_s"]["bwd"] > 0
