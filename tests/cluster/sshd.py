"""Each namespace host's sshd: started inside the host's network namespace only (so /sys/fs/cgroup stays
visible), with its own hostname and mount namespace, answering only on the host's address; the client's
known_hosts lines it adds carry the cluster's mark, so they go with it."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cluster import cpushare
from cluster.system import run

if TYPE_CHECKING:
    from cluster.netns import Cluster, Host

KNOWN_HOSTS = Path.home() / ".ssh" / "known_hosts"
CLIENT_KEY = Path.home() / ".ssh" / "id_ed25519"
"""ssh, pdsh and Open MPI's ssh agent use the default identity, so the cluster authorizes that key."""


def start(cluster: Cluster) -> None:
    """A host key, the client's key authorized, and one sshd per host; returns once every host answers."""
    d = cluster.state_dir
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "host_key")])
    if not CLIENT_KEY.exists():
        CLIENT_KEY.parent.mkdir(mode=0o700, exist_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(CLIENT_KEY)])
    shutil.copy(CLIENT_KEY.with_suffix(".pub"), d / "authorized_keys")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
    host_key = (d / "host_key.pub").read_text().split()
    with KNOWN_HOSTS.open("a") as f:
        for h in cluster.members:
            f.write(f"{h.address} {host_key[0]} {host_key[1]} {cluster.known_hosts_mark}\n")
    # No name server answers inside the namespaces (the machine's resolv.conf names one they cannot
    # reach), so every lookup of a name not in /etc/hosts, or of an address (gloo's rendezvous makes
    # reverse ones), would wait 10 s for the resolver's timeout. Each host's mount namespace gets a
    # resolv.conf naming 127.0.0.1, where nothing listens: lookups fail at once, as a real cluster's
    # DNS answers at once.
    resolv = d / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\n")
    # Node names resolve on every host, as a cluster's DNS or /etc/hosts makes them: Slurm hands out names
    # (`scontrol show hostnames`), and the batch script's ranks look the master up by name. The machine's
    # own /etc/hosts is left alone; the srun stand-in maps names to addresses from this file itself.
    hosts = hosts_file(cluster)
    for h in cluster.members:
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
                f"mount --bind {resolv} /etc/resolv.conf && mount --bind {hosts} /etc/hosts && "
                f'hostname "$0" && exec {sshd} -D -e -f {config}',
                h.hostname,
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        h.sshd_pid = proc.pid  # `exec` keeps the pid: this is sshd itself
        cluster._save()
        group = cluster.cpu_group(h)
        if group is not None:  # before the first login: every session, and its ranks, inherits it
            cpushare.join(group, proc.pid)
    for h in cluster.members:
        wait_for_ssh(cluster, h)


def wait_for_ssh(cluster: Cluster, h: Host, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        proc = cluster.ssh(h, "hostname", check=False, timeout=10)
        if proc.returncode == 0 and proc.stdout.strip() == h.hostname:
            return
        if time.monotonic() > deadline:
            log = (cluster.state_dir / f"sshd.{h.index}.log").read_text()[-2000:]
            raise RuntimeError(f"sshd on {h.address} did not answer: {proc.stderr.strip()}\n{log}")
        time.sleep(0.2)


def ssh(h: Host, command: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return run(
        ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", h.address, command],
        check=check,
        timeout=timeout,
    )


def drop_known_hosts(mark: str) -> None:
    """Remove the known_hosts lines a cluster added (those ending in its mark)."""
    if not mark or not KNOWN_HOSTS.exists():
        return
    lines = KNOWN_HOSTS.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.rstrip().endswith(mark)]
    if len(kept) != len(lines):
        tmp = KNOWN_HOSTS.with_suffix(".sdzero-tmp")
        tmp.write_text("".join(kept))
        tmp.replace(KNOWN_HOSTS)


def hosts_file(cluster: Cluster) -> Path:
    """<state>/hosts: the machine's /etc/hosts plus one `address hostname` line per host."""
    path = cluster.state_dir / "hosts"
    own = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
    names = "".join(f"{h.address} {h.hostname}\n" for h in cluster.members)
    path.write_text(own.rstrip("\n") + "\n# the sdzero namespace cluster\n" + names)
    return path
