"""How far a prediction leans on its trials (advisor.model.leverage), and the fit's spread scaled by it
(advisor.model.uncertainty)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from trial_rows import ok_trial

from advisor.model.leverage import FitPoints
from advisor.model.uncertainty import add_intervals, estimate_spread
from advisor.stats import Z95, t_quantile

Z1, Z2, Z3 = (1, "bf16", "none"), (2, "bf16", "none"), (3, "bf16", "none")


def _trials(rows: list[tuple[str, int, int, float]], half: float = 0.04) -> pd.DataFrame:
    """(trial_id, stage, micro-batch, step s) per ok trial, each with a +-`half` interval."""
    return pd.DataFrame(
        [
            ok_trial(
                stage,
                mb,
                trial_id=trial,
                step_time_s=step,
                step_time_median_s=step,
                step_s_lo=step * (1 - half),
                step_s_hi=step * (1 + half),
            )
            for trial, stage, mb, step in rows
        ]
    )


def _row(config: str, stage: int, mb: int, step: float, inter: float = 0.0) -> dict:
    return {
        "config_id": config,
        "zero_stage": stage,
        "dtype": "bf16",
        "micro_batch": mb,
        "offload": "none",
        "global_batch": 64,
        "step_time_s": step,
        "samples_per_s": 64 / step,
        "exposed_inter_s": inter,
        "mem_per_rank_bytes": 1e9,
    }


def test_a_line_through_two_trials_is_as_sure_as_one_of_them_there_and_less_beyond():
    points = FitPoints({Z1: ((1.0, 0.10), (4.0, 0.16))})
    assert points.relative_variance(Z1, 1) == pytest.approx(1.0)
    assert points.relative_variance(Z1, 4) == pytest.approx(1.0)
    between, beyond = points.relative_variance(Z1, 2), points.relative_variance(Z1, 8)
    assert between < 1.0 < beyond
    # micro-batch 8 from 1 and 4 by hand: 8 = -4/3 x (trial at 1) + 7/3 x (trial at 4), each trial's
    # sigma its share of its own step
    value = 0.10 + 0.02 * 7
    assert beyond == pytest.approx(((4 / 3 * 0.10) ** 2 + (7 / 3 * 0.16) ** 2) / value**2)
    assert points.relative_variance(Z2, 1) is None  # no trial of ZeRO-2: borrowed, not fitted


def test_a_group_at_one_micro_batch_takes_the_shared_slope_and_its_uncertainty():
    points = FitPoints({Z1: ((1.0, 0.10), (4.0, 0.16), (8.0, 0.24)), Z2: ((1.0, 0.12),)})
    assert points.relative_variance(Z2, 1) == pytest.approx(1.0)  # its one trial
    near, far = points.relative_variance(Z2, 2), points.relative_variance(Z2, 8)
    assert near < far and far > 1.0  # (the level's seconds weigh less on a longer step: near may be < 1)
    alone = FitPoints({Z2: ((2.0, 0.12), (2.0, 0.12))})  # no slope anywhere: proportional to the batch
    assert alone.relative_variance(Z2, 8) == pytest.approx(0.5)  # two trials' worth, scaled alike


def test_fit_points_take_the_last_run_of_a_trial_and_only_those_asked_for():
    trials = _trials([("a", 1, 1, 0.30), ("a", 1, 1, 0.10), ("b", 1, 4, 0.16), ("c", 2, 1, 0.12)])
    assert FitPoints.of(trials).groups == {Z1: ((1.0, 0.10), (4.0, 0.16)), Z2: ((1.0, 0.12),)}
    assert FitPoints.of(trials, only=["b", "c"]).groups == {Z1: ((4.0, 0.16),), Z2: ((1.0, 0.12),)}


def _validation(trials: pd.DataFrame, errors: dict[str, float], checks: set[str]) -> pd.DataFrame:
    """In-sample rows for the search's trials, then each held-out error (leave-one-out or check)."""
    rows = []
    for trial in trials["trial_id"]:
        if trial not in checks:
            rows.append({"config_id": trial, "quantity": "step_time_s", "predicted": 1.0, "measured": 1.0})
            rows[-1] |= {"held_out": False, "check": False}
    for trial, error in errors.items():
        rows.append({"config_id": trial, "quantity": "step_time_s", "predicted": 1 + error, "measured": 1.0})
        rows[-1] |= {"held_out": True, "check": trial in checks}
    return pd.DataFrame(rows)


def test_the_fits_spread_counts_an_extrapolations_error_for_less():
    trials = _trials([("a", 1, 1, 0.10), ("b", 1, 4, 0.16), ("c", 1, 2, 0.12), ("d", 1, 8, 0.25)])
    search = FitPoints.of(trials, only=["a", "b"])
    between, beyond = search.relative_variance(Z1, 2), search.relative_variance(Z1, 8)
    same = {"c": 0.2, "d": 0.2}  # both checks 20% off, one between the search's trials, one beyond
    spread = estimate_spread(trials, _validation(trials, same, {"c", "d"}), 0.05, 0.0, True)
    expected = math.sqrt((0.2**2 / (1 + between) + 0.2**2 / (1 + beyond)) / 2)
    assert spread.model == pytest.approx(expected) and spread.model_dof == 2
    assert spread.model < 0.2 / math.sqrt(1 + between)  # the extrapolation's error weighs less
    # a leave-one-out row is predicted by the search's fit less its own trial
    loo = estimate_spread(trials, _validation(trials, {"a": 0.1}, {"c", "d"}), 0.05, 0.0, True)
    alone = FitPoints.of(trials, only=["b"]).relative_variance(Z1, 1)
    assert loo.model == pytest.approx(max(0.1 / math.sqrt(1 + alone), 0.04 / Z95))


def test_an_unmeasured_config_is_as_uncertain_as_its_reach_and_never_surer_than_its_group():
    trials = _trials([("a", 1, 1, 0.10), ("b", 1, 4, 0.16), ("c", 2, 1, 0.12), ("d", 2, 4, 0.17)], 0.02)
    errors = {"a": 0.15, "b": -0.15, "c": 0.1, "d": -0.1}
    spread = estimate_spread(trials, _validation(trials, errors, set()), None, 0.0, True)
    rows = [_row("z1-mb2", 1, 2, 0.12), _row("z1-mb8", 1, 8, 0.24), _row("z1-mb4", 1, 4, 0.16)]
    table = add_intervals(pd.DataFrame(rows), spread)
    half = ((table["step_time_s_hi"] - table["step_time_s"]) / table["step_time_s"]).to_numpy()
    points = FitPoints.of(trials)
    for i, mb in ((0, 2), (1, 8)):
        fitted = t_quantile(spread.model_dof) * spread.model * math.sqrt(points.relative_variance(Z1, mb))
        assert half[i] == pytest.approx(max(fitted, Z95 * 0.02 / Z95))
    assert half[1] > 2 * half[0]  # the extrapolation's interval is the wider one
    assert half[2] == pytest.approx(0.02)  # measured: its own trial
    assert list(table["interval_source"]) == ["model", "model", "measured"]
    # a config right between two tight trials would come out surer than either: held at the group's own
    sure = estimate_spread(trials, _validation(trials, {"a": 0.001, "c": 0.001}, set()), None, 0.0, True)
    table = add_intervals(pd.DataFrame([_row("z1-mb2", 1, 2, 0.12)]), sure)
    assert table.iloc[0]["step_time_s_hi"] / 0.12 - 1 >= 0.02 - 1e-12


def test_the_inter_node_part_of_a_step_is_the_links_not_the_fits():
    trials = _trials([("a", 1, 1, 0.10), ("b", 1, 4, 0.16)])
    spread = estimate_spread(trials, _validation(trials, {"a": 0.2, "b": -0.2}, set()), None, 0.0, True)
    one = add_intervals(pd.DataFrame([_row("z1-mb8", 1, 8, 0.24)]), spread).iloc[0]
    four = add_intervals(pd.DataFrame([_row("z1-mb8", 1, 8, 0.48, inter=0.24)]), spread).iloc[0]
    rel = lambda r: r["step_time_s_hi"] / r["step_time_s"] - 1  # noqa: E731
    assert rel(four) == pytest.approx(rel(one) / 2)  # half the step is the link's (assumed here: no spread)


def test_an_older_validation_table_keeps_the_unscaled_spread():
    trials = _trials([("a", 1, 1, 0.10), ("b", 1, 4, 0.16)], Z95 * 0.02)
    old = pd.DataFrame(
        [
            {"config_id": c, "quantity": "step_time_s", "predicted": 1.05, "measured": 1.0, "held_out": True}
            for c in "ab"
        ]
    )
    spread = estimate_spread(trials, old, None, 0.0, True)
    assert spread.model == pytest.approx(math.sqrt(0.05**2 - 0.02**2)) and not spread.fit_points.groups
    assert "scaled" not in spread.describe()
    table = add_intervals(pd.DataFrame([_row("z1-mb8", 1, 8, 0.24)]), spread)
    assert table.iloc[0]["step_time_s_hi"] / 0.24 - 1 == pytest.approx(t_quantile(2) * spread.model)
    assert np.isfinite(table["step_time_s_lo"]).all()


def test_the_answer_says_how_many_checks_were_extrapolations():
    from advisor.model.prediction_error import error_summary
    from advisor.report.answer import held_out_sentence
    from advisor.report.terminal import error_line

    def row(config: str, stage: int, mb: int, held: bool, check: bool) -> dict:
        return {
            "config_id": config,
            "quantity": "step_time_s",
            "predicted": 1.1,
            "measured": 1.0,
            "held_out": held,
            "check": check,
            "zero_stage": stage,
            "micro_batch": mb,
        }

    search = [
        row("z1-mb1", 1, 1, False, False),
        row("z1-mb4", 1, 4, False, False),
        row("z2-mb1", 2, 1, False, False),
    ]
    checks = [
        row("z1-mb2", 1, 2, True, True),
        row("z1-mb8", 1, 8, True, True),
        row("z3-mb1", 3, 1, True, True),
    ]
    held = error_summary(pd.DataFrame(search + checks))["held_out"]
    assert held["beyond"] == 2 and held["trials"] == 3  # mb8 beyond 1-4, and a stage the search never ran
    rec = {"error": held, "noise_floor": 0.05}
    assert "(2 of them beyond the micro-batches their stage was measured at: extrapolations)" in error_line(
        rec
    )
    assert "2 of them beyond" in held_out_sentence(rec)
    inside = error_summary(pd.DataFrame(search + checks[:1]))["held_out"]
    assert inside["beyond"] == 0 and "beyond" not in error_line({"error": inside})
