"""The memory model's device overheads (issue 43): the CUDA context, NCCL's buffers and the allocator's
fragmentation, named in advisor.model.memory, added to what must fit on CUDA devices and nowhere else."""

from __future__ import annotations

import pandas as pd
import pytest
from trial_rows import ok_trial

from advisor.model import memory as mem
from advisor.model.memory import ActivationFit, MemoryModel, ZeroSettings, fit_memory_model, state_elements

NUMELS = (4096, 1000, 300_000, 50_000, 128)


def model(device: str) -> MemoryModel:
    return MemoryModel(
        NUMELS, ZeroSettings(reduce_bucket_size=1000), 2e6, ActivationFit(1e6, 5e5), device=device
    )


def test_cuda_predictions_add_the_named_overheads_and_cpu_ones_do_not():
    cpu = model("cpu").per_rank_bytes(2, "bf16", 4, "none", 8)
    cuda = model("cuda").per_rank_bytes(2, "bf16", 4, "none", 8)
    assert cpu["allocated"] == cuda["allocated"] == cpu["total"]  # the allocator's peak is the same
    assert cuda["cuda_context"] == mem.CUDA_CONTEXT_BYTES
    nccl = mem.NCCL_COMMUNICATORS * mem.NCCL_MAX_CHANNELS * 2 * mem.NCCL_BUFFSIZE_BYTES
    assert cuda["nccl_buffers"] == nccl
    assert cuda["allocator_fragmentation"] == pytest.approx(mem.ALLOCATOR_FRAGMENTATION * cuda["allocated"])
    assert cuda["total"] == pytest.approx(
        cuda["allocated"] + mem.CUDA_CONTEXT_BYTES + nccl + mem.ALLOCATOR_FRAGMENTATION * cuda["allocated"]
    )
    one_rank = model("cuda").per_rank_bytes(2, "bf16", 4, "none", 1)
    assert one_rank["nccl_buffers"] == 0.0  # no peers, no ring buffers


def test_the_fit_predicts_for_cuda_when_the_trials_measured_a_cuda_peak():
    elements = state_elements(NUMELS, 2, 2)
    states = {f"{k}_bytes": elements[k] * mem.DEFAULT_BYTES_PER_ELEMENT[k] for k in mem.STATE_KINDS}
    row = {**states, "world_size": 2, "frozen_bytes": 0.0, "activation_bytes": 1e6, "bucket_bytes": 4000.0}
    on_cpu = pd.DataFrame(
        [ok_trial(2, 1, **row, cuda_peak_bytes=None), ok_trial(2, 2, **row, cuda_peak_bytes=None)]
    )
    assert fit_memory_model(on_cpu, NUMELS, ZeroSettings()).device == "cpu"
    on_gpu = on_cpu.assign(cuda_peak_bytes=[3e6, 4e6])
    fitted = fit_memory_model(on_gpu, NUMELS, ZeroSettings())
    assert fitted.device == "cuda"
    parts = fitted.per_rank_bytes(2, "bf16", 1, "none", 2)
    assert parts["total"] > parts["allocated"] + mem.CUDA_CONTEXT_BYTES
