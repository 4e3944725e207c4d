"""End to end through the launcher: the loss falls, bad data is skipped, bad configs stop early."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from launch import CONFIGS, check_ok, metrics, run_trainer, write_config

pytestmark = pytest.mark.dist


def test_loss_falls_and_unreadable_images_are_skipped(tiny_model, synth_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(synth_data, data)
    (data / "000000.png").write_bytes(b"")
    (data / "000001.png").write_bytes((data / "000001.png").read_bytes()[:100])
    (data / "000002.png").write_text("not an image")
    config = json.loads((CONFIGS / "zero2_bf16.json").read_text())
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "monitor"), "job_name": "t"}
    cfg = write_config(tmp_path / "ds.json", config)
    out = tmp_path / "run"
    proc = run_trainer(
        cfg,
        tiny_model,
        data,
        out,
        "--lr",
        "1e-3",
        "--lr-scaling",
        "sqrt",
        "--lr-reference-batch",
        "4",
        steps=24,
    )
    check_ok(proc)
    rows = metrics(out)
    assert len(rows) == 24
    first, last = (sum(r["loss"] for r in rows[i : i + 4]) / 4 for i in (0, 20))
    assert last < 0.85 * first, (first, last)
    # 61 readable images, global batch 8: 7 steps per epoch, so 24 steps cross three epoch boundaries.
    assert [r["epoch"] for r in rows[6:8]] == [0, 1] and rows[-1]["epoch"] == 3
    assert "61 images (3 unreadable skipped)" in proc.stderr + proc.stdout
    assert rows[0]["lr"] == pytest.approx(1e-3 * 2**0.5)  # sqrt(global 8 / reference 4)
    environment = json.loads((out / "environment.json").read_text())
    assert environment["world_size"] == 2 and environment["versions"]["deepspeed"]
    # DeepSpeed's own monitor section works as documented: its lr events, plus the loss we add.
    written = {p.name for p in (tmp_path / "monitor").rglob("*.csv")}
    assert {"Train_Samples_lr.csv", "Train_Samples_train_loss.csv"} <= written, written


def test_inconsistent_batch_stops_before_any_process_group(tiny_model, synth_data, tmp_path):
    config = json.loads((CONFIGS / "zero2_bf16.json").read_text())
    config["train_batch_size"] = 64  # 4 x 1 x 2 ranks = 8
    cfg = write_config(tmp_path / "ds.json", config)
    start = time.monotonic()
    proc = run_trainer(cfg, tiny_model, synth_data, tmp_path / "run", timeout=300)
    assert proc.returncode != 0
    assert (
        "train_batch_size 64 != micro-batch 4 x gradient_accumulation_steps 1 x world size 2 (= 8)"
        in proc.stderr
    )
    assert proc.stderr.count("sdzero: error:") == 1  # one line, from rank 0 only
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing written
    assert time.monotonic() - start < 120  # it stopped at validation, not at a collective timeout


def test_data_smaller_than_one_global_batch(tiny_model, tmp_path):
    from sdzero.models.tiny import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "few", images=5)
    proc = run_trainer(CONFIGS / "zero2_bf16.json", tiny_model, data, tmp_path / "run")
    assert proc.returncode != 0
    assert "5 readable images, fewer than one global batch of 8" in proc.stderr
