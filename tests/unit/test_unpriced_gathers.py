"""An unmeasured ZeRO-3 config borrowed from ZeRO-1/2 trials (issue #53): the borrowed compute holds none of
ZeRO-3's per-parameter fetch and release, so its interval's upper bound reaches that work at its worst (one
collective per tensor at the measured link's per-call cost), and a measured config inside that interval
is picked over it."""

from __future__ import annotations

import pandas as pd
import pytest
from test_advisor_model import NUMELS, ZERO, nets
from test_stage_slopes import stage_trial

from advisor.decide.ties import pick_config
from advisor.model.predict import Candidate, predict_table
from advisor.model.step_time import fit_time_model
from advisor.model.uncertainty import Spread, add_intervals


class _Memory:
    def per_rank_bytes(self, stage, precision, micro_batch, offload, world, checkpointing):
        return {"total": 1e9 / stage, "model_states": 0, "activations": 0, "buckets": 0, "frozen": 0}


def _table(measured: list[tuple[int, int]]) -> pd.DataFrame:
    trials = pd.DataFrame([stage_trial(s, mb) for s, mb in measured])
    model = fit_time_model(trials, nets()[0], NUMELS, ZERO)
    candidates = [Candidate(s, "bf16", 4) for s in (1, 2, 3)]
    return predict_table(candidates, [1], _Memory(), model, nets()[0], 1e12, None)


def _row(table: pd.DataFrame, stage: int) -> pd.Series:
    return table[table["zero_stage"] == stage].iloc[0]


def test_zero3_borrowed_from_zero1_and_2_carries_its_unpriced_per_tensor_work():
    table = _table([(1, 1), (1, 4), (2, 1), (2, 4)])
    z3 = _row(table, 3)
    assert z3["unmeasured_s"] > 0
    assert _row(table, 1)["unmeasured_s"] == 0 and _row(table, 2)["unmeasured_s"] == 0
    # more calls than the bucketed mix: the difference is the per-call latency of the extra calls
    model = fit_time_model(
        pd.DataFrame([stage_trial(s, mb) for s, mb in [(1, 1), (2, 1)]]), nets()[0], NUMELS, ZERO
    )
    bucketed = sum(op.count for op in model.ops[3] if op.per_micro_step)
    single = sum(op.count for op in model.unbucketed_ops[3] if op.per_micro_step)
    assert single > bucketed


def test_a_measured_zero3_or_logged_collectives_leave_nothing_unpriced():
    table = _table([(1, 1), (1, 4), (3, 1), (3, 4)])
    assert (table["unmeasured_s"] == 0).all()


def test_the_unpriced_work_raises_the_upper_bound_only():
    table = _table([(1, 1), (1, 4), (2, 1), (2, 4)])
    spread = Spread(typical_measured=0.02, cross=0.02, cross_dof=8, measured_groups=frozenset({(1, "bf16")}))
    wide = add_intervals(table, spread)
    bare = add_intervals(table.assign(unmeasured_s=0.0), spread)
    z3, z3_bare = _row(wide, 3), _row(bare, 3)
    assert z3["step_time_s_lo"] == pytest.approx(z3_bare["step_time_s_lo"])
    assert z3["step_time_s_hi"] >= z3_bare["step_time_s_hi"] + z3["unmeasured_s"]
    assert z3["samples_per_s_lo"] < z3_bare["samples_per_s_lo"]


def _pick_rows(z3_rate: float, unmeasured_s: float) -> pd.DataFrame:
    rows = []
    for stage, rate, source in ((1, 100.0, "measured"), (3, z3_rate, "model")):
        step = 64 / rate
        rows.append(
            {
                "config_id": Candidate(stage, "bf16", 4).config_id,
                "zero_stage": stage,
                "samples_per_s": rate,
                "step_time_s": step,
                "mem_per_rank_bytes": 3e9 / stage,
                "compare_halfwidth": 0.03,
                "interval_source": source,
                "unmeasured_s": unmeasured_s if source == "model" else 0.0,
                "samples_per_s_lo": 64 / (step + unmeasured_s) if source == "model" else rate * 0.97,
            }
        )
    return pd.DataFrame(rows)


def test_a_measured_config_inside_an_unpriced_interval_is_the_pick():
    """ZeRO-3 predicted 30% faster, outside noise: without unpriced work it is the pick (no measured config
    within noise); with it, its interval reaches the measured ZeRO-1, which is picked."""
    assert pick_config(_pick_rows(130.0, 0.0)).row["zero_stage"] == 3
    pick = pick_config(_pick_rows(130.0, 0.5))
    assert pick.row["zero_stage"] == 1 and pick.measured_tied
    assert "inside its interval, which holds work no trial measured" in pick.describe()
    # an interval that stays above the measured config does not tie: the faster prediction stands
    assert pick_config(_pick_rows(300.0, 0.01)).row["zero_stage"] == 3
