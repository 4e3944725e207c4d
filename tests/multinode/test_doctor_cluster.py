"""`sdzero doctor --hostfile` across two namespace hosts: each host answers over ssh, the tokens written in
the shared output folder are read by the other, and the pair's all-reduce bandwidth is measured."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from cluster.launching import SDZERO

pytestmark = pytest.mark.multinode


def test_doctor_checks_both_hosts(cluster, synth_data, tmp_path):
    out = tmp_path / "out"
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
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for host in cluster.members:  # a row per host, named by the host itself (its UTS hostname)
        name = cluster.ssh(host, "hostname").stdout.strip()
        assert re.search(rf"│ {re.escape(name)}\s+│", proc.stdout), (name, proc.stdout)
    a, b = (h.address for h in cluster.members)
    pair = re.search(rf"{re.escape(a)} <-> {re.escape(b)}\s*│\s*([\d.]+)", proc.stdout)
    assert pair and float(pair.group(1)) > 0, proc.stdout
    assert "verdict: ready: 2 node(s) agree" in proc.stdout
    assert not list(out.rglob("*.token")), "tokens left behind"
