"""The namespace cluster's CPU quotas: every host the same share of the machine's cores (one cgroup per
host that its sshd, and so every process started over ssh, belongs to), and the 1-host reference trial
the same share per rank (`local_share`). cpushare.py says how a group is made and why its period is what
it is; this module says which groups a cluster has."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from cluster import cpushare
from cluster.system import ClusterUnavailable

if TYPE_CHECKING:
    from cluster.netns import Cluster


def check_share(cpus_per_host: float, hosts: int) -> None:
    cores = len(os.sched_getaffinity(0))
    if not 0 < cpus_per_host * hosts <= cores:
        raise ValueError(
            f"cpus_per_host={cpus_per_host} x {hosts} hosts: the quotas must be positive and "
            f"add up to at most this machine's {cores} cores"
        )


def make_host_groups(cluster: Cluster) -> None:
    """One group per host of `cluster.cpus_per_host` cores (none without a quota), each recorded in the
    cluster's state before it exists."""
    if cluster.cpus_per_host is None:
        return
    try:
        fs = cpushare.detect()
        for h in cluster.members:
            path = fs.root / f"sdz-{cluster.tag}-n{h.index}"
            cluster.cgroups.append(str(path))
            cluster._save()  # recorded before it exists, as everything else
            cpushare.create(fs, path.name, cluster.cpus_per_host, parallel=cluster.slots)
    except (cpushare.CpuShareUnavailable, OSError) as exc:
        raise ClusterUnavailable(f"cannot give each host a CPU quota: {exc}") from exc


def set_cpus_per_host(cluster: Cluster, cpus: float) -> None:
    """Change every host's quota (a cluster made with one)."""
    if cluster.cpus_per_host is None:
        raise ValueError("this cluster was made without CPU quotas (cpus_per_host=None)")
    check_share(cpus, cluster.hosts)
    fs = cpushare.detect()
    for h in cluster.members:
        cpushare.limit(fs, Path(cluster.cgroups[h.index - 1]), cpus, cluster.slots)
    cluster.cpus_per_host = cpus
    cluster._save()


@contextlib.contextmanager
def local_share(cluster: Cluster, cpus: float, ranks: int = 1) -> Iterator[Path]:
    """This process, and what it starts meanwhile (`ranks` ranks), under a `cpus`-core quota, recorded in
    the cluster's state so that a killed run's group goes with the cluster."""
    fs = cpushare.detect()
    path = fs.root / f"sdz-{cluster.tag}-local{len(cluster.cgroups)}"
    cluster.cgroups.append(str(path))
    cluster._save()
    try:
        with cpushare.joined(path.name, cpus, fs, parallel=ranks) as group:
            yield group
    finally:
        cluster.cgroups.remove(str(path))
        cluster._save()
