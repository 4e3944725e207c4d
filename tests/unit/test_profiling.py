"""The trainer-side meters of sdzero.telemetry.memory and sdzero.training.measuring.probe, on small hand-built modules (no process group)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch import nn

from sdzero.telemetry.memory import ActivationMeter, model_state_bytes, module_bytes, storage_bytes
from sdzero.training.measuring.comm_meters import WaitMeter


def test_views_of_one_buffer_count_once_with_their_padding():
    flat = torch.zeros(10, dtype=torch.bfloat16)  # 9 used elements + 1 of alignment padding
    views = [flat[:4], flat[4:9]]
    seen: set = set()
    assert storage_bytes(views, seen) == (20, 0)
    assert storage_bytes([flat[2:3], None], seen) == (0, 0)  # already counted; None is skipped


def test_activation_meter_counts_saved_activations_not_weights():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    meter = ActivationMeter()
    with meter.hooks():
        net(x).sum().backward()
    # saved for backward: the input of the first Linear (3x8 fp32) and the ReLU output, which the second
    # Linear saves too (one storage); the weights (and their transposed views) are model states
    assert meter.bytes == 3 * 8 * 4 + 3 * 16 * 4
    assert meter.tensors == 2


def test_activation_bytes_grow_linearly_with_the_batch():
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU())

    def measure(batch: int) -> int:
        meter = ActivationMeter()
        with meter.hooks():
            net(torch.randn(batch, 8))
        return meter.bytes

    assert measure(4) == 2 * measure(2) > 0


class _Module(nn.Module):
    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.a = nn.Parameter(flat[:6].view(2, 3))
        self.b = nn.Parameter(flat[6:9])


def test_model_state_bytes_by_kind_from_a_zero_like_engine():
    """Parameters as views of one padded bf16 flat buffer, an fp32 master partition with Adam states
    (m, v and its `step` tensor), gradients in a ZeRO partition buffer: the shape ZeRO 1/2 keep."""
    flat = torch.zeros(10, dtype=torch.bfloat16)
    module = _Module(flat)
    master = nn.Parameter(torch.zeros(5))
    inner = torch.optim.Adam([master])
    master.grad = torch.ones(5)
    inner.step()  # Adam creates exp_avg, exp_avg_sq and step lazily
    master.grad = None
    grad_partition = torch.zeros(6, dtype=torch.bfloat16)
    engine = SimpleNamespace(
        module=module,
        optimizer=SimpleNamespace(
            optimizer=inner, averaged_gradients={0: [grad_partition[:3], grad_partition[3:]]}
        ),
    )
    states = model_state_bytes(engine)
    assert states == {
        "params": 10 * 2,  # the whole flat buffer, padding included
        "grads": 6 * 2,
        "master": 5 * 4,
        "optimizer": 2 * 5 * 4 + 4,  # m and v in fp32, and Adam's step as a 0-d fp32 tensor
        "buckets": 0,
        "offloaded": 0,
    }


def test_module_bytes_counts_parameters_and_buffers():
    bn = nn.BatchNorm1d(4)  # weight, bias, running_mean, running_var (fp32), num_batches_tracked (int64)
    assert module_bytes(bn) == 4 * 4 * 4 + 8


class _Work:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> bool:
        time.sleep(self.seconds)
        return True

    def is_completed(self) -> bool:
        return True


class _Backend:
    """Stands in for DeepSpeed's TorchBackend: a handle for async calls only, as torch.distributed returns;
    all_reduce takes async_op by position, as DeepSpeed calls it."""

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return _Work(0.05) if async_op else None

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return _Work(0.02) if async_op else None


def test_wait_meter_times_the_waits_of_async_calls_only():
    backend = _Backend()
    meter = WaitMeter(backend)
    meter.install()
    handle = backend.all_reduce("t", None, None, True)  # async, by position
    assert handle.is_completed() and handle.wait() is True  # the real handle's methods and result
    assert backend.all_reduce("t") is None
    assert backend.all_gather_into_tensor("o", "i", async_op=False) is None  # blocking: comms_logger timed it
    backend.all_gather_into_tensor("o", "i", async_op=True).wait()
    assert meter.seconds["all_reduce"] >= 0.05 and meter.seconds["all_gather_into_tensor"] >= 0.02
    meter.reset()
    assert meter.seconds == {}
    meter.uninstall()
    assert "all_reduce" not in vars(backend) and isinstance(backend.all_reduce("t", async_op=True), _Work)
