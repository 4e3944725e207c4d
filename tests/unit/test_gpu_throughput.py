"""bench/gpu_throughput.py refuses clearly without CUDA, and reads the device's peak from its name."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_throughput.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_throughput_refuses_without_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gpu_throughput: no CUDA device visible to torch; run this on a CUDA machine (--cpu-rehearsal checks "
        "the script itself on a CPU)"
    ]
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_peak_is_looked_up_by_device_name_most_specific_first():
    bench = load_bench("gpu_throughput")
    assert bench.peak_flops("NVIDIA H200", None) == pytest.approx(989.4e12)
    assert bench.peak_flops("NVIDIA H100 PCIe", None) == pytest.approx(756e12)
    assert bench.peak_flops("NVIDIA H100 80GB HBM3", None) == pytest.approx(989.4e12)
    assert bench.peak_flops("Some New GPU", None) is None
    assert bench.peak_flops("Some New GPU", 100.0) == pytest.approx(100e12)
