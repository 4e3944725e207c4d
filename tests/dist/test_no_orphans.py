"""No orphans: SIGKILL of `sdzero train` mid-run, and of `sdzero advise` mid-trial, leaves no launcher,
rank or data-loader worker running 10 s later (sdzero.process.orphan_guard). Real processes: the command,
DeepSpeed's runner and per-node launcher, the ranks and their workers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch import CONFIGS, trainer_args

pytestmark = pytest.mark.dist

SDZERO = str(Path(sys.executable).with_name("sdzero"))
GONE_WITHIN_S = 10.0


def start(command: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:  # a file, not a pipe: a full pipe would block the ranks
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_rank(command: subprocess.Popen, log: Path, timeout: float = 150) -> list[psutil.Process]:
    """Every process below `command` once one of them is a training rank (its first step may not be done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert command.poll() is None, f"exited {command.returncode} early:\n{log.read_text()[-3000:]}"
        tree = psutil.Process(command.pid).children(recursive=True)
        ranks = [p for p in tree if _is_rank(p)]
        if ranks and all(_has_worker(r) for r in ranks):
            return tree
        time.sleep(0.2)
    raise AssertionError(f"no training rank within {timeout} s:\n{log.read_text()[-3000:]}")


def _is_rank(proc: psutil.Process) -> bool:
    try:
        line = " ".join(proc.cmdline())
        return "sdzero/train.py" in line and "--local_rank" in line and "deepspeed.launcher" not in line
    except psutil.Error:
        return False


def _has_worker(rank: psutil.Process) -> bool:
    """The rank is in its loop: its data-loader worker runs (the steps have begun)."""
    try:
        return bool(rank.children())
    except psutil.Error:
        return False


def left_running(tree: list[psutil.Process]) -> list[str]:
    alive = []
    for proc in tree:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            continue
    return alive


def kill_and_check(command: subprocess.Popen, tree: list[psutil.Process]) -> None:
    assert len(tree) >= 4, [p.pid for p in tree]  # runner or launcher, ranks, workers (and the guard)
    os.kill(command.pid, signal.SIGKILL)
    command.wait()
    time.sleep(GONE_WITHIN_S)
    alive = left_running(tree)
    for proc in tree:  # leave nothing behind for the next test, whatever the verdict
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not alive, f"still running {GONE_WITHIN_S:.0f} s after SIGKILL of the command:\n" + "\n".join(
        alive
    )


def test_sigkill_of_sdzero_train_ends_its_launcher_and_ranks(tiny_model, synth_data, tmp_path):
    args = trainer_args(CONFIGS / "zero2_bf16.json", tiny_model, synth_data, tmp_path / "run", 100000)
    log = tmp_path / "train.log"
    command = start([SDZERO, "train", "--num-gpus", "2", *args], log)
    kill_and_check(command, wait_for_rank(command, log))


def test_sigkill_of_sdzero_advise_mid_trial_ends_the_trial(tmp_path):
    log = tmp_path / "advise.log"
    out = tmp_path / "advise"
    command = start([SDZERO, "advise", "--out", str(out), "--max-nodes", "2", "--budget-minutes", "5"], log)
    kill_and_check(command, wait_for_rank(command, log))


def test_a_stopped_local_rank_is_named_and_sdzero_train_exits_restartable(tiny_model, synth_data, tmp_path):
    """One host, `sdzero train`: rank 1 SIGSTOPped mid-run is named in stall.json within --stall-seconds +
    15 s, and the command exits with EXIT_STALLED though the stopped rank could not exit by itself."""
    import json

    from sdzero.process.stall_watch import EXIT_STALLED, STALL_FILE

    out = tmp_path / "run"
    args = trainer_args(
        CONFIGS / "zero2_bf16.json", tiny_model, synth_data, out, 100000, "--stall-seconds", "8"
    )
    log = tmp_path / "train.log"
    command = start([SDZERO, "train", "--num-gpus", "2", *args], log)
    tree = wait_for_rank(command, log)
    victim = next(p for p in tree if _is_rank(p) and "--local_rank=1" in p.cmdline())
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().split()) < 2:
            assert time.monotonic() < deadline and command.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)  # the watch is armed once every rank is in the training loop
        victim.suspend()
        stopped_at = time.time()
        code = command.wait(timeout=60)
    finally:
        with contextlib.suppress(psutil.Error):
            victim.kill()
    text = log.read_text()
    assert code == EXIT_STALLED, text[-3000:]
    assert (out / STALL_FILE).stat().st_mtime - stopped_at <= 8 + 15
    stall = json.loads((out / STALL_FILE).read_text())
    assert stall["summary"].startswith("rank 1 (") and "(not responding); rank 0 (" in stall["summary"]
    assert f"exit {EXIT_STALLED}: restart with --resume auto" in text
    psutil.wait_procs(tree, timeout=5)  # the launch's guard leaves once the stopped rank's group is empty
    assert not left_running(tree)
