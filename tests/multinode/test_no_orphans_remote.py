"""No orphans on the multi-host launch paths: when the process that started a launch across two namespace
hosts dies by SIGKILL mid-run, within 10 s nothing of the launch runs anywhere: not on the launching host
(DeepSpeed's runner, pdsh, ssh, mpirun, the guard) and not on either host (the remote shells, DeepSpeed's
per-node launcher, orted, the ranks and their data-loader workers). Real processes on real hosts
(tests/cluster): each host's namespace must hold nothing but its sshd afterwards.

Two cases per launcher: the command alone is killed (its LaunchGuard ends the launch), and the command
is killed together with its guard and its local launch (a login node's OOM kill or lost session), where
only the remote side itself can notice (sdzero.process.session_watch).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from cluster.launching import SDZERO, start, wait_for_step
from cluster.netns import Cluster, Host, cmdline, run

pytestmark = pytest.mark.multinode

GONE_WITHIN_S = 10.0


def host_leftovers(cluster: Cluster, h: Host) -> list[str]:
    """Every process in host h's namespace but its sshd listener (the launch's sessions included)."""
    pids = [int(p) for p in run(["ip", "netns", "pids", h.netns]).stdout.split()]
    left = []
    for pid in pids:
        if pid == h.sshd_pid:
            continue
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{h.hostname}: {pid} {cmdline(pid)[:140]}")
    return left


def local_leftovers(tree: list[psutil.Process]) -> list[str]:
    left = []
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(f"local: {proc.pid} {' '.join(proc.cmdline())[:140]}")
    return left


def start_launch(cluster: Cluster, args, tmp_path: Path, *options: str) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "run"
    long_run = args(out, 100000)
    command = [SDZERO, "launch", "--hostfile", str(cluster.hostfile), *options, "--", *long_run]
    proc = start(command, tmp_path / "launch.log", tmp_path)
    try:
        wait_for_step(out, 2, proc, timeout=240)
    except AssertionError as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{exc}:\n{(tmp_path / 'launch.log').read_text()[-4000:]}") from None
    for h in cluster.members:
        assert cluster.rank_pids(h), f"no rank on {h.hostname}"
    return proc, out


def kill_and_measure(
    cluster: Cluster, proc: subprocess.Popen, with_guard: bool, stop: bool
) -> tuple[float, list[str]]:
    """SIGKILL the command (and, with_guard, everything it started on this host at the same instant);
    seconds until nothing of the launch runs anywhere, and what still ran after GONE_WITHIN_S. With
    `stop`, the second host's rank is SIGSTOPped first: a hung rank writes nothing into its closed ssh
    channel, so nothing on its host fails by itself."""
    if stop:
        for pid in cluster.rank_pids(cluster.members[1]):
            os.kill(pid, signal.SIGSTOP)
    tree = psutil.Process(proc.pid).children(recursive=True)
    victims = [proc.pid] + ([p.pid for p in tree] if with_guard else [])
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait()
    left: list[str] = []
    while time.monotonic() - killed_at < GONE_WITHIN_S:
        left = local_leftovers(tree) + [x for h in cluster.members for x in host_leftovers(cluster, h)]
        if not left:
            return time.monotonic() - killed_at, []
        time.sleep(0.2)
    return time.monotonic() - killed_at, left


def clean_up(cluster: Cluster, tree_root: subprocess.Popen) -> None:
    """Whatever the verdict, leave nothing for the next test (by pid, only this launch's)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(tree_root.pid, signal.SIGKILL)
    for h in cluster.members:
        for pid in run(["ip", "netns", "pids", h.netns]).stdout.split():
            if int(pid) != h.sshd_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def check(cluster: Cluster, args, tmp_path: Path, with_guard: bool, stop: bool, *options: str) -> None:
    proc, _ = start_launch(cluster, args, tmp_path, *options)
    try:
        took, left = kill_and_measure(cluster, proc, with_guard, stop)
    finally:
        clean_up(cluster, proc)
    log = (tmp_path / "launch.log").read_text()
    assert not left, f"still running {GONE_WITHIN_S:.0f} s after SIGKILL:\n" + "\n".join(left) + log[-2000:]
    how = f"{' '.join(options) or 'pdsh'}, guard killed: {with_guard}, remote rank stopped: {stop}"
    print(f"everything gone {took:.1f} s after SIGKILL ({how})")


def test_pdsh_launch_killed_leaves_nothing_on_any_host(cluster, args, tmp_path):
    """The command alone: its guard kills pdsh and the runner here and pkills the ranks on every host."""
    check(cluster, args, tmp_path, False, True)


def test_pdsh_launch_killed_with_its_guard_leaves_nothing_on_any_host(cluster, args, tmp_path):
    """The launching host's side all gone at once, a remote rank hung: the ssh sessions' end does it."""
    check(cluster, args, tmp_path, True, True)


def _need_mpi() -> None:
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI is not installed (apt-get install -y openmpi-bin libopenmpi-dev)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install -e '.[mpi]')")


def test_openmpi_launch_killed_leaves_nothing_on_any_host(cluster, args, tmp_path):
    _need_mpi()
    check(cluster, args, tmp_path, False, True, "--launcher", "openmpi")


def test_openmpi_launch_killed_with_its_guard_leaves_nothing_on_any_host(cluster, args, tmp_path):
    _need_mpi()
    check(cluster, args, tmp_path, True, True, "--launcher", "openmpi")
