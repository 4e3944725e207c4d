"""`sdzero launch`: check a DeepSpeed hostfile, write the `.deepspeed_env` remote ranks need, then launch.

What goes wrong on real clusters, and is checked here before any rank starts:
- a host that does not resolve, or that passwordless ssh cannot reach (DeepSpeed itself only tries the
  first host, and then pdsh hangs or prints a wall of errors for the others);
- `slots=` that is missing, zero, over MAX_SLOTS or not a number, a host listed twice (also as another
  spelling or address of the same machine), a name with shell metacharacters (pdsh and mpirun put host
  names into remote shell command lines) or one DNS cannot hold, and IPv6 literals (see IPV6_LITERAL_FIX);
- remote ranks that never see the launching shell's environment: DeepSpeed forwards variables only
  through `.deepspeed_env` (KEY=VALUE lines, read from the working directory and from $HOME). Without
  GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, gloo and NCCL bind to whatever the hostname resolves to
  (often 127.0.0.1) and the ranks never meet.
The launch itself (folder and values passed exactly, secrets by file) is sdzero.cluster.remote_launch.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sdzero.cluster.env_file import ENV_FILE, EnvMerge, env_file_name, merge_env_file, read_env_file
from sdzero.cluster.launch_command import REPO_ROOT, TRAIN_SCRIPT
from sdzero.cluster.remote_launch import RemoteLaunch, forwarded_values, remote_launch
from sdzero.config.user_file import read_user_bytes
from sdzero.errors import UserError

__all__ = ["ENV_FILE", "EnvMerge", "merge_env_file", "read_env_file"]  # the env file's, re-exported

HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$", re.ASCII)
"""Host names, IPv4 and IPv6 addresses; nothing a remote shell would interpret."""
HOSTFILE_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", re.ASCII)
"""What a hostfile line may name: a host name or IPv4 address (IPv6 literals: see IPV6_LITERAL_FIX)."""
ZONE_ID = re.compile(r"^[A-Za-z0-9._-]+$", re.ASCII)
"""An IPv6 zone (scope) id after '%': an interface name or number."""
MAX_SLOTS = 1024
"""Ranks per host: far above any machine's accelerators (8-16 today), low enough that a typo (slots=80000)
is caught here rather than as thousands of processes started on one node."""
DNS_LABEL_MAX, DNS_NAME_MAX = 63, 253
"""RFC 1035 limits; Python's resolver raises a UnicodeError (not a lookup failure) past them."""
IPV6_LITERAL_FIX = (
    "IPv6 addresses cannot be hostfile hosts: DeepSpeed reads `host:slots` in its --include syntax and pdsh "
    "reads `word:` in -w as a remote-command type, so the ':' splits the address. Give the host a name "
    "(an /etc/hosts line or DNS) and list the name: names that resolve only to IPv6 work"
)
LAUNCHERS = ("pdsh", "openmpi")
SSH_TIMEOUT_S = 5


@dataclass(frozen=True)
class HostEntry:
    host: str
    slots: int
    line: int


Runner = Callable[[str, str], "subprocess.CompletedProcess[str]"]
"""(host, shell command) -> completed process; ssh in real use, a stand-in in unit tests."""


def ssh_runner(host: str, command: str) -> subprocess.CompletedProcess[str]:
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_TIMEOUT_S}", host, command]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=SSH_TIMEOUT_S + 25)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 255, "", f"no answer within {SSH_TIMEOUT_S + 25} s")


def host_key(host: str) -> str:
    """One spelling per host name: DNS names are case-insensitive and a final '.' is the same name."""
    return host.rstrip(".").lower()


def check_host_name(host: str, where: str) -> None:
    """One clear line for every host a hostfile must not name."""
    if ipv6_literal(host) is not None:
        raise UserError(f"{where}: host {host!r}: {IPV6_LITERAL_FIX}")
    if ":" in host:
        raise UserError(
            f"{where}: host {host!r} holds ':', which DeepSpeed (`host:slots`) and pdsh (`type:hosts`) read "
            "as a separator; list the host name alone (an ssh port belongs in ~/.ssh/config)"
        )
    if not HOSTFILE_HOST.match(host):
        bad = sorted({c for c in host if not re.match(r"[A-Za-z0-9._-]", c)}) or [host[:1]]
        raise UserError(
            f"{where}: host name {host!r} contains {''.join(bad)!r}; host names may hold only letters, "
            "digits, '.', '-' and '_' (the launchers put them into remote shell commands)"
        )
    labels = host.rstrip(".").split(".")
    longest = max(labels, key=len)
    if len(host.rstrip(".")) > DNS_NAME_MAX or len(longest) > DNS_LABEL_MAX or "" in labels:
        problem = (
            f"is {len(host)} characters long (DNS allows {DNS_NAME_MAX})"
            if len(host.rstrip(".")) > DNS_NAME_MAX
            else "has an empty part between dots"
            if "" in labels
            else f"has a part of {len(longest)} characters (DNS allows {DNS_LABEL_MAX} between dots)"
        )
        raise UserError(f"{where}: host name {host[:40]!r}... {problem}; fix the name in the hostfile")


def hostfile_lines(path: Path) -> list[str]:
    data = read_user_bytes(path, "--hostfile")  # a FIFO or a device: one line, never a read that blocks
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(
            f"--hostfile {path}:{line}: byte {exc.start} is not UTF-8; host names are ASCII, write "
            "the file as plain text (`host slots=N` per line)"
        ) from None
    except OSError as exc:
        raise UserError(f"--hostfile {path}: cannot read it ({exc.strerror})") from None


def parse_hostfile(path: Path) -> list[HostEntry]:
    """`host slots=N` per line, `#` comments and blank lines allowed (DeepSpeed's and Open MPI's format)."""
    if not os.path.lexists(path):
        raise UserError(f"--hostfile {path}: no such file; write one `host slots=N` line per node")
    entries: list[HostEntry] = []
    seen: dict[str, tuple[str, int]] = {}
    for number, raw in enumerate(hostfile_lines(path), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"--hostfile {path}:{number}"
        host, *rest = text.split()
        check_host_name(host, where)
        if len(rest) != 1 or not rest[0].startswith("slots="):
            raise UserError(f"{where}: expected `{host} slots=N`, got {raw.strip()!r}")
        value = rest[0][len("slots=") :]
        # ASCII digits only: str.isdigit() accepts '²', which int() then refuses with a traceback.
        if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise UserError(f"{where}: slots={value!r} must be a whole number >= 1 (ranks on that host)")
        if int(value) > MAX_SLOTS:
            raise UserError(
                f"{where}: slots={value} is more ranks than one host runs (at most {MAX_SLOTS}); slots is "
                "the number of GPUs (ranks) on that host"
            )
        key = host_key(host)
        if key in seen:
            first, line = seen[key]
            same = "" if first == host else f", as {first}"
            raise UserError(
                f"{where}: host {host} is listed twice (first on line {line}{same}); merge the lines"
            )
        seen[key] = (host, number)
        entries.append(HostEntry(host, int(value), number))
    if not entries:
        raise UserError(f"--hostfile {path}: no hosts in it; add one `host slots=N` line per node")
    return entries


def resolve(host: str) -> str:
    """The address of a host name (or the address itself): IPv4 where it has one, else IPv6."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UserError(
            f"host {host} does not resolve ({exc.strerror}); fix the name in the hostfile, add it to "
            "/etc/hosts or DNS, or use its IP address"
        ) from None
    except UnicodeError:  # the idna codec's verdict on a name DNS cannot hold
        raise UserError(f"host {host[:40]!r}: not a name DNS can hold; fix it in the hostfile") from None
    ipv4 = [i for i in infos if i[0] == socket.AF_INET]
    return str((ipv4 or infos)[0][4][0])


def check_distinct_machines(entries: list[HostEntry], addresses: dict[str, str]) -> None:
    """Two lines that reach one machine (a name and its address, two aliases) would start two "nodes" on
    it with the same local ranks, both claiming its first GPUs: refused like a host listed twice."""
    first: dict[str, HostEntry] = {}
    for entry in entries:
        address = addresses[entry.host]
        if address in first:
            other = first[address]
            raise UserError(
                f"--hostfile line {entry.line}: host {entry.host} is the same machine as {other.host} on "
                f"line {other.line} (both {address}); list each machine once with all its slots"
            )
        first[address] = entry


def check_reachable(entries: list[HostEntry], runner: Runner = ssh_runner) -> None:
    """`ssh -o BatchMode=yes host true` on every host at once: one clear error names each bad host."""
    with ThreadPoolExecutor(max_workers=min(16, len(entries))) as pool:
        results = list(pool.map(lambda e: (e, runner(e.host, "true")), entries))
    bad = [(e, p) for e, p in results if p.returncode != 0]
    if bad:
        lines = "; ".join(f"{e.host}: {_last_line(p.stderr) or f'exit {p.returncode}'}" for e, p in bad)
        raise UserError(
            f"not reachable by passwordless ssh: {lines}. Every host (the first one too) needs "
            "`ssh -o BatchMode=yes HOST true` to work from here: copy your key (ssh-copy-id) and accept "
            "its host key once"
        )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def route_interface(host: str, master_addr: str, runner: Runner = ssh_runner) -> str:
    """The interface `host` uses to reach the master address (on the master itself: the one holding it)."""
    family = "-6" if ":" in master_addr else "-4"  # `ip` answers for one address family at a time
    target = master_addr.partition("%")[0] if family == "-6" else master_addr
    command = f"ip -o {family} route get {target}; ip -o {family} addr show to {target}"
    proc = runner(host, command)
    if proc.returncode != 0:
        raise UserError(f"could not ask {host} for its route to {master_addr}: {_last_line(proc.stderr)}")
    route = re.search(r"\bdev (\S+)", proc.stdout)
    if route and route.group(1) != "lo":
        return route.group(1)
    # The master address is this host's own: route says lo; the interface holding the address is wanted.
    owned = re.search(r"^\d+:\s+(\S+)\s+inet6?\s", proc.stdout, re.M)
    if owned:
        return owned.group(1)
    if route:
        return route.group(1)
    raise UserError(f"{host} has no route to the master address {master_addr}; pass --master-addr")


def pick_interface(entries: list[HostEntry], master_addr: str, runner: Runner = ssh_runner) -> str:
    with ThreadPoolExecutor(max_workers=min(16, len(entries))) as pool:
        names = dict(
            zip(
                [e.host for e in entries],
                pool.map(lambda e: route_interface(e.host, master_addr, runner), entries),
                strict=True,
            )
        )
    distinct = sorted(set(names.values()))
    if len(distinct) > 1:
        listing = ", ".join(f"{h}: {i}" for h, i in names.items())
        raise UserError(
            f"the hosts reach {master_addr} through differently named interfaces ({listing}); one "
            "GLOO_SOCKET_IFNAME serves all ranks, so set it yourself in .deepspeed_env (a comma-separated "
            "list works for NCCL_SOCKET_IFNAME) or rename the interfaces"
        )
    return distinct[0]


def remote_environment(interface: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """What remote ranks need and would not otherwise get (pdsh and mpirun start fresh shells)."""
    env = dict(os.environ if environ is None else environ)
    pythonpath = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    venv = Path(sys.prefix)
    return {
        "GLOO_SOCKET_IFNAME": interface,
        "NCCL_SOCKET_IFNAME": interface,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(pythonpath)),
        # JIT-built DeepSpeed ops: the same folder everywhere, or every node rebuilds (see the Makefile).
        "TORCH_EXTENSIONS_DIR": env.get("TORCH_EXTENSIONS_DIR", str(venv / "torch_extensions")),
        "HF_HOME": env.get("HF_HOME", str(Path.home() / ".cache" / "huggingface")),
    }


def ipv6_literal(text: str) -> str | None:
    """The IPv6 address in `text` ('fd00::1', '[fd00::1]', 'fe80::1%eth0'), unbracketed, or None.

    Unbracketed is what the ranks need: DeepSpeed hands --master_addr to each rank as MASTER_ADDR, and
    torch's env:// rendezvous gives it to TCPStore, which resolves it with getaddrinfo (brackets belong
    in URLs, not there). A zone id is kept only if it is an interface name (it reaches remote shells)."""
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    address, _, zone = inner.partition("%")
    if "%" in inner and not ZONE_ID.match(zone):
        return None
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return None
    return inner


def check_master_addr(master_addr: str) -> str:
    """--master-addr goes into every rank's environment and into remote shell commands: a host name or an
    address, nothing else, and one that resolves here. Returns the address the ranks are given."""
    ipv6 = ipv6_literal(master_addr)
    if ipv6 is not None:
        return ipv6
    if not HOST_NAME.match(master_addr) or ":" in master_addr:
        raise UserError(
            f"--master-addr {master_addr!r}: a host name or IP address only (IPv4, or IPv6 as 'fd00::1' or "
            "'[fd00::1]')"
        )
    return resolve(master_addr)


def prepare_hosts(
    hostfile: Path, master_addr: str | None = None, workdir: Path | None = None, runner: Runner = ssh_runner
) -> tuple[list[HostEntry], str, str, Path, EnvMerge]:
    """Check every host, then merge what remote ranks need into `workdir`/.deepspeed_env (the folder the
    deepspeed launcher will run in). Returns (hosts, master address, interface, env file, what changed)."""
    entries = parse_hostfile(hostfile)
    addresses = {e.host: resolve(e.host) for e in entries}
    check_distinct_machines(entries, addresses)
    master = check_master_addr(master_addr) if master_addr else addresses[entries[0].host]
    check_reachable(entries, runner)
    interface = pick_interface(entries, master, runner)
    env_file = (workdir or Path.cwd()) / env_file_name()
    return entries, master, interface, env_file, merge_env_file(env_file, remote_environment(interface))


@dataclass(frozen=True)
class LaunchPlan:
    entries: list[HostEntry]
    master_addr: str
    interface: str
    launch: RemoteLaunch
    env_file: Path
    merge: EnvMerge

    @property
    def command(self) -> list[str]:
        """The deepspeed runner command (run it with `launch.run()`: its folder, environment, secrets)."""
        return self.launch.command


def plan_launch(
    hostfile: Path,
    train_args: list[str],
    launcher: str = "pdsh",
    master_addr: str | None = None,
    master_port: int | None = None,
    workdir: Path | None = None,
    runner: Runner = ssh_runner,
    entry: Path = TRAIN_SCRIPT,
) -> LaunchPlan:
    """Every check, then `.deepspeed_env` in `workdir`, then the launch (not yet run)."""
    if launcher not in LAUNCHERS:
        raise UserError(f"--launcher {launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    folder = Path(os.path.abspath(workdir or Path.cwd()))
    entries, master, interface, env_file, merge = prepare_hosts(hostfile, master_addr, folder, runner)
    mca = None
    if launcher == "openmpi":
        # Open MPI's daemons and its TCP transport must use the same interface as gloo, or they try
        # every interface (bridges, docker0, ...) and fail to route back to mpirun.
        mca = f"--mca btl_tcp_if_include {interface} --mca oob_tcp_if_include {interface}"
        if os.geteuid() == 0:
            mca += " --allow-run-as-root"
    values = {**forwarded_values(folder, os.environ), **merge.not_written}
    launch = remote_launch(
        train_args,
        Path(os.path.abspath(entry)),
        values,
        folder,
        hostfile=hostfile,
        master_addr=master,
        master_port=master_port,
        launcher="openmpi" if mca else None,
        launcher_args=mca,
    )
    if mca is None and len(entries) > 1:
        # pdsh over several hosts: a signal reaches the remote ranks by pkill (sdzero.process.launch_signals);
        # one host's ranks are local processes, and mpirun passes signals on itself.
        launch = dataclasses.replace(launch, remote_hosts=tuple(e.host for e in entries))
    return LaunchPlan(entries, master, interface, launch, env_file, merge)


def describe(plan: LaunchPlan) -> list[str]:
    ranks = sum(e.slots for e in plan.entries)
    lines = [
        f"{len(plan.entries)} hosts, {ranks} ranks; master {plan.master_addr}; interface {plan.interface}"
    ]
    if plan.merge.added:
        lines.append(f"{plan.env_file}: added " + ", ".join(f"{k}={v}" for k, v in plan.merge.added.items()))
    for key, (theirs, ours) in plan.merge.kept.items():
        lines.append(f"{plan.env_file}: kept your {key}={theirs} (sdzero would have written {ours})")
    for key in plan.merge.not_written:
        lines.append(f"{plan.env_file}: {key} not written (a line cannot hold its value); forwarded as is")
    forwarded = sorted(plan.launch.forwarded)
    hidden = sorted(plan.launch.secrets)
    lines.append(
        f"forwarded to every rank: {', '.join(forwarded) or 'nothing'}"
        + (f"; by a 0600 file, not the command line: {', '.join(hidden)}" if hidden else "")
    )
    return lines
