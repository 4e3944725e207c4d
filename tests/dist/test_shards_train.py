"""Tar shards through the real launcher, 2 ranks x 2 loader workers: the shards train exactly as the loose
folder they were made from (same samples, order and noise: same losses), a mid-epoch resume over the
shards repeats the uninterrupted losses, and `sdzero cache` builds from shards a cache that training over
the same shards takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ckpt_helpers import TORCH_ADAMW
from launch import check_ok, fp32_config, metrics, run_trainer, write_config

from sdzero.checkpoint import checkpointer as ck
from sdzero.data.shard_writer import write_shards

pytestmark = pytest.mark.dist

WORKERS = ("--num-workers", "2")


@pytest.fixture(scope="module")
def runs(tiny_model, synth_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("shard_runs")
    write_shards(synth_data, root / "shards", max_count=16)  # 64 images: 4 shards
    pattern = str(root / "shards" / "{000000..000003}.tar")
    # micro 4 x 2 ranks: 8 steps per epoch; 4 steps end mid-epoch, the checkpoint at 2 is mid-epoch too
    config = write_config(root / "ds.json", fp32_config(2, micro=4, optimizer=TORCH_ADAMW))
    loose = run_trainer(config, tiny_model, synth_data, root / "loose", *WORKERS, steps=4)
    sharded = run_trainer(
        config, tiny_model, pattern, root / "sharded", *WORKERS, "--checkpoint-every", "2", steps=4
    )
    check_ok(sharded)
    step2 = ck.checkpoint_root(root / "sharded") / ck.step_tag(2)
    resumed = run_trainer(
        config, tiny_model, pattern, root / "resumed", *WORKERS, "--resume", str(step2), steps=4
    )
    build = subprocess.run(
        [sys.executable, "-m", "sdzero.cli", "cache", "--model", str(tiny_model), "--data", pattern]
        + ["--out", str(root / "cache"), "--dtype", "fp32", "--shard-size", "16"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    cached = run_trainer(
        config, tiny_model, pattern, root / "cached", "--cache-dir", str(root / "cache"), steps=2
    )
    return {
        "root": root,
        "loose": loose,
        "sharded": sharded,
        "resumed": resumed,
        "build": build,
        "cached": cached,
    }


def losses(out):
    return [(r["step"], r["loss"]) for r in metrics(out)]


def test_shards_train_as_the_folder_they_were_made_from(runs):
    check_ok(runs["loose"])
    assert losses(runs["root"] / "sharded") == losses(runs["root"] / "loose")
    assert "64 images" in runs["sharded"].stderr + runs["sharded"].stdout


def test_a_mid_epoch_resume_over_shards_repeats_the_uninterrupted_losses(runs):
    check_ok(runs["resumed"])
    assert losses(runs["root"] / "resumed") == losses(runs["root"] / "sharded")[2:]


def test_sdzero_cache_builds_from_shards_and_training_takes_it(runs):
    assert runs["build"].returncode == 0, runs["build"].stderr[-3000:]
    index = json.loads((runs["root"] / "cache" / "cache.json").read_text())
    assert len(index["samples"]) == 64 and index["samples"][0]["file_name"] == "000000.tar#000000000"
    check_ok(runs["cached"])
    assert "from cache" in runs["cached"].stderr + runs["cached"].stdout
    online = losses(runs["root"] / "sharded")[:2]
    for (step, a), (step_c, b) in zip(online, losses(runs["root"] / "cached"), strict=True):
        assert step == step_c and b == pytest.approx(a, rel=1e-5)
