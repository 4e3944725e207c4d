"""A pick is a measured config (issue #53, item 4): a tie goes to measured evidence, an unmeasured config is
recommended only when no measured one is within noise (and the verdict says so first), an unmeasured
stage's interval holds the spread of the costs it borrows, and a config left out for contention is said
to be left out."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from advisor.decide.node_rules import EfficiencyRule
from advisor.decide.outcome import UNMEASURED_PICK, verdict
from advisor.decide.recommend import why_not
from advisor.decide.ties import pick_config
from advisor.model.network import Link, Network
from advisor.model.predict import Candidate, borrowed_halfwidth
from advisor.model.step_time import TimeModel
from advisor.model.uncertainty import Spread, add_intervals

NET = Network(2, Link(1e10, 1e-6, "intra"), Link(1e9, 1e-5, "inter"))


def _row(stage: int, mb: int, rate: float, mem: float) -> dict:
    batch = 64
    step = batch / rate
    return {
        "node_count": 1,
        "config_id": Candidate(stage, "bf16", mb).config_id,
        "zero_stage": stage,
        "dtype": "bf16",
        "micro_batch": mb,
        "offload": "none",
        "grad_accum": batch // (mb * 2),
        "global_batch": batch,
        "world_size": 2,
        "samples_per_s": rate,
        "step_time_s": step,
        "compute_s": step,
        "exposed_comm_s": 0.0,
        "exposed_inter_s": 0.0,
        "mem_per_rank_bytes": mem,
        "feasible": True,
    }


def _predictions(z3_rate: float, contended_z1: bool = False) -> pd.DataFrame:
    """The case of issue #53: ZeRO-1 micro-batch 4 measured, ZeRO-3 micro-batch 4 never launched (the
    budget ran out), predicted faster and with less memory; ZeRO-2 micro-batch 4 measured, slower."""
    spread = Spread(
        measured={(1, "bf16", 4, "none"): 0.03, (2, "bf16", 4, "none"): 0.03},
        typical_measured=0.03,
        measured_groups=frozenset({(1, "bf16"), (2, "bf16")}),
        contended=frozenset({(1, "bf16", 4, "none")}) if contended_z1 else frozenset(),
    )
    rows = [_row(1, 4, 100.0, 3.0e9), _row(2, 4, 80.0, 2.5e9), _row(3, 4, z3_rate, 1.5e9)]
    return add_intervals(pd.DataFrame(rows), spread)


def test_a_measured_config_within_noise_of_an_unmeasured_one_is_the_pick():
    """ZeRO-3 (unmeasured) predicted 6% faster, within noise of the measured ZeRO-1, and with less memory:
    the old tie rule (least memory first) picked ZeRO-3; measured evidence now decides the tie."""
    table = _predictions(106.0)
    pick = pick_config(table)
    assert pick.fastest["config_id"] == "z3-bf16-mb4-off-none"
    assert pick.tied == ["z3-bf16-mb4-off-none", "z1-bf16-mb4-off-none"]
    assert pick.row["config_id"] == "z1-bf16-mb4-off-none" and not pick.unmeasured
    assert "goes to a measured config" in pick.describe()
    rows = table.set_index("config_id", drop=False)
    line = why_not(rows.loc["z3-bf16-mb4-off-none"], pick.row, 1e12)
    assert line.startswith("within noise of the pick (6% faster predicted, not measured)")


def test_an_unmeasured_config_is_picked_only_when_no_measured_one_is_within_noise():
    pick = pick_config(_predictions(130.0))  # 30% faster predicted: no measured config within noise
    assert pick.row["config_id"] == "z3-bf16-mb4-off-none" and pick.unmeasured
    assert pick.tied == ["z3-bf16-mb4-off-none"]


def _verdict(measured: dict) -> str:
    outcome = SimpleNamespace(
        target_net=SimpleNamespace(inter=SimpleNamespace(source="measured: 2 hosts")),
        rule=EfficiencyRule(),
    )
    rec = {
        "time_to_train": {"seconds": 600.0, "gpu_hours": 0.5, "samples": 1000, "cost": None},
        "node_count": 1,
        "gpus_per_node": 2,
        "config_id": "z3-bf16-mb4-off-none",
        "micro_batch": 4,
        "grad_accum": 8,
        "global_batch": 64,
        "trials_run": 6,
        "provenance": {"trials_ran_on": "a CPU (2 ranks)"},
        "measured": measured,
        "error": {},
    }
    return verdict(outcome, rec)


def test_the_verdict_says_first_that_the_pick_was_not_measured():
    unmeasured = _verdict(
        {"recommended_config_measured": False, "best_measured_config": "z1-bf16-mb4-off-none"}
    )
    assert unmeasured.startswith(f"{UNMEASURED_PICK} (best measured: z1-bf16-mb4-off-none): 1 node x 2")
    measured = _verdict({"recommended_config_measured": True})
    assert measured.startswith("1 node x 2 ranks, z3-bf16-mb4-off-none") and UNMEASURED_PICK not in measured


def test_a_config_left_out_for_contention_is_said_to_be_left_out_not_slower():
    table = _predictions(70.0, contended_z1=True)
    pick = pick_config(table)
    assert pick.row["config_id"] == "z2-bf16-mb4-off-none"
    rows = table.set_index("config_id", drop=False)
    line = why_not(rows.loc["z1-bf16-mb4-off-none"], pick.row, 1e12)
    assert line.startswith("left out: measured only while other processes took the cores")
    assert "slower" not in line and "faster" not in line


def _borrowing(intercepts: dict) -> TimeModel:
    return TimeModel(intercepts, {"bf16": 0.02}, {})


def test_an_unmeasured_stage_interval_holds_the_spread_of_its_borrowed_costs():
    """ZeRO-3 was never launched: its compute is the mean of ZeRO-1's and ZeRO-2's. Its interval holds the
    step it would have with either one's costs, however small the fit's own spread."""
    both = _borrowing({(1, "bf16", "none"): 0.05, (2, "bf16", "none"): 0.15})
    z3 = Candidate(3, "bf16", 4)
    accum = 8
    step = both.predict(3, "bf16", 4, accum, 1, NET).step_time_s
    half = borrowed_halfwidth(both, z3, accum, step)
    assert half > 0 and borrowed_halfwidth(both, Candidate(1, "bf16", 4), accum, step) == 0.0
    row = _row(3, 4, 64 / step, 1e9) | {"borrowed_halfwidth": half}
    spread = Spread(typical_measured=0.005, cross=0.005, cross_dof=8)
    table = add_intervals(pd.DataFrame([row]), spread).iloc[0]
    for donor in ((1, "bf16", "none"), (2, "bf16", "none")):
        alone = _borrowing({donor: both.intercepts[donor]}).predict(3, "bf16", 4, accum, 1, NET)
        assert table["step_time_s_lo"] <= alone.step_time_s <= table["step_time_s_hi"]
    # without the borrowed spread (today's interval) the cheaper donor's step lies outside it
    bare = add_intervals(pd.DataFrame([row | {"borrowed_halfwidth": 0.0}]), spread).iloc[0]
    cheap = _borrowing({(1, "bf16", "none"): 0.05}).predict(3, "bf16", 4, accum, 1, NET).step_time_s
    assert cheap < bare["step_time_s_lo"]
