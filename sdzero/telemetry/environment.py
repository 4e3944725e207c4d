"""What machine and software a run or a report was made on (versions, devices, memory)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOCAL_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
"""Ranks on this node as the deepspeed launcher, torchrun, Open MPI and MPICH announce it."""

PACKAGES = ("torch", "deepspeed", "diffusers", "transformers", "accelerate", "numpy", "mpi4py", "sdzero")


def environment_snapshot() -> dict[str, Any]:
    """Versions and devices of this interpreter's machine. Package versions come from metadata (no import);
    torch is imported only to list accelerators, which it alone can."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "versions": versions,
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": _physical_memory_bytes(),
        "accelerators": _accelerators(),
    }


def cpu_kind() -> str:
    """The CPU model and whether it has AVX-512, for benchmark output: without it bf16 is emulated and
    several times slower than fp32, so a figure means little without saying which kind produced it."""
    emulated = bf16_emulated()
    return f"{_cpu_model()}, {emulated or 'with AVX-512'}"


def bf16_emulated() -> str:
    """Why this CPU runs bf16 in software ('without AVX-512 (bf16 emulated)', or AVX-512 capped by a
    variable), or '' when it has AVX-512 in use."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    if " avx512f" not in flags:
        return "without AVX-512 (bf16 emulated)"
    cap = isa_cap()
    return f"with AVX-512 capped by {cap} (bf16 emulated)" if cap else ""


ISA_CAP_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Variables that keep torch's kernels (ATen's vectorised ops, oneDNN's matmuls and convolutions) below
AVX-512 on a CPU that has it: how an AVX-512 host runs as one without (bench/advisor_accuracy.py --no-avx512)."""


def isa_cap(environ: Mapping[str, str] | None = None) -> str:
    """The variables set here that keep torch below AVX-512 ('NAME=value, ...'), or '' when none does."""
    env = os.environ if environ is None else environ
    capped = []
    for name in ISA_CAP_VARS:
        value = env.get(name, "").strip()
        # ATen: default / avx2 / avx512; oneDNN: SSE41 .. AVX2_VNNI_2, AVX512_CORE.., AVX10_.., ALL
        if value and not value.upper().startswith(("AVX512", "AVX10", "ALL")):
            capped.append(f"{name}={value}")
    return ", ".join(capped)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _accelerators() -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory)})
    return found


def local_ranks_from_env() -> int:
    for var in LOCAL_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return 1


def share_cpu_threads() -> int | None:
    """Give torch's CPU thread pool this rank's share of the cores; the number set, or None if the user
    chose one (OMP_NUM_THREADS).

    torch sizes its pool to all cores of the machine in every process, and the deepspeed launcher leaves
    it so (unlike torchrun): k ranks on a node then run k x cores threads that preempt each other, which
    shows up as steps alternating between fast and several times slower, the noise an advisor trial must
    not measure. CPU-side work on GPU nodes (the optimizer with offload, data preparation) suffers alike.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // local_ranks_from_env())
    torch.set_num_threads(threads)
    return threads
