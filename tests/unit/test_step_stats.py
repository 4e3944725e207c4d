"""The per-step stats collective runs on the loss's device: NCCL refuses CPU tensors (seen on an H200:
"No backend type associated with device type cpu"), so a CPU tensor there stops every GPU run at step 1. A meta tensor stands in for a device
other than the CPU, without needing a GPU: it also fails any read-back to the host (a sync on a GPU)."""

import torch

from sdzero.telemetry import step_stats as step_log


def test_step_stats_tensor_lives_on_the_loss_device(monkeypatch):
    seen = {}

    def fake_all_gather(parts, local):
        seen["device"] = local.device
        seen["dtype"] = local.dtype
        # what two ranks would have sent: (mean loss, peak bytes, stop flag)
        parts[:] = [
            torch.tensor([3.0, 100.0, 0.0], dtype=torch.float64),
            torch.tensor([1.0, 300.0, 1.0], dtype=torch.float64),
        ]

    monkeypatch.setattr(step_log.dist, "all_gather", fake_all_gather)
    pending = step_log.launch_step_stats(torch.full((), 6.0, device="meta"), 2, 2, stop=False, peak_bytes=100)
    loss, peaks, stop = pending.resolve()
    assert seen == {"device": torch.device("meta"), "dtype": torch.float64}
    assert (loss, peaks, stop) == (2.0, [100, 300], True)
