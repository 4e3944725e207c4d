"""The slow host's verdict from the ranks' shared compute times (sdzero.training.straggler), its one
terminal line, and the training report's host section built from metrics lines (advisor.report)."""

from __future__ import annotations

import pandas as pd
import pytest

from advisor.report.hosts_section import host_series, hosts_items, straggler_note
from sdzero.training.straggler import STRAGGLER_FRACTION, host_verdict, straggler_line


def test_a_host_slower_than_the_others_is_named_with_its_ranks_and_the_wait():
    hosts = ["n1", "n1", "n2", "n2", "n3", "n3"]
    means, found = host_verdict(hosts, [0.10, 0.10, 0.10, 0.12, 0.20, 0.20], [0.5] * 6)
    assert means == pytest.approx({"n1": 0.10, "n2": 0.11, "n3": 0.20})
    assert found is not None and found["host"] == "n3" and found["ranks"] == [4, 5]
    assert found["others_compute_s"] == pytest.approx(0.105)
    assert found["wait_share"] == pytest.approx((0.20 - 0.105) / 0.5)
    assert straggler_line(found) == (
        "slow host n3 (ranks 4-5): 200 ms of own compute per step against 105 ms on the other hosts "
        "(+90%); every other rank spends 19% of its step waiting for it"
    )


def test_hosts_within_the_margin_or_a_single_host_name_nobody():
    near = 1 + STRAGGLER_FRACTION * 0.9
    assert host_verdict(["a", "b"], [0.1, 0.1 * near], [0.3, 0.3])[1] is None
    assert host_verdict(["a", "a"], [0.1, 0.9], [0.3, 0.3])[1] is None


def test_the_report_plots_every_host_and_says_which_was_slow():
    found = host_verdict(["a", "b"], [0.1, 0.3], [0.4, 0.4])[1]
    m = pd.DataFrame(
        {
            "step": [1, 2, 3, 4],
            "host_compute_s": [None, {"a": 0.1, "b": 0.3}, None, {"a": 0.1, "b": 0.31}],
            "straggler": [None, None, None, found],
        }
    )
    steps, series = host_series(m)
    assert steps.tolist() == [2.0, 4.0] and series["b"].tolist() == [0.3, 0.31]
    assert straggler_note(m).startswith("Slow host: b (ranks 1) took 300 ms of own compute per step")
    keys = [item.key for item in hosts_items(m)]
    assert keys == ["hosts", "straggler"]
    assert hosts_items(pd.DataFrame({"step": [1]})) == []
