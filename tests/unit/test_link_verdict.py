"""The slow link's verdict from timed host-pair round trips (sdzero.training.link_probe): which pairs are
timed, which host is named, its one terminal line, and its sentence in the training report."""

from __future__ import annotations

import pandas as pd

from advisor.report.hosts_section import hosts_items, slow_link_note
from sdzero.training.link_probe import SLOW_LINK_FRACTION, host_pairs, link_verdict, slow_link_line


def test_pairs_join_the_first_rank_of_every_host_in_one_order():
    assert host_pairs(["a", "a", "b", "b", "c", "c"]) == [(0, 2), (0, 4), (2, 4)]
    assert host_pairs(["a", "a"]) == []


def test_the_host_slow_with_every_other_host_is_named_not_its_partners():
    hosts = ["a", "a", "b", "b", "c", "c"]
    best, found = link_verdict(hosts, [(0, 2), (0, 4), (2, 4)], [6.0, 0.2, 0.21])
    assert best == {"a": 6.0, "b": 6.0, "c": 0.21}
    assert found == {"host": "c", "ranks": [4, 5], "gbps": 0.21, "others_gbps": 6.0}
    assert slow_link_line(found) == (
        "slow link on host c (ranks 4-5): 0.21 Gbit/s at best to any other host against 6 Gbit/s "
        "between the other hosts"
    )


def test_within_the_margin_or_two_hosts_name_nobody():
    pairs = [(0, 1), (0, 2), (1, 2)]
    near = SLOW_LINK_FRACTION * 1.1
    assert link_verdict(["a", "b", "c"], pairs, [6.0, 6.0 * near, 6.0 * near])[1] is None
    # one pair cannot say whose end of it is slow
    best, found = link_verdict(["a", "b"], [(0, 1)], [0.1])
    assert best == {"a": 0.1, "b": 0.1} and found is None


def test_the_report_says_which_host_had_the_slow_link():
    found = link_verdict(["a", "b", "c"], [(0, 1), (0, 2), (1, 2)], [5.0, 0.1, 0.1])[1]
    m = pd.DataFrame(
        {
            "step": [2, 4],
            "host_compute_s": [{"a": 0.1, "b": 0.1, "c": 0.1}] * 2,
            "slow_link": [None, found],
        }
    )
    assert slow_link_note(m) == (
        "Slow link: c (ranks 2) reached 0.1 Gbit/s at best to any other host against 5 Gbit/s between "
        "the other hosts, named at 1 probe step(s)."
    )
    assert [item.key for item in hosts_items(m)] == ["hosts", "straggler", "slow_link"]
    assert slow_link_note(pd.DataFrame({"step": [1]})) is None
