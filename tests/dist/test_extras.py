"""The extras `sdzero[tensorboard]`, `[wandb]` and `[parquet]`, in one real 2-rank run: metadata.parquet
trains like metadata.jsonl, and DeepSpeed's tensorboard and wandb (offline) sections record sdzero's own
scalars, the same losses metrics.jsonl holds."""

from __future__ import annotations

import json
import shutil

import pytest
from launch import CONFIGS, check_ok, metrics, run_trainer, write_config

from sdzero.data import read_metadata

pytestmark = pytest.mark.dist

STEPS = 3
LOSS_TAG = "Train/Samples/train_loss"


def test_parquet_metadata_reads_like_jsonl(synth_data, tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow", reason="pip install 'sdzero[parquet]'")
    data = tmp_path / "data"
    shutil.copytree(synth_data, data)
    pd.read_json(data / "metadata.jsonl", lines=True, dtype=False).to_parquet(data / "metadata.parquet")
    (data / "metadata.jsonl").unlink()
    from_parquet = [(r.path.relative_to(data), r.text) for r in read_metadata(data)]
    assert from_parquet == [(r.path.relative_to(synth_data), r.text) for r in read_metadata(synth_data)]
    assert len(from_parquet) == 64


def test_tensorboard_and_wandb_record_sdzero_scalars_from_parquet_data(
    tiny_model, synth_data, tmp_path, monkeypatch
):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow", reason="pip install 'sdzero[parquet]'")
    pytest.importorskip("tensorboard", reason="pip install 'sdzero[tensorboard]'")
    pytest.importorskip("wandb", reason="pip install 'sdzero[wandb]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = tmp_path / "data"
    shutil.copytree(synth_data, data)
    pd.read_json(data / "metadata.jsonl", lines=True, dtype=False).to_parquet(data / "metadata.parquet")
    (data / "metadata.jsonl").unlink()
    config = json.loads((CONFIGS / "zero2_bf16.json").read_text())
    config["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "t"}
    config["wandb"] = {"enabled": True, "project": "sdzero-test"}
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: the run stays on disk
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    proc = run_trainer(write_config(tmp_path / "ds.json", config), tiny_model, data, out, steps=STEPS)
    check_ok(proc)
    losses = [r["loss"] for r in metrics(out)]
    assert len(losses) == STEPS

    events = EventAccumulator(str(tmp_path / "tb" / "t")).Reload()  # output_path/job_name
    scalars = [e.value for e in events.Scalars(LOSS_TAG)]
    assert scalars == pytest.approx(losses, rel=1e-6), events.Tags()["scalars"]

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # rank 0 only
    summary = json.loads((runs[0] / "files" / "wandb-summary.json").read_text())
    assert summary[LOSS_TAG] == pytest.approx(losses[-1], rel=1e-6)
