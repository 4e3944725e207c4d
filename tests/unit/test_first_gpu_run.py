"""What a first run on CUDA GPUs would hit, checked on the CPU with stand-ins for CUDA (issue 43): no device
sync per micro-step by DeepSpeed's throughput timer or SD3's schedule, attention kernels that survive
activation recomputation, FusedAdam only where it can be built, and the current TF32 API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from unet_fakes import fast_path_options, tiny_unet

from sdzero.training import adam_kernel
from sdzero.training import fast_paths as speed
from sdzero.training.engine import effective_ds_config

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------------
# 1. DeepSpeed's throughput timer and SD3's schedule


def _cfg_ds(raw: dict) -> tuple[SimpleNamespace, SimpleNamespace]:
    return SimpleNamespace(effective_lr=lambda ds: 1e-3), SimpleNamespace(raw=raw)


def test_deepspeeds_throughput_timer_is_off_unless_the_json_configures_timers():
    cfg, ds = _cfg_ds({"train_micro_batch_size_per_gpu": 1})
    assert effective_ds_config(cfg, ds)["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
    mine = {"throughput": {"enabled": True, "synchronized": True}}
    cfg, ds = _cfg_ds({"train_micro_batch_size_per_gpu": 1, "timers": mine})
    assert effective_ds_config(cfg, ds)["timers"] == mine  # the user's own choice stands


@pytest.fixture
def one_rank_env(monkeypatch):
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)


def test_a_real_deepspeed_engine_synchronizes_the_device_in_no_micro_step(
    monkeypatch, process_group, one_rank_env
):
    """Every forward/backward/step of a real engine under sdzero's effective JSON, counting the accelerator's
    synchronize (DeepSpeed's throughput timer starts syncing from its third step when left at defaults)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    calls: list[int] = []
    monkeypatch.setattr(get_accelerator(), "synchronize", lambda *a, **k: calls.append(1))
    raw = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**6}
    cfg, ds = _cfg_ds(raw)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config=effective_ds_config(cfg, ds),
    )
    try:
        calls.clear()  # start-up may synchronize; the loop must not
        for _ in range(12):  # six optimizer steps of two micro-steps
            loss = engine(torch.randn(2, 4)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 6
        assert calls == []
    finally:
        engine.destroy()


class DeviceCopies(TorchDispatchMode):
    """Counts tensor copies from one device to another (what `.to(device)` of a host tensor does)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            self.count += int(args[0].device != out.device)
        return out


def test_sd3s_schedule_goes_to_the_device_once_not_every_micro_step():
    from diffusers import FlowMatchEulerDiscreteScheduler

    from sdzero.models.objectives import flow_timesteps

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = torch.rand(4).to("meta")  # the draws live on the device (meta stands in for CUDA)
    with DeviceCopies() as copies:
        for _ in range(5):  # five micro-steps
            timesteps, sigmas = flow_timesteps(scheduler, u)
    assert timesteps.device.type == sigmas.device.type == "meta" and timesteps.shape == (4,)
    assert copies.count == 2  # timesteps and sigmas, once
    # the values are the schedule's own (checked on the CPU, where indexing reads real numbers)
    u = torch.tensor([0.0, 0.5, 0.9999])
    timesteps, sigmas = flow_timesteps(scheduler, u)
    assert torch.equal(timesteps, scheduler.timesteps[[0, 500, 999]])
    assert torch.equal(sigmas, scheduler.sigmas[[0, 500, 999]])
    scheduler.set_timesteps(10)  # a new schedule: the kept copy is not reused
    assert torch.equal(flow_timesteps(scheduler, torch.tensor([0.0]))[0], scheduler.timesteps[[0]])


# --------------------------------------------------------------------------------------------------
# 2. --attention with --gradient-checkpointing


def _grads(unet) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 3, 16)
    unet.zero_grad(set_to_none=True)
    unet(x, t, text).sample.pow(2).mean().backward()
    return [p.grad.clone() for p in unet.parameters() if p.grad is not None]


def test_attention_kernel_holds_in_the_recomputation_of_gradient_checkpointing():
    """--attention math with checkpointing: the CPU's default kernel (flash) saves other tensors than math,
    so a recomputation outside the chosen kernel raises torch.utils.checkpoint.CheckpointError."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = tiny_unet().train()
    with sdpa_kernel([SDPBackend.MATH]):
        expected = _grads(plain)  # no checkpointing, math everywhere

    unet = tiny_unet().train()
    unet.enable_gradient_checkpointing()
    speed.prepare_network(fast_path_options(attention="math"), unet)
    kernels: list[bool] = []
    block = next(m for m in unet.modules() if type(m).__name__ == "Attention")
    attn = block.to_out[0]  # runs inside the block, after SDPA
    attn.register_forward_hook(lambda *_: kernels.append(torch.backends.cuda.flash_sdp_enabled()))
    got = _grads(unet)
    assert len(kernels) == 2 and not any(kernels)  # the forward and its recomputation, both restricted
    assert torch.backends.cuda.flash_sdp_enabled()  # and restored after each
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------------------------------
# 3. FusedAdam only where a matching CUDA toolkit exists


ADAMW_JSON = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8}},
}


@pytest.fixture
def no_prebuilt_fused_adam(monkeypatch):
    from deepspeed import git_version_info

    monkeypatch.setitem(git_version_info.installed_ops, "fused_adam", False)


def _toolkit(monkeypatch, release: tuple[int, int] | None, torch_cuda: str = "13.0") -> None:
    from deepspeed.ops.op_builder import builder

    def installed(name=""):
        if release is None:
            raise builder.MissingCUDAException("CUDA_HOME does not exist, unable to compile CUDA op(s)")
        return release

    monkeypatch.setattr(builder, "installed_cuda_version", installed)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)


def test_without_nvcc_an_adam_section_runs_torchs_fused_adamw_said_in_one_line(
    monkeypatch, no_prebuilt_fused_adam
):
    _toolkit(monkeypatch, None)
    config, line = adam_kernel.choose_adam(ADAMW_JSON, "cuda")
    assert config["optimizer"]["params"] == {
        **ADAMW_JSON["optimizer"]["params"],
        "torch_adam": True,
        "fused": True,
    }
    assert "optimizer" in ADAMW_JSON and "torch_adam" not in ADAMW_JSON["optimizer"]["params"]  # a copy
    assert line is not None and "\n" not in line
    assert line.startswith("optimizer: torch's fused AdamW instead of DeepSpeed's FusedAdam: no CUDA toolkit")


def test_a_mismatched_nvcc_is_named_and_a_matching_one_keeps_fused_adam(monkeypatch, no_prebuilt_fused_adam):
    _toolkit(monkeypatch, (12, 4), torch_cuda="13.0")
    config, line = adam_kernel.choose_adam(ADAMW_JSON, "cuda")
    assert config["optimizer"]["params"]["torch_adam"] is True
    assert "nvcc is CUDA 12.4, torch is built for CUDA 13.0" in line
    _toolkit(monkeypatch, (13, 0), torch_cuda="13.0")
    assert adam_kernel.choose_adam(ADAMW_JSON, "cuda") == (ADAMW_JSON, None)


def test_fused_adam_is_left_alone_off_cuda_with_offload_or_with_the_users_torch_adam(
    monkeypatch, no_prebuilt_fused_adam
):
    _toolkit(monkeypatch, None)
    assert adam_kernel.choose_adam(ADAMW_JSON, "cpu") == (ADAMW_JSON, None)
    offload = {**ADAMW_JSON, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert adam_kernel.choose_adam(offload, "cuda") == (offload, None)  # DeepSpeedCPUAdam, no nvcc
    mine = json.loads(json.dumps(ADAMW_JSON))
    mine["optimizer"]["params"]["torch_adam"] = False
    assert adam_kernel.choose_adam(mine, "cuda") == (mine, None)
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    assert adam_kernel.choose_adam(sgd, "cuda") == (sgd, None)


def test_deepspeed_builds_torchs_fused_adamw_from_the_rewritten_section(
    monkeypatch, no_prebuilt_fused_adam, process_group, one_rank_env
):
    import deepspeed

    _toolkit(monkeypatch, None)
    config, _ = adam_kernel.choose_adam(ADAMW_JSON, "cuda")
    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    try:
        assert speed.optimizer_implementation(engine.optimizer) == "torch.AdamW (fused)"
    finally:
        engine.destroy()


def test_prebuild_skips_fused_adam_without_a_toolkit_and_the_makefile_goes_through_it(
    monkeypatch, no_prebuilt_fused_adam
):
    from deepspeed import accelerator
    from deepspeed.ops import adam

    _toolkit(monkeypatch, None)
    built: list[str] = []
    cuda = SimpleNamespace(device_name=lambda *a: "cuda", create_op_builder=lambda name: None)
    monkeypatch.setattr(accelerator, "get_accelerator", lambda: cuda)

    def fused_adam(params):  # what the JIT build does without nvcc
        raise RuntimeError("CUDA_HOME does not exist, unable to compile CUDA op(s)")

    monkeypatch.setattr(adam, "FusedAdam", fused_adam)
    monkeypatch.setattr(adam, "DeepSpeedCPUAdam", lambda params: built.append("cpu_adam"))
    line = adam_kernel.prebuild()
    assert built == ["cpu_adam"]
    assert line.startswith("FusedAdam not built (no CUDA toolkit with nvcc")
    makefile = subprocess.run(
        ["make", "-n", "-B", "-f", str(REPO / "Makefile"), ".venv/.installed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "-m sdzero.training.adam_kernel" in makefile
    assert "FusedAdam(p)" not in makefile  # no unconditional build of the CUDA op


# --------------------------------------------------------------------------------------------------
# 6. TF32 through the current API


TF32_SCRIPT = """
import json, torch
from types import SimpleNamespace
from sdzero.training import fast_paths as speed
cfg = SimpleNamespace(channels_last=False, attention="auto")
net = torch.nn.Linear(2, 2)
engine = SimpleNamespace(module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))

def used():  # what environment.json records (sdzero.training.fast_paths.speed_report)
    report = speed.speed_report(cfg, engine, "events", {})
    return [report["tf32_matmul"], report["tf32_cudnn"]]

speed.apply_backend_flags(SimpleNamespace(tf32=True), "cuda")
new = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
on = used()
torch.backends.cuda.matmul.fp32_precision = "ieee"  # other code in the process uses the new API
after = used()  # environment.json's record, read after it: what is in force
speed.apply_backend_flags(SimpleNamespace(tf32=False), "cuda")
print(json.dumps({"on": on, "new": new, "after": after, "off": used()}))
"""


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9")
def test_tf32_is_set_and_read_through_fp32_precision_never_the_legacy_flags():
    """Once the new API is used, reading `allow_tf32` raises (torch >= 2.9): sdzero must set and read the
    new one, whatever else in the process uses it. A fresh process: the mixed-API state is process-wide."""
    proc = subprocess.run([sys.executable, "-c", TF32_SCRIPT], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "on": [True, True],
        "new": ["tf32", "tf32"],
        "after": [False, True],
        "off": [False, False],
    }


def test_without_the_new_api_the_legacy_flags_are_used(monkeypatch):
    legacy_matmul = SimpleNamespace(allow_tf32=False)
    legacy_cudnn = SimpleNamespace(allow_tf32=False)
    monkeypatch.setattr(torch.backends.cuda, "matmul", legacy_matmul)
    monkeypatch.setattr(torch.backends, "cudnn", legacy_cudnn)
    speed.apply_backend_flags(SimpleNamespace(tf32=True), "cuda")
    assert legacy_matmul.allow_tf32 and legacy_cudnn.allow_tf32
    assert speed.tf32_in_use() == (True, True)
    speed.apply_backend_flags(SimpleNamespace(tf32=True), "cpu")  # a CPU run changes nothing
