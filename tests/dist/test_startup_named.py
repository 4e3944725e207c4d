"""Start-up named, on one host with 2 ranks (`sdzero train`):

- a run's first metrics line carries every rank's start-up phases and the longest one (`startup`), and the
  terminal's start-up line names it;
- rank 1 SIGSTOPped during start-up (model load, data listing or engine build) is named in stall.json in
  that phase within --stall-seconds + 15 s, and `sdzero train` exits 142; before, a start-up stall waited
  for the collective timeout with nothing named.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
from launch import CONFIGS, trainer_args

from sdzero.process.stall_watch import EXIT_STALLED, STALL_FILE
from sdzero.telemetry.metrics import read_metrics
from sdzero.telemetry.progress import SHM_ROOT, read_host

SDZERO = str(Path(sys.executable).with_name("sdzero"))
STALL_S = 8
STOP_IN = ("model load", "data listing", "engine build")


def start(command: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:  # a file, not a pipe: a full pipe would block the ranks
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def test_the_first_metrics_line_says_where_each_ranks_start_up_went(tiny_model, synth_data, tmp_path):
    out = tmp_path / "run"
    args = trainer_args(CONFIGS / "zero2_bf16.json", tiny_model, synth_data, out, 2)
    done = subprocess.run([SDZERO, "train", "--num-gpus", "2", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first, second = read_metrics(out / "metrics.jsonl")
    startup = first["startup"]
    assert [r["rank"] for r in startup["ranks"]] == [0, 1] and "startup" not in second
    for row in startup["ranks"]:
        assert set(STOP_IN) <= set(row["phases"]) and row["total_s"] > 0
    longest = startup["longest"]
    assert longest["seconds"] == max(s for r in startup["ranks"] for s in r["phases"].values())
    line = f"longest: rank {longest['rank']} ({longest['host']}) in {longest['phase']} "
    assert line in done.stdout + done.stderr


def test_a_rank_stopped_in_start_up_is_named_in_its_phase(tiny_model, synth_data, tmp_path):
    out = tmp_path / "run"
    args = trainer_args(
        CONFIGS / "zero2_bf16.json", tiny_model, synth_data, out, 100000, "--stall-seconds", str(STALL_S)
    )
    log = tmp_path / "train.log"
    command = start([SDZERO, "train", "--num-gpus", "2", *args], log)
    victim = None
    try:
        deadline = time.monotonic() + 150
        while victim is None:
            assert time.monotonic() < deadline and command.poll() is None, log.read_text()[-3000:]
            ours = {p.pid for p in psutil.Process(command.pid).children(recursive=True)}
            for folder in SHM_ROOT.glob("sdzero-progress-*"):
                for s in read_host(folder):
                    if s.pid in ours and s.rank == 1 and s.phase in STOP_IN:
                        victim = psutil.Process(s.pid)
                        victim.suspend()
                        stopped_at = time.time()
            time.sleep(0.02)
        code = command.wait(timeout=STALL_S + 60)
    finally:
        if victim is not None:
            with contextlib.suppress(psutil.Error):
                victim.kill()
        with contextlib.suppress(ProcessLookupError):
            if command.poll() is None:
                command.kill()
    text = log.read_text()
    assert code == EXIT_STALLED, text[-3000:]
    assert (out / STALL_FILE).stat().st_mtime - stopped_at <= STALL_S + 15
    stall = json.loads((out / STALL_FILE).read_text())
    held = [g for g in stall["groups"] if g["holding_the_job"]]
    assert len(held) == 1 and held[0]["ranks"] == [1] and held[0]["phase"] in STOP_IN, stall
    assert stall["summary"].startswith("rank 1 (") and "(not responding)" in stall["summary"]
    assert not (out / "metrics.jsonl").exists() or not read_metrics(out / "metrics.jsonl")
    print(f"start-up stall line: {stall['summary']}")
