"""One object per node-count rule (advisor.decide.node_rules): chosen once from the options, each chooses,
words itself and records itself; the knee is computed by the scaling table alone and read everywhere
else; no other advisor module tells the rules apart."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_time_to_train import _timed_table

from advisor.decide.node_rules import (
    DeadlineRule,
    EfficiencyRule,
    FixedNodes,
    GpuHourCap,
    table_knee,
)
from advisor.decide.node_rules import node_rule as rule_of

ROOT = Path(__file__).resolve().parents[2]
RATES = {1: 100.0, 2: 180.0, 4: 320.0, 8: 480.0, 16: 640.0}  # efficiency 1, 0.9, 0.8, 0.6, 0.4


@pytest.mark.parametrize(
    ("options", "kind", "record", "words"),
    [
        ({}, EfficiencyRule, {}, "efficiency rule"),
        ({"nodes": 8}, FixedNodes, {}, "--nodes"),
        ({"deadline_hours": 2.0}, DeadlineRule, {"deadline_hours": 2.0}, "deadline rule"),
        ({"max_gpu_hours": 5.0}, GpuHourCap, {"max_gpu_hours": 5.0}, "gpu hours rule"),
    ],
)
def test_the_options_choose_one_rule_that_records_and_words_itself(options, kind, record, words):
    rule = rule_of(0.7, **options)
    assert type(rule) is kind and rule.min_efficiency == 0.7
    expected = {"rule_name": kind.name, "min_efficiency": 0.7, "deadline_hours": None, "max_gpu_hours": None}
    assert rule.record() == expected | record
    assert list(rule.record()) == ["rule_name", "min_efficiency", "deadline_hours", "max_gpu_hours"]
    assert rule.verdict_words == words
    assert rule.describe()  # every rule words itself


def test_the_knee_is_the_tables_mark_and_every_rule_reads_it():
    table = _timed_table(RATES)
    assert table_knee(table) == 4 == table.loc[table["knee"], "node_count"].item()
    assert EfficiencyRule().choose(table) == (4, None)
    moved = table.assign(knee=table["node_count"] == 2)  # the rule reads the mark, it does not recompute
    assert EfficiencyRule().choose(moved) == (2, None)
    # a table with no time to train: the limit rules fall back on the same knee
    untimed = moved.drop(columns=["time_to_train_s"])
    assert DeadlineRule(hours=1.0).choose(untimed) == GpuHourCap(gpu_hours=1.0).choose(untimed) == (2, None)
    none = table.assign(knee=False)
    chosen, why = EfficiencyRule(min_efficiency=0.95).choose(none)
    assert chosen == 1 and "no node count keeps 95% efficiency" in why


def test_each_limit_rule_says_how_sure_it_is():
    table = _timed_table(RATES)
    for column in ("time_to_train_s", "gpu_hours"):
        table[f"{column}_lo"], table[f"{column}_hi"] = table[column] * 0.9, table[column] * 1.1
    hours = dict(zip(table["node_count"], table["time_to_train_s"] / 3600, strict=True))
    sure = DeadlineRule(hours=hours[2] * 1.2)
    assert sure.confidence(table, 2).startswith("node count sure: 2 nodes: ")
    tight = DeadlineRule(hours=hours[2] * 1.05)
    assert tight.confidence(table, 2).endswith("; 4 nodes would be sure")
    gpu_hours = dict(zip(table["node_count"], table["gpu_hours"], strict=True))
    capped = GpuHourCap(gpu_hours=gpu_hours[2] * 1.05)
    assert "not sure" in capped.confidence(table, 2) and capped.confidence(table, 2).endswith(
        "1 node would be sure"
    )
    assert FixedNodes(nodes=2).confidence(table, 2) == ""


RULE_SWITCH = re.compile(
    r"rule\.(name|nodes|deadline_hours|max_gpu_hours|hours|gpu_hours)\b"
    r"|isinstance\([^)]*(EfficiencyRule|FixedNodes|DeadlineRule|GpuHourCap)"
    r"|rule_name\"?\]?\s*=="
)


def test_nothing_else_switches_on_a_rule():
    """Only advisor.decide.node_rules tells the rules apart: everyone else asks the rule object."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "advisor").rglob("*.py"))
        if path.name != "node_rules.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if RULE_SWITCH.search(line)
    ]
    assert found == []
    assert RULE_SWITCH.search("    if o.rule.name == 'nodes'") and RULE_SWITCH.search(
        'rec["rule_name"] == "x"'
    )
