"""Exit codes and exits of a preempted rank: 143 only when the checkpoint is committed, another code when
the watchdog gives up, and no interpreter teardown (which waits on non-daemon children such as a
DataLoader worker that ignores SIGTERM) after the commit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from sdzero.process.preemption import EXIT_PREEMPTED, EXIT_WATCHDOG

STUCK_CHILD_THEN_PREEMPTED = textwrap.dedent("""
    import multiprocessing, signal, sys, time
    def stuck():  # a worker that ignores SIGTERM, as sdzero's DataLoader workers do
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    if __name__ == "__main__":
        child = multiprocessing.Process(target=stuck)  # non-daemon: teardown joins it
        child.start()
        print(child.pid, flush=True)
        import sdzero.training.trainer
        from sdzero.process.preemption import Preempted
        def run(cfg):
            raise Preempted()  # what the Trainer raises once the preemption checkpoint is committed
        sdzero.training.trainer.run = run
        import sdzero.train
        from pathlib import Path
        from types import SimpleNamespace
        sdzero.train.parse_train_args = lambda argv: SimpleNamespace(output_dir=Path("out"))
        sys.exit(sdzero.train.main([]))
""")

WATCHDOG = textwrap.dedent("""
    import os, signal, time
    from sdzero.process.preemption import PreemptionFlag
    PreemptionFlag(timeout_s=0.5).install()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # a save that never finishes
""")


def test_after_the_commit_the_rank_exits_143_without_waiting_on_its_children(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_CHILD_THEN_PREEMPTED], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    child = int(proc.stdout.readline())
    try:
        assert proc.wait(timeout=30) == EXIT_PREEMPTED
    finally:
        proc.kill()
        if psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


def test_the_watchdog_exits_with_its_own_code():
    done = subprocess.run([sys.executable, "-c", WATCHDOG], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_WATCHDOG != EXIT_PREEMPTED
    assert f"exiting with {EXIT_WATCHDOG} without one" in done.stderr
