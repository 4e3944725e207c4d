"""GPU speed without a GPU: no per-phase sync unless --sync-timing, stats read a step late on CUDA, and the
fast-path options reaching the network (sdzero.telemetry.phase_timers, sdzero.telemetry.step_stats, sdzero.training.fast_paths, the Trainer)."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from step_input_fakes import step_input
from trainer_fakes import FakeEngine, FakeEvent
from unet_fakes import fast_path_options, tiny_unet

from sdzero.errors import UserError
from sdzero.models.families import family_named
from sdzero.telemetry.phase_timers import PhaseTimer, timing_mode
from sdzero.training import fast_paths as speed
from sdzero.training import trainer as trainer_module
from sdzero.training.callbacks import Callback
from sdzero.training.trainer import Trainer
from sdzero.training.trainer_parts import DataSide, ModelSide, RunSettings


@pytest.fixture
def syncs(monkeypatch):
    """Counts torch.cuda.synchronize calls (a CPU build would raise on the real one)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    FakeEvent.clock_ms, FakeEvent.waits = 0.0, 0
    return calls


def test_timing_mode_events_on_cuda_sync_only_when_asked_host_on_cpu():
    assert timing_mode(torch.device("cuda"), sync_timing=False) == "events"
    assert timing_mode(torch.device("cuda"), sync_timing=True) == "sync"
    assert timing_mode(torch.device("cpu"), sync_timing=True) == "host"


def test_event_timer_records_per_phase_and_waits_once_per_read(syncs):
    timer = PhaseTimer("events", event_factory=FakeEvent)
    timer.begin_step()
    for _ in range(2):  # two micro-steps
        for name in ("data_s", "forward_s"):
            with timer.phase(name):
                pass
    pending = timer.end_step()
    assert FakeEvent.waits == 0 and not syncs  # nothing waited while the step was queued
    assert pending.seconds() == {"data_s": 2e-3, "forward_s": 2e-3}  # 1 ms per phase, summed
    assert pending.seconds() == {"data_s": 2e-3, "forward_s": 2e-3}  # read once, then kept
    assert FakeEvent.waits == 1 and not syncs  # one event wait, never a device-wide synchronize


def test_sync_timer_synchronizes_after_every_phase(syncs):
    timer = PhaseTimer("sync")
    timer.begin_step()
    for name in ("data_s", "encode_s", "forward_s"):
        with timer.phase(name):
            pass
    assert len(syncs) == 3
    assert set(timer.end_step().seconds()) == {"data_s", "encode_s", "forward_s"}


# --------------------------------------------------------------------------------------------------
# The real Trainer, with a stand-in engine and model (one gloo rank)


class Recorder(Callback):
    """Records, at each step's end, how many metrics lines were written and whether the ranks stopped."""

    def __init__(self, lines: list, stop_from: int | None) -> None:
        self.lines, self.stop_from, self.seen = lines, stop_from, []
        self.step = 0

    def wants_stop(self, trainer) -> bool:
        return self.stop_from is not None and self.step >= self.stop_from

    def on_optimizer_step(self, trainer, step: int) -> None:
        self.step += 1

    def on_step_end(self, trainer, step: int) -> None:
        self.seen.append((step, len(self.lines), False))

    def on_stop(self, trainer, step: int) -> None:
        self.seen.append((step, len(self.lines), True))
        raise SystemExit(143)


def run_loop(monkeypatch, tmp_path, mode: str, stop_from: int | None = None, steps: int = 3):
    """Trainer.train as on a device timed in `mode` ("host": a CPU; "events"/"sync": CUDA by default / with
    --sync-timing), the model's loss replaced by the step number."""
    monkeypatch.setattr(trainer_module, "timing_mode", lambda device, sync: mode)
    monkeypatch.setattr(trainer_module, "PhaseTimer", functools.partial(PhaseTimer, event_factory=FakeEvent))
    monkeypatch.setattr(trainer_module, "encode_batch", lambda comps, batch: (None, None))
    hooks = Recorder([], stop_from)
    family = family_named("sd")
    monkeypatch.setattr(family, "loss", lambda *a, **k: torch.tensor(float(hooks.step + 1)))
    cfg = SimpleNamespace(
        max_steps=steps,
        sync_timing=mode == "sync",
        export_final=False,
        output_dir=tmp_path,
        snr_gamma=None,
    )
    ds = SimpleNamespace(grad_accum=2, global_batch=4, zero_stage=2, dtype="bf16", micro_batch=2)
    comps = SimpleNamespace(family=family, noise_scheduler=None)
    batches = SimpleNamespace(
        next=step_input, epoch=0, batches_in_epoch=0, samples_in_epoch=0, check_late=lambda: 0
    )
    writer = SimpleNamespace(write=hooks.lines.append, close=lambda: None)
    trainer = Trainer(
        RunSettings(cfg, ds, torch.device("cpu")),
        ModelSide(comps, FakeEngine(), "epsilon"),
        DataSide(batches),
        callbacks=[hooks],
        writer=writer,
    )
    try:
        summary = trainer.train()
    except SystemExit:
        summary = None
    return hooks, summary


def test_default_cuda_loop_never_synchronizes_and_writes_each_line_a_step_late(
    monkeypatch, tmp_path, syncs, process_group
):
    hooks, summary = run_loop(monkeypatch, tmp_path, "events")
    assert not syncs  # 3 steps x 2 micro-steps x 5 phases, and not one torch.cuda.synchronize
    assert FakeEvent.waits == 3  # one event wait per step, when its line is written
    # at step N's end the line of step N-1 is written: the GPU already has step N queued
    assert [(s, n) for s, n, _ in hooks.seen] == [(1, 0), (2, 1), (3, 2)]
    assert [r["step"] for r in hooks.lines] == [1, 2, 3]  # the last one after the loop
    assert [r["loss"] for r in hooks.lines] == [1.0, 2.0, 3.0]  # each step's own loss, read late
    # events 1 ms apart: every phase of a step took 2 ms of "GPU time" over its two micro-steps
    assert all(r[k] == 2e-3 for r in hooks.lines for k in ("data_s", "encode_s", "forward_s"))
    assert summary.steps == 3 and summary.last_loss == 3.0


def test_sync_timing_and_cpu_loops_write_each_line_at_its_step(monkeypatch, tmp_path, syncs, process_group):
    hooks, _ = run_loop(monkeypatch, tmp_path, "sync")
    assert len(syncs) == 3 * 2 * 5  # --sync-timing: one per phase of every micro-step
    assert [(s, n) for s, n, _ in hooks.seen] == [(1, 1), (2, 2), (3, 3)]
    syncs.clear()
    hooks, _ = run_loop(monkeypatch, tmp_path, "host")
    assert not syncs
    assert [(s, n) for s, n, _ in hooks.seen] == [(1, 1), (2, 2), (3, 3)]


def test_stop_vote_is_acted_on_a_step_late_on_cuda_with_the_line_written(
    monkeypatch, tmp_path, syncs, process_group
):
    """Asked to stop during step 2: the CPU loop stops at step 2; the lagged loop reads the vote with step
    2's stats at step 3's end and stops there, with step 3's line written before it saves."""
    hooks, _ = run_loop(monkeypatch, tmp_path, "host", stop_from=2, steps=5)
    assert hooks.seen[-1] == (2, 2, True)
    hooks, _ = run_loop(monkeypatch, tmp_path, "events", stop_from=2, steps=5)
    assert hooks.seen[-1] == (3, 3, True)


# --------------------------------------------------------------------------------------------------
# Fast paths


def forward_seen(unet, probe_module) -> dict:
    seen = {}

    def hook(_m, args, _out):
        seen["nhwc"] = args[0].is_contiguous(memory_format=torch.channels_last)
        seen["flash_enabled"] = torch.backends.cuda.flash_sdp_enabled()

    probe_module.register_forward_hook(hook)
    with torch.no_grad():
        unet(torch.randn(2, 4, 8, 8), torch.tensor([1, 2]), torch.randn(2, 3, 16))
    return seen


@pytest.mark.parametrize("channels_last", [False, True])
def test_channels_last_reaches_the_unets_convolutions(channels_last):
    unet = tiny_unet()
    handles = speed.prepare_network(fast_path_options(channels_last=channels_last), unet)
    assert len(handles) == int(channels_last)
    conv = unet.down_blocks[0].resnets[0].conv1  # a convolution deep inside, fed by GroupNorm and SiLU
    assert forward_seen(unet, conv)["nhwc"] is channels_last


def test_attention_option_restricts_the_kernel_during_the_networks_forward_only():
    unet = tiny_unet()
    speed.prepare_network(fast_path_options(attention="math"), unet)
    attn = next(m for m in unet.modules() if type(m).__name__ == "Attention")
    # inside the attention block's forward (its output projection runs after SDPA, within the block)
    assert forward_seen(unet, attn.to_out[0])["flash_enabled"] is False  # sdpa_kernel([MATH])
    assert torch.backends.cuda.flash_sdp_enabled()  # and restored after it


def test_attention_kernel_is_probed_and_an_impossible_one_refused():
    unet = tiny_unet()
    assert speed.attention_head_dims(unet) == [8]  # attention at 32 channels in 4 heads (diffusers' naming)
    found = speed.check_attention(fast_path_options(), unet, torch.float32, torch.device("cpu"))
    assert found == {"8": "flash"}  # PyTorch's CPU flash kernel comes first in its order
    found = speed.check_attention(
        fast_path_options(attention="math"), unet, torch.float32, torch.device("cpu")
    )
    assert found == {"8": "math"}
    with pytest.raises(UserError, match="--attention efficient: that SDPA kernel cannot run here"):
        speed.check_attention(
            fast_path_options(attention="efficient"), unet, torch.float32, torch.device("cpu")
        )


def test_tf32_flag_sets_both_torch_switches_on_cuda_and_leaves_the_cpu_alone():
    # torch >= 2.9's fp32_precision API where present (see test_first_gpu_run.py), read back through it
    new_api = hasattr(torch.backends.cuda.matmul, "fp32_precision")
    if new_api:
        before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    else:
        before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    try:
        speed.apply_backend_flags(fast_path_options(tf32=True), "cpu")
        assert torch.get_float32_matmul_precision() == precision  # a CPU run's matmuls are untouched
        speed.apply_backend_flags(fast_path_options(tf32=True), "cuda")
        assert speed.tf32_in_use() == (True, True)
        speed.apply_backend_flags(fast_path_options(tf32=False), "cuda")
        assert speed.tf32_in_use() == (False, False)
    finally:
        if new_api:
            torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = before
        else:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
        torch.set_float32_matmul_precision(precision)


def test_compile_goes_through_deepspeeds_engine_compile_and_wraps_the_module_in_place():
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "backend" in inspect.signature(DeepSpeedEngine.compile).parameters

    class Engine:  # what DeepSpeedEngine.compile does without DeepCompile: module.compile(backend=...)
        def __init__(self) -> None:
            self.module, self.calls = torch.nn.Linear(2, 2), []

        def compile(self, backend: str) -> None:
            self.calls.append(backend)
            self.module.compile(backend=backend)

    engine = Engine()
    speed.compile_engine(fast_path_options(compile=False), engine)
    assert engine.calls == [] and engine.module._compiled_call_impl is None
    speed.compile_engine(fast_path_options(compile=True), engine)
    assert engine.calls == ["inductor"] and engine.module._compiled_call_impl is not None
    assert list(engine.module.state_dict()) == ["weight", "bias"]  # checkpoint names unchanged


def test_compile_is_refused_with_zero3_parameter_offload():
    ds = SimpleNamespace(offload_param=True, path="ds.json")
    with pytest.raises(UserError, match="--compile with offload_param"):
        speed.check_speed_options(fast_path_options(compile=True), ds)
    speed.check_speed_options(
        fast_path_options(compile=True), SimpleNamespace(offload_param=False, path="ds.json")
    )
    speed.check_speed_options(fast_path_options(), ds)  # offload alone is fine


def test_optimizer_implementation_is_read_from_the_innermost_optimizer():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert speed.optimizer_implementation(torch.optim.AdamW(p, fused=True)) == "torch.AdamW (fused)"
    assert speed.optimizer_implementation(torch.optim.AdamW(p, foreach=True)) == "torch.AdamW (foreach)"
    wrapped = SimpleNamespace(optimizer=SimpleNamespace(optimizer=torch.optim.AdamW(p)))  # ZeRO's wrappers
    assert speed.optimizer_implementation(wrapped) == "torch.AdamW (default)"
    assert speed.adamw_options("cuda") == {"fused": True} and speed.adamw_options("cpu") == {}


def test_speed_options_parse_from_the_command_line(tmp_path):
    from sdzero.config.train_config import parse_train_args

    base = [
        "--deepspeed_config",
        "x.json",
        "--model",
        "org/model",
        "--data",
        str(tmp_path),
        "--output-dir",
        str(tmp_path / "out"),
    ]
    cfg = parse_train_args(base)
    assert (cfg.tf32, cfg.channels_last, cfg.compile, cfg.attention, cfg.sync_timing) == (
        True,
        False,
        False,
        "auto",
        False,
    )
    cfg = parse_train_args(
        [*base, "--no-tf32", "--channels-last", "--compile", "--attention", "math", "--sync-timing"]
    )
    assert (cfg.tf32, cfg.channels_last, cfg.compile, cfg.attention, cfg.sync_timing) == (
        False,
        True,
        True,
        "math",
        True,
    )


def test_advisor_launches_time_their_steps_without_a_sync_a_users_run_does_not_take():
    """A launch's timed steps are the user's (phases timed by events on CUDA, read a step late): no
    --sync-timing; DeepSpeed's synchronizing instruments are on in its instrumented steps only
    (sdzero.training.measuring.sweep)."""
    from dataclasses import replace

    from advisor.measure.trials import TrialSettings, trainer_args

    settings = TrialSettings(
        model="m", data=Path("d"), steps=2, warmup_steps=1, trial_timeout_s=60, stall_timeout_s=None
    )
    args = trainer_args(replace(settings, sweep="1:1,4:1", launch_measure_s=20), "ds.json", Path("/tmp/t"))
    assert "--sync-timing" not in args
    assert args[args.index("--profile-configs") + 1] == "1:1,4:1"
    assert args[args.index("--profile-max-seconds") + 1] == "20"
