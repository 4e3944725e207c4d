"""`sdzero doctor`'s verdict from the nodes' facts: version and accelerator mismatches, a node with other
data or a private output folder are blockers; a slow pair and a full disk are named."""

from __future__ import annotations

import copy

from sdzero.doctor import MIN_FREE_DISK_BYTES, assess, render_report

NODE = {
    "host": "n0",
    "accelerators": [{"index": 0, "name": "NVIDIA H200", "memory_bytes": 150_000_000_000}] * 8,
    "cpu": "x",
    "cpu_count": 96,
    "versions": {
        "python": "3.11.7",
        "torch": "2.13.0",
        "deepspeed": "0.19.8",
        "diffusers": "0.42.1",
        "transformers": "5.24.0",
        "cuda": "12.8",
        "nccl": "2.27.3",
        "driver": "570.1",
    },
    "free_disk_bytes": 2 * MIN_FREE_DISK_BYTES,
    "data_fingerprint": "abc",
}


def nodes(n: int = 3) -> list[dict]:
    made = [copy.deepcopy(NODE) for _ in range(n)]
    for i, node in enumerate(made):
        node["host"] = f"n{i}"
    return made


def no_unseen(facts: list[dict]) -> dict[str, list[str]]:
    return {f["host"]: [] for f in facts}


def test_agreeing_nodes_are_ready(capsys):
    facts = nodes()
    pairs = {("n0", "n1"): 90.0, ("n0", "n2"): 88.0, ("n1", "n2"): 91.0}
    found = assess(facts, no_unseen(facts), pairs)
    assert found.blockers == [] and found.warnings == []
    assert render_report(facts, pairs, found) == 0
    assert "verdict: ready: 3 node(s) agree" in capsys.readouterr().out


def test_each_blocker_is_named(capsys):
    facts = nodes()
    facts[1]["versions"]["deepspeed"] = "0.18.0"
    facts[2]["accelerators"] = facts[2]["accelerators"][:4]
    facts[2]["data_fingerprint"] = "stale"
    unseen = {"n0": ["n1"], "n1": ["n0", "n2"], "n2": ["n1"]}
    found = assess(facts, unseen, {})
    text = "\n".join(found.blockers)
    assert "deepspeed versions differ (n0: 0.19.8, n1: 0.18.0, n2: 0.19.8)" in text
    assert "n2: 4 x NVIDIA H200" in text
    assert "--data differs on n2 from n0" in text
    assert "n1 cannot read the tokens of n0, n2" in text
    assert render_report(facts, {}, found) == 1
    assert "verdict: NOT READY" in capsys.readouterr().out


def test_slow_pair_and_low_disk_are_warnings():
    facts = nodes()
    facts[2]["free_disk_bytes"] = MIN_FREE_DISK_BYTES // 2
    pairs = {("n0", "n1"): 90.0, ("n0", "n2"): 20.0, ("n1", "n2"): 89.0}
    found = assess(facts, no_unseen(facts), pairs)
    assert found.blockers == []
    assert any(w.startswith("slowest link n0 <-> n2: 20.00 Gbit/s") for w in found.warnings)
    assert any(w.startswith("n2: 5.0 GiB free") for w in found.warnings)
