"""`sdzero doctor --hostfile` on three namespace hosts, one with a private output folder (a bind mount in
its own mount namespace) and another with a slower link (a token bucket on its leg): each host answers
over ssh, every pair's all-reduce is measured, and the doctor names both faulty hosts, and only them,
with exit 1 for the storage blocker. One doctor run covers the healthy parts too (rows, the fast pair,
tokens cleaned up), so the file costs one run."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from cluster import Cluster, ClusterUnavailable, unavailable_reason
from cluster.faults import private_folder, slow_link
from cluster.launching import SDZERO

pytestmark = pytest.mark.multinode

SLOW_RATE = "200mbit"
"""Under a tenth of what gloo reaches between two namespaces even on a busy 2-core machine (about 1-6
Gbit/s, CPU-bound), so the doctor's half-of-typical rule cannot miss it nor flag a healthy host."""


@pytest.fixture
def three_hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no namespace cluster on this machine: {reason}")
    try:
        with Cluster(hosts=3, slots=1) as made:
            made.write_hostfile(made.hostfile)
            yield made
    except ClusterUnavailable as exc:
        pytest.skip(f"no namespace cluster on this machine: {exc}")


def test_doctor_names_the_private_folder_and_the_slow_node(three_hosts, synth_data, tmp_path):
    cluster = three_hosts
    first, slow, private = cluster.members
    out = tmp_path / "out"
    slow_link(cluster, slow, SLOW_RATE)
    with private_folder(cluster, private, out, tmp_path / "private-out") as backing:
        proc = subprocess.run(
            [
                SDZERO,
                "doctor",
                "--hostfile",
                str(cluster.hostfile),
                "--output-dir",
                str(out),
                "--data",
                str(synth_data),
                "--probe-mib",
                "4",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "COLUMNS": "250"},
        )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]
    for host in cluster.members:  # a row per host, named by the host itself (its UTS hostname)
        assert re.search(rf"│ {re.escape(host.hostname)}\s+│", proc.stdout), (host.hostname, text)
    gbps = {
        frozenset(m.groups()[:2]): float(m.group(3))
        for m in re.finditer(r"│ (\S+) <-> (\S+)\s*│\s*([\d.]+)", proc.stdout)
    }
    assert len(gbps) == 3 and min(gbps.values()) > 0, text
    fast = gbps[frozenset((first.hostname, private.hostname))]
    assert all(g < fast / 2 for pair, g in gbps.items() if slow.hostname in pair), gbps
    # The storage blocker names the private host alone, against the two that share the folder.
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith(
        f"verdict: NOT READY: --output-dir on {private.hostname} is not the same folder as on "
        f"{first.hostname}, {slow.hostname} "
    ), verdict
    assert f"{private.hostname} cannot read the tokens of {first.hostname}, {slow.hostname}" in verdict
    # The link warning names the slow host alone; the healthy ones are not flagged.
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    slow_warnings = [w for w in warnings if "slow" in w]
    assert len(slow_warnings) == 1, warnings
    assert slow_warnings[0].startswith(f"warning: slow node {slow.hostname}: "), warnings
    # Every host removed its own token from its own view: the shared folder and the private one.
    assert not list(out.rglob("*.token")) and not list(backing.rglob("*.token")), "tokens left behind"
