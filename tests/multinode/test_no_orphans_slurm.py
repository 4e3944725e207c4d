"""No orphans under Slurm (`sdzero slurm`'s batch script, a real slurmctld and one slurmd per namespace host,
tests/cluster/slurm.py): SIGKILL of the process that started the ranks mid-run, the batch shell or its
`srun`, leaves within 10 s no rank, no srun, no step daemon (slurmstepd) and no batch shell on any host;
only the hosts' own daemons (sshd, slurmd, slurmctld, munged) remain.

Slurm itself does it: the batch shell's end ends the job, and the job's end ends every step (SIGTERM, then
SIGKILL KillWait later; KillWait is short here, tests/cluster/slurm.py); an `srun` killed makes the batch
shell go on to its end. The ranks' parent-death signal (sdzero.process.orphan_guard, slurmstepd is a
launcher) ends a rank whose step daemon dies first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from cluster import Cluster, ClusterUnavailable
from cluster import slurm as slurm_cluster
from cluster import unavailable_reason as cluster_unavailable
from cluster.netns import cmdline
from cluster.slurm import Slurm, _pids_in
from test_slurm import wait_for_job_step, write_job

pytestmark = pytest.mark.multinode

GONE_WITHIN_S = 10.0
STEPS = 100000


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    reason = cluster_unavailable() or slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(f"no Slurm on namespace hosts here: {reason}")
    try:
        with Cluster(hosts=2, slots=1) as made, slurm_cluster.running(made) as running:
            yield running
    except ClusterUnavailable as exc:
        pytest.skip(f"no namespace cluster on this machine: {exc}")


def is_daemon(line: str) -> bool:
    """A host's own Slurm daemon or its helper (`slurmctld: slurmscriptd`); slurmstepd is the job's."""
    return line.split(" ", 1)[0].split(":")[0].rsplit("/", 1)[-1] in slurm_cluster.DAEMONS


def leftovers(slurm: Slurm) -> list[str]:
    """Every process on the hosts but their daemons: what a job left behind."""
    daemons = set(slurm.pids.values()) | {h.sshd_pid for h in slurm.cluster.members}
    left = []
    for h in slurm.cluster.members:
        for pid in _pids_in(h):
            if pid in daemons or is_daemon(cmdline(pid)):
                continue
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{h.hostname}: {pid} {cmdline(pid)[:140]}")
    return left


def job_process(slurm: Slurm, match) -> int:
    for pid in _pids_in(slurm.cluster.master):
        if match(cmdline(pid)):
            return pid
    raise AssertionError(f"no such process on {slurm.cluster.master.hostname}: {leftovers(slurm)}")


def is_batch_shell(line: str) -> bool:
    return "slurm_script" in line and not line.startswith("slurmstepd")


def is_srun(line: str) -> bool:
    return line.split(" ", 1)[0].endswith("srun")


def kill_mid_run(slurm: Slurm, args, tmp_path: Path, match) -> float:
    out = tmp_path / "run"
    job_id = slurm.sbatch(write_job(tmp_path, 2, args(out, STEPS)), tmp_path)
    try:
        wait_for_job_step(slurm, job_id, out, 2)
        assert all(slurm.cluster.rank_pids(h) for h in slurm.cluster.members)
        os.kill(job_process(slurm, match), signal.SIGKILL)
        killed_at = time.monotonic()
        left = leftovers(slurm)
        while left and time.monotonic() - killed_at < GONE_WITHIN_S:
            time.sleep(0.2)
            left = leftovers(slurm)
        took = time.monotonic() - killed_at
    finally:
        slurm.client("scancel", "--signal=KILL", str(job_id), check=False)
        slurm.wait_gone(job_id, 60)
    assert not left, f"still running {GONE_WITHIN_S:.0f} s after SIGKILL:\n" + "\n".join(left)
    return took


def test_sigkill_of_the_batch_shell_leaves_nothing_on_any_host(slurm, args, tmp_path):
    took = kill_mid_run(slurm, args, tmp_path, is_batch_shell)
    print(f"everything gone {took:.1f} s after SIGKILL of the batch shell")


def test_sigkill_of_srun_leaves_nothing_on_any_host(slurm, args, tmp_path):
    took = kill_mid_run(slurm, args, tmp_path, is_srun)
    print(f"everything gone {took:.1f} s after SIGKILL of srun")
