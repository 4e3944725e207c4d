"""The memory model's optimizer-step peak (advisor/model/memory.py `MemoryModel.step_bytes`).

The first test checks the formula against a recorded GPU measurement: docs/measurements.md's "On a GPU (H200)" table
(bench/gpu_check.py, one H200, an SD 1.5-sized UNet, 1 rank, ZeRO-2 bf16, torch's AdamW via
`"torch_adam": true`). A CPU run cannot check this term: there sdzero's profile has no allocator to read,
and its `device_peak_bytes` is the sum of the forward/backward parts, not a measurement of the step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.model.memory import ActivationFit, MemoryModel, ZeroSettings, largest_sub_group
from sdzero.constants import GIB

REPO = Path(__file__).resolve().parents[2]
SD15_UNET_PARAMS = 859_520_964  # trained parameters, docs/measurements.md "On a GPU (H200)"
# docs/measurements.md table, micro-batch -> torch.cuda.max_memory_allocated (GiB) and the old model's figure
H200_PEAK_GIB = {1: 18.006, 2: 18.009}
H200_OLD_MODEL_GIB = {1: 14.182, 2: 15.054}


def shipped(name: str, **optimizer_params) -> dict:
    config = json.loads((REPO / "ds_configs" / name).read_text())
    config["optimizer"]["params"].update(optimizer_params)
    return config


def sd15_model(zero: ZeroSettings) -> MemoryModel:
    # One tensor of the UNet's size: at 1 rank ZeRO-1/2 flatten everything into one partition, so the
    # per-parameter split does not change any figure below.
    return MemoryModel(
        numels=(SD15_UNET_PARAMS,),
        zero=zero,
        frozen_bytes=0.315 * GIB,  # frozen VAE and text encoder, as measured
        activations=ActivationFit(intercept=0.0, slope=0.872 * GIB),  # per sample, as measured
    )


def test_step_peak_matches_the_recorded_h200_measurement():
    """Check of the formula against a recorded measurement (H200, 2026-11-30), not a fresh one."""
    zero = ZeroSettings.from_config(shipped("zero2_bf16.json", torch_adam=True), device="cuda")
    assert zero.optimizer_impl("none") == "torch_foreach"
    model = sd15_model(zero)
    # the inputs reproduce docs/measurements.md's parts
    states = {k: round(v / GIB, 3) for k, v in model.state_bytes(2, "bf16", 1).items()}
    assert states == {"params": 1.601, "grads": 1.601, "master": 3.202, "optimizer": 6.404}
    assert round(model.bucket_bytes(2) / GIB, 3) == 0.186
    for mb, measured in H200_PEAK_GIB.items():
        mem = model.per_rank_bytes(2, "bf16", mb, "none", 1)
        # the forward/backward sum is the old model's figure ...
        assert mem["fwd_bwd"] / GIB == pytest.approx(H200_OLD_MODEL_GIB[mb], abs=0.002)
        # ... and the step is the peak: params + master + Adam + frozen + max(2+2+4, 4+4) bytes x Psi
        assert mem["total"] == mem["step"] > mem["fwd_bwd"]
        assert mem["step_transient"] == 8 * SD15_UNET_PARAMS
        assert mem["total"] / GIB == pytest.approx(17.926, abs=0.001)
        assert abs(mem["total"] / GIB / measured - 1) < 0.01  # -0.44% / -0.46%


def test_optimizer_implementation_follows_deepspeed_and_torch_defaults():
    fused = ZeroSettings.from_config(shipped("zero2_bf16.json"))
    assert fused.optimizer_impl("none") == "fused" and fused.optimizer_impl("optimizer") == "cpu_adam"
    torch_cuda = ZeroSettings.from_config(shipped("zero2_bf16.json", torch_adam=True))
    assert torch_cuda.optimizer_impl("optimizer") == "torch_for_loop"  # offloaded tensors are on the CPU
    torch_cpu = ZeroSettings.from_config(shipped("zero2_bf16.json", torch_adam=True), device="cpu")
    assert torch_cpu.optimizer_impl("none") == "torch_for_loop"
    forced = ZeroSettings.from_config(shipped("zero2_bf16.json", torch_adam=True, foreach=False))
    assert forced.optimizer_impl("none") == "torch_for_loop"
    l2 = ZeroSettings.from_config(
        shipped("zero2_bf16.json", torch_adam=True, foreach=False, adam_w_mode=False)
    )
    assert not l2.adam_l2  # "type": "AdamW" stays decoupled whatever adam_w_mode says
    config = shipped("zero2_bf16.json", torch_adam=True, foreach=False, adam_w_mode=False)
    config["optimizer"]["type"] = "Adam"
    assert ZeroSettings.from_config(config).adam_l2
    assert ZeroSettings.from_config(config).optimizer_temp_elements("none", 10) == 30
    assert forced.optimizer_temp_elements("none", 10) == 20
    assert torch_cuda.optimizer_temp_elements("none", 10) == 10
    assert fused.optimizer_temp_elements("none", 10) == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero3_step_transient_per_case(precision):
    numels = (4000, 3000, 2000, 1000)  # shards at 2 ranks: 2000, 1500, 1000, 500
    base = ZeroSettings(reduce_bucket_size=100, persistence_threshold=0, sub_group_size=3000)
    assert largest_sub_group(numels, 2, 3000) == 3500  # sub-groups close once they reach 3000
    for impl, temp in (("fused", 0), ("torch_foreach", 4), ("torch_for_loop", 8)):
        zero = ZeroSettings(
            **{**base.__dict__, "torch_adam": impl != "fused", "torch_foreach": impl == "torch_foreach"}
        )
        model = MemoryModel(numels, zero, frozen_bytes=0.0, activations=ActivationFit(0.0, 0.0))
        step = model.step_bytes(3, precision, "none", 2)
        states = model.state_bytes(3, precision, 2)
        assert step["resident"] == sum(states.values()) + model.bucket_bytes(3)
        assert step["transient"] == max(6 * 3500, 4 * 3500 + temp * 3500)
        off = model.step_bytes(3, precision, "optimizer", 2)
        assert off["transient"] == 0.0  # the fp32 gradient and the update live on the host
        host_temp = {"fused": 0, "torch_foreach": 4, "torch_for_loop": 8}[impl]  # fused -> DeepSpeedCPUAdam
        assert off["host_transient"] == host_temp * 3500


def test_zero1_and_2_step_frees_buckets_and_other_ranks_gradients():
    numels = (600, 600, 600, 600)  # part 1200 at 2 ranks, boundary between parameters
    zero = ZeroSettings(reduce_bucket_size=10_000, persistence_threshold=0)
    model = MemoryModel(numels, zero, frozen_bytes=0.0, activations=ActivationFit(0.0, 0.0))
    for stage in (1, 2):
        step = model.step_bytes(stage, "bf16", "none", 2)
        states = model.state_bytes(stage, "bf16", 2)
        assert step["resident"] == states["params"] + states["master"] + states["optimizer"]
        assert step["transient"] == 1200 * 2 + 1200 * 2 + 1200 * 4  # FusedAdam: the cast moment
    kept = ZeroSettings(reduce_bucket_size=10_000, persistence_threshold=0, contiguous_gradients=False)
    model = MemoryModel(numels, kept, frozen_bytes=0.0, activations=ActivationFit(0.0, 0.0))
    assert model.step_bytes(2, "bf16", "none", 2)["resident"] == 2 * 2400 + 4800 + 9600 + 20_000


def test_zero0_holds_everything_everywhere_and_casts_each_gradient_to_fp32_at_the_step():
    """ZeRO-0 (DeepSpeed's FP16_Optimizer, also for bf16): states of 16 bytes per parameter at any world
    size, no reduce buckets; its step casts each 16-bit gradient to fp32 and flattens the copies into one
    fp32 tensor while the 16-bit gradients still live: 2 + 4 + 4 bytes per parameter on top."""
    zero = ZeroSettings.from_config(shipped("zero0_bf16.json"), device="cuda")
    model = sd15_model(zero)
    psi = SD15_UNET_PARAMS
    for world in (1, 8, 64):
        assert sum(model.state_bytes(0, "bf16", world).values()) == 16 * psi
    assert model.bucket_bytes(0) == 0
    step = model.step_bytes(0, "bf16", "none", 8)
    assert step["transient"] == (2 + 4 + 4) * psi  # FusedAdam: no temporaries of its own
    assert step["resident"] == (2 + 4 + 8) * psi + model.frozen_bytes
    # ZeRO-1 at the same world holds a fraction of the optimizer states: far less at the step
    assert (
        model.per_rank_bytes(1, "bf16", 1, "none", 8)["total"]
        < model.per_rank_bytes(0, "bf16", 1, "none", 8)["total"]
    )
