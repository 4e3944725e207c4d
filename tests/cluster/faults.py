"""Faults one host of a namespace cluster can be given: a private folder, and a slower link of its own.

A private folder is the node where the shared filesystem is not mounted (or another export is): the
path exists, but what the node writes there no other node sees. Each host's sshd runs in a mount namespace
of its own (netns.py: `unshare --mount --propagation slave`: the machine's mounts propagate into it, none
back out), and every process started over ssh inherits it. A bind mount made in that namespace
(`nsenter --mount`) over the folder is therefore seen by that host alone.

A slower link is a token bucket on both directions of one host's leg to the bridge: its `eth0` (what it
sends) and its veth on the bridge side (what it receives), so every pair this host is in runs at `rate`
and the other pairs are untouched. `Cluster.shape` limits all hosts alike; this limits one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from cluster.netns import Cluster, Host, run


@contextlib.contextmanager
def private_folder(cluster: Cluster, host: Host, folder: Path, backing: Path) -> Iterator[Path]:
    """Within the block, `folder` on `host` is `backing` (an empty folder of its own); elsewhere unchanged."""
    folder.mkdir(parents=True, exist_ok=True)
    backing.mkdir(parents=True, exist_ok=True)
    with bind(host, backing, folder):
        yield backing


@contextlib.contextmanager
def bind(host: Host, source: Path, target: Path) -> Iterator[None]:
    """`source` bind-mounted over `target` in `host`'s mount namespace alone, for the block."""
    if host.sshd_pid is None:
        raise RuntimeError(f"{host.hostname} has no sshd: bring the cluster up first")
    if os.readlink(f"/proc/{host.sshd_pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
        raise RuntimeError(f"{host.hostname}'s sshd shares this process's mount namespace: no private mount")
    enter = ["nsenter", "--target", str(host.sshd_pid), "--mount"]
    ours = _identity(target)
    run([*enter, "mount", "--bind", str(source), str(target)])
    try:
        if _identity(target) != ours:  # it propagated out: a shared `/` in the host's namespace
            raise RuntimeError(f"the bind mount on {target} reached this machine's namespace too")
        yield
    finally:
        run([*enter, "umount", str(target)], check=False)


def _identity(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_dev, status.st_ino


def slow_link(cluster: Cluster, host: Host, rate: str) -> None:
    """Limit `host`'s link to the bridge to `rate` (tc syntax, e.g. "200mbit") both ways; ends with the
    cluster (its veth and namespace go at teardown)."""
    # One packet's worth of burst, as Cluster.shape explains: more lets a burst through at memory speed.
    bucket = ["root", "tbf", "rate", rate, "burst", "70kb", "latency", "50ms"]
    cluster.exec(host, ["tc", "qdisc", "replace", "dev", "eth0", *bucket])
    run(["tc", "qdisc", "replace", "dev", host.veth, *bucket])
