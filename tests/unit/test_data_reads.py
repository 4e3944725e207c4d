"""`sdzero doctor --data`'s read at once by every node (sdzero.cluster.data_reads, sdzero.data.read_rate):
one node's read of its sample from the agreed second, the aggregate over the common span, the slowest."""

from __future__ import annotations

import time

import pytest

from sdzero.cluster.data_reads import aggregate, read_everywhere, slowest_note
from sdzero.constants import MIB
from sdzero.data.read_rate import read_sample
from sdzero.models.tiny import write_synthetic_dataset


def test_a_node_reads_its_own_sample_from_the_agreed_second(tmp_path):
    data = write_synthetic_dataset(tmp_path / "d", images=10, size=24)
    start_at = time.time() + 0.3
    read = read_sample(data, files=6, readers=2, start_at=start_at, sample=1)
    assert read["started"] >= start_at and read["files"] == 6 and read["readers"] == 2
    assert read["bytes"] == pytest.approx(read["bytes_per_s"] * read["seconds"])


def test_the_aggregate_spans_the_first_start_to_the_last_end():
    reads = [
        {
            "host": "a",
            "started": 100.0,
            "ended": 102.0,
            "bytes": 200 * MIB,
            "files": 20,
            "bytes_per_s": 100 * MIB,
        },
        {
            "host": "b",
            "started": 100.5,
            "ended": 104.0,
            "bytes": 70 * MIB,
            "files": 7,
            "bytes_per_s": 20 * MIB,
        },
    ]
    assert aggregate(reads) == {"bytes_per_s": 270 * MIB / 4, "files_per_s": 27 / 4, "span_s": 4.0}
    assert slowest_note(reads) == (
        "slowest node: b (20.0 MiB/s, under half the median node's 100.0 MiB/s: it starves its GPUs first)"
    )
    assert slowest_note(reads[:1]) == "slowest node: a (100.0 MiB/s)"


def test_every_node_is_asked_for_its_own_sample_at_one_second(tmp_path):
    asked = []

    def remote(host, args, module):
        asked.append((host, module, args))
        return {"host": host}

    read_everywhere(["n1", "n2"], tmp_path, remote, files=8, readers=3)
    assert [(h, m) for h, m, _ in asked] == [("n1", "sdzero.data.read_rate"), ("n2", "sdzero.data.read_rate")]
    starts = {a[a.index("--start-at") + 1] for _, _, a in asked}
    assert len(starts) == 1 and float(starts.pop()) > time.time()
    assert [a[a.index("--sample") + 1] for _, _, a in asked] == ["0", "1"]
