"""A slope per stage where a stage was measured at two micro-batches, the search's second micro-batch for a
stage measured at one, and the budget the search keeps free for the check trials."""

from __future__ import annotations

import time

import pandas as pd
import pytest
from test_advisor_model import NUMELS, ZERO, nets, replayer, trial
from test_measurement_noise import SPECS, Machine, make_runner, no_config_check  # noqa: F401

import advisor.model.search as search
from advisor.measure.grid import GridRequest, plan_grid
from advisor.model.search import run_search, slope_specs
from advisor.model.step_time import fit_time_model

PER_SAMPLE = {1: 0.010, 2: 0.012, 3: 0.030}
"""Seconds per sample of compute at each stage: ZeRO-3's grows 3x faster with the micro-batch."""


def stage_trial(stage: int, mb: int) -> dict:
    """The synthetic trial of test_advisor_model with its step set to a line of the stage's own slope."""
    row = trial(stage, mb)
    row["step_time_s"] = 0.05 * stage + PER_SAMPLE[stage] * mb + row["comm_s"]
    row["samples_per_s"] = row["global_batch"] / row["step_time_s"]
    return row


def compute_of(model, stage: int, mb: int) -> float:
    return model.compute_per_micro_s(stage, "bf16", mb)


def test_a_stage_measured_at_two_micro_batches_gets_its_own_line():
    measured = [(1, 1), (1, 4), (3, 1), (3, 4), (2, 1)]
    trials = pd.DataFrame([stage_trial(s, mb) for s, mb in measured])
    model = fit_time_model(trials, nets()[0], NUMELS, ZERO)
    assert set(model.group_slopes) == {(1, "bf16", "none"), (3, "bf16", "none")}
    assert model.group_slopes[(3, "bf16", "none")] == pytest.approx(PER_SAMPLE[3])
    for stage in (1, 3):  # micro-batch 8, which no trial ran, on the stage's own line
        assert compute_of(model, stage, 8) == pytest.approx(0.05 * stage + PER_SAMPLE[stage] * 8)
    # ZeRO-2, at one micro-batch, keeps the shared slope: the pooled growth of the two measured stages
    shared = model.slopes["bf16"]
    assert PER_SAMPLE[1] < shared < PER_SAMPLE[3]
    assert compute_of(model, 2, 8) - compute_of(model, 2, 1) == pytest.approx(7 * shared)


def test_one_shared_slope_would_miss_the_stage_that_grows_faster():
    """The error the own line removes: with ZeRO-3 at one micro-batch, its micro-batch 8 is off by a third."""
    trials = pd.DataFrame([stage_trial(s, mb) for s, mb in [(1, 1), (1, 4), (3, 1)]])
    model = fit_time_model(trials, nets()[0], NUMELS, ZERO)
    truth = 0.05 * 3 + PER_SAMPLE[3] * 8
    assert compute_of(model, 3, 8) / truth - 1 < -0.3


def test_a_line_whose_slope_comes_out_negative_is_not_kept():
    rows = [stage_trial(1, 1), stage_trial(1, 4), stage_trial(2, 1), stage_trial(2, 2)]
    rows[3]["step_time_s"] = rows[2]["step_time_s"] * 0.97  # a noisy pair close together: more costs less
    model = fit_time_model(pd.DataFrame(rows), nets()[0], NUMELS, ZERO)
    assert (2, "bf16", "none") not in model.group_slopes and (1, "bf16", "none") in model.group_slopes
    assert compute_of(model, 2, 8) > compute_of(model, 2, 2)


def plan():
    return plan_grid(
        GridRequest(stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1, 2, 4, 8), ranks_per_node=(2,)),
        {"bf16": True},
    )


def full_grid(wall_s: float = 10.0) -> pd.DataFrame:
    rows = [stage_trial(s, mb) | {"wall_s": wall_s} for s in (1, 2, 3) for mb in (1, 2, 4, 8)]
    return pd.DataFrame(rows).set_index("trial_id")


def test_slope_specs_pick_the_largest_micro_batch_that_fits_of_each_one_point_ladder():
    full = full_grid()
    measured = full.loc[
        [
            "z1-bf16-mb1-off-none-r2",
            "z1-bf16-mb4-off-none-r2",
            "z2-bf16-mb1-off-none-r2",
            "z3-bf16-mb1-off-none-r2",
        ]
    ].reset_index()
    roomy = slope_specs(plan(), measured, NUMELS, ZERO, nets()[0], 1e12)
    assert {s.trial_id for s in roomy} == {"z2-bf16-mb8-off-none-r2", "z3-bf16-mb8-off-none-r2"}
    assert roomy[0].zero_stage == 2  # the faster one first
    # memory that holds micro-batch 4 but not 8: the largest that fits instead
    from advisor.model.prediction_error import fit_models

    memory = fit_models(measured, NUMELS, ZERO, nets()[0]).memory
    total = {
        (st, mb): memory.per_rank_bytes(st, "bf16", mb, "none", 2)["total"] for st in (2, 3) for mb in (4, 8)
    }
    limit = max(total[(2, 4)], total[(3, 4)]) * 1.001
    assert limit < min(total[(2, 8)], total[(3, 8)])
    tight = slope_specs(plan(), measured, NUMELS, ZERO, nets()[0], limit)
    assert {s.trial_id for s in tight} == {"z2-bf16-mb4-off-none-r2", "z3-bf16-mb4-off-none-r2"}


class Clock:
    """time.monotonic for the search, advanced by each replayed trial's wall time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def timed_replayer(full: pd.DataFrame, clock: Clock):
    replay = replayer(full)

    def run(specs):
        before = len(replay([]))
        table = replay(specs)
        clock.now += float(full["wall_s"].iloc[0]) * (len(table) - before)
        return table

    return run


def searched(monkeypatch, budget_s: float, reserve_trials: int):
    clock = Clock()
    monkeypatch.setattr(search.time, "monotonic", clock)
    measured_net, target = nets(gpus=2)
    result = run_search(
        plan(),
        timed_replayer(full_grid(), clock),
        NUMELS,
        ZERO,
        measured_net,
        target,
        1,
        1e12,
        None,
        budget_s=budget_s,
        reserve_trials=reserve_trials,
    )
    return result, budget_s - (clock.now - 1000.0)


def test_the_search_measures_a_second_micro_batch_per_stage_with_budget_left(monkeypatch):
    result, left = searched(monkeypatch, budget_s=300, reserve_trials=3)
    seconds = [line for line in result.log if line.startswith("second micro-batch:")]
    ok = result.trials
    for stage in (1, 2, 3):  # every stage ends with two micro-batches or more: a line of its own
        assert ok.loc[ok["zero_stage"] == stage, "micro_batch"].nunique() >= 2, stage
    assert seconds and left >= 3 * 10.0  # the check trials' room is still there
    model = fit_time_model(ok, nets()[0], NUMELS, ZERO)
    truth = 0.05 * 3 + PER_SAMPLE[3] * 2
    assert compute_of(model, 3, 2) == pytest.approx(truth, rel=1e-6)  # a micro-batch no trial ran


def test_the_reserve_is_not_spent_on_second_micro_batches(monkeypatch):
    # Room for the seeds (4 trials), the model's picks and nothing beyond the reserve.
    bare, _ = searched(monkeypatch, budget_s=300, reserve_trials=0)
    picks = len(bare.trials) - sum(line.startswith("second micro-batch:") for line in bare.log)
    budget = picks * 10.0 + 25.0  # 2.5 trials past the picks: less than a trial beside a reserve of 2
    tight, left = searched(monkeypatch, budget_s=budget, reserve_trials=2)
    assert not any(line.startswith("second micro-batch:") for line in tight.log)
    assert any("no room for a second micro-batch" in line for line in tight.log)
    assert left >= 2 * 10.0


def test_a_rematch_keeps_the_reserve_free(tmp_path, no_config_check):  # noqa: F811
    machine = Machine(lambda t: 1.0)
    runner = make_runner(tmp_path, machine, bracket_every=0)
    a, b = SPECS[3], SPECS[7]
    runner([a, b])  # 20 s of wall time each
    runner.deadline = time.monotonic() + 90.0  # room for a duel's 4 legs (80 s), not beside 40 s kept
    machine.calls.clear()
    runner.rematch([a.trial_id, b.trial_id], reserve_s=40.0)
    assert [trial for trial, _ in machine.calls] == [a.trial_id, b.trial_id]  # once each, back to back
    assert not any(name.startswith("duel") for _, name in machine.calls)
    machine.calls.clear()
    runner.deadline = time.monotonic() + 90.0
    runner.rematch([a.trial_id, b.trial_id])
    assert [name for _, name in machine.calls] == ["duel-1", "duel-2", "duel-3", "duel-4"]
