"""A cluster of "hosts" on one machine: network namespaces on a bridge, each with its own sshd.

Each host is a network namespace with one veth leg on a private bridge, its own UTS hostname (Open MPI
and DeepSpeed's MPI discovery tell nodes apart by hostname) and an sshd that listens only on that
namespace's address. The filesystem is shared, as on a cluster with NFS: the same venv and data paths
work on every host. Recipe and measurements: /work/shared/notes/multinode-on-one-machine.md.

Everything a cluster creates carries its tag (netns, bridge, veths, the state folder, the lines added to
~/.ssh/known_hosts), and is recorded in `STATE_ROOT/<tag>/state.json` before it is created, so that
`down()` ends exactly what was started, and a cluster left behind by a killed run is found and removed by
the next `up()` (its owner process is gone) without touching anything else.

This module holds the cluster's life cycle, its network and its state; each other role has its module:
sshd.py starts the hosts' sshd, shaping.py rate-limits and delays the links (this kernel has no netem:
delayline.py's relays), quotas.py gives every host the same CPU share (cpushare.py makes the groups).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cluster import cpushare, quotas, shaping, sshd
from cluster.shaping import DELAY_DEVICE, DELAY_TABLE, DELAYED_MTU, PLAIN_MTU
from cluster.sshd import CLIENT_KEY, KNOWN_HOSTS
from cluster.system import ClusterUnavailable, cmdline, ppid, run, start_time

__all__ = [
    "CLIENT_KEY",
    "DELAYED_MTU",
    "DELAY_DEVICE",
    "DELAY_TABLE",
    "KNOWN_HOSTS",
    "PLAIN_MTU",
    "STATE_ROOT",
    "Cluster",
    "ClusterUnavailable",
    "Host",
    "list_clusters",
    "reap_stale",
    "run",
    "teardown",
    "unavailable_reason",
]

STATE_ROOT = Path("/run/sdzero-cluster")
SUBNET_PREFIX = "10.77"
"""Every address lives inside 10.77.X.0/24 on a bridge this module creates, X unused on this machine."""
_cmdline = cmdline  # the names the tests read


def unavailable_reason() -> str | None:
    """Why no cluster can be made here, or None. Cheap checks first; namespaces are tried for real."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge and sshd)"
    for tool in ("ip", "tc", "sshd", "ssh", "ssh-keygen", "unshare"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"`{tool}` is not installed (apt-get install -y iproute2 openssh-server openssh-client)"
    probe = f"sdzprobe{os.getpid() % 100000}"
    made = run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    run(["ip", "netns", "del", probe], check=False)
    return None


@dataclass
class Host:
    index: int
    netns: str
    veth: str
    address: str
    hostname: str
    sshd_pid: int | None = None


@dataclass
class Cluster:
    """`with Cluster(hosts=2) as c:` ... `c.hostfile`; or `c.up()` / `c.down()` (also at exit and SIGTERM)."""

    hosts: int = 2
    slots: int = 1
    persistent: bool = False
    """Kept after this process exits (the CLI's `up`); otherwise a later `up()` removes it as stale."""
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    members: list[Host] = field(default_factory=list)
    subnet: str = ""
    shaped_rate: str | None = None
    delay_ms: float | None = None
    delay_pids: list[int] = field(default_factory=list)
    cpus_per_host: float | None = None
    """CPU quota of each host in cores (e.g. 0.4); None: no quota, the hosts share the cores freely."""
    cgroups: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cpus_per_host is not None:
            quotas.check_share(self.cpus_per_host, self.hosts)

    @property
    def state_dir(self) -> Path:
        return STATE_ROOT / self.tag

    @property
    def bridge(self) -> str:
        return f"sdzb{self.tag}"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    @property
    def hostfile(self) -> Path:
        return self.state_dir / "hostfile"

    @property
    def master(self) -> Host:
        return self.members[0]

    def write_hostfile(self, path: Path, slots: int | None = None, hosts: int | None = None) -> Path:
        lines = [
            f"{h.address} slots={slots or self.slots}" for h in self.members[: hosts or len(self.members)]
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    # -- life cycle ------------------------------------------------------------------------------------

    def up(self) -> Cluster:
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        STATE_ROOT.mkdir(parents=True, exist_ok=True)
        with _lock():
            reap_stale()
            self.subnet = _free_subnet()
            self.members = [
                Host(
                    i,
                    f"sdz-{self.tag}-n{i}",
                    f"sdzv{self.tag}n{i}",
                    f"{self.subnet}.{10 + i}",
                    f"node{i}-{self.tag}",
                )
                for i in range(1, self.hosts + 1)
            ]
            self.state_dir.mkdir()
            self._save()  # recorded before anything exists, so a crash half-way is still cleaned up
            if not self.persistent:
                _register_teardown(self)
            try:
                self._make_network()
                quotas.make_host_groups(self)
            except BaseException:
                self.down()
                raise
        try:
            sshd.start(self)
        except BaseException:
            self.down()
            raise
        return self

    def _make_network(self) -> None:
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        for h in self.members:
            run(["ip", "netns", "add", h.netns])
            run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns])
            run(["ip", "link", "set", h.veth, "master", self.bridge, "up"])
            self.exec(h, ["ip", "addr", "add", f"{h.address}/24", "dev", "eth0"])
            self.exec(h, ["ip", "link", "set", "eth0", "up"])
            self.exec(h, ["ip", "link", "set", "lo", "up"])
            # Traffic to the launching machine goes through the bridge's address.
            self.exec(h, ["ip", "route", "add", "default", "via", self.gateway])

    # -- CPU quotas (quotas.py) ---------------------------------------------------------------------

    def set_cpus_per_host(self, cpus: float) -> None:
        """Change every host's quota (a cluster made with one): e.g. more cores for a start-up-bound run."""
        quotas.set_cpus_per_host(self, cpus)

    def cpu_group(self, h: Host) -> Path | None:
        """Host h's cgroup (None without a quota): its sshd and everything started over ssh belong to it."""
        return Path(self.cgroups[h.index - 1]) if self.cpus_per_host is not None else None

    @contextlib.contextmanager
    def local_share(self, cpus: float, ranks: int = 1) -> Iterator[Path]:
        """This process, and what it starts meanwhile (`ranks` ranks), under a `cpus`-core quota: the 1-host
        reference trial gets the same share per rank as a host's ranks. Recorded in the state, so a killed
        run's group goes with the cluster."""
        with quotas.local_share(self, cpus, ranks) as group:
            yield group

    def down(self) -> None:
        teardown(self.state_dir)
        _unregister_teardown(self)

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- using it --------------------------------------------------------------------------------------

    @property
    def known_hosts_mark(self) -> str:
        return f"sdzero-cluster-{self.tag}"

    def exec(self, h: Host, cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return run(["ip", "netns", "exec", h.netns, *cmd], check=check)

    def ssh(
        self, h: Host, command: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        return sshd.ssh(h, command, check, timeout)

    # -- links (shaping.py) ------------------------------------------------------------------------------

    def shape(self, rate: str | None, delay_ms: float | None = None) -> None:
        """Rate-limit every host's outgoing link with a token bucket and/or delay it by delay_ms one way
        (a round trip between two hosts then takes 2 x delay_ms); None removes either."""
        shaping.shape(self, rate, delay_ms)

    def rank_pids(self, h: Host, marker: str = "sdzero/train.py") -> list[int]:
        """Training ranks running in host h: processes in its namespace that run `marker` and whose parent
        does not (that parent is a launcher or orted; a DataLoader worker's parent is its rank)."""

        def is_rank(cmdline: str) -> bool:
            return marker in cmdline and "deepspeed.launcher" not in cmdline

        pids = [int(p) for p in run(["ip", "netns", "pids", h.netns]).stdout.split()]
        return [p for p in pids if is_rank(cmdline(p)) and not is_rank(cmdline(ppid(p)))]

    def _save(self) -> None:
        state = {
            "tag": self.tag,
            "owner_pid": None if self.persistent else os.getpid(),
            "owner_start": None if self.persistent else start_time(os.getpid()),
            "bridge": self.bridge,
            "subnet": self.subnet,
            "netns": [h.netns for h in self.members],
            "veths": [h.veth for h in self.members],
            "sshd_pids": [h.sshd_pid for h in self.members if h.sshd_pid],
            "known_hosts_mark": self.known_hosts_mark,
            "hosts": [{"address": h.address, "hostname": h.hostname, "netns": h.netns} for h in self.members],
            "shaped_rate": self.shaped_rate,
            "delay_ms": self.delay_ms,
            "delay_pids": self.delay_pids,
            "cpus_per_host": self.cpus_per_host,
            "cgroups": self.cgroups,
        }
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / "state.json")


# -- teardown: by recorded state, so it also works for a cluster whose owner died ---------------------


def teardown(state_dir: Path) -> None:
    """Remove what the state file records: sshd pids (only if still this cluster's sshd), netns, bridge,
    known_hosts lines. Safe to call twice."""
    path = state_dir / "state.json"
    if not path.exists():
        shutil.rmtree(state_dir, ignore_errors=True)
        return
    state = json.loads(path.read_text())
    for pid in state.get("sshd_pids", []):
        # Only a process that is still sshd running our own config file; a reused pid is left alone.
        if "sshd" in cmdline(pid) and str(state_dir) in cmdline(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    for netns in state.get("netns", []):
        _end_processes_in(netns)
        run(["ip", "netns", "del", netns], check=False)
    for veth in state.get("veths", []):
        run(["ip", "link", "del", veth], check=False)
    if state.get("bridge"):
        run(["ip", "link", "del", state["bridge"]], check=False)
    for group in state.get("cgroups", []):
        # Its processes (sshd, ranks) were ended above; a straggler is moved to the parent, not killed.
        with contextlib.suppress(OSError):
            cpushare.remove(Path(group))
    sshd.drop_known_hosts(state.get("known_hosts_mark", ""))
    shutil.rmtree(state_dir, ignore_errors=True)


def _end_processes_in(netns: str) -> None:
    """Processes still inside one of our namespaces (ranks started over its sshd) are this cluster's."""
    pids = run(["ip", "netns", "pids", netns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def reap_stale() -> list[str]:
    """Remove clusters whose owning process is gone (a killed test run); keep persistent (CLI) ones."""
    removed = []
    for state_file in STATE_ROOT.glob("*/state.json"):
        state = json.loads(state_file.read_text())
        pid = state.get("owner_pid")
        if pid is None:
            continue
        if start_time(pid) == state.get("owner_start"):
            continue  # its owner is alive
        teardown(state_file.parent)
        removed.append(state["tag"])
    return removed


def list_clusters() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(STATE_ROOT.glob("*/state.json"))]


def _free_subnet() -> str:
    used = run(["ip", "-o", "-4", "addr"]).stdout + run(["ip", "-o", "-4", "route"]).stdout
    taken = {s["subnet"] for s in list_clusters()}
    for x in range(0, 255):
        subnet = f"{SUBNET_PREFIX}.{x}"
        if f"{subnet}." not in used and subnet not in taken:
            return subnet
    raise RuntimeError(f"no free {SUBNET_PREFIX}.X.0/24 subnet left")


@contextlib.contextmanager
def _lock():
    with (STATE_ROOT / ".lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- teardown at exit and on SIGTERM for clusters owned by this process --------------------------------

_OWNED: list[Cluster] = []


def _teardown_owned() -> None:
    for cluster in list(_OWNED):
        cluster.down()


def _on_sigterm(signum: int, frame: object) -> None:
    _teardown_owned()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _register_teardown(cluster: Cluster) -> None:
    if not _OWNED:
        atexit.register(_teardown_owned)
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            with contextlib.suppress(ValueError):  # not the main thread: atexit still covers normal exits
                signal.signal(signal.SIGTERM, _on_sigterm)
    _OWNED.append(cluster)


def _unregister_teardown(cluster: Cluster) -> None:
    if cluster in _OWNED:
        _OWNED.remove(cluster)
