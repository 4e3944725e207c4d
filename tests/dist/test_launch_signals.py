"""A stop signal to `sdzero train` reaches the ranks of a real 2-rank launch (issue #44): SIGTERM to the
command alone (as a scheduler preempting the job step sends it) ends the run with a committed checkpoint
of the step it stopped at and exit 143, with no process of the launch left behind. Before, the runner and
both ranks trained on to the last step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from ckpt_helpers import wait_for_step
from launch import CONFIGS, trainer_args

from sdzero.checkpoint import checkpointer as ck
from sdzero.telemetry.metrics import read_metrics

STEPS = 300


def start_sdzero_train(out: Path, model: Path, data: Path) -> subprocess.Popen:
    args = trainer_args(CONFIGS / "zero2_bf16.json", model, data, out, STEPS, "--checkpoint-every", "0")
    log = open(f"{out}.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sdzero.cli", "train", "--num-gpus", "2", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the test's own handle to kill everything if the fix fails
    )
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


def test_sigterm_to_sdzero_train_saves_and_exits_143(tmp_path, tiny_model, synth_data):
    out = tmp_path / "run"
    proc = start_sdzero_train(out, tiny_model, synth_data)
    tree: list[psutil.Process] = []
    try:
        wait_for_step(out, 2, proc)
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGTERM)  # to the command alone, not its process group
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.log_file.close()  # type: ignore[attr-defined]
    log = Path(f"{out}.log").read_text(errors="replace")
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert code == 143, log[-3000:]
    assert steps[-1] < STEPS, "the ranks trained on to the end"
    complete = [m.step for _, m in ck.complete_checkpoints(ck.checkpoint_root(out))]
    assert complete == [steps[-1]], (complete, steps[-1])  # the save of the step it stopped at
    assert "passed to the ranks as SIGTERM" in log
    time.sleep(1)
    left = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
