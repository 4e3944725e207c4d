"""Intervals on predicted figures, the tie rule and the node count's confidence (advisor.model.uncertainty,
advisor.decide.node_rules: each rule's confidence)."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
from trial_rows import ok_trial

from advisor.decide.node_rules import node_rule
from advisor.decide.recommend import why_not
from advisor.decide.scaling_table import scaling_table
from advisor.decide.ties import is_tie, pick_config
from advisor.model.uncertainty import Spread, add_intervals, estimate_spread
from advisor.stats import MEAN_ABS_TO_SIGMA, Z95, t_quantile


def _row(config: str, stage: int, mb: int, rate: float, mem: float, nodes: int = 1, **extra) -> dict:
    batch = 64
    step = batch / rate
    return {
        "node_count": nodes,
        "config_id": config,
        "zero_stage": stage,
        "dtype": "bf16",
        "micro_batch": mb,
        "offload": "none",
        "grad_accum": batch // (mb * 2 * nodes),
        "global_batch": batch,
        "world_size": 2 * nodes,
        "samples_per_s": rate,
        "step_time_s": step,
        "compute_s": step,
        "exposed_comm_s": 0.0,
        "exposed_inter_s": 0.0,
        "mem_per_rank_bytes": mem,
        "feasible": True,
        "optimizer_steps": 100,
        "time_to_train_s": 10.0 + 100 * step,
        "gpu_hours": (10.0 + 100 * step) / 3600 * 2 * nodes,
        **extra,
    }


def _trials(rows: list[tuple[int, int, float, float]]) -> pd.DataFrame:
    """(stage, micro-batch, step s, relative 95% half-width) per ok trial."""
    return pd.DataFrame(
        [
            ok_trial(
                stage,
                mb,
                step_time_s=step,
                step_time_median_s=step,
                step_s_lo=step * (1 - half),
                step_s_hi=step * (1 + half),
            )
            for stage, mb, step, half in rows
        ]
    )


def _validation(errors: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"quantity": "step_time_s", "predicted": 1 + e, "measured": 1.0, "held_out": True} for e in errors]
    )


def test_t_quantile_widens_few_errors_and_meets_the_normal():
    assert t_quantile(2) == pytest.approx(4.303)
    assert t_quantile(11) == pytest.approx(2.228)  # the next lower entry: errs wide
    assert t_quantile(500) == pytest.approx(Z95)
    assert t_quantile(0) > t_quantile(1) - 1e-9


def test_spread_takes_measurement_noise_out_of_the_fit_errors():
    trials = _trials([(2, 1, 1.0, Z95 * 0.02), (2, 4, 2.0, Z95 * 0.02)])
    spread = estimate_spread(trials, _validation([0.05, -0.05, 0.05, -0.05]), 0.04, 0.1, False, [10, 12, 14])
    assert spread.measured[(2, "bf16", 1, "none")] == pytest.approx(0.02)
    assert spread.model == pytest.approx(math.sqrt(0.05**2 - 0.02**2))  # 5% rms less the 2% own noise
    assert spread.model_dof == 4
    assert spread.noise == pytest.approx(0.04 * MEAN_ABS_TO_SIGMA)
    assert spread.link == 0.1
    assert spread.startup_s == pytest.approx(1.4826 * 2)
    assert not spread.notes


def test_spread_says_what_it_could_not_measure():
    spread = estimate_spread(_trials([(2, 1, 1.0, 0.02)]), pd.DataFrame(), None, 0.2, True)
    # no errors to size the fit: it is taken as no surer than the trial it rests on
    assert spread.link == 0.0 and spread.model == pytest.approx(0.02 / Z95)
    text = " ".join(spread.notes)
    assert "no held-out errors" in text and "no noise floor" in text and "assumed" in text


def test_a_measured_config_is_pinned_by_its_trial_and_others_by_the_fit():
    spread = Spread(
        measured={(2, "bf16", 4, "none"): 0.01},
        typical_measured=0.01,
        model=0.05,
        model_dof=8,
        cross=0.3,
        cross_dof=2,
        measured_groups=frozenset({(2, "bf16")}),
    )
    table = add_intervals(
        pd.DataFrame([_row("z2-mb4", 2, 4, 100.0, 1e9), _row("z2-mb8", 2, 8, 110.0, 2e9)]), spread
    )
    measured, modelled = table.iloc[0], table.iloc[1]
    assert measured["interval_source"] == "measured" and modelled["interval_source"] == "model"
    rel = (measured["step_time_s_hi"] - measured["step_time_s"]) / measured["step_time_s"]
    assert rel == pytest.approx(Z95 * 0.01)
    rel = (modelled["step_time_s_hi"] - modelled["step_time_s"]) / modelled["step_time_s"]
    assert rel == pytest.approx(t_quantile(8) * 0.05)
    # throughput is the batch over the step: its bounds are the step's, swapped
    assert modelled["samples_per_s_lo"] == pytest.approx(64 / modelled["step_time_s_hi"])
    assert modelled["samples_per_s_lo"] < modelled["samples_per_s"] < modelled["samples_per_s_hi"]
    assert modelled["time_to_train_s_lo"] < modelled["time_to_train_s"] < modelled["time_to_train_s_hi"]
    assert modelled["gpu_hours_hi"] / modelled["time_to_train_s_hi"] == pytest.approx(
        modelled["gpu_hours"] / modelled["time_to_train_s"]
    )
    # the comparison uses measurement noise only: both configs compare at the trial's 1%
    assert table["compare_halfwidth"].tolist() == pytest.approx([Z95 * 0.01] * 2)
    # a stage no trial ran borrows its costs: the cross-group spread, not the in-group one
    other = add_intervals(pd.DataFrame([_row("z3-mb8", 3, 8, 90.0, 1e9)]), spread).iloc[0]
    rel = (other["step_time_s_hi"] - other["step_time_s"]) / other["step_time_s"]
    assert rel == pytest.approx(t_quantile(2) * 0.3)


def test_held_out_errors_are_split_by_whether_their_group_kept_a_trial():
    trials = _trials([(2, 1, 1.0, 0.0), (2, 4, 2.0, 0.0), (3, 1, 3.0, 0.0)]).assign(trial_id=["a", "b", "c"])
    validation = pd.DataFrame(
        [
            {"config_id": c, "quantity": "step_time_s", "predicted": 1 + e, "measured": 1.0, "held_out": True}
            for c, e in (("a", 0.02), ("b", -0.02), ("c", 0.4))
        ]
    )
    spread = estimate_spread(trials, validation, 0.02, 0.0, False)
    assert spread.model == pytest.approx(0.02) and spread.model_dof == 2  # z2's two trials
    assert spread.cross == pytest.approx(0.4) and spread.cross_dof == 1  # z3 held out as its only trial
    assert spread.measured_groups == {(2, "bf16"), (3, "bf16")}


def test_the_noise_floor_and_the_link_widen_the_prediction():
    quiet = Spread(measured={(2, "bf16", 4, "none"): 0.01}, typical_measured=0.01)
    noisy = Spread(measured={(2, "bf16", 4, "none"): 0.01}, typical_measured=0.01, noise=0.05, link=0.2)
    row = _row("z2-mb4", 2, 4, 100.0, 1e9, nodes=4)
    row["exposed_inter_s"] = row["step_time_s"] / 2  # half the step waits on the inter-node link
    a, b = (
        add_intervals(pd.DataFrame([row]), quiet).iloc[0],
        add_intervals(pd.DataFrame([row]), noisy).iloc[0],
    )
    rel = (b["step_time_s_hi"] - b["step_time_s"]) / b["step_time_s"]
    assert rel == pytest.approx(Z95 * math.sqrt(0.01**2 + 0.1**2 + 0.05**2))
    assert b["link_halfwidth"] == pytest.approx(Z95 * 0.1)
    assert b["compare_halfwidth"] > a["compare_halfwidth"]  # the link is not shared drift: it counts


def test_ties_are_differences_within_the_difference_interval():
    a = pd.Series({"samples_per_s": 100.0, "compare_halfwidth": 0.03})
    assert is_tie(a, pd.Series({"samples_per_s": 96.0, "compare_halfwidth": 0.03}))  # 4% < 4.2%
    assert not is_tie(a, pd.Series({"samples_per_s": 94.0, "compare_halfwidth": 0.03}))  # 6.2% > 4.2%
    bare = pd.Series({"samples_per_s": 99.0})  # predictions without intervals (an older folder)
    assert not is_tie(bare, pd.Series({"samples_per_s": 100.0})) and is_tie(bare, bare)


def _tied_rows() -> pd.DataFrame:
    spread = Spread(
        measured={(s, "bf16", mb, "none"): 0.02 for s, mb in ((1, 8), (2, 8), (2, 4), (3, 2))},
        typical_measured=0.02,
    )
    rows = [
        _row("z1-mb8", 1, 8, 100.0, 4.0e9),  # the fastest
        _row("z2-mb8", 2, 8, 99.0, 3.0e9),  # tied, less memory
        _row("z2-mb4", 2, 4, 97.0, 2.0e9),  # tied, least memory
        _row("z3-mb2", 3, 2, 97.5, 2.1e9),  # tied, within 10% of the least memory, but ZeRO-3
        _row("z1-mb1", 1, 1, 80.0, 1.0e9),  # least memory of all, but 20% slower: not tied
    ]
    return add_intervals(pd.DataFrame(rows), spread)


def test_a_tie_goes_to_less_memory_then_the_simpler_stage():
    pick = pick_config(_tied_rows())
    assert pick.row["config_id"] == "z2-mb4" and pick.fastest["config_id"] == "z1-mb8"
    assert pick.broke_tie and set(pick.tied) == {"z1-mb8", "z2-mb8", "z2-mb4", "z3-mb2"}
    assert "chosen over the faster-predicted" in pick.describe() and "least memory" in pick.describe()


def test_memory_differences_are_weighed_against_the_device_usable_memory():
    # 2-4 GB per rank on a 100 GB device: the same headroom; the simpler stage, then the faster, wins
    roomy = _tied_rows().assign(usable_bytes=100e9)
    pick = pick_config(roomy)
    assert pick.row["config_id"] == "z1-mb8" and not pick.broke_tie
    assert "usable memory" in pick.describe()
    # on a 12 GB device 1.2 GB matters: z2-mb8 (3.0 GB) is within it of the least (2.0 GB), z1-mb8 is not
    tight = _tied_rows().assign(usable_bytes=12e9)
    assert pick_config(tight).row["config_id"] == "z2-mb8"


def test_without_a_tie_the_fastest_wins_and_nothing_is_said():
    rows = _tied_rows()
    rows["compare_halfwidth"] = 0.001
    pick = pick_config(rows)
    assert pick.row["config_id"] == "z1-mb8" and not pick.broke_tie and pick.describe() == ""


def test_why_not_says_within_noise_only_where_it_is_true():
    rows = _tied_rows().set_index("config_id", drop=False)
    best = rows.loc["z2-mb4"]
    assert why_not(rows.loc["z1-mb8"], best, 1e12).startswith(
        "within noise of the pick (3% faster predicted)"
    )
    assert "within noise" not in why_not(rows.loc["z1-mb1"], best, 1e12)


def _table(effs: dict[int, tuple[float, float]], rule_min: float = 0.8) -> pd.DataFrame:
    """A scaling table from per-node (efficiency, compare half-width) of one config."""
    rows = []
    for n, (eff, half) in effs.items():
        row = _row("z2-mb4", 2, 4, 100.0 * n * eff, 1e9, nodes=n)
        row |= {"compare_halfwidth": half, "link_halfwidth": half}
        row |= {f"time_to_train_s_{e}": row["time_to_train_s"] * f for e, f in (("lo", 0.9), ("hi", 1.1))}
        row |= {f"gpu_hours_{e}": row["gpu_hours"] * f for e, f in (("lo", 0.9), ("hi", 1.1))}
        rows.append(row)
    return scaling_table(pd.DataFrame(rows), list(effs), rule_min, "measured", set())


def test_the_knee_is_sure_when_the_bar_is_outside_both_intervals():
    table = _table({1: (1.0, 0.0), 2: (0.95, 0.02), 4: (0.6, 0.02)})
    assert table["efficiency_lo"].iloc[1] == pytest.approx(0.95 / 1.02)
    line = node_rule(0.8).confidence(table, 2)
    assert line.startswith("node count sure: 2 nodes keep 95.0% efficiency (93.1%-96.9%); 4 nodes 60.0%")


def test_a_sure_knee_on_an_assumed_link_says_its_interval_holds_no_link_spread():
    rows = []
    for n, eff in {1: 1.0, 2: 0.95, 4: 0.6}.items():  # one config at every count, no link spread
        row = _row("z2-mb4", 2, 4, 100.0 * n * eff, 1e9, nodes=n)
        rows.append(row | {"compare_halfwidth": 0.05, "link_halfwidth": 0.0})
    table = scaling_table(pd.DataFrame(rows), [1, 2, 4], 0.8, "assumed", {"z2-mb4"})
    line = node_rule(0.8).confidence(table, 2)
    # a range of zero width is not printed as one: the figure alone, and the caveat says why
    assert line.startswith("node count sure: 2 nodes keep 95.0% efficiency; 4 nodes 60.0%, the 80% bar")
    assert line.endswith("the link is assumed: --hostfile measures it)")
    measured = scaling_table(pd.DataFrame(rows), [1, 2, 4], 0.8, "measured", {"z2-mb4"})
    assert "assumed" not in node_rule(0.8).confidence(measured, 2)


def test_the_knee_is_borderline_when_the_next_count_may_keep_the_bar():
    table = _table({1: (1.0, 0.0), 2: (0.95, 0.02), 4: (0.78, 0.05)})
    line = node_rule(0.8).confidence(table, 2)
    assert line.startswith("node count borderline") and "inside 4 nodes' interval" in line


def test_a_deadline_is_sure_only_at_the_slow_end():
    table = _table({1: (1.0, 0.0), 2: (0.95, 0.02), 4: (0.9, 0.02)})
    seconds = dict(zip(table["node_count"], table["time_to_train_s"], strict=True))
    between = (seconds[2] + seconds[2] * 1.1) / 2 / 3600  # inside 2 nodes' interval, above 4 nodes' end
    line = node_rule(deadline_hours=between).confidence(table, 2)
    assert line.startswith("node count not sure: 2 nodes") and "4 nodes would be sure" in line
    line = node_rule(deadline_hours=seconds[2] * 1.2 / 3600).confidence(table, 2)
    assert line.startswith("node count sure: 2 nodes")
    assert node_rule(nodes=2).confidence(table, 2) == ""


def test_efficiency_cancels_the_compute_error_of_one_config():
    table = _table({1: (1.0, 0.05), 2: (0.9, 0.05)})
    table.loc[table["node_count"] == 2, "link_halfwidth"] = 0.01
    from advisor.decide.scaling_table import efficiency_halfwidth

    half = efficiency_halfwidth(table, table.iloc[0])
    assert half.iloc[1] == pytest.approx(0.01)  # same config: only the link's part is left
    table.loc[table["node_count"] == 2, "config_id"] = "z3-mb4"
    half = efficiency_halfwidth(table, table.iloc[0])
    assert half.iloc[1] == pytest.approx(np.hypot(0.05, 0.05))


def test_contended_trials_leave_the_fit_unless_their_group_has_no_other():
    from advisor.stages.fit import clean_trials

    trials = pd.DataFrame(
        [
            {"trial_id": "a", "status": "ok", "zero_stage": 2, "precision": "bf16", "contended": False},
            {"trial_id": "b", "status": "ok", "zero_stage": 2, "precision": "bf16", "contended": True},
            {"trial_id": "c", "status": "ok", "zero_stage": 3, "precision": "bf16", "contended": "True"},
        ]
    )
    kept, note = clean_trials(trials)
    assert kept["trial_id"].tolist() == ["a", "c"]
    assert "1 contended trial(s) left out" in note and "only trial(s) of their group: c" in note
    assert clean_trials(trials.assign(contended=False))[1] == ""


def test_an_advise_run_carries_intervals_everywhere(monkeypatch, tmp_path, tiny_model, synth_data):
    """predictions.csv, recommendation.json, the verdict, the terminal and the report all carry them."""
    from rich.console import Console
    from test_advisor_model import advise_on_synthetic_trials

    from advisor.report.advise_page import build_advise_report
    from advisor.report.terminal import print_advice

    rec = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, step_noise=0.03
    ).recommendation
    predictions = pd.read_csv(tmp_path / "out" / "predictions.csv")
    for figure in ("step_time_s", "samples_per_s", "time_to_train_s", "gpu_hours", "mem_per_rank_bytes"):
        assert (predictions[f"{figure}_lo"] < predictions[figure]).all(), figure
        assert (predictions[figure] < predictions[f"{figure}_hi"]).all(), figure
    lo, hi = rec["intervals"]["samples_per_s"]
    assert lo < rec["samples_per_s"] < hi
    lo, hi = rec["time_to_train"]["seconds_interval"]
    assert lo < rec["time_to_train"]["seconds"] < hi
    assert rec["intervals_from"].startswith("95% intervals:")
    assert rec["node_choice"]["confidence"].startswith("node count ")
    assert " - " not in rec["verdict"] and "(" in rec["verdict"].split(" to train")[0]
    console = Console(record=True, width=250)
    print_advice(
        rec, rec["trials_run"], rec["full_grid"], tmp_path / "out", None, console=console, explain=True
    )
    text = console.export_text()
    # an interval is printed as a range ("2,300-3,000", "0.68-1.0 min"), or as words where it is too wide
    in_range = re.compile(r"\(\d[\d.,]*-\d[\d.,]*( min| h| days)?\)|not measured well enough")
    assert "how sure:" in text and in_range.search(text) and "95% intervals" in text
    assert in_range.search(repr(build_advise_report(tmp_path / "out")))


def test_a_scaleout_error_carries_the_two_runs_intervals():
    from advisor.stages.scaleout_check import ScaleoutRow, _halfwidth, rows_table

    row = ScaleoutRow("ZeRO-2 bf16 mb4", 2, 1, 1.05, 1.0, 0.2, 0.8, 1.0)
    assert math.isnan(row.measured_halfwidth) and row.error_halfwidth() == 0.0  # an old row: none known
    row = ScaleoutRow(
        "ZeRO-2 bf16 mb4", 2, 1, 1.05, 1.0, 0.2, 0.8, 1.0, measured_halfwidth=0.03, one_host_halfwidth=0.04
    )
    assert row.error == pytest.approx(0.05)
    assert row.error_halfwidth() == pytest.approx(0.05)  # 3% and 4% in quadrature
    assert row.error_halfwidth(one_host_spread=-0.24) == pytest.approx(math.sqrt(0.05**2 + 0.12**2))
    assert rows_table([row])["error_halfwidth"].iloc[0] == pytest.approx(0.05)
    trial = pd.DataFrame([{"step_time_s": 2.0, "step_s_lo": 1.9, "step_s_hi": 2.1}])
    assert _halfwidth(trial) == pytest.approx(0.05)
    assert math.isnan(_halfwidth(trial.drop(columns=["step_s_lo"])))


def test_a_stage_no_trial_measured_is_named_with_the_budget_that_would():
    from types import SimpleNamespace

    from advisor.decide.outcome import stages_without_trials

    trials = pd.DataFrame([{"status": "ok", "zero_stage": 2, "precision": "bf16"}])
    predictions = pd.DataFrame([{"zero_stage": s, "dtype": "bf16"} for s in (1, 2, 3)])
    outcome = SimpleNamespace(trials=trials, predictions=predictions, elapsed_s=250.0, per_trial_s=40.0)
    line = stages_without_trials(outcome)
    assert line.startswith("no trial measured ZeRO-1 bf16, ZeRO-3 bf16")
    assert "--budget-minutes 6 " in line  # 250 s + 2 x 40 s, rounded up to minutes
    outcome.trials = pd.DataFrame([{"status": "ok", "zero_stage": s, "precision": "bf16"} for s in (1, 2, 3)])
    assert stages_without_trials(outcome) == ""


def test_the_noise_floor_widens_by_students_t_for_its_few_repeats():
    few = Spread(noise=0.05, noise_dof=3)
    assert few.noise_halfwidth == pytest.approx(t_quantile(3) * 0.05)
    assert Spread(noise=0.05).noise_halfwidth == pytest.approx(Z95 * 0.05)  # unknown: an older folder
    row = _row("z2-mb4", 2, 4, 100.0, 1e9)
    table = add_intervals(pd.DataFrame([row]), Spread(typical_measured=0.01, noise=0.05, noise_dof=3))
    rel = (table.iloc[0]["step_time_s_hi"] - table.iloc[0]["step_time_s"]) / table.iloc[0]["step_time_s"]
    assert rel == pytest.approx(math.hypot(0.0, t_quantile(3) * 0.05))


def test_configs_measured_to_tight_intervals_are_told_apart_and_wide_ones_tie():
    """Two configs 3% apart: measured side by side to +-0.5% (a launch's interleaved rounds) they are not
    a tie and the faster is picked; measured to +-10% they are, and the tie rule (less memory) decides."""
    rows = [_row("z1-mb8", 1, 8, 100.0, 4.0e9), _row("z2-mb8", 2, 8, 97.0, 3.0e9)]

    def pick(half: float):
        trials = _trials([(1, 8, 0.64, half), (2, 8, 0.66, half)])
        spread = estimate_spread(trials, _validation([0.02, 0.03]), None, 0.0, True)
        return pick_config(add_intervals(pd.DataFrame(rows), spread))

    wide = pick(0.10)
    assert wide.tied == ["z1-mb8", "z2-mb8"] and wide.broke_tie and wide.row["config_id"] == "z2-mb8"
    tight = pick(0.005)
    assert tight.tied == ["z1-mb8"] and tight.row["config_id"] == "z1-mb8"


def test_a_config_measured_only_under_contention_is_left_out_of_the_pick():
    """ZeRO-1 measured fastest, but only while another process took the cores: the pick is ZeRO-2; a
    quiet re-launch's row clears it; with every config contended the pick is among them."""
    rows = [_row("z1-mb8", 1, 8, 150.0, 3.0e9), _row("z2-mb8", 2, 8, 100.0, 3.0e9)]

    def pick(contended: list[bool]):
        trials = _trials([(1, 8, 0.43, 0.01), (2, 8, 0.64, 0.01)]).assign(contended=contended)
        spread = estimate_spread(trials, _validation([0.02, 0.03]), None, 0.0, True)
        table = add_intervals(pd.DataFrame(rows), spread)
        return pick_config(table).row["config_id"], list(table["contended"])

    assert pick([True, False]) == ("z2-mb8", [True, False])
    assert pick([False, False])[0] == "z1-mb8"
    assert pick([True, True])[0] == "z1-mb8"
    quiet_again = _trials([(1, 8, 0.43, 0.01), (1, 8, 0.43, 0.01)]).assign(contended=[True, False])
    assert not estimate_spread(quiet_again, _validation([0.02]), None, 0.0, True).contended


def test_a_measured_configs_interval_holds_how_far_the_fit_lies_from_its_measurement():
    """The printed figure is the fit's: a measured config whose fit sits 8% off its own +-1% measurement
    gets an interval that reaches the measurement, and the tie rule still weighs only the measurement."""
    trials = _trials([(1, 8, 0.64, 0.01)])
    trials["trial_id"] = ["t-z1"]
    validation = pd.DataFrame(
        [
            {
                "config_id": "t-z1",
                "quantity": "step_time_s",
                "predicted": 0.64 * 1.08,
                "measured": 0.64,
                "held_out": False,
                "check": None,
            },
        ]
    )
    row = _row("z1-mb8", 1, 8, 100.0, 4.0e9)
    spread = estimate_spread(trials, validation, None, 0.0, True)
    table = add_intervals(pd.DataFrame([row]), spread).iloc[0]
    assert table["step_time_s_hi"] / table["step_time_s"] - 1 == pytest.approx(
        math.hypot(Z95 * 0.01 / Z95, math.log(1.08)), rel=0.05
    )
    assert table["compare_halfwidth"] == pytest.approx(0.01, rel=0.05)
