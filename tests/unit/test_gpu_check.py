"""bench/gpu_check.py refuses clearly (exit 2, one line) where torch sees no CUDA device."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_gpu_check_refuses_without_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
