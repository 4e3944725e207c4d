"""Alpha-beta fits and nccl-tests bandwidth definitions (advisor.measure.alphabeta)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from advisor.measure.alphabeta import (
    AlphaBetaFit,
    algbw_gbps,
    bus_factor,
    busbw_gbps,
    fit_line,
    fit_table,
    fits_payload,
    load_fits,
    ring_latency_steps,
)
from sdzero.atomic import write_json_atomic

SIZES = np.array([4096 * 2**k for k in range(17)], dtype=float)  # 4 KiB .. 256 MiB


def test_fit_recovers_exact_alpha_beta() -> None:
    alpha, beta = 25e-6, 1 / 12e9  # 25 us, 12 GB/s
    fit = fit_line(SIZES, alpha + beta * SIZES)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-9)
    assert fit.clamped == ()
    assert fit.rel_rmse < 1e-9


def test_fit_recovers_alpha_beta_under_noise() -> None:
    alpha, beta = 8e-6, 1 / 40e9
    rng = np.random.default_rng(0)
    times = (alpha + beta * SIZES) * rng.uniform(0.97, 1.03, SIZES.size)  # +-3 % multiplicative noise
    fit = fit_line(SIZES, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(beta, rel=0.05)


def test_noise_at_large_sizes_does_not_spoil_the_latency() -> None:
    # a 1 % wobble on the largest sizes is larger than alpha itself: one absolute fit would ruin alpha
    alpha, beta = 5e-6, 1 / 10e9
    times = alpha + beta * SIZES
    times[-3:] *= [1.01, 0.99, 1.01]
    fit = fit_line(SIZES, times)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)


def test_one_slowed_large_size_does_not_set_the_bandwidth() -> None:
    # measured on the shaped 200 Mbit/s link: the 2 MiB all-gather took 62.7 ms where the others say 42
    sizes = np.array([2**k for k in range(12, 22)], dtype=float)
    times = np.array([2.6, 2.6, 2.6, 2.7, 2.9, 3.5, 5.454, 10.506, 21.175, 62.723]) * 1e-3
    busbw = 0.5 / fit_line(sizes, times).beta_s_per_byte * 8  # all-gather on 2 ranks
    assert busbw == pytest.approx(200e6, rel=0.03)
    # a link that really slows down at the largest size keeps its slowness when two sizes show it
    times[-2:] = [30e-3, 62.723e-3]
    assert 0.5 / fit_line(sizes, times).beta_s_per_byte * 8 < 150e6


def test_regime_change_keeps_both_ends_right() -> None:
    # shared memory: 20 GB/s while in cache, 2 GB/s from 2 MiB up (as Open MPI showed on this project's box)
    alpha = 3e-6
    in_cache = SIZES < 2 * 2**20
    times = np.where(in_cache, alpha + SIZES / 20e9, 200e-6 + SIZES / 2e9)
    fit = fit_line(SIZES, times)
    assert 1 / fit.beta_s_per_byte / 1e9 == pytest.approx(2.0, rel=1e-6)  # the large-message bandwidth
    assert fit.alpha_s == pytest.approx(alpha, rel=0.01)
    large = SIZES >= 32 * 2**20
    assert np.all(
        np.abs(fit.alpha_s + fit.beta_s_per_byte * SIZES[large] - times[large]) / times[large] < 0.02
    )
    assert fit.max_rel_error > 1.0  # and the misfit in the middle is reported, not hidden
    assert fit.rel_rmse < fit.max_rel_error


def test_non_positive_alpha_is_floored_and_reported() -> None:
    times = -1e-8 + SIZES / 10e9  # zero latency measured a hair fast: a small negative intercept
    fit = fit_line(SIZES, times)
    assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0
    assert fit.clamped == ("alpha",)
    assert fit.beta_s_per_byte == pytest.approx(1 / 10e9, rel=0.05)


def test_flat_times_floor_beta_and_keep_the_latency() -> None:
    times = np.full(SIZES.size, 30e-6)
    times[-1] *= 0.9  # time falls with size: the unconstrained beta is negative
    fit = fit_line(SIZES, times)
    assert fit.alpha_s > 0 and fit.beta_s_per_byte > 0
    assert "beta" in fit.clamped
    assert fit.alpha_s == pytest.approx(30e-6, rel=0.1)


@pytest.mark.parametrize(
    ("sizes", "times"),
    [([4096, 4096], [1e-5, 2e-5]), ([4096, 8192], [1e-5, 0.0]), ([0, 8192], [1e-5, 2e-5])],
)
def test_fit_refuses_data_that_cannot_define_a_line(sizes: list[int], times: list[float]) -> None:
    with pytest.raises(ValueError):
        fit_line(sizes, times)


@pytest.mark.parametrize(
    ("collective", "ranks", "factor"),
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_reduce", 8, 1.75),
        ("reduce_scatter", 2, 0.5),
        ("reduce_scatter", 8, 0.875),
        ("all_gather", 4, 0.75),
        ("all_gather", 1, 0.0),
    ],
)
def test_bus_factor_follows_nccl_tests(collective: str, ranks: int, factor: float) -> None:
    assert bus_factor(collective, ranks) == pytest.approx(factor)
    assert busbw_gbps(collective, ranks, 2e9, 1.0) == pytest.approx(2.0 * factor)


def test_algbw_and_unknown_collective() -> None:
    assert algbw_gbps(256 * 2**20, 0.1) == pytest.approx(256 * 2**20 / 0.1 / 1e9)
    assert ring_latency_steps("all_reduce", 4) == 6 and ring_latency_steps("all_gather", 4) == 3
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 2)


def _synthetic_table(alpha: float, beta: float, correct: bool = True) -> pd.DataFrame:
    rows = []
    for collective in ("all_reduce", "all_gather"):
        for size in SIZES[:8]:
            rows.append(
                {
                    "backend": "mpi",
                    "library": "Open MPI v4.1.4",
                    "collective": collective,
                    "link_level": "intra",
                    "ranks": 4,
                    "nodes": 1,
                    "size_bytes": int(size),
                    "time_s": alpha + beta * size,
                    "correct": correct,
                    "emulated": False,
                }
            )
    return pd.DataFrame(rows)


def test_fit_table_gives_one_fit_per_group_and_derived_units() -> None:
    alpha, beta = 10e-6, 1 / 5e9
    fits = fit_table(_synthetic_table(alpha, beta))
    assert [f.collective for f in fits] == ["all_gather", "all_reduce"]
    ar = fits[1]
    assert ar.latency_us == pytest.approx(10.0, rel=1e-6)
    assert ar.algbw_gbps == pytest.approx(5.0, rel=1e-6)
    assert ar.bandwidth_gbps == pytest.approx(5.0 * 1.5, rel=1e-6)  # busbw, 4 ranks all-reduce
    assert ar.hop_latency_us == pytest.approx(10.0 / 6, rel=1e-6)
    assert ar.predict_s(1e6) == pytest.approx(alpha + beta * 1e6)


def test_fit_table_leaves_out_noisy_points() -> None:
    alpha, beta = 10e-6, 1 / 5e9
    table = _synthetic_table(alpha, beta)
    table["time_spread"] = 0.1
    largest = table["size_bytes"] == table["size_bytes"].max()
    table.loc[largest, "time_s"] *= 20  # a rank descheduled by another job during the largest size
    table.loc[largest, "time_spread"] = 2.5
    for fit in fit_table(table):
        assert fit.noisy_points_dropped == 1 and fit.n_points == 7
        assert fit.beta_s_per_byte == pytest.approx(beta, rel=1e-6)
    table["time_spread"] = 2.5  # everything noisy: keep all rather than fit nothing
    assert all(fit.noisy_points_dropped == 0 for fit in fit_table(table))


def test_fit_table_ignores_wrong_results() -> None:
    assert fit_table(_synthetic_table(10e-6, 1 / 5e9, correct=False)) == []


def test_json_round_trip(tmp_path: Path) -> None:
    fits = fit_table(_synthetic_table(10e-6, 1 / 5e9))
    path = tmp_path / "comm_fit.json"
    write_json_atomic(path, fits_payload(fits, {"note": "test"}))
    data = json.loads(path.read_text())
    assert data["fits"][0]["bandwidth_gbps"] > 0 and data["fits"][0]["latency_us"] > 0
    assert load_fits(path) == fits
    assert [p.name for p in tmp_path.iterdir()] == ["comm_fit.json"]  # no temporary left behind


def test_from_dict_ignores_derived_fields() -> None:
    fit = AlphaBetaFit("torch", "gloo", "all_reduce", "intra", 2, 1, 1e-5, 1e-10, 5, 4096, 65536, 0.01)
    assert AlphaBetaFit.from_dict(fit.to_dict()) == fit


def test_latency_never_exceeds_the_fastest_small_message() -> None:
    """Small sizes whose times fall with size (noise on a shared machine) must not give a latency above
    what the smallest messages actually took."""
    sizes = np.array([2**15, 2**16, 2**17, 2**20, 2**22, 2**24], dtype=float)
    times = np.array([1.27e-3, 0.89e-3, 0.71e-3, 9e-3, 35e-3, 140e-3])
    fit = fit_line(sizes, times)
    assert 0 < fit.alpha_s <= 0.71e-3


def _gloo_fit(
    collective: str, ranks: int = 4, emulated: bool = False, max_bytes: int = 2**26
) -> AlphaBetaFit:
    return AlphaBetaFit(
        "torch",
        "gloo",
        collective,
        "inter",
        ranks,
        ranks,
        alpha_s=0.014,
        beta_s_per_byte=1.2e-8,
        n_points=10,
        min_bytes=4096,
        max_bytes=max_bytes,
        rel_rmse=0.01,
        emulated=emulated,
    )


def test_an_emulated_reduce_scatter_is_normalised_as_the_all_reduce_it_runs() -> None:
    """gloo runs reduce-scatter as a whole all-reduce: the same times give the same busbw and hop latency
    (nccl-tests' (n-1)/n would read the link at half its rate: 0.55 Gbit/s through 1 Gbit/s at 4 hosts)."""
    rs, ar = _gloo_fit("reduce_scatter", emulated=True), _gloo_fit("all_reduce")
    assert rs.bandwidth_gbps == pytest.approx(ar.bandwidth_gbps)
    assert rs.hop_latency_us == pytest.approx(ar.hop_latency_us)
    assert _gloo_fit("reduce_scatter").bandwidth_gbps == pytest.approx(ar.bandwidth_gbps / 2)  # native


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter"])
def test_gloo_at_the_measured_group_size_costs_exactly_its_own_fit(collective: str) -> None:
    """Normalised by what gloo does (a ring at every size, reduce-scatter as an all-reduce), costing an op
    at the group size the probe ran gives back the fitted line: for a 4-host all-reduce the tree latency
    NCCL would take (4 steps, not the ring's 6) costed two thirds of the measured latency."""
    from advisor.model.collective_cost import CommOp, op_seconds
    from advisor.model.network import GLOO, Link, Network, link_from_fits

    fit = _gloo_fit(collective, emulated=collective == "reduce_scatter")
    inter = link_from_fits([fit], "inter")
    net = Network(1, Link(1e10, 1e-6, "intra"), inter, algorithm=GLOO)
    for size in (4096.0, 1e6, 3e7):
        op = CommOp(collective, 1, size, per_micro_step=False)
        assert op_seconds(op, 1, 4, net)[1] == pytest.approx(fit.predict_s(size), rel=1e-9)


def test_a_sweep_short_of_the_bandwidth_regime_is_flagged() -> None:
    """A 4-host gloo all-reduce (14 ms latency, 1 Gbit/s) swept to 2 MiB: the largest size's bytes take
    less than twice the latency, where a pipelined ring hides latency under the transfer and the slope
    under-reads the cost per byte; swept to 64 MiB it is in the bandwidth regime."""
    assert not _gloo_fit("all_reduce", max_bytes=2**21).bandwidth_bound
    assert _gloo_fit("all_reduce", max_bytes=2**26).bandwidth_bound
    assert _gloo_fit("all_reduce", max_bytes=2**21).to_dict()["bandwidth_bound"] is False


def test_a_sweep_in_the_latency_regime_is_costed_at_the_rate_it_surely_reached() -> None:
    """4 hosts through 200 Mbit/s links swept to 512 KiB (the probe's budget): all-reduce flat at 14.5 ms
    up to 256 KiB, 32.2 ms at 512 KiB. The slope over the top sizes reads ~1.8 Gbit/s; the link is costed
    at the largest size's own busbw, 1.5 x 512 KiB / 32.2 ms = 0.195 Gbit/s."""
    from advisor.model.network import link_from_fits

    sizes = [4096 * 2**k for k in range(8)]
    times = [0.0145] * 7 + [0.0322]
    table = pd.DataFrame(
        {
            "backend": "torch",
            "library": "gloo",
            "collective": "all_reduce",
            "link_level": "inter",
            "ranks": 4,
            "nodes": 4,
            "size_bytes": sizes,
            "time_s": times,
            "correct": True,
            "emulated": False,
        }
    )
    (fit,) = fit_table(table)
    assert not fit.bandwidth_bound and fit.bandwidth_gbps * 8 > 1.0
    assert fit.sure_bandwidth_gbps * 8 == pytest.approx(1.5 * 2**19 * 8 / 0.0322 / 1e9)
    link = link_from_fits([fit], "inter")
    assert link.busbw_bytes_s == pytest.approx(fit.sure_bandwidth_gbps * 1e9)
    assert link.figures("all_reduce").busbw_bytes_s == pytest.approx(fit.sure_bandwidth_gbps * 1e9)
