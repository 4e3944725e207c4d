"""sdzero.process.session_watch on real processes, one host: a stand-in sshd session (a process whose
argv[0] reads `sshd: ...`) runs a shell line that starts a stand-in per-node launcher (its command line
names deepspeed.launcher.launch), which starts a real rank entry. When the session process dies, the
launcher and the rank end within seconds; a launcher not started over ssh gets no watcher."""

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

from sdzero.process.rank_entry import MODULE, Payload, encode_payload

LAUNCHER = """import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-m", "{module}", "{payload}"])
open("{pids}", "w").write(f"{{rank.pid}}\\n")
rank.wait()
time.sleep(600)  # a launcher that outlives its rank would show here
"""
RANK = "import time; time.sleep(600)"


def start_chain(tmp_path: Path, via_sshd: bool) -> tuple[subprocess.Popen, psutil.Process, psutil.Process]:
    payload = encode_payload(Payload(cwd=str(tmp_path), command=["-c", RANK], env={}, secrets_file=None))
    pids = tmp_path / "rank.pid"
    code = LAUNCHER.format(module=MODULE, payload=payload, pids=pids)
    (tmp_path / "launcher.py").write_text(code)
    launcher = f"exec {sys.executable} {tmp_path / 'launcher.py'} deepspeed.launcher.launch"
    # the session: sleeps while a shell runs the launcher line, as sshd does with a remote command
    session_code = f"import subprocess, time; subprocess.Popen(['sh', '-c', {launcher!r}]); time.sleep(600)"
    name = "sshd: test@notty" if via_sshd else "python3"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    session = subprocess.Popen(
        ["bash", "-c", f'exec -a "{name}" {sys.executable} -c "$0"', session_code],
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not (pids.exists() and pids.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the stand-in launcher did not start its rank"
        time.sleep(0.05)
    rank = psutil.Process(int(pids.read_text()))
    return session, rank.parent(), rank


def _gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _cleanup(session: subprocess.Popen, *procs: psutil.Process) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(session.pid, signal.SIGKILL)
    session.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_the_rank_and_its_launcher_end_with_their_ssh_session(tmp_path):
    session, launcher, rank = start_chain(tmp_path, via_sshd=True)
    try:
        time.sleep(1)  # the rank is running (exec'd), its watcher beside it
        assert not _gone(rank) and not _gone(launcher)
        assert any(c.pid != rank.pid for c in rank.children())  # the watcher, the rank's child
        session.kill()  # the ssh connection closed: sshd's session process exits, signalling nobody
        session.wait()
        deadline = time.monotonic() + 5
        while not (_gone(rank) and _gone(launcher)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(rank) and _gone(launcher)
    finally:
        _cleanup(session, rank, launcher)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_launch_not_started_over_ssh_gets_no_watcher(tmp_path):
    session, launcher, rank = start_chain(tmp_path, via_sshd=False)
    try:
        time.sleep(1)
        assert rank.children() == []
        session.kill()
        session.wait()
        time.sleep(1.5)
        assert not _gone(rank) and not _gone(launcher)  # a user's nohup'd launch outlives its shell
    finally:
        _cleanup(session, rank, launcher)


def test_the_watcher_ends_with_its_rank(tmp_path):
    session, launcher, rank = start_chain(tmp_path, via_sshd=True)
    try:
        time.sleep(1)
        (watcher,) = rank.children()
        rank.kill()
        deadline = time.monotonic() + 5
        while not _gone(watcher) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(watcher)
    finally:
        _cleanup(session, rank, launcher)
