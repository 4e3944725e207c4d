"""A cluster of "hosts" on one machine: network namespaces on a bridge, each with its own sshd.

Each host is a network namespace with one veth leg on a private bridge, its own UTS hostname (Open MPI
and DeepSpeed's MPI discovery tell nodes apart by hostname) and an sshd that listens only on that
namespace's address. The filesystem is shared, as on a cluster with NFS: the same venv and data paths
work on every host. Recipe and measurements: /work/shared/notes/multinode-on-one-machine.md.

Everything a cluster creates carries its tag (netns, bridge, veths, the state folder, the lines added to
~/.ssh/known_hosts), and is recorded in `STATE_ROOT/<tag>/state.json` before it is created, so that
`down()` ends exactly what was started, and a cluster left behind by a killed run is found and removed by
the next `up()` (its owner process is gone) without touching anything else.

Links can be rate-limited with `tc tbf` and given a one-way delay. This kernel has no `netem` ("Specified
qdisc kind is unknown"), so the delay is a TUN device in each host and a relay process that holds each
packet for the delay (delayline.py says how); the rate limit then sits on that device, before the delay.

With `cpus_per_host`, every host gets the same CPU quota (a cgroup its sshd, and so every process started
over ssh, belongs to; cpushare.py says how), so a host computes as fast alone as next to three others.
The delay relays stay outside the quota: they stand for the NIC, not for the host's cores.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster import cpushare

STATE_ROOT = Path("/run/sdzero-cluster")
SUBNET_PREFIX = "10.77"
"""Every address lives inside 10.77.X.0/24 on a bridge this module creates, X unused on this machine."""
KNOWN_HOSTS = Path.home() / ".ssh" / "known_hosts"
CLIENT_KEY = Path.home() / ".ssh" / "id_ed25519"
"""ssh, pdsh and Open MPI's ssh agent use the default identity, so the cluster authorizes that key."""
DELAY_DEVICE = "sdzdelay"
DELAY_TABLE = "177"
"""Routing table (and rule priority) that sends a host's own packets to the cluster through DELAY_DEVICE."""
DELAYED_MTU = 65000
"""MTU of every link while a delay is on: big packets keep the user-space relay to a few thousand a second."""
PLAIN_MTU = 1500


class ClusterUnavailable(RuntimeError):
    """This machine cannot host a cluster (not root, no namespaces, no sshd): tests skip with the reason."""


def run(cmd: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


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
            _check_share(self.cpus_per_host, self.hosts)

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
                self._make_cpu_shares()
            except BaseException:
                self.down()
                raise
        try:
            self._start_sshd()
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

    def _make_cpu_shares(self) -> None:
        if self.cpus_per_host is None:
            return
        try:
            fs = cpushare.detect()
            for h in self.members:
                path = fs.root / f"sdz-{self.tag}-n{h.index}"
                self.cgroups.append(str(path))
                self._save()  # recorded before it exists, as everything else
                cpushare.create(fs, path.name, self.cpus_per_host, parallel=self.slots)
        except (cpushare.CpuShareUnavailable, OSError) as exc:
            raise ClusterUnavailable(f"cannot give each host a CPU quota: {exc}") from exc

    def set_cpus_per_host(self, cpus: float) -> None:
        """Change every host's quota (a cluster made with one): e.g. more cores for a start-up-bound run."""
        if self.cpus_per_host is None:
            raise ValueError("this cluster was made without CPU quotas (cpus_per_host=None)")
        _check_share(cpus, self.hosts)
        fs = cpushare.detect()
        for h in self.members:
            cpushare.limit(fs, Path(self.cgroups[h.index - 1]), cpus, self.slots)
        self.cpus_per_host = cpus
        self._save()

    def cpu_group(self, h: Host) -> Path | None:
        """Host h's cgroup (None without a quota): its sshd and everything started over ssh belong to it."""
        return Path(self.cgroups[h.index - 1]) if self.cpus_per_host is not None else None

    @contextlib.contextmanager
    def local_share(self, cpus: float, ranks: int = 1):
        """This process, and what it starts meanwhile (`ranks` ranks), under a `cpus`-core quota: the 1-host
        reference trial gets the same share per rank as a host's ranks. Recorded in the state, so a killed
        run's group goes with the cluster."""
        fs = cpushare.detect()
        path = fs.root / f"sdz-{self.tag}-local{len(self.cgroups)}"
        self.cgroups.append(str(path))
        self._save()
        try:
            with cpushare.joined(path.name, cpus, fs, parallel=ranks) as group:
                yield group
        finally:
            self.cgroups.remove(str(path))
            self._save()

    def _start_sshd(self) -> None:
        d = self.state_dir
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")])
        if not CLIENT_KEY.exists():
            CLIENT_KEY.parent.mkdir(mode=0o700, exist_ok=True)
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(CLIENT_KEY)])
        shutil.copy(CLIENT_KEY.with_suffix(".pub"), d / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
        host_key = (d / "host_key.pub").read_text().split()
        with KNOWN_HOSTS.open("a") as f:
            for h in self.members:
                f.write(f"{h.address} {host_key[0]} {host_key[1]} {self.known_hosts_mark}\n")
        # No name server answers inside the namespaces (the machine's resolv.conf names one they cannot
        # reach), so every lookup of a name not in /etc/hosts, or of an address (gloo's rendezvous makes
        # reverse ones), would wait 10 s for the resolver's timeout. Each host's mount namespace gets a
        # resolv.conf naming 127.0.0.1, where nothing listens: lookups fail at once, as a real cluster's
        # DNS answers at once.
        resolv = d / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\n")
        for h in self.members:
            config = d / f"sshd_config.{h.index}"
            config.write_text(
                f"ListenAddress {h.address}\nHostKey {d / 'host_key'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "UsePAM no\nStrictModes no\nPidFile none\nMaxStartups 100\nMaxSessions 100\n"
                "AcceptEnv LANG LC_*\n"
            )
            log = (d / f"sshd.{h.index}.log").open("w")
            sshd = shutil.which("sshd") or "/usr/sbin/sshd"
            # nsenter enters the host's network namespace only: `ip netns exec` would also mount a fresh
            # /sys there, hiding /sys/fs/cgroup, so a host's ranks could not take a CPU group of their own
            # (tests/cluster/rankshare) and a 2-rank host's ranks would share its quota freely.
            proc = subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{h.netns}",
                    "unshare",
                    "--uts",
                    # A mount namespace of its own (a copy: /sys/fs/cgroup stays), mounts flowing in only:
                    # cluster/faults.py gives one host a private folder there, as a node without NFS.
                    "--mount",
                    "--propagation",
                    "slave",
                    "sh",
                    "-c",
                    f'mount --bind {resolv} /etc/resolv.conf && hostname "$0" && exec {sshd} -D -e -f {config}',
                    h.hostname,
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            h.sshd_pid = proc.pid  # `exec` keeps the pid: this is sshd itself
            self._save()
            group = self.cpu_group(h)
            if group is not None:  # before the first login: every session, and its ranks, inherits it
                cpushare.join(group, proc.pid)
        for h in self.members:
            self._wait_for_ssh(h)

    def _wait_for_ssh(self, h: Host, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            proc = self.ssh(h, "hostname", check=False, timeout=10)
            if proc.returncode == 0 and proc.stdout.strip() == h.hostname:
                return
            if time.monotonic() > deadline:
                log = (self.state_dir / f"sshd.{h.index}.log").read_text()[-2000:]
                raise RuntimeError(f"sshd on {h.address} did not answer: {proc.stderr.strip()}\n{log}")
            time.sleep(0.2)

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
        return run(
            ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", h.address, command],
            check=check,
            timeout=timeout,
        )

    def shape(self, rate: str | None, delay_ms: float | None = None) -> None:
        """Rate-limit every host's outgoing link with a token bucket and/or delay it by delay_ms one way
        (a round trip between two hosts then takes 2 x delay_ms); None removes either."""
        if delay_ms is not None and not 0 < delay_ms <= 1000:
            raise ValueError(f"delay_ms={delay_ms}: must be in (0, 1000] ms")
        if delay_ms != self.delay_ms:
            self._delay_off()
            if delay_ms:
                self._delay_on(delay_ms)
        device = DELAY_DEVICE if delay_ms else "eth0"
        for h in self.members:
            self.exec(h, ["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
            if rate is not None:
                # The bucket must hold one whole packet at the largest MTU (65000 with a delay); tbf's
                # hrtimer watchdog keeps the rate with no more (measured 199/976 Mbit/s at 200M/1G).
                # Anything above lets that much through at memory speed after each idle moment, which no
                # real link does: 256 kB was 10 ms of free traffic at 200 Mbit/s, after every compute
                # phase, and made the link look faster to a trial than to the back-to-back benchmark.
                self.exec(
                    h,
                    [
                        "tc",
                        "qdisc",
                        "replace",
                        "dev",
                        device,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        "70kb",
                        "latency",
                        "50ms",
                    ],
                )
            elif delay_ms:
                self.exec(h, ["tc", "qdisc", "del", "dev", device, "root"], check=False)
        self.shaped_rate = rate
        self._save()

    def _delay_on(self, delay_ms: float) -> None:
        """Start a relay in each host, then route the host's own packets for the cluster subnet through it."""
        self._set_mtu(DELAYED_MTU)
        relay = Path(__file__).with_name("delayline.py")
        for h in self.members:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", h.netns, sys.executable, str(relay), DELAY_DEVICE, str(delay_ms)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            self.delay_pids.append(proc.pid)
            self.delay_ms = delay_ms
            self._save()  # recorded at once: teardown also ends every process left in the namespace
            ready, _, _ = select.select([proc.stdout], [], [], 20)
            line = proc.stdout.readline().strip() if ready else ""
            if line != "ready":
                proc.kill()
                raise RuntimeError(f"delay relay in {h.netns} did not start: {line or 'no answer in 20 s'}")
            self.exec(h, ["ip", "link", "set", DELAY_DEVICE, "mtu", str(DELAYED_MTU), "up"])
            for key in (
                "net.ipv4.ip_forward=1",
                "net.ipv4.conf.all.rp_filter=0",
                f"net.ipv4.conf.{DELAY_DEVICE}.rp_filter=0",
                # the relay hands back packets whose source is this host's own address
                f"net.ipv4.conf.{DELAY_DEVICE}.accept_local=1",
            ):
                self.exec(h, ["sysctl", "-q", "-w", key])
            self.exec(
                h,
                [
                    "ip",
                    "route",
                    "add",
                    f"{self.subnet}.0/24",
                    "dev",
                    DELAY_DEVICE,
                    "src",
                    h.address,
                    "table",
                    DELAY_TABLE,
                ],
            )
            # `iif lo` is what the host sends itself; what the relay writes back arrives on the TUN device
            # and takes the main table out of eth0.
            self.exec(
                h,
                [
                    "ip",
                    "rule",
                    "add",
                    "pref",
                    DELAY_TABLE,
                    "iif",
                    "lo",
                    "to",
                    f"{self.subnet}.0/24",
                    "lookup",
                    DELAY_TABLE,
                ],
            )

    def _delay_off(self) -> None:
        for h in self.members:
            self.exec(h, ["ip", "rule", "del", "pref", DELAY_TABLE], check=False)
        for pid in self.delay_pids:
            if "delayline.py" in _cmdline(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for pid in self.delay_pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        if self.delay_pids:
            self._set_mtu(PLAIN_MTU)
        self.delay_pids, self.delay_ms = [], None
        self._save()

    def _set_mtu(self, mtu: int) -> None:
        # Host ends and bridge ports first: a bridge's MTU cannot exceed its ports'.
        for h in self.members:
            self.exec(h, ["ip", "link", "set", "eth0", "mtu", str(mtu)])
            run(["ip", "link", "set", h.veth, "mtu", str(mtu)])
        run(["ip", "link", "set", self.bridge, "mtu", str(mtu)])

    def rank_pids(self, h: Host, marker: str = "sdzero/train.py") -> list[int]:
        """Training ranks running in host h: processes in its namespace that run `marker` and whose parent
        does not (that parent is a launcher or orted; a DataLoader worker's parent is its rank)."""

        def is_rank(cmdline: str) -> bool:
            return marker in cmdline and "deepspeed.launcher" not in cmdline

        pids = [int(p) for p in run(["ip", "netns", "pids", h.netns]).stdout.split()]
        return [p for p in pids if is_rank(_cmdline(p)) and not is_rank(_cmdline(_ppid(p)))]

    def _save(self) -> None:
        state = {
            "tag": self.tag,
            "owner_pid": None if self.persistent else os.getpid(),
            "owner_start": None if self.persistent else _start_time(os.getpid()),
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


def _check_share(cpus_per_host: float, hosts: int) -> None:
    cores = len(os.sched_getaffinity(0))
    if not 0 < cpus_per_host * hosts <= cores:
        raise ValueError(
            f"cpus_per_host={cpus_per_host} x {hosts} hosts: the quotas must be positive and "
            f"add up to at most this machine's {cores} cores"
        )


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
        if "sshd" in _cmdline(pid) and str(state_dir) in _cmdline(pid):
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
    _drop_known_hosts(state.get("known_hosts_mark", ""))
    shutil.rmtree(state_dir, ignore_errors=True)


def _end_processes_in(netns: str) -> None:
    """Processes still inside one of our namespaces (ranks started over its sshd) are this cluster's."""
    pids = run(["ip", "netns", "pids", netns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _drop_known_hosts(mark: str) -> None:
    if not mark or not KNOWN_HOSTS.exists():
        return
    lines = KNOWN_HOSTS.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.rstrip().endswith(mark)]
    if len(kept) != len(lines):
        tmp = KNOWN_HOSTS.with_suffix(".sdzero-tmp")
        tmp.write_text("".join(kept))
        tmp.replace(KNOWN_HOSTS)


def reap_stale() -> list[str]:
    """Remove clusters whose owning process is gone (a killed test run); keep persistent (CLI) ones."""
    removed = []
    for state_file in STATE_ROOT.glob("*/state.json"):
        state = json.loads(state_file.read_text())
        pid = state.get("owner_pid")
        if pid is None:
            continue
        if _start_time(pid) == state.get("owner_start"):
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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _start_time(pid: int) -> int | None:
    """Process start time in clock ticks: tells a living owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


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
