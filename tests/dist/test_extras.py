"""The extras `sdzero[tensorboard]`, `[wandb]` and `[parquet]`, in one real 2-rank run: metadata.parquet
trains like metadata.jsonl, and DeepSpeed's tensorboard and wandb (offline) sections record sdzero's own
scalars, the same losses metrics.jsonl holds."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from launch import CONFIGS, check_ok, metrics, run_trainer, write_config

from sdzero.data.images import read_metadata

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

    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0 only
    records = wandb_records(runs[0])
    logged = [
        json.loads(i.value_json)
        for r in records
        if r.HasField("history")
        for i in r.history.item
        if i.key == LOSS_TAG or "/".join(i.nested_key) == LOSS_TAG
    ]
    assert logged == pytest.approx(losses, rel=1e-6)
    assert any(r.HasField("exit") and r.exit.exit_code == 0 for r in records)  # the run was finished


def wandb_records(path):
    """The records of an offline run file: W&B writes LevelDB's log format (32 KiB blocks; each record a
    crc32/length/type header and a protobuf `Record`, split as FIRST/MIDDLE/LAST across blocks)."""
    from wandb.proto.wandb_internal_pb2 import Record

    raw, block, header = path.read_bytes(), 32768, 7
    assert raw[:4] == b":W&B", raw[:8]
    records, pos, pending = [], header, b""
    while pos + header <= len(raw):
        if block - pos % block < header:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + header])
        data = raw[pos + header : pos + header + length]
        pos += header + length
        if kind == 0:
            break
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):  # FULL or LAST: one whole record
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
    return records
