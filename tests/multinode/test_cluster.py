"""The namespace cluster itself: teardown removes exactly what it made, a killed owner's cluster is reaped,
and shaped links give the round trip and rate they promise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import netns
from cluster.linkcheck import round_trip_s, throughput_bit_s
from cluster.netns import Cluster

pytestmark = pytest.mark.multinode


def existing() -> tuple[str, str]:
    return (netns.run(["ip", "netns", "list"]).stdout, netns.run(["ip", "-o", "link"]).stdout)


def test_teardown_removes_what_it_made(cluster):
    small = Cluster(hosts=1).up()
    host = small.members[0]
    assert small.ssh(host, "hostname").stdout.strip() == host.hostname
    assert small.bridge in existing()[1] and host.netns in existing()[0]
    small.down()
    namespaces, links = existing()
    assert host.netns not in namespaces and small.bridge not in links and host.veth not in links
    assert not os.path.exists(f"/proc/{host.sshd_pid}") or "sshd" not in netns._cmdline(host.sshd_pid)
    assert small.known_hosts_mark not in (netns.KNOWN_HOSTS.read_text() if netns.KNOWN_HOSTS.exists() else "")
    assert not small.state_dir.exists()
    # the session's cluster is untouched
    assert cluster.ssh(cluster.master, "hostname").stdout.strip() == cluster.master.hostname


def test_cluster_of_a_killed_owner_is_reaped(cluster, tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from cluster import Cluster; "
        "c = Cluster(hosts=1).up(); print(c.tag, flush=True); time.sleep(300)"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code, str(Path(__file__).parents[1])], stdout=subprocess.PIPE, text=True
    )
    tag = owner.stdout.readline().strip()
    owner.send_signal(signal.SIGKILL)  # no atexit, no handler: the cluster is left behind
    owner.wait()
    assert (netns.STATE_ROOT / tag / "state.json").exists()
    with netns._lock():
        reaped = netns.reap_stale()
    assert tag in reaped and not (netns.STATE_ROOT / tag).exists()
    assert f"sdz-{tag}-n1" not in existing()[0]
    assert cluster.tag not in reaped  # a living owner's cluster stays


def test_delay_and_rate_shaping(cluster):
    a, b = cluster.members[:2]
    plain = round_trip_s(cluster, a, b)
    try:
        cluster.shape("200mbit", delay_ms=1)
        delayed = round_trip_s(cluster, a, b)
        rate = throughput_bit_s(cluster, a, b, mebibytes=12)
        # Each host delays what it sends: a round trip is 2 ms plus the relay's and the stack's own cost,
        # which stays well under a millisecond unless the machine is very busy.
        assert 2e-3 <= delayed < 3.5e-3, f"round trip {delayed * 1e3:.2f} ms with 1 ms each way"
        # One TCP stream through the bucket: never above the rate; TCP's ramp-up over the 2 ms round trip
        # and a shared machine cost some of it.
        assert 0.5 * 200e6 < rate <= 1.03 * 200e6, f"{rate / 1e6:.0f} Mbit/s through a 200 Mbit/s bucket"
        state = netns.list_clusters()
        assert [s["delay_ms"] for s in state if s["tag"] == cluster.tag] == [1]
    finally:
        cluster.shape(None)
    restored = round_trip_s(cluster, a, b)
    assert restored < 1e-3 and restored < 4 * plain + 2e-4, (plain, restored)
    assert cluster.delay_pids == [] and "mtu 1500" in cluster.exec(a, ["ip", "link", "show", "eth0"]).stdout


def test_bad_delay_is_refused(cluster):
    with pytest.raises(ValueError, match="delay_ms"):
        cluster.shape("1gbit", delay_ms=-1)
