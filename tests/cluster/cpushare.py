"""Equal compute per namespace host: a CPU quota per host, cgroup v1 `cpu.cfs_quota_us` or v2 `cpu.max`.

The hosts of a test cluster share this machine's cores. Without a quota, four hosts on two cores each get
half of what one host alone gets, so a host's compute per step would depend on how many hosts run, and a
multi-host run would compare a different machine with the 1-host trial it is predicted from. A quota of
`cpus` cores per host (every process its sshd starts inherits the host's cgroup) makes each host the same
fractional machine whether it runs alone or with three others, as long as the quotas add up to less than
the cores. The 1-host reference trial runs under the same share (`joined`).

The quota is refilled every PERIOD_US; a short period keeps the throttling fine-grained (a rank that used
its 0.8 ms of a 2 ms period waits 1.2 ms, not 60 ms of a 100 ms one), so the host behaves like a slower
CPU rather than one that stops for long stretches between collectives. That holds for a group of ONE
rank. A group whose processes run on several cores at once (a host with 2 ranks, the 1-host trial) must
not have a short period: each core takes its runtime from the group's pool in slices of
`kernel.sched_cfs_bandwidth_slice_us` (5 ms), so with 3.2 ms per 2 ms period one core takes it all and
the other's ranks wait (measured: a 1-host trial's 4 ranks computed 1.4x slower than the same ranks on 4
hosts). Such a group gets LONG_PERIOD_US, a cap over 100 ms, and each rank its own short-period group
inside it (rankshare/sitecustomize.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 2000
"""Quota refill period of a one-rank group: 2 ms (the kernel allows 1 ms to 1 s; its default is 100 ms)."""
LONG_PERIOD_US = 100_000
"""Period of a group whose processes run on several cores at once (see the module doc)."""
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class CpuShareUnavailable(RuntimeError):
    """No cgroup CPU controller this process can use (not root, or neither v1 cpu nor v2 cpu.max)."""


@dataclass(frozen=True)
class CgroupFs:
    """Where the CPU controller lives: v1's `cpu` hierarchy or the v2 unified tree (with `cpu` enabled)."""

    version: int
    root: Path

    def quota_files(self, cpus: float, period_us: int = PERIOD_US) -> dict[str, str]:
        """The files (relative to a group) and values that limit the group to `cpus` cores."""
        if not cpus > 0:
            raise ValueError(f"cpus={cpus}: a CPU share must be a positive number of cores")
        quota_us = max(1000, round(cpus * period_us))  # the kernel's smallest quota is 1 ms
        if self.version == 1:
            return {"cpu.cfs_period_us": str(period_us), "cpu.cfs_quota_us": str(quota_us)}
        return {"cpu.max": f"{quota_us} {period_us}"}


def detect(v1_root: Path = V1_ROOT, v2_root: Path = V2_ROOT) -> CgroupFs:
    """The CPU controller this machine offers; v1 first (on a hybrid mount the cpu controller is v1's)."""
    if (v1_root / "cpu.cfs_quota_us").exists():
        return CgroupFs(1, v1_root)
    controllers = v2_root / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return CgroupFs(2, v2_root)
    raise CpuShareUnavailable(
        f"no cgroup CPU controller: neither {v1_root}/cpu.cfs_quota_us (v1) nor `cpu` in {controllers} (v2)"
    )


def period_us_for(cpus: float, parallel: int = 1) -> int:
    """PERIOD_US for one rank (longer where the quota would fall under the kernel's 1 ms minimum);
    LONG_PERIOD_US for a group of `parallel` > 1 ranks."""
    return LONG_PERIOD_US if parallel > 1 else max(PERIOD_US, round(1000 / cpus))


def create(fs: CgroupFs, name: str, cpus: float, exist_ok: bool = False, parallel: int = 1) -> Path:
    """A new cgroup `name` (a path under the root) limited to `cpus` cores for `parallel` ranks; its path."""
    if fs.version == 2:
        # v2 distributes `cpu` to children only where the parent enables it for its subtree.
        control = fs.root / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
    group = fs.root / name
    group.mkdir(exist_ok=exist_ok)
    limit(fs, group, cpus, parallel)
    return group


def limit(fs: CgroupFs, group: Path, cpus: float, parallel: int = 1) -> None:
    """Set (or change) an existing group's quota to `cpus` cores for `parallel` ranks."""
    for file, value in fs.quota_files(cpus, period_us_for(cpus, parallel)).items():
        (group / file).write_text(value)


def join(group: Path, pid: int) -> None:
    """Move process `pid` (all its threads) into the group; the processes it starts later inherit it."""
    (group / "cgroup.procs").write_text(str(pid))


def members(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def remove(group: Path, timeout_s: float = 5.0) -> None:
    """Delete the group, and the groups under it (ranks' own), once empty: processes still in one are moved
    to its parent first (a killed process takes a moment to leave). Safe for a group that no longer exists."""
    for child in [c for c in group.iterdir() if c.is_dir()] if group.is_dir() else []:
        remove(child, timeout_s)
    deadline = time.monotonic() + timeout_s
    while group.exists():
        for pid in members(group):
            with contextlib.suppress(OSError):  # it exited meanwhile
                join(group.parent, pid)
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def throttled_periods(group: Path) -> int:
    """How many periods the quota stopped the group (v1 and v2 both name it nr_throttled)."""
    fields = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines() if line.strip())
    return int(fields.get("nr_throttled", 0))


@contextlib.contextmanager
def joined(name: str, cpus: float, fs: CgroupFs | None = None, parallel: int = 1) -> Iterator[Path]:
    """Run this process, and what it starts meanwhile, under a `cpus`-core quota; moved back and the group
    removed afterwards (also on failure). The 1-host reference trial runs inside this, so it gets the same
    share per rank as a cluster host's ranks."""
    fs = fs or detect()
    group = create(fs, name, cpus, parallel=parallel)
    home = own_group(fs)
    try:
        join(group, os.getpid())
        yield group
    finally:
        join(home, os.getpid())
        remove(group)


def own_group(fs: CgroupFs) -> Path:
    """This process's current group in the controller's tree (v1: the `cpu` line; v2: the `0::` line)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (fs.version == 1 and "cpu" in controllers.split(",")) or (fs.version == 2 and controllers == ""):
            return fs.root / path.lstrip("/")
    return fs.root
