"""Rank-0-only work under a collective timeout sized for it (issue 43): two real gloo ranks whose process
group times out collectives after 2 s, while rank 0 converts an elastic checkpoint or exports the pipeline
for longer. The other rank must wait it out, and get rank 0's answer or failure, instead of timing out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdzero.process.rank0_wait import RANK0_WAIT_FLOOR_S, SLOW_STORAGE_BYTES_PER_S, rank0_timeout_s

REPO = Path(__file__).resolve().parents[2]
WORK_S = 4.0  # rank 0's work: twice the group's 2 s collective timeout

RANK = r"""
import datetime, json, sys, time
from pathlib import Path
from types import SimpleNamespace
import torch, torch.distributed as dist

rank, store, case, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=2))
result = {}
try:
    if case == "universal":
        from sdzero.checkpoint import universal
        def slow_conversion(path, manifest):
            time.sleep(float(sys.argv[5]))
            return Path("/ckpt/.universal-step5")
        universal.converted = slow_conversion
        manifest = SimpleNamespace(zero_stage=2, world_size=4, total_bytes=10)
        result["answer"] = str(universal.universal_for(Path("/ckpt/step5"), manifest, 2, {}))
    else:
        from sdzero.checkpoint import export
        from sdzero.training import run_output
        export.gathered_state_dict = lambda engine: {"w": torch.zeros(1)} if rank == 0 else None
        def slow_write(out, state, comps, dtype, extra_unets=None):
            time.sleep(float(sys.argv[5]))
            if case == "export-fails":
                raise OSError("disk full")
            return out
        export.write_pipeline = slow_write
        engine = SimpleNamespace(module=torch.nn.Linear(4, 4))
        cfg = SimpleNamespace(output_dir=out, export_dtype="fp32")
        run_output.export_final(cfg, engine, SimpleNamespace(), rank)
        result["answer"] = "exported"
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
(out / f"rank{rank}.json").write_text(json.dumps(result))
"""


def run_two_ranks(tmp_path: Path, case: str) -> list[dict]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                str(rank),
                str(tmp_path / "store"),
                case,
                str(tmp_path),
                str(WORK_S),
            ],
            cwd=REPO,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.wait(timeout=120)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_the_wait_is_sized_by_the_bytes_and_never_below_the_groups_timeout():
    assert rank0_timeout_s(0, 30.0) == RANK0_WAIT_FLOOR_S
    assert rank0_timeout_s(0, 7200.0) == 7200.0
    big = 100 * 2**30  # an SDXL-size ZeRO checkpoint, read and written
    assert rank0_timeout_s(big, 600.0) == pytest.approx(RANK0_WAIT_FLOOR_S + big / SLOW_STORAGE_BYTES_PER_S)


def test_ranks_wait_out_a_universal_conversion_longer_than_the_collective_timeout(tmp_path):
    assert run_two_ranks(tmp_path, "universal") == [{"answer": "/ckpt/.universal-step5"}] * 2


def test_ranks_wait_out_a_final_export_longer_than_the_collective_timeout(tmp_path):
    assert run_two_ranks(tmp_path, "export") == [{"answer": "exported"}] * 2


def test_a_failed_export_on_rank_0_stops_every_rank_with_its_cause(tmp_path):
    rank0, rank1 = run_two_ranks(tmp_path, "export-fails")
    assert rank0 == {"error": "OSError: disk full"}
    assert rank1 == {
        "error": "RuntimeError: rank 0 could not export the trained pipeline (OSError: disk full)"
    }
