"""The time model's communication: each collective costed with its own fit, bursts, the waits a trial
timed, the burst rows of a probe, and the check trials and median steps the fit is judged by (split from
test_advisor_model.py, whose synthetic trials these share)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_advisor_model import NUMELS, ZERO, grid_trials, nets, with_accumulation_checks

from advisor.model.prediction_error import fit_models, mape, trial_predictions


def zero3_trial(comm_s: float, ops: dict) -> dict:
    """A 1-host, 2-rank ZeRO-3 bf16 trial of 0.3 s a step that logged `ops` (comm_ops) and `comm_s`."""
    return {
        "status": "ok",
        "zero_stage": 3,
        "precision": "bf16",
        "offload": "none",
        "micro_batch": 4,
        "grad_accum": 1,
        "ranks_per_node": 2,
        "nodes": 1,
        "world_size": 2,
        "step_time_s": 0.3,
        "step_time_median_s": 0.3,
        "comm_s": comm_s,
        "comm_ops": json.dumps(ops),
    }


def test_each_collective_is_costed_with_its_own_measured_fit():
    """gloo's all-gather is slower than its all-reduce: a link measured per collective costs each op with
    its own figures, and falls back to the link's for one it did not measure."""
    from advisor.model.collective_cost import _phase_s
    from advisor.model.network import CollectiveFigures, Link

    link = Link(1e9, 1e-5, "test", per_collective=(CollectiveFigures("all_gather", 0.5e9, 2e-5),))
    gather = _phase_s("all_gather", 1e8, 2, link, count=1)
    assert gather == pytest.approx(1 * 2e-5 + 0.5e8 / 0.5e9)
    assert _phase_s("all_reduce", 1e8, 2, link, count=1) == pytest.approx(2 * 1e-5 + 1e8 / 1e9)


def test_ops_issued_in_bursts_pay_the_burst_latency():
    """ZeRO-3's hundreds of parameter gathers per step go back to back: where `sdzero comm` measured a
    burst, each call costs its latency; a rare op (one gather per step at ZeRO-1/2) pays the blocking one."""
    from advisor.measure.alphabeta import AlphaBetaFit
    from advisor.model.collective_cost import BURST_CALLS, _phase_s
    from advisor.model.network import CollectiveFigures, Link, link_from_fits

    link = Link(1e9, 2.5e-3, "test", per_collective=(CollectiveFigures("all_gather", 1e9, 2.5e-3, 1e-3),))
    many = _phase_s("all_gather", 1e6, 2, link, count=BURST_CALLS * 13)
    assert many == pytest.approx(BURST_CALLS * 13 * 1e-3)  # the bytes move while the calls wait
    heavy = _phase_s("all_gather", 2e9, 2, link, count=BURST_CALLS * 13)
    assert heavy == pytest.approx(1e9 / 1e9)  # ... unless they take longer than the latencies
    assert _phase_s("all_gather", 1e6, 2, link, count=1) == pytest.approx(2.5e-3 + 0.5e6 / 1e9)
    assert _phase_s("all_reduce", 1e6, 2, link, count=BURST_CALLS * 13) == pytest.approx(
        BURST_CALLS * 13 * 2 * 2.5e-3 + 1e6 / 1e9
    )  # no burst measured for it: blocking latency
    # from a fit: the burst latency per call becomes a per-hop figure like the blocking one (4 ranks: 3 hops)
    fit = AlphaBetaFit(
        "torch",
        "gloo",
        "all_gather",
        "inter",
        4,
        4,
        3e-3,
        1e-9,
        9,
        4096,
        2**20,
        0.01,
        burst_alpha_s=1.5e-3,
        burst_in_flight=32,
    )
    measured = link_from_fits([fit], "inter")
    assert measured.figures("all_gather").burst_hop_latency_s == pytest.approx(0.5e-3)
    assert measured.figures("all_gather").hop_latency_s == pytest.approx(1e-3)
    assert AlphaBetaFit.from_dict(fit.to_dict()) == fit


def test_bursts_the_logger_missed_are_communication_not_compute():
    """On a CPU, comms_logger times an async call up to its start: a ZeRO-3 trial's 208 parameter gathers
    log 5 ms where they cost 208 x 0.2 ms on its link. The fit moves the difference from compute to
    communication, still reproduces the trial, and so does not count the gathers twice at 2 nodes."""
    from advisor.model.network import CollectiveFigures, Link, Network
    from advisor.model.step_time import fit_time_model

    intra = Link(1e9, 1e-4, "intra", per_collective=(CollectiveFigures("all_gather", 1e9, 1e-4, 2e-4),))
    inter = Link(1e8, 2.5e-3, "inter", per_collective=(CollectiveFigures("all_gather", 1e8, 2.5e-3, 1e-3),))
    one_host, two_hosts = Network(2, intra, inter), Network(1, intra, inter)
    ops = {"all_gather_into_tensor": {"count_per_step": 208, "bytes_per_step": 1e6, "seconds_per_step": 5e-3}}
    trial = zero3_trial(5e-3, ops)
    model = fit_time_model(pd.DataFrame([trial]), one_host)
    gathers_intra = 208 * 2e-4
    assert model.compute_per_micro_s(3, "bf16", 4) == pytest.approx(0.3 - gathers_intra)
    assert model.predict(3, "bf16", 4, 1, 1, one_host).step_time_s == pytest.approx(0.3)
    at_two = model.predict(3, "bf16", 4, 1, 2, two_hosts).step_time_s
    assert at_two == pytest.approx(0.3 - gathers_intra + 208 * 1e-3)


def test_waits_the_trial_timed_replace_the_benchmark_figure():
    """A trial that timed its waits (sdzero.training.measuring.comm_meters.WaitMeter) already counts its bursts whole: the fit
    takes its communication as measured and costs nothing more, however the link benchmark came out."""
    from advisor.model.collective_cost import ops_from_trial
    from advisor.model.network import CollectiveFigures, Link, Network
    from advisor.model.step_time import fit_time_model

    intra = Link(1e9, 1e-4, "intra", per_collective=(CollectiveFigures("all_gather", 1e9, 1e-4, 2e-4),))
    inter = Link(1e8, 2.5e-3, "inter", per_collective=(CollectiveFigures("all_gather", 1e8, 2.5e-3, 1e-3),))
    one_host, two_hosts = Network(2, intra, inter), Network(1, intra, inter)
    gathers = {
        "count_per_step": 208,
        "bytes_per_step": 1e6,
        "seconds_per_step": 0.12,
        "waited_seconds_per_step": 0.115,
    }
    trial = zero3_trial(0.12, {"all_gather_into_tensor": gathers})
    (op,) = ops_from_trial(trial["comm_ops"], 3, 2)
    assert op.waits_measured and op.logged_s == pytest.approx(0.12)
    model = fit_time_model(pd.DataFrame([trial]), one_host)
    assert model.compute_per_micro_s(3, "bf16", 4) == pytest.approx(0.3 - 0.12)
    # What the trial spent beyond its own link's cost is no link's (advisor.model.sync_wait): at the same
    # 2 ranks it is paid again, beside the inter-host burst's cost.
    beyond = 0.12 - model.comm_seconds(3, 1, 2, 1, one_host)[0]
    step = model.predict(3, "bf16", 4, 1, 2, two_hosts)
    assert step.wait_s == pytest.approx(beyond) and beyond > 0
    assert step.step_time_s == pytest.approx(0.18 + 208 * 1e-3 + beyond)


def test_burst_rows_stay_out_of_the_line_fit_and_set_the_burst_latency():
    from advisor.measure.alphabeta import fit_table

    sizes = [4096 * 2**i for i in range(6)]
    rows = [
        {
            "backend": "torch",
            "library": "gloo",
            "collective": "all_gather",
            "link_level": "inter",
            "ranks": 2,
            "nodes": 2,
            "size_bytes": s,
            "time_s": 2e-3 + s * 1e-8,
            "correct": True,
            "emulated": False,
            "time_spread": 0.0,
            "in_flight": 1,
        }
        for s in sizes
    ]
    rows.append(rows[0] | {"time_s": 1e-3 + 4096 * 1e-8, "in_flight": 32})
    (fit,) = fit_table(pd.DataFrame(rows))
    assert fit.n_points == 6 and fit.alpha_s == pytest.approx(2e-3, rel=1e-6)
    assert fit.burst_alpha_s == pytest.approx(1e-3, rel=1e-6) and fit.burst_in_flight == 32
    old = pd.DataFrame(rows[:-1]).drop(columns="in_flight")  # a comm.csv from before the burst
    (fit,) = fit_table(old)
    assert fit.burst_alpha_s is None and fit.alpha_s == pytest.approx(2e-3, rel=1e-6)


def test_the_accumulation_checks_are_held_out_of_the_fit_that_predicts_them_and_set_the_error(tmp_path):
    from types import SimpleNamespace

    from advisor.stages.measure import check_model

    trials = with_accumulation_checks(grid_trials(noise=False))
    checks = [t for t in trials["trial_id"] if t.endswith("-ga4") and "-mb8-" in t]
    trials = trials[~trials["trial_id"].str.endswith("-ga4") | trials["trial_id"].isin(checks)]
    # a check measured off the model's line: a fit that saw it would bend toward it and hide the error
    trials.loc[trials["trial_id"] == checks[0], "step_time_s"] *= 1.3
    inputs, hardware = SimpleNamespace(out_dir=tmp_path), SimpleNamespace(measured_net=nets()[0])
    result = check_model(inputs, hardware, trials.reset_index(drop=True), checks, NUMELS, ZERO)
    held = result.validation[result.validation["check"].fillna(False).astype(bool)]
    assert sorted(set(held["config_id"])) == sorted(checks) and result.check_ids == checks
    # the off-line check shows its whole error (predicted at 1/1.3 of what it measured), the others none
    step = held[held["quantity"] == "step_time_s"].set_index("config_id")
    error = (step["predicted"] / step["measured"] - 1).abs()
    assert error[checks[0]] == pytest.approx(1 - 1 / 1.3, rel=0.05)
    assert error[checks[1:]].max() < 0.05  # the synthetic accumulation rule is near the model's, not it
    assert mape(result.validation, "step_time_s") == pytest.approx(error.mean())
    assert (tmp_path / "validation.csv").is_file()


def test_step_time_is_fitted_to_the_median_step():
    """One slow step (another process on the machine) moves a trial's mean, not the median modelled."""
    trials = grid_trials(noise=False)
    medians = trials["step_time_s"].copy()
    trials["step_time_median_s"] = medians
    trials.loc[trials["trial_id"] == "z1-bf16-mb4-off-none-r2", "step_time_s"] *= 1.5
    models = fit_models(trials, NUMELS, ZERO, nets()[0])
    row = trials[trials["trial_id"] == "z1-bf16-mb4-off-none-r2"].iloc[0]
    assert trial_predictions(models, row, nets()[0])["step_time_s"] == pytest.approx(
        medians[row.name], rel=1e-9
    )
