"""The collective mix from first principles, and what the time model does with it: ZeRO-3 measured on one
rank still pays its gathers at N nodes, ZeRO-0 is costed without a trial, and once-per-step work is not
multiplied by the accumulation."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from advisor.model.collective_cost import op_seconds, ops_from_mix
from advisor.model.collective_mix import bucket_calls, collective_mix, logger_view, prefetch_calls, regathered
from advisor.model.memory import ZeroSettings, state_elements
from advisor.model.network import Link, Network
from advisor.model.step_time import fit_time_model

NUMELS = (300, 50, 50, 900, 20, 400, 10, 700)
PSI = sum(NUMELS)
ZERO = ZeroSettings(reduce_bucket_size=1000, persistence_threshold=60, prefetch_bucket_size=800)
NET = Network(1, Link(1e9, 1e-5, "intra"), Link(1e8, 1e-4, "inter"))


def test_buckets_and_prefetch_chunks_follow_deepspeeds_rules():
    assert bucket_calls([300, 50, 50, 900], 1000) == 2  # 400 held, 900 would overflow: sent first
    assert bucket_calls([2000, 10], 1000) == 2  # a gradient larger than a bucket goes alone
    assert prefetch_calls([300, 400, 700, 100], 800) == 2  # a chunk closes once it reaches the bucket
    assert prefetch_calls([300, 400], 0) == 2  # no prefetch: one fetch per parameter
    kept = ZeroSettings(max_reuse_distance=10**9)
    assert regathered(NUMELS, kept) == []
    # used again within 2 x 0 elements: only the last forward parameter stays gathered for backward
    assert sorted(regathered(NUMELS, ZeroSettings(max_reuse_distance=1000))) == sorted(NUMELS[:-1])
    assert regathered(NUMELS, ZeroSettings(max_live_parameters=100)) == list(NUMELS)


def test_each_stage_issues_its_own_collectives():
    zero0 = logger_view(collective_mix(NUMELS, 0, 2, ZERO), world=2, grad_accum=4)
    assert zero0 == {"all_reduce": {"count_per_step": 1, "bytes_per_step": 2 * PSI}}  # once, at the boundary
    z1, z2 = (logger_view(collective_mix(NUMELS, s, 2, ZERO), 2, 4) for s in (1, 2))
    assert z1["all_reduce"]["bytes_per_step"] == 2 * PSI + 5  # ZeRO-1 reduces once per step
    assert z2["all_reduce"]["bytes_per_step"] == 4 * 2 * PSI + 5  # ZeRO-2 in every micro-step's backward
    assert z1["all_gather_into_tensor"] == {"count_per_step": 1, "bytes_per_step": 2432}  # shard of 2N-padded
    mix3 = {c.what: c for c in collective_mix(NUMELS, 3, 2, ZERO)}
    gathered = [n for n in NUMELS if n > 60]
    assert (
        mix3["parameter gathers"].full_bytes == 2 * sum(gathered) and mix3["parameter gathers"].per_micro_step
    )
    persistent = mix3["persistent parameters after the step"]
    assert (persistent.calls, persistent.full_bytes, persistent.per_micro_step) == (4, 2 * 130, False)
    assert mix3["gradient reduce-scatter"].full_bytes == 2 * PSI


def one_rank_zero3_trial(**over) -> dict:
    """A ZeRO-3 trial on one rank: DeepSpeed skipped every gather, the logger saw one scalar."""
    ops = {"all_reduce": {"count_per_step": 1, "bytes_per_step": 8, "seconds_per_step": 1e-5}}
    return {
        "status": "ok",
        "zero_stage": 3,
        "precision": "bf16",
        "offload": "none",
        "micro_batch": 2,
        "grad_accum": 1,
        "ranks_per_node": 1,
        "nodes": 1,
        "world_size": 1,
        "step_time_s": 0.5,
        "step_time_median_s": 0.5,
        "comm_s": 1e-5,
        "comm_ops": json.dumps(ops),
        "optimizer_s": 0.1,
        **over,
    }


def test_a_one_rank_zero3_trial_still_pays_its_gathers_at_n_nodes():
    trials = pd.DataFrame([one_rank_zero3_trial()])
    blind = fit_time_model(trials, NET)  # what the logger saw: one scalar, no gather
    assert [op.collective for op in blind.ops[3]] == ["all_reduce"]
    model = fit_time_model(trials, NET, NUMELS, ZERO)
    assert 3 in model.derived_stages and any("one rank" in n for n in model.notes)
    costed = sum(sum(op_seconds(op, 1, 8, NET)) for op in ops_from_mix(collective_mix(NUMELS, 3, 2, ZERO)))
    at_8 = model.predict(3, "bf16", 2, 1, 8, NET)
    assert at_8.comm_s == pytest.approx(costed) and costed > 0
    assert at_8.step_time_s == pytest.approx(0.5 - 1e-5 + costed)


def test_zero0_is_costed_without_a_zero0_trial():
    trials = pd.DataFrame([one_rank_zero3_trial()])
    model = fit_time_model(trials, NET, NUMELS, ZERO)
    at_4 = model.predict(0, "bf16", 2, 1, 4, NET)
    # one ring all-reduce of the 16-bit gradients across 4 nodes: 2(p-1)/p of the bytes, 2 log2(p) hops
    assert at_4.comm_s == pytest.approx(2 * 3 / 4 * 2 * PSI / 1e8 + 4 * 1e-4)
    assert state_elements(NUMELS, 0, 64) == {k: PSI for k in ("params", "grads", "master", "optimizer")}


def test_the_optimizer_step_runs_once_per_step_whatever_the_accumulation():
    one = one_rank_zero3_trial()
    model = fit_time_model(pd.DataFrame([one]), NET, NUMELS, ZERO)
    per_micro = model.compute_per_micro_s(3, "bf16", 2)
    assert per_micro == pytest.approx(0.5 - 1e-5)
    # 4 micro-steps: the optimizer's 0.1 s once, the rest four times (the old model charged it four times)
    once = 0.1 - 1e-5  # the optimizer phase less the scalar all-reduce inside it
    assert model.predict(3, "bf16", 2, 4, 1, NET).compute_s == pytest.approx(once + 4 * (per_micro - once))
    # and an accumulation-4 trial of the same work gives back the same per-micro-step compute
    step = 1e-5 + once + 4 * (per_micro - once)
    four = one_rank_zero3_trial(grad_accum=4, step_time_s=step, step_time_median_s=step)
    refit = fit_time_model(pd.DataFrame([four]), NET, NUMELS, ZERO)
    assert refit.compute_per_micro_s(3, "bf16", 2) == pytest.approx(per_micro)


def _overlap_model(shares: tuple[float, float], side_stream: bool = True):
    from advisor.model.step_time import TimeModel

    overlap = ZeroSettings(reduce_bucket_size=1000, overlap_comm=True)
    ops = {s: ops_from_mix(collective_mix(NUMELS, s, 2, overlap)) for s in (0, 2)}
    groups = {(s, "bf16", "none"): 10.0 for s in (0, 2)}  # 10 s of compute a micro-step: a wide window
    return TimeModel(
        groups,
        {"bf16": 0.0},
        ops,
        side_stream=side_stream,
        phase_shares={g: shares for g in groups},
    ), ops


def test_only_what_is_issued_during_compute_hides_within_and_across_nodes():
    """The bucket-level account: with a side stream and a backward window wider than the communication,
    ZeRO-2's reduce buckets hide all but the last, within and across nodes alike; its gather after the
    step and ZeRO-0's boundary reduction never hide."""
    model, ops = _overlap_model((0.3, 0.6))
    g2 = Network(2, NET.intra, NET.inter)
    for stage in (0, 2):
        assert model.predict(stage, "bf16", 1, 1, 4, g2).comm_s > 0
    zero0 = model.predict(0, "bf16", 1, 1, 4, g2)
    assert zero0.exposed_comm_s == pytest.approx(zero0.comm_s)  # all of it
    reduction, gather, *scalars = ops[2]
    assert reduction.count == 4 and reduction.exposed_share == pytest.approx(1 / 4)
    intra, inter = op_seconds(reduction, 2, 4, g2)
    rest = [op_seconds(op, 2, 4, g2) for op in (gather, *scalars)]
    step = model.predict(2, "bf16", 1, 3, 4, g2)  # accumulation 3: the last bucket of every micro-step
    assert step.exposed_inter_s == pytest.approx(3 * inter / 4 + sum(b for _, b in rest))
    assert step.exposed_intra_s == pytest.approx(3 * intra / 4 + sum(a for a, _ in rest))
    assert step.exposed_comm_s < step.comm_s


def test_what_exceeds_the_window_stays_exposed_and_a_cpu_hides_nothing():
    """A window narrower than the hideable part hides only its own length; on a CPU (no side stream, as
    DeepSpeed runs there) every collective is exposed whatever the phase split."""
    wide, ops = _overlap_model((0.3, 0.6))
    reduction = ops[2][0]
    hideable = sum(op_seconds(reduction, 1, 4, NET)) * 3 / 4
    window_s = hideable / 2
    narrow, _ = _overlap_model((0.3, window_s / 10.0))
    exposed = [m.predict(2, "bf16", 1, 1, 4, NET).exposed_comm_s for m in (wide, narrow)]
    assert exposed[1] == pytest.approx(exposed[0] + hideable - window_s)
    cpu, _ = _overlap_model((0.3, 0.6), side_stream=False)
    step = cpu.predict(2, "bf16", 1, 1, 4, NET)
    assert step.exposed_comm_s == pytest.approx(step.comm_s)


def test_the_error_is_given_by_micro_batch_accumulation_and_node_count():
    from advisor.model.prediction_error import error_by

    validation = pd.DataFrame(
        {
            "quantity": "step_time_s",
            "held_out": [True, True, True, False],
            "predicted": [1.1, 2.0, 4.4, 9.0],
            "measured": [1.0, 2.0, 4.0, 1.0],
            "micro_batch": [1, 1, 2, 2],
            "grad_accum": [1, 1, 4, 4],
            "node_count": [1, 1, 1, 2],
        }
    )
    by_accum = error_by(validation, "grad_accum").set_index("grad_accum")
    assert by_accum.loc[1, "mape"] == pytest.approx(0.05) and by_accum.loc[4, "mape"] == pytest.approx(0.1)
    assert list(by_accum["trials"]) == [2, 1]  # the row fitted on (held_out false) does not count
    assert list(error_by(validation, "node_count")["node_count"]) == [1]


def test_cuda_trials_measure_the_windows_and_cpu_trials_hide_nothing():
    """A CUDA trial (torch.cuda saw a peak) runs collectives on DeepSpeed's side stream: its forward and
    backward phases, less the collectives logged inside them, become the windows, as shares of the
    per-micro-step compute. A CPU trial gets no windows: at 8 nodes all of ZeRO-3's cost is exposed."""
    phases = {"forward_s": 0.12, "backward_s": 0.24, "optimizer_s": 0.1}
    gpu = fit_time_model(
        pd.DataFrame([one_rank_zero3_trial(cuda_peak_bytes=1e9, **phases)]), NET, NUMELS, ZERO
    )
    cpu = fit_time_model(
        pd.DataFrame([one_rank_zero3_trial(cuda_peak_bytes=None, **phases)]), NET, NUMELS, ZERO
    )
    assert gpu.side_stream and not cpu.side_stream
    per_micro = gpu.compute_per_micro_s(3, "bf16", 2)
    per_micro -= gpu.once_s(3, "bf16", "none", per_micro)
    forward, backward = gpu.phase_shares[(3, "bf16", "none")]
    assert (forward * per_micro, backward * per_micro) == pytest.approx((0.12, 0.24))
    on_cpu = cpu.predict(3, "bf16", 2, 1, 8, NET)
    assert on_cpu.exposed_comm_s == pytest.approx(on_cpu.comm_s)
    on_gpu = gpu.predict(3, "bf16", 2, 1, 8, NET)
    assert on_gpu.exposed_comm_s < on_cpu.exposed_comm_s  # its prefetched gathers hid behind forward
