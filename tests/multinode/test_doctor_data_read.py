"""`sdzero doctor --hostfile H --data D` on two namespace hosts: every host reads its own sample of the
data at the same second (over ssh, as the doctor reaches them), and the doctor prints each host's read
rate, the aggregate over the common span, and the slowest host."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from cluster import Cluster, ClusterUnavailable, unavailable_reason
from cluster.launching import SDZERO

from sdzero.data.shard_writer import write_shards

pytestmark = pytest.mark.multinode


@pytest.fixture
def two_hosts():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no namespace cluster on this machine: {reason}")
    try:
        with Cluster(hosts=2, slots=1) as made:
            made.write_hostfile(made.hostfile)
            yield made
    except ClusterUnavailable as exc:
        pytest.skip(f"no namespace cluster on this machine: {exc}")


def test_every_node_reads_the_shards_at_once_and_the_slowest_is_named(two_hosts, synth_data, tmp_path):
    write_shards(synth_data, tmp_path / "shards", max_count=16)
    pattern = f"{tmp_path}/shards/{{000000..000003}}.tar"
    command = [SDZERO, "doctor", "--hostfile", str(two_hosts.hostfile), "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(
        [*command, "--data", pattern, "--probe-mib", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "COLUMNS": "250"},
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    table = proc.stdout[proc.stdout.index("data read at once by every node") :]
    rates = {
        m.group(1): (int(m.group(2)), float(m.group(3)))
        for m in re.finditer(r"│ (\S+)\s+│\s+(\d+) │\s+\d* │\s+([\d.]+) │", table)
    }
    hosts = {h.hostname for h in two_hosts.members}
    assert set(rates) == hosts | {"aggregate"}, table
    assert all(files == 64 for host, (files, _) in rates.items() if host in hosts), rates  # each: every image
    assert rates["aggregate"][0] == 128 and rates["aggregate"][1] > 0
    # The table rounds the rates: where the two hosts show the same figure, either may be the slowest.
    least = min(rates[h][1] for h in hosts)
    named = re.search(r"slowest node: (\S+) \(", table)
    assert named and named.group(1) in {h for h in hosts if rates[h][1] == least}, table
