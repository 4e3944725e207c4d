"""A slope per stage where a stage was measured at two micro-batches; the search's launches (one per group,
every micro-batch of it) and the budget it plans from the first launch's measured cost."""

from __future__ import annotations

import pandas as pd
import pytest
from test_advisor_model import NUMELS, ZERO, nets, trial, with_accumulation_checks

import advisor.decide.search as search
from advisor.decide.search import LaunchCosts, default_budget_s, run_search
from advisor.measure.grid import GridRequest, plan_grid
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


def full_grid() -> pd.DataFrame:
    rows = pd.DataFrame([stage_trial(s, mb) for s in (1, 2, 3) for mb in (1, 2, 4, 8)])
    return with_accumulation_checks(rows).set_index("trial_id")


STARTUP_S, STEP_S = 20.0, 0.1


class Clock:
    """time.monotonic for the search, advanced by each replayed launch."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LaunchReplay:
    """A stand-in for advisor.measure.launch.LaunchRunner: answers from `full`; each call is one launch
    of STARTUP_S, its measuring time and its untimed steps; `costs` as the runner measures them."""

    def __init__(self, full: pd.DataFrame, clock: Clock) -> None:
        self.full, self.clock = full, clock
        self.measured: list[str] = []
        self.launches: list[list[str]] = []

    def __call__(self, specs, measure_s: float = 24.0) -> pd.DataFrame:
        self.launches.append([s.trial_id for s in specs])
        self.measured += [s.trial_id for s in specs if s.trial_id not in self.measured]
        self.clock.now += LaunchCosts(STARTUP_S, STEP_S).launch_s(len(specs), measure_s)
        return self.full.loc[self.measured].reset_index()

    def costs(self) -> tuple[float, float]:
        return STARTUP_S, STEP_S


def searched(
    monkeypatch,
    budget_s: float,
    default_base_s: float | None = None,
    decide: bool = False,
    full: pd.DataFrame | None = None,
    grid=None,
):
    """The search over the replayed grid; `decide` False: it never stops for a decided pick (the launches
    and the budget's plan are what is tested), as where every group stays within DECIDED_MARGIN."""
    clock = Clock()
    monkeypatch.setattr(search.time, "monotonic", clock)
    if not decide:
        monkeypatch.setattr(search, "DECIDED_MARGIN", 1.0)
    replay = LaunchReplay(full_grid() if full is None else full, clock)
    measured_net, target = nets(gpus=2)
    result = run_search(
        plan() if grid is None else grid,
        replay,
        NUMELS,
        ZERO,
        measured_net,
        target,
        1,
        1e12,
        None,
        budget_s=budget_s,
        default_base_s=default_base_s,
    )
    return result, replay, clock.now - 1000.0


def test_each_launch_measures_every_micro_batch_of_its_group_and_its_accumulation_check(monkeypatch):
    result, replay, spent = searched(monkeypatch, budget_s=600)
    assert len(replay.launches) == 3  # one per ZeRO stage, not one per config
    assert replay.launches[0][0].startswith("z1-")  # the first ladder's; then in the model's order
    for launch in replay.launches:
        stage = int(launch[0][1])
        assert launch == [f"z{stage}-bf16-mb{mb}-off-none-r2" for mb in (1, 2, 4, 8)] + [
            f"z{stage}-bf16-mb8-off-none-r2-ga4"
        ]
    assert result.check_ids == sorted(launch[-1] for launch in replay.launches)
    assert spent <= 600
    # every stage has its own line: a micro-batch of ZeRO-3 is its own, not the others' slope
    fitted = result.trials[~result.trials["trial_id"].isin(result.check_ids)]
    model = fit_time_model(fitted, nets()[0], NUMELS, ZERO)
    assert compute_of(model, 3, 2) == pytest.approx(0.05 * 3 + PER_SAMPLE[3] * 2, rel=1e-6)


def test_the_first_launchs_cost_plans_the_budget_says_so_and_the_search_ends_within_it(monkeypatch):
    # Room for the first launch and one more: the plan says which, the third group is left predicted.
    result, replay, spent = searched(monkeypatch, budget_s=120)
    (line,) = [line for line in result.log if line.startswith("budget:")]
    assert "start-up of 20 s" in line and "cover 1 of the 2 other groups" in line and "predicted" in line
    assert len(replay.launches) == 2 and spent <= 120 - search.END_RESERVE_S
    assert any("--budget-minutes reached" in line for line in result.log)


def test_the_default_budget_grows_to_launch_every_group_once_at_the_measured_cost(monkeypatch):
    costs = LaunchCosts(100.0, 0.5)  # minutes-long launches: 100 s start-up, 0.5 s a step
    every = default_budget_s(300.0, costs, groups=3, configs=5, spent_s=130.0)
    reserve = search.END_RESERVE_S
    assert every == pytest.approx((130.0 + 3 * costs.launch_s(5, 0.0) + reserve) / (1 - search.END_RESERVE))
    assert default_budget_s(3600.0, costs, groups=3, configs=5, spent_s=130.0) == 3600.0
    # a given --budget-minutes is a cap: the search stays within it; the default budget follows the cost
    capped, _, _ = searched(monkeypatch, budget_s=100)
    assert capped.budget_s == 100
    grown, replay, spent = searched(monkeypatch, budget_s=100, default_base_s=100)
    assert grown.budget_s > 100 and len(replay.launches) == 3 and spent <= grown.budget_s


def with_offload(full: pd.DataFrame) -> pd.DataFrame:
    """The grid again with optimizer offload: every config slower by a fixed CPU-optimizer cost a step."""
    rows = full.reset_index()
    offloaded = rows.assign(
        trial_id=rows["trial_id"].str.replace("off-none", "off-optimizer"),
        offload="optimizer",
        step_time_s=rows["step_time_s"] + 0.3,
    )
    offloaded["samples_per_s"] = offloaded["global_batch"] / offloaded["step_time_s"]
    return pd.concat([rows, offloaded], ignore_index=True).set_index("trial_id")


def test_the_search_stops_launching_once_the_groups_left_are_predicted_clearly_slower(monkeypatch):
    """Across launches: once every config of the groups not launched is predicted more than
    DECIDED_MARGIN slower than the best measured one, no more launches; the log says why. Doubling the
    grid with slower groups (optimizer offload) adds no launch, and the grid's best is measured."""
    result, replay, _ = searched(monkeypatch, budget_s=6000, decide=True)
    assert [launch[0][:3] for launch in replay.launches] == ["z1-", "z3-"]  # ZeRO-2 predicted, not launched
    (stop,) = [line for line in result.log if line.startswith("stopped: the pick is decided")]
    assert "1 groups not launched" in stop and "z2-" in stop
    full = full_grid()
    plain = full[~full.index.str.endswith("-ga4")]
    assert plain["samples_per_s"].idxmax() in set(result.trials["trial_id"])

    doubled = with_offload(full)
    grid = plan_grid(
        GridRequest(
            stages=(1, 2, 3),
            precisions=("bf16",),
            micro_batches=(1, 2, 4, 8),
            offloads=("none", "optimizer"),
            ranks_per_node=(2,),
        ),
        {"bf16": True},
    )
    larger, replay2, _ = searched(monkeypatch, budget_s=6000, decide=True, full=doubled, grid=grid)
    assert len(replay2.launches) == len(replay.launches)  # 6 groups, the same 2 launches
    assert any("4 groups not launched" in line for line in larger.log)
    best = doubled[~doubled.index.str.endswith("-ga4")]["samples_per_s"].idxmax()
    assert best in set(larger.trials["trial_id"])
    # Without the stop (the margin never met) every group is launched: the cost grows with the grid.
    _, every, _ = searched(monkeypatch, budget_s=6000, decide=False, full=doubled, grid=grid)
    assert len(every.launches) == 6


def test_a_measured_leader_over_the_memory_cap_decides_nothing():
    """ZeRO-1 and 3 measured, ZeRO-2 left. With room for everything, ZeRO-2 is predicted far slower than
    ZeRO-1's micro-batch 8 and the search is decided; under a cap that ZeRO-1's micro-batch 4 and 8 do
    not fit (ZeRO-2's micro-batch 4, a little smaller, does), the leader to beat is ZeRO-1's micro-batch 2,
    ZeRO-2's micro-batch 4 is predicted within DECIDED_MARGIN of it, and ZeRO-2 must be launched."""
    full = full_grid().reset_index()
    trials = full[full["trial_id"].str.startswith(("z1-", "z3-")) & ~full["trial_id"].str.endswith("-ga4")]
    left = [ladder for ladder in plan().ladders if ladder[0].zero_stage == 2]
    measured_net, target = nets(gpus=2)
    models = search.fit_models(trials, NUMELS, ZERO, measured_net)
    per_rank = {s: models.memory.per_rank_bytes(s, "bf16", 4, "none", 2)["total"] for s in (1, 2)}
    cap = (per_rank[1] + per_rank[2]) / 2  # ZeRO-1's micro-batch 4 over it, ZeRO-2's under

    def why(usable: float) -> str | None:
        return search.decided(left, trials, models, search.Judged(target, 1, usable, None))

    assert why(1e12) is not None and "z2-" in why(1e12)
    assert why(cap) is None
