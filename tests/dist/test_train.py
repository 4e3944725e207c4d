"""The trainer under the real `deepspeed` launcher: 2 ranks, gloo, on the CPU."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import RUN_SHAPES, SPEED_OPTIONS, is_fp16
from launch import CONFIGS, SGD, check_ok, fp32_config, metrics, run_trainer, write_config
from safetensors.torch import load_file

pytestmark = pytest.mark.dist

SHIPPED = sorted(p.name for p in CONFIGS.glob("*.json"))
REQUIRED_FIELDS = {
    "step",
    "epoch",
    "loss",
    "lr",
    "samples_per_s",
    "step_time_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "world_size",
    "zero_stage",
    "dtype",
    "micro_batch",
    "grad_accum",
    "loss_scale",
    "skipped_steps",
    "peak_mem_bytes",
}


def test_all_required_configs_are_shipped():
    required = {f"zero{s}_{p}.json" for s in (1, 2, 3) for p in ("bf16", "fp16")}
    required |= {"zero2_offload_bf16.json", "zero3_offload_bf16.json"}
    assert required <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_trains(name, shipped_run):
    raw = json.loads((CONFIGS / name).read_text())
    fp16 = is_fp16(name)
    proc, out = shipped_run(name)
    check_ok(proc)
    rows = metrics(out)
    steps, extra = RUN_SHAPES.get(name, (2, ()))
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert set(r) >= REQUIRED_FIELDS
        assert r["zero_stage"] == raw["zero_optimization"]["stage"]
        assert r["dtype"] == ("fp16" if fp16 else "bf16")
        assert r["world_size"] == 2 and r["micro_batch"] == raw["train_micro_batch_size_per_gpu"]
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 10
        assert r["samples_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_bytes"] > 0
        if fp16:
            # Dynamic loss scaling starts at 2**initial_scale_power and may halve on overflow.
            assert 1 <= r["loss_scale"] <= 2 ** raw["fp16"]["initial_scale_power"]
            assert isinstance(r["skipped_steps"], int)
        else:
            assert r["loss_scale"] is None
    assert f"sdzero: trained {steps} steps" in proc.stdout
    # what the fast paths really were, read from torch, the engine and an SDPA probe (sdzero.training.fast_paths)
    used = json.loads((out / "environment.json").read_text())["speed"]
    assert used["optimizer"].startswith(("torch.", "deepspeed."))
    assert used["timing"] == "host"  # on a CPU phases are timed on the host, --sync-timing or not
    if extra == SPEED_OPTIONS:  # the options as a user passes them reach the run
        assert used["channels_last"] is True
        assert used["attention_requested"] == "math" and used["attention_kernel_by_head_size"] == {
            "8": "math"
        }
    else:
        assert used["compiled"] is False and used["channels_last"] is False
        assert used["attention_kernel_by_head_size"] == {"8": "flash"}  # the tiny UNet's one head size, CPU


@pytest.fixture(scope="module")
def fp32_runs(tiny_model, synth_data, tmp_path_factory):
    """Four-step fp32 runs that several comparisons share (each launch costs ~30 s on 2 cores)."""
    runs: dict[str, Path] = {}

    def get(key: str, config: dict, *extra: str) -> Path:
        if key not in runs:
            out = tmp_path_factory.mktemp(key)
            cfg = write_config(out / "ds.json", config)
            check_ok(run_trainer(cfg, tiny_model, synth_data, out / "run", *extra, "--export-final", steps=4))
            runs[key] = out / "run"
        return runs[key]

    return get


def final_unet(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "unet" / "diffusion_pytorch_model.safetensors")


def test_zero_stages_give_the_same_trajectory(fp32_runs):
    """fp32, same seed: ZeRO 1, 2 and 3 differ only in where the optimizer state lives.

    The one numeric difference is summation order (ZeRO-3 reduces and clips per partition), which in fp32
    moves a loss by a few ulps; 1e-5 relative is ~100 ulps of headroom, far below any real divergence
    (a wrong gradient or a dropped shard changes losses by >1e-3 within 4 steps at lr 1e-3).
    The ZeRO-3 run also recomputes activations (--gradient-checkpointing): that must not change the math
    either, nor crash at ZeRO-3 (DeepSpeed#4595). One launch proves both; a failure names the run.
    """
    losses = {
        "z1": [r["loss"] for r in metrics(fp32_runs("z1", fp32_config(1)))],
        "z2": [r["loss"] for r in metrics(fp32_runs("z2", fp32_config(2)))],
        "z3 + gradient checkpointing": [r["loss"] for r in metrics(zero3_checkpointed(fp32_runs))],
    }
    for name in ("z2", "z3 + gradient checkpointing"):
        assert losses[name] == pytest.approx(losses["z1"], rel=1e-5), (name, losses)
    assert losses["z1"][0] != losses["z1"][-1]  # the weights did change


def zero3_checkpointed(fp32_runs) -> Path:
    return fp32_runs("z3_ckpt", fp32_config(3), "--gradient-checkpointing")


def test_gradient_accumulation_is_exact(fp32_runs, tiny_model):
    """micro 2 x accumulation 2 must reach the same weights as micro 4 x accumulation 1.

    Per-sample noise and timesteps make the two runs see identical inputs; only the order of the float
    sums differs, hence a tolerance of 1e-5 (fp32) rather than bitwise equality. Plain SGD, because Adam
    turns ulp-level noise in near-zero gradients into lr-sized steps (its update is ~lr whatever the
    gradient's size), while SGD maps any gradient difference linearly onto the weights.
    """
    big = final_unet(fp32_runs("z2_sgd", fp32_config(2, optimizer=SGD)))
    accum = final_unet(fp32_runs("z2_sgd_accum", fp32_config(2, micro=2, accum=2, optimizer=SGD)))
    start = load_file(tiny_model / "unet" / "diffusion_pytorch_model.safetensors")
    assert big.keys() == accum.keys()
    for key in big:
        torch.testing.assert_close(accum[key], big[key], rtol=1e-5, atol=1e-6, msg=key)
    moved = max((big[k] - start[k]).abs().max().item() for k in big)
    assert moved > 1e-3  # the comparison is not between two untrained copies
    rows = metrics(fp32_runs("z2_sgd_accum", fp32_config(2, micro=2, accum=2, optimizer=SGD)))
    assert rows[0]["grad_accum"] == 2 and rows[0]["micro_batch"] == 2


def test_export_final_is_a_loadable_pipeline(fp32_runs, tiny_model):
    from diffusers import StableDiffusionPipeline

    run = zero3_checkpointed(fp32_runs)
    pipe = StableDiffusionPipeline.from_pretrained(run / "final")
    trained = final_unet(run)
    initial = load_file(tiny_model / "unet" / "diffusion_pytorch_model.safetensors")
    # Real weights, not ZeRO-3 placeholders: every tensor has its full shape and some have moved.
    assert all(trained[k].shape == initial[k].shape for k in initial)
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3)


def test_an_attention_kernel_the_cpu_lacks_is_refused(tiny_model, synth_data, tmp_path):
    """One rank: an SDPA kernel the CPU lacks, refused with one line and exit 2 before any step (the
    options that can run are proven on the shipped zero0_bf16 run, see conftest.RUN_SHAPES)."""
    config = CONFIGS / "zero2_bf16.json"
    refused = run_trainer(
        config, tiny_model, synth_data, tmp_path / "refused", "--attention", "efficient", ranks=1
    )
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("sdzero: error:")]
    assert errors == [
        "sdzero: error: --attention efficient: that SDPA kernel cannot run here for head size 8 in "
        "torch.bfloat16 on cpu; use --attention auto (or flash/math on a CPU)"
    ]
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
