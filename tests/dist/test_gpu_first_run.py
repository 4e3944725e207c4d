"""bench/gpu_first_run.py, the prepared first GPU check, rehearsed whole on the CPU (issue 43): the
wheelhouse's manifest checked, every throughput row at two micro-batches (the example loop, sdzero with and
without the fast paths, DeepSpeed's FusedAdam), and `sdzero advise --max-nodes 32`, into one JSON and one
markdown table. Its figures mean nothing on a CPU; the test checks that every part ran and was written."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_first_run.py"


def wheelhouse(folder: Path) -> Path:
    """A wheelhouse as `make gpu-bundle` writes it (a rehearsal checks its manifest, installs nothing)."""
    folder.mkdir()
    wheel = folder / "hjson-3.1.0-py3-none-any.whl"
    wheel.write_bytes(b"stand-in wheel bytes")
    entry = {"bytes": wheel.stat().st_size, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    manifest = {"python": "3.12", "files": {wheel.name: entry}, "total_bytes": entry["bytes"]}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_the_cpu_rehearsal_runs_every_phase_and_writes_the_json_and_table(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--cpu-rehearsal",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--wheelhouse",
            str(wheelhouse(tmp_path / "wheels")),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "gpu_first_run.json").read_text())
    assert results["install"] == {
        "wheels": ["hjson-3.1.0-py3-none-any.whl"],
        "bytes": 20,
        "installed": False,
        "why_not": "rehearsal: the wheels are for Python 3.12",
    }
    rows = {(r["row"], r["micro_batch"]): r for r in results["rows"]}
    names = ("example", "sdzero", "sdzero+fast", "sdzero+fast+FusedAdam")
    assert set(rows) == {(n, mb) for n in names for mb in (2, 4)}
    for (name, mb), row in rows.items():
        assert row["samples_per_s"] > 0 and "error" not in row, row
        if name != "example":
            assert row["vs_example"] == row["samples_per_s"] / rows[("example", mb)]["samples_per_s"]
    assert rows[("sdzero", 2)]["used"]["tf32_matmul"] is False  # fast paths off, read from torch
    fast = rows[("sdzero+fast", 2)]["used"]
    assert fast["channels_last"] is True and set(fast["attention_kernel_by_head_size"].values()) == {"flash"}
    assert rows[("sdzero+fast", 2)]["used"]["optimizer"].startswith("torch.AdamW")
    assert rows[("sdzero+fast+FusedAdam", 2)]["used"]["optimizer"] == "deepspeed.FusedAdam"
    assert "fused_adam_vs_torch_adamw" in rows[("sdzero+fast+FusedAdam", 4)]
    assert "vs_mlperf_h200" not in rows[("sdzero", 4)]  # a CPU's figure is not compared with an H200's
    advise = results["advise"]
    assert advise["exit_code"] == 0 and advise["answer"].startswith("answer: ")
    assert advise["trials_run"] >= 2 and len(advise["configs_measured"]) >= 2
    assert [row["node_count"] for row in advise["scaling"]] == [1, 2, 4, 8, 16, 32]
    table = (out / "gpu_first_run.md").read_text()
    assert "| sdzero+fast+FusedAdam | 4 |" in table and "advise: answer: " in table
    assert results["problems"] == [] and "phase_errors" not in results
