"""The CPU quota files a host's cgroup gets (tests/cluster/cpushare.py), on a stand-in cgroup tree: cgroup v1's
cfs quota and period, v2's cpu.max with the controller enabled for the subtree, and the checks that keep a
quota meaningful. The quota acting on real processes is tests/multinode/test_hosts_at_scale.py."""

from __future__ import annotations

import pytest
from cluster import cpushare
from cluster.netns import Cluster


def fake_v1(tmp_path):
    root = tmp_path / "cpu"
    root.mkdir()
    (root / "cpu.cfs_quota_us").write_text("-1\n")
    return root


def fake_v2(tmp_path, enabled: str = ""):
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text(enabled)
    return root


def test_v1_group_gets_quota_and_period(tmp_path):
    fs = cpushare.detect(fake_v1(tmp_path), tmp_path / "none")
    group = cpushare.create(fs, "sdz-h1", 0.5)
    assert fs.version == 1 and group.parent == fs.root
    period = int((group / "cpu.cfs_period_us").read_text())
    assert int((group / "cpu.cfs_quota_us").read_text()) / period == pytest.approx(0.5)
    assert period == cpushare.PERIOD_US


def test_v2_group_gets_cpu_max_and_enables_the_controller(tmp_path):
    fs = cpushare.detect(tmp_path / "no-v1", fake_v2(tmp_path))
    group = cpushare.create(fs, "sdz-h1", 1.5)
    quota, period = map(int, (group / "cpu.max").read_text().split())
    assert fs.version == 2 and quota / period == pytest.approx(1.5)
    assert (fs.root / "cgroup.subtree_control").read_text() == "+cpu"


def test_v2_without_the_cpu_controller_is_unavailable(tmp_path):
    root = fake_v2(tmp_path)
    (root / "cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(cpushare.CpuShareUnavailable, match="no cgroup CPU controller"):
        cpushare.detect(tmp_path / "no-v1", root)


def test_small_share_lengthens_the_period_not_the_quota(tmp_path):
    """The kernel refuses a quota under 1 ms: 0.2 of a core becomes 1 ms every 5 ms, not 1 ms every 2 ms."""
    fs = cpushare.detect(fake_v1(tmp_path), tmp_path / "none")
    group = cpushare.create(fs, "small", 0.2)
    quota, period = (int((group / f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    assert quota >= 1000 and quota / period == pytest.approx(0.2)


def test_a_group_of_several_ranks_gets_the_long_period(tmp_path):
    """Cores take runtime from a group in 5 ms slices: a 2 ms period would let one core take a 2-rank
    group's whole quota; the long period keeps the cap without that (each rank has its own short one)."""
    fs = cpushare.detect(fake_v1(tmp_path), tmp_path / "none")
    group = cpushare.create(fs, "two-ranks", 0.8, parallel=2)
    quota, period = (int((group / f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    assert period == cpushare.LONG_PERIOD_US and quota / period == pytest.approx(0.8)


@pytest.mark.parametrize("cpus", [0.0, -1.0])
def test_non_positive_share_is_refused(cpus):
    with pytest.raises(ValueError, match="positive"):
        cpushare.CgroupFs(1, cpushare.V1_ROOT).quota_files(cpus)


def test_quotas_beyond_the_cores_are_refused():
    with pytest.raises(ValueError, match="add up to at most"):
        Cluster(hosts=4, cpus_per_host=1000.0)
    assert Cluster(hosts=2).cpus_per_host is None  # the default: no quota, as before
