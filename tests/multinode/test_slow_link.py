"""A slow link named while the run is on, across three namespace hosts (`sdzero launch`).

One host's leg to the bridge is rate-limited both ways (tc tbf, cluster.faults.slow_link): its ranks'
compute time is unchanged, so the straggler sharing cannot see it; the link probe every --straggler-every
steps times each host pair and names that host in metrics.jsonl (`slow_link`), once on the terminal, and
in the training report. Three hosts, because one pair alone cannot say whose end of it is slow.
"""

from __future__ import annotations

import shutil

import pytest
from cluster import Cluster, ClusterUnavailable, unavailable_reason
from cluster.faults import slow_link
from cluster.launching import launch, ok

from advisor.report.build import write_training_report
from sdzero.telemetry.metrics import read_metrics

pytestmark = pytest.mark.multinode

RATE = "100mbit"
"""Far under the unshaped namespace link (CPU-bound, several Gbit/s) and still a few steps a second."""


@pytest.fixture(scope="module")
def cluster3():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no namespace cluster on this machine: {reason}")
    if shutil.which("pdsh") is None:
        pytest.skip("pdsh is not installed (apt-get install -y pdsh); DeepSpeed starts remote ranks with it")
    try:
        with Cluster(hosts=3, slots=1) as made:
            yield made
    except ClusterUnavailable as exc:
        pytest.skip(f"no namespace cluster on this machine: {exc}")


def test_a_rate_limited_link_names_its_host_in_metrics_terminal_and_report(cluster3, args, tmp_path):
    hostfile = cluster3.write_hostfile(tmp_path / "hosts3", hosts=3)
    (tmp_path / ".deepspeed_env").write_text("OMP_NUM_THREADS=1\n")
    slow = cluster3.members[2]
    slow_link(cluster3, slow, RATE)
    out = tmp_path / "run"
    log = ok(launch(hostfile, args(out, 6, "--straggler-every", "2"), tmp_path / "l.log", tmp_path))
    records = read_metrics(out / "metrics.jsonl")
    probed = [r for r in records if "host_link_gbps" in r]
    assert [r["step"] for r in probed] == [2, 4, 6]
    assert all(set(r["host_link_gbps"]) == {h.hostname for h in cluster3.members} for r in probed)
    named = [r["slow_link"] for r in records if r.get("slow_link")]
    assert [r["step"] for r in records if r.get("slow_link")] == [4, 6], records
    assert all(n["host"] == slow.hostname and n["ranks"] == [2] for n in named), named
    # the bucket's 100 Mbit/s (its one-packet burst lets a little more through), the other pair unshaped
    assert all(n["gbps"] < 0.15 and n["others_gbps"] > 1 for n in named), named
    lines = [line for line in log.splitlines() if f"slow link on host {slow.hostname} (rank 2)" in line]
    assert len(lines) == 1, log[-4000:]  # one line for the run, not one per probe
    page = write_training_report(out, tmp_path / "report.html").read_text()
    assert f"Slow link: {slow.hostname} (ranks 2)" in page
    print(f"slow-link line: {lines[0][lines[0].index('slow link') :]}")
