"""Caches and buckets through the real launcher, 2 ranks: a cache built by both ranks, training from it gives
the online loss without loading the frozen parts, a mismatched cache is refused, and a bucketed run trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import TORCH_ADAMW
from launch import check_ok, fp32_config, metrics, run_trainer, write_config
from PIL import Image

from sdzero.checkpoint import checkpointer as ck
from sdzero.data.buckets import assign_buckets, bucket_sizes, dropped_per_epoch, image_sizes

pytestmark = pytest.mark.dist

STEPS = 2


@pytest.fixture(scope="module")
def runs(tiny_model, synth_data, tmp_path_factory):
    """One cache build and the two runs the assertions compare, launched once for the module."""
    root = tmp_path_factory.mktemp("cache_runs")
    cache = root / "cache"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdzero.cli",
            "cache",
            "--model",
            str(tiny_model),
            "--data",
            str(synth_data),
            "--out",
            str(cache),
            "--dtype",
            "fp32",
            "--shard-size",
            "8",
            "--num-gpus",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    config = write_config(root / "ds.json", fp32_config(2))
    profile = ["--profile-warmup-steps", "1"]
    online = run_trainer(
        config,
        tiny_model,
        synth_data,
        root / "online",
        "--profile-out",
        str(root / "online.json"),
        *profile,
        steps=STEPS,
    )
    cached = run_trainer(
        config,
        tiny_model,
        synth_data,
        root / "cached",
        "--cache-dir",
        str(cache),
        "--profile-out",
        str(root / "cached.json"),
        *profile,
        steps=STEPS,
    )
    return {
        "root": root,
        "cache": cache,
        "config": config,
        "build": build,
        "online": online,
        "cached": cached,
    }


def test_cache_build_is_split_over_both_ranks(runs):
    index = json.loads((runs["cache"] / "cache.json").read_text())
    assert len(index["samples"]) == 64 and len(index["shards"]) == 8
    assert [s["first"] for s in index["shards"]] == list(range(0, 64, 8))
    assert [s["rank"] for s in index["shards"]] == [0, 1] * 4  # shard k by rank k % 2
    assert all((runs["cache"] / s["file"]).stat().st_size == s["bytes"] for s in index["shards"])


def test_training_from_the_cache_gives_the_online_loss(runs):
    check_ok(runs["online"])
    check_ok(runs["cached"])
    online, cached = metrics(runs["root"] / "online"), metrics(runs["root"] / "cached")
    assert len(online) == len(cached) == STEPS
    # fp32, same seed, no flip, center crop: the only difference is the VAE/text encoder batch
    # composition (the cache encoded 16 per call, online 4): agreement to 1e-5 relative.
    for a, b in zip(online, cached, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert "from cache" in runs["cached"].stderr + runs["cached"].stdout


def test_training_from_the_cache_loads_no_frozen_part(runs):
    online = json.loads((runs["root"] / "online.json").read_text())
    cached = json.loads((runs["root"] / "cached.json").read_text())
    assert all(r["frozen_bytes"] > 0 for r in online["ranks"])  # VAE + text encoder on every rank
    assert all(r["frozen_bytes"] == 0 for r in cached["ranks"])  # none at all from the cache


def test_mismatched_cache_is_refused(runs, tiny_model, synth_data):
    proc = run_trainer(
        runs["config"],
        tiny_model,
        synth_data,
        runs["root"] / "bad",
        "--cache-dir",
        str(runs["cache"]),
        "--resolution",
        "48",
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "does not match this run: resolution 32 vs 48" in proc.stderr
    assert proc.stderr.count("sdzero: error:") == 1 and "Traceback" not in proc.stderr
    assert not (runs["root"] / "bad").exists()  # refused before anything was written


def write_mixed_aspect_data(folder: Path, n: int = 40) -> Path:
    """Wide, square and tall images in uneven numbers, so buckets get remainders."""
    folder.mkdir()
    shapes = [(64, 40)] * 3 + [(48, 48)] * 2 + [(40, 64)] * 1  # (width, height)
    lines = []
    for i in range(n):
        w, h = shapes[i % len(shapes)]
        Image.new("RGB", (w, h), ((37 * i) % 255, 120, 200)).save(folder / f"{i:03d}.png")
        lines.append(json.dumps({"file_name": f"{i:03d}.png", "text": "a red circle on a blue background"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_bucketed_two_rank_run_and_exact_mid_epoch_resume(tiny_model, tmp_path):
    data = write_mixed_aspect_data(tmp_path / "data")
    stage = 2
    ds = fp32_config(stage, micro=2, accum=2, optimizer=TORCH_ADAMW)  # bit-exact resume (see ckpt_helpers)
    config = write_config(tmp_path / "ds.json", ds)
    bucket_args = ("--buckets", "--random-flip", "--checkpoint-every", "2")
    ref = tmp_path / "ref"
    proc = run_trainer(config, tiny_model, data, ref, *bucket_args, steps=4)
    check_ok(proc)
    rows = metrics(ref)
    assert len(rows) == 4 and all(r["loss"] > 0 for r in rows)
    # 21 wide, 13 square, 6 tall; global batch 8 -> 5 + 5 + 6 left out per epoch (3 steps per epoch).
    sizes = bucket_sizes(32, 4)
    bucket_of = assign_buckets(image_sizes(sorted(data.glob("*.png"))), sizes)
    expected = dropped_per_epoch(bucket_of, len(sizes), 8)
    assert expected == 16
    assert [r["epoch"] for r in rows] == [0, 0, 0, 1]
    run_config = json.loads((ref / "run_config.json").read_text())
    assert run_config["samples_dropped_per_epoch"] == expected and run_config["buckets"] is True
    log = proc.stderr + proc.stdout
    assert f"{expected} samples per epoch left out by the batch shape" in log
    assert "aspect-ratio buckets (height x width: images): " in log
    # Resumed from the step-2 checkpoint (mid-epoch: 4 of this rank's 6 micro-batches) into a new folder,
    # as a preempted run would be: steps 3 and 4 (across the epoch boundary) repeat the same losses.
    out = tmp_path / "resumed"
    step2 = ck.checkpoint_root(ref) / ck.step_tag(2)
    check_ok(run_trainer(config, tiny_model, data, out, *bucket_args, "--resume", str(step2), steps=4))
    assert [(r["step"], r["loss"]) for r in metrics(out)] == [(r["step"], r["loss"]) for r in rows[2:]]
