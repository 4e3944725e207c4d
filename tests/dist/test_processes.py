"""`sdzero comm` (and, through the same wrapper, `advise` and `profile`) ends every process it started
when it gets SIGINT, SIGTERM or SIGHUP: the ranks run in a session of their own, which a signal to the
command never reaches, so before this SIGTERM/SIGHUP left them running as orphans."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.dist

SDZERO = str(Path(sys.executable).with_name("sdzero"))


def rank_processes(
    root: psutil.Process, marker: str, count: int, timeout_s: float = 120
) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = []
        for child in root.children(recursive=True):
            try:
                cmdline = child.cmdline()  # the ranks themselves, not the launchers naming the module
                if any(marker in part for part in cmdline) and not any(
                    "deepspeed" in part for part in cmdline
                ):
                    found.append(child)
            except psutil.Error:
                continue
        if len(found) >= count:
            return found
        assert root.is_running(), "the command ended before its ranks started"
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} ranks within {timeout_s} s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_comm_ends_its_ranks_on_a_signal(sig, tmp_path):
    command = [
        SDZERO,
        "comm",
        "--out",
        str(tmp_path),
        "--backend",
        "torch",
        "--budget-s",
        "300",
        "--min-bytes",
        "4KiB",
        "--max-bytes",
        "64MiB",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        root = psutil.Process(proc.pid)
        ranks = rank_processes(root, "collectives_rank", 2)
        started = [root, *root.children(recursive=True)]
        proc.send_signal(sig)
        gone, alive = psutil.wait_procs(started, timeout=15)  # reaps the command: its code is read here
        assert alive == [], [p.pid for p in alive]
        assert all(not r.is_running() for r in ranks)
        assert {p.pid: p.returncode for p in gone}[proc.pid] == 128 + sig
    finally:
        for p in (
            [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            if proc.poll() is None
            else []
        ):
            p.kill()
