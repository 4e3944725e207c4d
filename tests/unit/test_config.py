"""Run options and DeepSpeed JSON validation: every bad input gets one clear, actionable message."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launch import CONFIGS

from sdzero.config.lr_rule import choose_lr
from sdzero.config.train_config import TrainConfig, load_ds_config, parse_train_args
from sdzero.errors import UserError


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_parse_here_and_in_deepspeed(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = load_ds_config(path, world_size=8)
    name = path.stem
    assert ds.zero_stage == int(name[4])
    assert ds.dtype == ("fp16" if "fp16" in name else "bf16")
    assert ds.offload_optimizer == ("offload" in name)
    assert ds.offload_param == ("zero3_offload" in name)
    assert ds.global_batch == ds.micro_batch * ds.grad_accum * 8
    raw = json.loads(path.read_text())
    assert "auto" not in json.dumps(raw)
    if ds.dtype == "fp16":
        assert raw["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    # DeepSpeed's own parser (world size 1 without a process group) agrees on the batch and the stage.
    parsed = DeepSpeedConfig(dict(raw, train_batch_size=ds.micro_batch * ds.grad_accum))
    assert parsed.zero_optimization_stage == ds.zero_stage
    assert parsed.gradient_accumulation_steps == ds.grad_accum


def test_batch_triple_mismatch_is_explained(tmp_path):
    path = write(
        tmp_path,
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
    )
    with pytest.raises(UserError) as err:
        load_ds_config(path, world_size=2)
    msg = str(err.value)
    assert "train_batch_size 32" in msg and "(= 16)" in msg and "set train_batch_size to 16" in msg


def test_batch_triple_derivations(tmp_path):
    ds = load_ds_config(write(tmp_path, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}), 2)
    assert (ds.micro_batch, ds.grad_accum) == (4, 4)
    ds = load_ds_config(write(tmp_path, {"train_batch_size": 32, "gradient_accumulation_steps": 2}), 4)
    assert (ds.micro_batch, ds.grad_accum) == (4, 2)
    with pytest.raises(UserError, match="not divisible"):
        load_ds_config(write(tmp_path, {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}), 2)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"train_micro_batch_size_per_gpu": "auto"}, "accelerate"),
        ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"reduce_bucket_size": "auto"}}, "auto"),
        ({"train_micro_batch_size_per_gpu": 0}, "positive integer"),
        ({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both"),
        ({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 4}}, "stage"),
        ({"gradient_accumulation_steps": 2}, "train_micro_batch_size_per_gpu"),
    ],
)
def test_inconsistent_configs_are_refused(tmp_path, config, fragment):
    with pytest.raises(UserError, match=fragment):
        load_ds_config(write(tmp_path, config), world_size=2)


def test_missing_and_broken_config_files(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_ds_config(tmp_path / "nope.json", 1)
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_micro_batch_size_per_gpu": 2,')
    with pytest.raises(UserError, match="not valid JSON"):
        load_ds_config(broken, 1)


def test_lr_scaling_rules():
    assert choose_lr(1e-4, 64, 8, "none").lr == 1e-4
    assert choose_lr(1e-4, 32, 8, "linear").lr == pytest.approx(4e-4)
    assert choose_lr(1e-4, 64, 8, "sqrt").lr == pytest.approx(1e-4 * math.sqrt(8))


def test_effective_lr_uses_json_lr_and_its_own_batch_as_reference(tmp_path):
    cfg_path = write(
        tmp_path,
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
        },
    )
    ds = load_ds_config(cfg_path, world_size=4)
    data = tmp_path / "data"
    data.mkdir()
    base = dict(deepspeed_config=cfg_path, model="hub/id", data=data, output_dir=tmp_path / "o")
    assert TrainConfig(**base).effective_lr(ds) == pytest.approx(2e-4)
    # the JSON's own batch is the reference: run as written, its LR is kept whatever the rule
    assert TrainConfig(**base, lr_scaling="linear").effective_lr(ds) == pytest.approx(2e-4)
    halved = TrainConfig(**base, lr_scaling="linear", lr_reference_batch=16)
    assert halved.effective_lr(ds) == pytest.approx(4e-4)
    assert TrainConfig(**base, lr=1e-4, lr_scaling="sqrt", lr_reference_batch=32).effective_lr(ds) == (
        pytest.approx(1e-4)
    )


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--max-steps", "0"], "--max-steps"),
        (["--resolution", "30"], "multiple of 8"),
        (["--lr", "5"], "--lr"),
        (["--snr-gamma", "-1"], "--snr-gamma"),
        (["--max-bad-fraction", "0"], "--max-bad-fraction"),
    ],
)
def test_nonsense_values_are_refused(tmp_path, flags, fragment):
    base = ["--deepspeed_config", "x.json", "--model", "m", "--data", str(tmp_path), "--output-dir", "o"]
    with pytest.raises(UserError, match=fragment):
        parse_train_args(base + flags)


def test_missing_data_and_non_pipeline_model_folder(tmp_path):
    with pytest.raises(UserError, match="--data"):
        parse_train_args(
            ["--deepspeed_config", "x", "--model", "m", "--data", str(tmp_path / "no"), "--output-dir", "o"]
        )
    with pytest.raises(UserError, match="model_index.json"):
        parse_train_args(
            [
                "--deepspeed_config",
                "x",
                "--model",
                str(tmp_path),
                "--data",
                str(tmp_path),
                "--output-dir",
                "o",
            ]
        )


def test_unknown_flag_exits_2_with_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_train_args(
            [
                "--deepspeed_config",
                "x",
                "--model",
                "m",
                "--data",
                ".",
                "--output-dir",
                "o",
                "--zero-stage",
                "3",
            ]
        )
    assert exc.value.code == 2
    assert "unrecognized arguments: --zero-stage" in capsys.readouterr().err
