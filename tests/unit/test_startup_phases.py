"""Start-up named: every rank's start-up phases in one table with the longest phase (sdzero.training
.startup), and a rank that stops responding during start-up named as a stall in its start-up phase, while
a long start-up of ranks that all respond is not (sdzero.process.stall_watch.Leader)."""

from __future__ import annotations

import time

from sdzero.process.stall_watch import Leader, describe_stall
from sdzero.telemetry.progress import Snapshot
from sdzero.training.startup import longest_line, longest_phase, share_phases


def snap(rank: int, step: int, phase: str) -> Snapshot:
    return Snapshot(rank, 100 + rank, f"node{rank + 1}", step, phase, 0.0, time.time(), 0)


def test_each_ranks_phases_are_kept_and_the_longest_is_named():
    (mine,) = share_phases([("model load", 1.5), ("engine build", 2.25)])  # no process group: this rank
    assert mine["rank"] == 0 and mine["phases"] == {"model load": 1.5, "engine build": 2.25}
    assert mine["total_s"] == 3.75
    other = {"rank": 1, "host": "node2", "phases": {"model load": 9.0, "engine build": 1.0}, "total_s": 10.0}
    found = longest_phase([mine, other])
    assert found == {"rank": 1, "host": "node2", "phase": "model load", "seconds": 9.0, "median_s": 5.25}
    assert longest_line(found) == "longest: rank 1 (node2) in model load 9 s (median of the ranks 5.25 s)"


def test_a_silent_rank_in_start_up_is_a_stall_named_in_its_phase():
    leader = Leader(world=2)
    start = [(snap(0, 0, "engine build"), True), (snap(1, 0, "data listing"), False)]
    leader.observe(start, now=0.0)
    assert not leader.armed and leader.stalled_for(30.0) == 30.0
    lines, groups = describe_stall(leader.ranks, now=30.0)
    assert lines[0] == "rank 1 (node2) in data listing at step 0 for 30 s (not responding)"
    assert groups[0]["holding_the_job"] and groups[0]["phase"] == "data listing"


def test_a_long_start_up_of_responding_ranks_is_no_stall():
    leader = Leader(world=2)
    leader.observe([(snap(0, 0, "engine build"), True), (snap(1, 0, "engine build"), True)], now=0.0)
    assert leader.stalled_for(10_000.0) == 0.0
    # a silent rank is named only once every rank of the world is known
    half = Leader(world=3)
    half.observe([(snap(0, 0, "engine build"), True), (snap(1, 0, "model load"), False)], now=0.0)
    assert half.stalled_for(10_000.0) == 0.0
