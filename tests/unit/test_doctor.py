"""`sdzero doctor`'s verdict from the nodes' facts: version and accelerator mismatches, a node with other
data or a private output folder are blockers; a slow pair and a full disk are named."""

from __future__ import annotations

import copy

from sdzero.cluster.doctor import MIN_FREE_DISK_BYTES, assess, render_report

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


def test_a_private_output_folder_names_that_node_only():
    # n2 writes into a folder of its own: it reads no one's token and no one reads its own.
    facts = nodes(4)
    unseen = {"n0": ["n2"], "n1": ["n2"], "n2": ["n0", "n1", "n3"], "n3": ["n2"]}
    found = assess(facts, unseen, {})
    assert found.blockers == [
        "--output-dir on n2 is not the same folder as on n0, n1, n3 (a private or different mount): "
        "n2 cannot read the tokens of n0, n1, n3 and n0, n1, n3 cannot read n2's"
    ]


def test_a_node_that_reads_all_but_is_not_read_is_named():
    # n2 sees the shared tokens (a read-only copy of the mount) but writes where no one else looks.
    facts = nodes()
    found = assess(facts, {"n0": ["n2"], "n1": ["n2"], "n2": []}, {})
    assert len(found.blockers) == 1
    assert found.blockers[0].startswith("--output-dir on n2 is not the same folder as on n0, n1")
    assert found.blockers[0].endswith("(a private or different mount): n0, n1 cannot read n2's")


def test_two_nodes_apart_are_named_from_the_first():
    facts = nodes(2)
    found = assess(facts, {"n0": ["n1"], "n1": ["n0"]}, {})
    assert found.blockers[0].startswith("--output-dir on n1 is not the same folder as on n0 ")


def test_a_node_with_a_slow_link_is_named_not_its_pairs():
    facts = nodes(4)
    pairs = {("n0", "n1"): 9.0, ("n0", "n2"): 0.2, ("n0", "n3"): 8.5}
    pairs |= {("n1", "n2"): 0.19, ("n1", "n3"): 9.2, ("n2", "n3"): 0.21}
    found = assess(facts, no_unseen(facts), pairs)
    assert found.blockers == []
    assert len(found.warnings) == 1
    assert found.warnings[0].startswith("slow node n2: its fastest pair reaches 0.21 Gbit/s")


def test_two_nodes_have_no_slow_pair_to_compare():
    facts = nodes(2)
    assert assess(facts, no_unseen(facts), {("n0", "n1"): 0.01}).warnings == []
