"""LoRA's options, its adapters on each family's network, and the check that refuses an empty or partial
adapter before it is written (sdzero.models.lora, sdzero.checkpoint.adapter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sdzero.errors import EXIT_USER_ERROR, AgreedError
from sdzero.models.families import detect_family
from sdzero.models.lora import (
    LORA_WEIGHTS,
    LoraSettings,
    adapter_problem,
    adapter_state,
    add_lora,
    expected_adapter,
    write_lora,
)

BAD_OPTIONS = {
    "rank zero": (["--lora-rank", "0"], "--lora-rank must be an integer in [1,"),
    "rank negative": (["--lora-rank", "-4"], "--lora-rank must be an integer in [1,"),
    "alpha zero": (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be positive"),
    "dropout one": (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    "alpha without rank": (["--lora-alpha", "8"], "--lora-alpha: LoRA options without --lora-rank"),
    "comma-separated targets": (
        ["--lora-rank", "4", "--lora-target-modules", "to_q,to_k"],
        "--lora-target-modules",
    ),
    "merged without the export": (["--lora-rank", "4", "--export-merged"], "--export-merged writes into"),
    "unknown target": (
        ["--lora-rank", "4", "--lora-target-modules", "to_q", "to_qq"],
        "--lora-target-modules: to_qq matches no Linear/Conv layer",
    ),
}


@pytest.fixture
def launched(monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)


@pytest.mark.parametrize("case", list(BAD_OPTIONS), ids=list(BAD_OPTIONS))
def test_bad_lora_options_are_one_line_and_exit_2(case, tmp_path, tiny_model, launched, capsys):
    from launch import CONFIGS

    from sdzero.train import main

    extra, fragment = BAD_OPTIONS[case]
    (tmp_path / "data").mkdir()
    out = tmp_path / "run"
    argv = ["--deepspeed_config", str(CONFIGS / "zero2_bf16.json"), "--model", str(tiny_model)]
    code = main([*argv, "--data", str(tmp_path / "data"), "--output-dir", str(out), *extra])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR
    assert err.startswith("sdzero: error:") and "\n" not in err, err
    assert fragment in err, err
    assert not out.exists()


def settings(rank: int = 4, targets: tuple[str, ...] = (), alpha: float | None = None, family=None):
    cfg = type(
        "Cfg",
        (),
        {"lora_rank": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "lora_target_modules": list(targets)},
    )
    result = LoraSettings.of(cfg, family)
    assert result is not None
    return result


def lora_network(model: Path, rank: int = 4):
    family = detect_family(str(model))
    cls = family.network_class()
    net = cls.from_config(cls.load_config(str(model), subfolder=family.subfolder))
    return add_lora(net, settings(rank, family=family)), family


def test_defaults_follow_diffusers_lora_scripts(tiny_model):
    sd = detect_family(str(tiny_model))
    s = settings(16, family=sd)
    assert (s.rank, s.alpha, s.dropout, s.targets) == (16, 16.0, 0.0, ("to_k", "to_q", "to_v", "to_out.0"))
    config = s.peft_config()
    assert config.init_lora_weights == "gaussian" and config.lora_alpha == 16
    from sdzero.models.families import family_named

    assert "attn.add_q_proj" in family_named("sd3").lora_targets
    assert "attn.to_add_out" in family_named("sd3").lora_targets


def test_only_the_adapters_require_grad_and_the_network_starts_as_the_base(tiny_model):
    net, _ = lora_network(tiny_model)
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert all(not p.requires_grad for n, p in net.named_parameters() if ".lora_" not in n)
    # B is zero at the start: the adapted network's output is the base's
    assert all(not p.any() for n, p in net.named_parameters() if ".lora_B." in n)


def test_a_whole_adapter_passes_and_writes_in_the_diffusers_format(tiny_model, tmp_path):
    net, family = lora_network(tiny_model)
    state = adapter_state(net)
    assert adapter_problem(state, expected_adapter(net)) is None
    path = write_lora(tmp_path, family, state, net.peft_config["default"])
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    assert path.name == LORA_WEIGHTS and len(keys) == len(state)
    assert all(k.startswith("unet.") and (".lora.down." in k or ".lora.up." in k) for k in keys)


def placeholders(net: torch.nn.Module) -> None:
    """The adapters as ZeRO-3 leaves them outside a gather: zero-element tensors, the size in ds_numel."""
    for _, p in net.named_parameters():
        if p.requires_grad:
            p.ds_numel = p.numel()
            p.data = torch.empty(0, dtype=p.dtype)


def test_an_ungathered_zero3_adapter_is_refused_in_one_line(tiny_model):
    """The save other tools make under ZeRO-3 (peft#2500): state_dict of partitioned placeholders."""
    net, _ = lora_network(tiny_model)
    expected = expected_adapter(net)
    placeholders(net)
    assert expected_adapter(net) == expected  # the full sizes, from ds_numel
    line = adapter_problem(adapter_state(net), expected)
    assert line is not None and "\n" not in line
    assert f"{len(expected)} of {len(expected)} tensors empty (0 elements)" in line


def test_missing_and_partial_adapters_are_refused(tiny_model):
    net, _ = lora_network(tiny_model)
    expected = expected_adapter(net)
    state = adapter_state(net)
    first = sorted(state)[0]
    missing = {k: v for k, v in state.items() if k != first}
    assert f"1 of {len(expected)} tensors missing (first: {first})" in adapter_problem(missing, expected)
    partial = {**state, first: state[first].reshape(-1)[:1]}
    assert f"1 of {len(expected)} tensors partial" in adapter_problem(partial, expected)
    assert "no LoRA adapter" in adapter_problem({}, {})


class PlaceholderEngine:
    """An engine whose save forgot the ZeRO-3 gather: the adapters are placeholders and it says its
    weights are not partitioned (so nothing gathers them)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def zero_optimization_partition_weights(self) -> bool:
        return False


def test_a_planted_empty_adapter_save_stops_the_checkpoint(tiny_model, tmp_path, process_group):
    from sdzero.checkpoint.adapter import ADAPTER_DIR, AdapterCheckpoint

    net, family = lora_network(tiny_model)
    placeholders(net)
    with pytest.raises(AgreedError) as refused:
        AdapterCheckpoint(PlaceholderEngine(net), family).save(tmp_path, 0)
    assert "empty (0 elements)" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / ADAPTER_DIR).exists()  # nothing written


def test_export_merged_of_a_full_fine_tune_checkpoint_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """`sdzero export --merged` fuses a LoRA adapter; a full fine-tune's checkpoint (no adapter file in its
    manifest) is refused with one line before anything is read or written."""
    import json
    import sys

    from payloads import reseal

    from sdzero import cli
    from sdzero.checkpoint.manifest import MANIFEST

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}}, checkpoint / "mp_rank_00_model_states.pt")
    manifest = {
        "zero_stage": 0,
        "dtype": "fp32",
        "world_size": 1,
        "seed": 0,
        "model": str(tmp_path / "model"),
        "prediction_type": "epsilon",
        "tag": checkpoint.name,
        "step": 2,
        "serial": 1,
        "ema": False,
        "files": {},
    }
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    reseal(checkpoint)
    out = tmp_path / "exported"
    monkeypatch.setattr(sys, "argv", ["sdzero", "export", str(tmp_path / "run"), str(out), "--merged"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == EXIT_USER_ERROR and "\n" not in err, err
    assert err.startswith("sdzero: error:") and "--merged applies to LoRA checkpoints only" in err, err
    assert not out.exists()
