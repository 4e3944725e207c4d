"""What the advice is for: the node counts to predict, and the target's device and its memory.

The trials run here (a CPU, or this node's GPUs); the target may be other nodes. When it differs, memory
must be predicted for the target's devices, so their memory has to be given (--device-memory-gib or
--target-gpu) rather than read from this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from advisor.model.gpu_catalogue import GPUS
from sdzero.errors import UserError

TARGET_GPUS = {name: gpu.memory_gib for name, gpu in GPUS.items()}
"""--target-gpu names and their memory in GiB, from the one catalogue (advisor.model.gpu_catalogue: the
vendors' nominal figure; the usable part is smaller, which --headroom accounts for)."""


def target_differs(
    device: dict[str, Any], ranks: int, gpus_per_node: int | None, target_gpu: str | None
) -> str | None:
    """Why the trials' device is not the target's (None when the target is nodes like this one)."""
    here = "a CPU" if device["device"] == "cpu" else f"{ranks} {device['device']} device(s)"
    if target_gpu is not None:
        return f"the trials ran on {here}; the target is {target_gpu} GPUs"
    if device["device"] == "cpu" and gpus_per_node is not None:
        return f"the trials ran on {here}; the target has {gpus_per_node} GPUs per node (--gpus-per-node)"
    if device["device"] != "cpu" and gpus_per_node is not None and gpus_per_node != ranks:
        return f"the trials ran on {here}; the target has {gpus_per_node} per node (--gpus-per-node)"
    return None


def target_memory(
    differs: str | None, device_memory_gib: float | None, target_gpu: str | None
) -> tuple[float, str] | None:
    """(GiB, where it comes from) for a target unlike this machine; refuses when nothing gives it."""
    if device_memory_gib:
        return device_memory_gib, "assumed (user figure: --device-memory-gib)"
    if target_gpu:
        return TARGET_GPUS[target_gpu.lower()], f"assumed (--target-gpu {target_gpu.lower()} nominal memory)"
    if differs:
        raise UserError(
            f"{differs}: give the target's device memory with --device-memory-gib (or --target-gpu "
            f"{'/'.join(TARGET_GPUS)}) so memory is predicted for it, not for this machine"
        )
    return None


def device_memory_bytes(device: dict[str, Any], ranks_per_node: int) -> tuple[float, str]:
    """A GPU's total memory, or on a CPU the host's memory shared by the node's ranks."""
    if device["device"] != "cpu":
        code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        if out.returncode == 0 and out.stdout.strip().isdigit():
            return float(out.stdout.strip()), f"{device['device']} device 0 total memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float(total) / ranks_per_node, f"host memory / {ranks_per_node} ranks (no accelerator)"


def machine_target(
    preset: str | None, gpus_per_node: int | None, target_gpu: str | None
) -> tuple[int | None, str | None]:
    """(GPUs per node, GPU name) of the target: as given, else the machine preset's (a GB200 NVL72's node is
    its 72-GPU NVLink domain), else None."""
    from advisor.model.network import MACHINES

    if gpus_per_node is not None and gpus_per_node < 1:  # before anything reads it as "not given"
        raise UserError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    machine = MACHINES.get(preset or "")
    if machine is None:
        return gpus_per_node, target_gpu
    return gpus_per_node or machine.gpus_per_node, target_gpu or machine.gpu


def check_target_rate(target_tflops: float | None) -> None:
    if target_tflops is not None and not target_tflops > 0:
        raise UserError(f"--target-tflops {target_tflops}: must be a positive sustained TFLOP/s per GPU")
