"""A real Slurm on a namespace cluster: munged, one slurmctld and one slurmd per host (Debian's packages).

Every daemon runs inside a host's namespaces, entered from that host's sshd (`nsenter --target SSHD --net
--uts --mount`): its address, its hostname and its mount namespace, so a job's ranks see what a login over
ssh sees (the hosts' /etc/hosts naming every node, a private folder that cluster/faults.py bound there).
The first host is the head node too: slurmctld and munged run there beside its slurmd. munged's socket is
a file under the cluster's state folder, and a Unix socket bound to a path is reached from any network
namespace, so the one munged serves every host and the test process, as one key on every node would.

The clients (`sbatch`, `squeue`, `sacct`, `scontrol`) run here, the login node, with `SLURM_CONF` naming
this cluster's slurm.conf; sbatch hands the variable to the job (`--export=ALL`, its default), so `srun`
and `scontrol` in a batch script find the same file. Spool, log and pid files are per host
(`SlurmdSpoolDir=.../%n/spool`). No cgroup plugin is used (proctrack/linuxproc: a job's processes are
the descendants of its slurmstepd; task/none), and no accounting daemon: `sacct --completion` reads the job
completion log (jobcomp/filetxt), one record per job end, a requeue included.

Everything lives under `<cluster state>/slurm` and inside the cluster's namespaces: the cluster's teardown
ends the daemons (it kills what is left in its namespaces) even after a killed run; `down()` stops them
first, by pid, and gently.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cluster.netns import Cluster, Host
from cluster.sshd import KNOWN_HOSTS

CLIENTS = ("sbatch", "srun", "scontrol", "sacct", "sinfo", "squeue", "scancel")
DAEMONS = ("slurmctld", "slurmd", "munged")
APT_PACKAGES = "slurmctld slurmd slurm-client munge"
PARTITION = "test"
COMPLETION_FIELDS = "jobid,jobname,state,exitcode,nodelist,start,end"
"""What `sacct --completion` reads from the job completion log (jobcomp/filetxt has no step records)."""
CRED_EXPIRE_S = 10
SCHED_INTERVAL_S = 2
KILL_WAIT_S = 5
"""Shorter than Slurm's defaults (120, 60 and 30 s), so a requeue and a job's end take seconds here; each
is named where the tests and docs/cluster.md rely on it."""


def unavailable_reason() -> str | None:
    """Why no Slurm can be started here (the namespace cluster's own reasons are checked by its fixture)."""
    if os.geteuid() != 0:
        return "needs root (slurmd and munged run as root on the namespace hosts)"
    for tool in (*DAEMONS, *CLIENTS):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"`{tool}` is not installed (apt-get install -y {APT_PACKAGES})"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class Slurm:
    cluster: Cluster
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def folder(self) -> Path:
        return self.cluster.state_dir / "slurm"

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a shell on the login node needs: the cluster's slurm.conf."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def nodes(self) -> list[str]:
        return [h.hostname for h in self.cluster.members]

    # -- life cycle ------------------------------------------------------------------------------------

    def up(self, timeout_s: float = 60) -> Slurm:
        for sub in ("munge", "ctld", *self.nodes):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.folder / node / "spool").mkdir(exist_ok=True)
        self._write_munge_key()
        self.conf.write_text(self._slurm_conf())
        self._name_hosts_for_ssh()
        head = self.cluster.master
        key, sock = self.folder / "munge" / "munge.key", self.folder / "munge" / "munge.socket"
        # --force: munged otherwise refuses folders it finds too open (a umask leaving /run/sdzero-cluster
        # group-writable); the key is this cluster's own and lives only as long as it.
        self._start(
            "munged",
            head,
            [
                _binary("munged"),
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={self.folder / 'munge' / 'munged.pid'}",
                f"--log-file={self.folder / 'munge' / 'munged.log'}",
                f"--seed-file={self.folder / 'munge' / 'munged.seed'}",
            ],
        )
        _wait_for(lambda: sock.exists(), timeout_s, "munged made no socket", self.folder / "munge/munged.log")
        self._start("slurmctld", head, [_binary("slurmctld"), "-D", "-f", str(self.conf)])
        _wait_for(
            lambda: self.client("scontrol", "ping", check=False).stdout.count("UP") > 0,
            timeout_s,
            "slurmctld does not answer",
            self.folder / "ctld" / "slurmctld.log",
        )
        for h in self.cluster.members:
            self._start_slurmd(h)
        self.wait_idle(timeout_s)
        return self

    def down(self) -> None:
        """SIGTERM each daemon this object started (slurmds first, munged last), then SIGKILL stragglers."""
        order = sorted(self.pids, key=lambda n: (n == "munged", n == "slurmctld"))
        for name in order:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[name], signal.SIGTERM)
            _reap(self.pids[name], 10)
        self.pids.clear()

    def lose_node(self, host: Host, reason: str) -> None:
        """A node that dies under a job: it stops (its slurmd, slurmstepds and ranks are frozen, SIGSTOP:
        the other ranks wait on it in their collectives, none fails first), it is set DOWN (`scontrol
        update state=down`, what an administrator or a health check does; slurmctld itself would wait
        SlurmdTimeout, 300 s), and it powers off (SIGKILL). The host's sshd stays, for the cluster's
        teardown. Not the head node, whose slurmctld and munged the cluster needs."""
        assert host is not self.cluster.master, "the head node holds slurmctld and munged"
        slurmd = self.pids.pop(f"slurmd.{host.hostname}")
        node = [p for p in {slurmd, *_pids_in(host)} if p != host.sshd_pid]
        _signal_all(node, signal.SIGSTOP)
        self.client("scontrol", "update", f"nodename={host.hostname}", "state=down", f"reason={reason}")
        _signal_all(node, signal.SIGKILL)
        _reap(slurmd, 10)

    def restore(self, timeout_s: float = 60) -> None:
        """Every node back in service: a lost node's slurmd started again, a DOWN node resumed."""
        for h in self.cluster.members:
            if f"slurmd.{h.hostname}" not in self.pids:
                self._start_slurmd(h)
        for node, state in self.node_states().items():
            if state.startswith(("down", "drain")):
                self.client("scontrol", "update", f"nodename={node}", "state=resume")
        self.wait_idle(timeout_s)

    def _start_slurmd(self, h: Host) -> None:
        self._start(
            f"slurmd.{h.hostname}", h, [_binary("slurmd"), "-D", "-N", h.hostname, "-f", str(self.conf)]
        )

    def _start(self, name: str, host: Host, command: list[str]) -> None:
        assert host.sshd_pid is not None, "bring the cluster up first"
        log = (self.folder / f"{name}.out").open("w")
        proc = subprocess.Popen(
            ["nsenter", "--target", str(host.sshd_pid), "--net", "--uts", "--mount", *command],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.pids[name] = proc.pid  # nsenter execs the command: this is the daemon itself
        group = self.cluster.cpu_group(host)
        if group is not None:  # a host's jobs share its CPU quota, as its ssh logins do
            from cluster import cpushare

            cpushare.join(group, proc.pid)

    def _write_munge_key(self) -> None:
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)  # munged refuses a key that others can read

    def _name_hosts_for_ssh(self) -> None:
        """known_hosts lines for the node names (Slurm hands out names; the cluster accepted addresses),
        with the cluster's mark, so they go with it."""
        host_key = (self.cluster.state_dir / "host_key.pub").read_text().split()
        with KNOWN_HOSTS.open("a") as f:
            for h in self.cluster.members:
                f.write(f"{h.hostname} {host_key[0]} {host_key[1]} {self.cluster.known_hosts_mark}\n")

    def _slurm_conf(self) -> str:
        d, head = self.folder, self.cluster.master
        nodes = "\n".join(
            f"NodeName={h.hostname} NodeAddr={h.address} NodeHostname={h.hostname} CPUs=2 State=UNKNOWN"
            for h in self.cluster.members
        )
        return f"""# The namespace cluster {self.cluster.tag}: written by tests/cluster/slurm.py
ClusterName=sdz{self.cluster.tag}
SlurmctldHost={head.hostname}({head.address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={d / "munge" / "munge.socket"},cred_expire={CRED_EXPIRE_S}
CredType=cred/munge
StateSaveLocation={d / "ctld"}
SlurmctldPidFile={d / "ctld" / "slurmctld.pid"}
SlurmctldLogFile={d / "ctld" / "slurmctld.log"}
SlurmdSpoolDir={d}/%n/spool
SlurmdPidFile={d}/%n/slurmd.pid
SlurmdLogFile={d}/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: a job's processes are found as the descendants of its slurmstepd.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: `sacct --completion` reads this log, one record per job end (a requeue too).
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d / "jobcomp.log"}
SchedulerType=sched/builtin
# Pending jobs are tried every sched_interval s (default 60), besides on submit and at a job's end.
SchedulerParameters=sched_interval={SCHED_INTERVAL_S}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
# The hosts are namespaces of one machine: take their configured CPUs as they are.
SlurmdParameters=config_overrides
# A node set DOWN by hand stays down until resumed; one that stopped answering returns when it answers.
ReturnToService=1
# SIGTERM to a job's processes, SIGKILL this long after (default 30 s).
KillWait={KILL_WAIT_S}
MinJobAge=600
InactiveLimit=0
MessageTimeout=10
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

    # -- using it --------------------------------------------------------------------------------------

    def client(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 30,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env={**os.environ, **self.env, **(env or {})},
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def node_states(self) -> dict[str, str]:
        """`sinfo` per node: name -> state (idle, alloc, down*, ...)."""
        shown = self.client("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout
        return dict(line.split(None, 1) for line in shown.splitlines() if line.strip())

    def wait_idle(self, timeout_s: float = 60) -> None:
        _wait_for(
            lambda: self.node_states() == {n: "idle" for n in self.nodes},
            timeout_s,
            lambda: f"not every node idle: {self.node_states()}",
            self.folder / "ctld" / "slurmctld.log",
        )

    def sbatch(self, script: Path, cwd: Path, *options: str) -> int:
        """Submit as a user would, from cwd; the job id."""
        shown = self.client("sbatch", "--parsable", *options, str(script), cwd=cwd).stdout
        return int(shown.strip().split(";")[0])

    def sbatch_wrap(self, command: str, cwd: Path, *options: str, env: dict[str, str] | None = None) -> int:
        """`sbatch --wrap COMMAND`: a one-line batch job, its log slurm-<job name>-<id>.log in cwd."""
        shown = self.client(
            "sbatch",
            "--parsable",
            "--output=slurm-%x-%j.log",
            *options,
            f"--wrap={command}",
            cwd=cwd,
            env=env,
        ).stdout
        return int(shown.strip().split(";")[0])

    def job_state(self, job_id: int) -> str:
        shown = self.client("squeue", "--noheader", "--jobs", str(job_id), "--format=%T", check=False)
        return shown.stdout.strip() or "GONE"

    def wait_gone(self, job_id: int, timeout_s: float) -> float:
        """Wait until the job has left the queue (done, failed, cancelled); the seconds it took."""
        start = time.monotonic()
        _wait_for(lambda: self.job_state(job_id) == "GONE", timeout_s, f"job {job_id} still queued", None)
        return time.monotonic() - start

    def completions(self, job_id: int) -> list[dict[str, str]]:
        """The job's records in the completion log, oldest first (`sacct --completion`)."""
        shown = self.client(
            "sacct",
            "--completion",
            "--jobs",
            str(job_id),
            "--noheader",
            "--parsable2",
            f"--format={COMPLETION_FIELDS}",
        ).stdout
        names = COMPLETION_FIELDS.split(",")
        return [dict(zip(names, line.split("|"), strict=True)) for line in shown.splitlines() if line]

    def log_of(self, node: str) -> str:
        return (self.folder / node / "slurmd.log").read_text(errors="replace")


@contextlib.contextmanager
def running(cluster: Cluster) -> Iterator[Slurm]:
    """A Slurm on the cluster for the block; every node idle at the start."""
    slurm = Slurm(cluster)
    try:
        yield slurm.up()
    finally:
        slurm.down()


def _wait_for(
    ready: Callable[[], bool], timeout_s: float, what: str | Callable[[], str], log: Path | None
) -> None:
    """Poll `ready` until it holds; else fail, saying `what` (called then, if a function) and the log's tail."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            said = what() if callable(what) else what
            raise RuntimeError(f"{said} within {timeout_s:g} s\n{tail}")
        time.sleep(0.2)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _pids_in(host: Host) -> list[int]:
    shown = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in shown.stdout.split()]


def _reap(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (any more): poll for its end
            if not Path(f"/proc/{pid}").exists():
                return
            done = 0
        if done:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
