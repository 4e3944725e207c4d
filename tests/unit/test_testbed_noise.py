"""bench/testbed_noise.py's arithmetic: steps of equal work, trials judged by their median step, the drift
between trials apart, and the steal share."""

import numpy as np
import pytest
from bench_scripts import load_bench

from sdzero.telemetry.environment import cpu_kind


@pytest.fixture(scope="module")
def bench():
    return load_bench("testbed_noise")


def blocks(times: list[float]) -> np.ndarray:
    """Back-to-back blocks: each starts where the one before ended."""
    starts = np.concatenate([[0.0], np.cumsum(times)[:-1]])
    return np.column_stack([starts, times])


def test_steps_hold_equal_work_however_long_they_take(bench):
    # 0.1 s blocks, then a machine at half speed: 0.2 s blocks of the same work
    series = bench.steps(blocks([0.1] * 90 + [0.2] * 30), step_s=0.6)
    assert len(series) == 20  # 6 blocks a step: 0.6 s at the blocks' median speed (0.1 s a block)
    assert list(series[:, 1]) == pytest.approx([0.6] * 15 + [1.2] * 5)
    assert series[1, 0] == pytest.approx(0.6)  # a step starts where its first block did


def test_trials_are_judged_by_their_median_step(bench):
    series = bench.steps(blocks([0.5, 0.5, 5.0, 0.5, 0.6, 0.6, 0.6, 0.6]), step_s=0.5)
    starts, medians = bench.trials(series, 4)
    assert list(medians) == pytest.approx([0.5, 0.6])  # the 5 s stall moves the mean, not the median
    assert list(starts) == pytest.approx([0.0, 6.5])


def test_pairs_compare_only_trials_the_given_gap_apart(bench):
    starts = np.array([0.0, 10.0, 40.0, 50.0])
    medians = np.array([1.0, 1.0, 1.5, 1.2])
    errors = bench.pair_errors(starts, medians, gap_min=30.0, gap_max=45.0)
    # (0, 40): 0.5, (0, 50) is 50 s apart: out, (10, 40): 0.5, (10, 50): 0.2; (40, 50) only 10 s: out
    assert sorted(errors) == pytest.approx([0.2, 0.5, 0.5])


def test_a_steady_machine_has_no_drift(bench):
    starts, medians = bench.trials(bench.steps(blocks([0.1] * 1200), 0.6), 10)
    assert len(medians) == 20
    assert bench.pair_errors(starts, medians, 30.0, 90.0).max() == pytest.approx(0.0, abs=1e-12)


def test_steal_is_the_share_of_cpu_time_the_hypervisor_kept(bench):
    before = [100, 0, 50, 800, 0, 0, 0, 50, 0, 0]
    after = [300, 0, 100, 900, 0, 0, 0, 100, 0, 0]  # 400 ticks spent, 50 of them stolen
    assert bench.steal_share(before, after) == pytest.approx(50 / 400)
    assert bench.steal_share([], after) is None
    assert bench.cpu_ticks() == [] or len(bench.cpu_ticks()) >= 8


def test_cpu_kind_says_whether_bf16_is_in_hardware():
    assert ("with AVX-512" in cpu_kind()) != ("without AVX-512" in cpu_kind())


def test_an_isa_cap_below_avx512_is_named_and_one_at_or_above_is_not():
    from sdzero.telemetry.environment import isa_cap

    assert isa_cap({}) == ""
    assert isa_cap({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == ""
    assert isa_cap({"ONEDNN_MAX_CPU_ISA": "ALL"}) == ""
    both = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert isa_cap(both) == "ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2"
    assert isa_cap({"DNNL_MAX_CPU_ISA": "avx2_vnni"}) == "DNNL_MAX_CPU_ISA=avx2_vnni"


def test_cpu_kind_names_the_cap_that_emulates_bf16_on_an_avx512_host(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    kind = cpu_kind()
    assert "bf16 emulated" in kind
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in kind or "without AVX-512" in kind
