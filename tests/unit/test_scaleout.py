"""The scale-out prediction (advisor.stages.scaleout_check) without a cluster: only the link differs between the 1-host
trial and the predicted multi-host run, so a link as fast as the measured one reproduces a trial whose
collectives ran at the benchmark's speed, a slower link costs exactly the extra communication time, and a
1-host trial whose collectives beat the benchmark (shared memory) does not make the inter-host link look
faster than measured."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from advisor.measure.alphabeta import FIT_SCHEMA, AlphaBetaFit
from advisor.model.network import build_network
from advisor.model.step_time import fit_time_model
from advisor.stages.scaleout_check import predict_from_one_host
from sdzero.atomic import write_json_atomic

GRADS_BYTES = 4_000_000


def fits(inter_slowdown: float) -> list[dict]:
    made = []
    for collective in ("all_reduce", "all_gather", "reduce_scatter"):
        intra = AlphaBetaFit(
            "torch",
            "gloo",
            collective,
            "intra",
            2,
            1,
            alpha_s=1e-4,
            beta_s_per_byte=1e-9,
            n_points=10,
            min_bytes=4096,
            max_bytes=2**24,
            rel_rmse=0.01,
        )
        inter = replace(intra, link_level="inter", nodes=2, beta_s_per_byte=1e-9 * inter_slowdown)
        made += [intra.to_dict(), inter.to_dict()]
    return made


def one_host_trial(comm_s: float = 0.05) -> pd.DataFrame:
    ops = {"all_reduce": {"count_per_step": 1, "bytes_per_step": GRADS_BYTES}}
    row = {
        "trial_id": "z2",
        "status": "ok",
        "zero_stage": 2,
        "precision": "bf16",
        "micro_batch": 4,
        "grad_accum": 1,
        "offload": "none",
        "ranks_per_node": 2,
        "world_size": 2,
        "nodes": 1,
        "step_time_s": 0.30,
        "step_time_median_s": 0.30,
        "comm_s": comm_s,
        "comm_ops": json.dumps(ops),
    }
    return pd.DataFrame([row])


def costed_intra_s(fit_path) -> float:
    """What the alpha-beta fit says the trial's collectives cost on the 1-host link."""
    net, _ = build_network(fit_path, 2)
    return fit_time_model(one_host_trial(), net).comm_seconds(2, 1, 2, 1, net)[0]


@pytest.fixture
def fit_file(tmp_path):
    def write(slowdown: float):
        path = tmp_path / f"fit-{slowdown}.json"
        write_json_atomic(path, {"schema": FIT_SCHEMA, "fits": fits(slowdown)})
        return path

    return write


def test_same_link_reproduces_the_one_host_trial(fit_file):
    path = fit_file(1.0)
    trial = one_host_trial(comm_s=costed_intra_s(path))  # its collectives ran as fast as the benchmark's
    step, _, net = predict_from_one_host(trial, path, hosts=2, slots=1)
    assert step == pytest.approx(0.30, rel=1e-6)
    assert net.gpus_per_node == 1 and "measured" in net.inter.source


def test_a_faster_local_transport_does_not_speed_up_the_inter_host_link(fit_file):
    """1-host collectives 10x faster than the benchmark's (DeepSpeed's shared-memory ops on a CPU): the
    2-host run still pays the measured inter-host cost in full."""
    path = fit_file(1.0)
    costed = costed_intra_s(path)
    trial = one_host_trial(comm_s=costed / 10)
    step, comm, _ = predict_from_one_host(trial, path, hosts=2, slots=1)
    assert comm == pytest.approx(costed, rel=1e-6)  # same link, nothing assumed hidden
    assert step == pytest.approx(0.30 - costed / 10 + costed, rel=1e-6)


def test_slower_link_adds_its_communication_time(fit_file):
    fast, fast_comm, _ = predict_from_one_host(one_host_trial(), fit_file(1.0), hosts=2, slots=1)
    slow, slow_comm, net = predict_from_one_host(one_host_trial(), fit_file(10.0), hosts=2, slots=1)
    assert slow > fast and slow - fast == pytest.approx(slow_comm - fast_comm, rel=1e-6)
    assert net.inter.busbw_bytes_s < net.intra.busbw_bytes_s


def test_merged_probes_hold_both_links(fit_file, tmp_path):
    """An intra and an inter probe (two comm_fit.json files) merge into the one network the check predicts with."""
    from advisor.stages.scaleout_check import merge_fits

    both = json.loads(fit_file(10.0).read_text())["fits"]
    paths = []
    for level in ("intra", "inter"):
        path = tmp_path / level / "comm_fit.json"
        path.parent.mkdir()
        write_json_atomic(path, {"schema": FIT_SCHEMA, "fits": [f for f in both if f["link_level"] == level]})
        paths.append(path)
    net, _ = build_network(merge_fits(paths, tmp_path / "merged.json"), 2)
    assert "measured" in net.inter.source and "measured" in net.intra.source
    assert net.inter.busbw_bytes_s == pytest.approx(net.intra.busbw_bytes_s / 10)


def test_two_by_two_as_a_flat_ring_crosses_hosts_more(fit_file):
    """gloo's ring over 2 hosts x 2 ranks crosses the slow link with 2(W-1)/W of the buffer (W = 4 ranks)
    in 2(W-1) slow steps, not the hierarchy's 2(H-1)/H (H = 2 hosts): the measured library's account of
    2x2 is the 4 hosts x 1 prediction, and costs more than NCCL's hierarchy would."""
    from advisor.model.network import NCCL
    from advisor.stages.scaleout_check import flat_ring_step_s

    path = fit_file(10.0)
    trial = one_host_trial().assign(ranks_per_node=4, world_size=4)
    net4, _ = build_network(path, 4)  # the 1-host collectives ran at the benchmark's speed
    trial = trial.assign(comm_s=fit_time_model(trial, net4).comm_seconds(2, 1, 4, 1, net4)[0])
    model, _, _ = predict_from_one_host(trial, path, hosts=2, slots=2)
    hierarchy = predict_from_one_host(trial, path, hosts=2, slots=2, algorithm=NCCL)[0]
    flat = flat_ring_step_s(trial, path, hosts=2, slots=2)
    assert flat > hierarchy
    # the probes' latencies are alike within and across hosts here, so only the bytes tell them apart
    assert model == pytest.approx(flat, rel=1e-9)
    assert flat == pytest.approx(predict_from_one_host(trial, path, hosts=4, slots=1)[0], rel=1e-9)


def _nets(g: int):
    from advisor.model.network import GLOO, NCCL, Link, Network

    intra, inter = Link(1e10, 1e-5, "intra"), Link(1e8, 1e-3, "inter")
    return Network(g, intra, inter, algorithm=GLOO), Network(g, intra, inter, algorithm=NCCL)


def test_gloo_moves_a_large_op_as_one_ring_over_all_ranks_nccl_by_the_hierarchy():
    """gloo knows no hosts: at 2 hosts x 2 ranks a 100 MB all-reduce is one 4-rank ring, paced by its
    slowest hop: 2(W-1)/W of the buffer through each host's link. Its 2(W-1) sequential hops alternate
    within and across hosts (ranks in rank order), so 3 of the 6 pay the cross-host latency. NCCL's
    hierarchy runs the within-host step, then a 2-host ring with 2(H-1)/H. On one host the two agree."""
    from advisor.model.collective_cost import CommOp, op_seconds

    gloo, nccl = _nets(2)
    op = CommOp("all_reduce", 1, 100e6, per_micro_step=False)
    g_intra, g_inter = op_seconds(op, 2, 2, gloo)
    n_intra, n_inter = op_seconds(op, 2, 2, nccl)
    assert g_inter == pytest.approx(3 * 1e-3 + 3 * 1e-5 + 2 * 3 / 4 * 100e6 / 1e8)
    assert n_inter == pytest.approx(2 * 1e-3 + 2 * 1 / 2 * 100e6 / 1e8)
    assert g_intra == 0.0  # the bytes move at the slowest hop's rate, so all of it is costed across hosts
    assert n_intra == pytest.approx(2 * 1e-5 + 100e6 / 1e10)
    assert op_seconds(op, 2, 1, gloo) == pytest.approx(op_seconds(op, 2, 1, nccl))


def test_a_gloo_rings_latency_crosses_hosts_on_the_hops_that_do():
    """The longest chain of consecutive hops in a ring of W ranks in rank order over N hosts crosses
    ceil(steps N / W) times: an all-reduce's 6 hops at 2x2 cross 3 times, an all-gather's 3 hops twice;
    at 4 hosts x 1 rank every hop crosses (as before), at 4 hosts x 2 an all-reduce's 14 hops 7 times."""
    from advisor.model.collective_cost import CommOp, op_seconds

    gloo, _ = _nets(2)
    tiny = CommOp("all_reduce", 1, 4.0, per_micro_step=False)
    assert op_seconds(tiny, 2, 2, gloo)[1] == pytest.approx(3 * 1e-3 + 3 * 1e-5, rel=1e-4)
    gather = CommOp("all_gather", 1, 4.0, per_micro_step=False)
    assert op_seconds(gather, 2, 2, gloo)[1] == pytest.approx(2 * 1e-3 + 1e-5, rel=1e-4)
    assert op_seconds(tiny, 1, 4, _nets(1)[0])[1] == pytest.approx(6 * 1e-3, rel=1e-4)
    assert op_seconds(tiny, 2, 4, gloo)[1] == pytest.approx(7 * 1e-3 + 7 * 1e-5, rel=1e-4)


def test_gloo_pays_a_burst_of_small_ops_as_a_ring_over_all_ranks():
    """ZeRO-3's 208 small gathers a step over 2 hosts x 2 ranks: latency-bound, each a 4-rank ring's
    3 sequential hops, 2 of them across hosts: more than NCCL's hierarchy (one cross-host hop per gather),
    less than 4 hosts x 1 rank (3 cross-host hops)."""
    from advisor.model.collective_cost import CommOp, op_seconds

    gloo, nccl = _nets(2)
    burst = CommOp("all_gather", 208, 208 * 512, per_micro_step=True)
    flat = sum(op_seconds(burst, 2, 2, gloo))
    assert flat == pytest.approx(208 * (2 * 1e-3 + 1e-5) + 3 / 4 * 208 * 512 / 1e8)
    assert sum(op_seconds(burst, 2, 2, nccl)) < flat < op_seconds(burst, 1, 4, gloo)[1]


def test_gloos_two_rank_all_gather_rate_holds_at_two_ranks_only():
    """gloo's all-gather probed at 2 ranks reads about two thirds of the link's rate (the all-reduce's);
    in a ring of 3+ ranks it moves at the link's rate (docs/multinode.md round 4), at 2 ranks at its own.
    Another library's figures are its own at every size."""
    from advisor.model.network import CollectiveFigures, Link

    own = (
        CollectiveFigures("all_gather", 6e7, 1e-3, probe_ranks=2),
        CollectiveFigures("all_reduce", 1e8, 1e-3, probe_ranks=2),
    )
    gloo = Link(1e8, 1e-3, "inter", own, "gloo")
    assert gloo.ring_busbw_bytes_s("all_gather", 2) == 6e7
    assert gloo.ring_busbw_bytes_s("all_gather", 4) == 1e8
    assert gloo.ring_busbw_bytes_s("all_reduce", 4) == 1e8
    assert replace(gloo, library="nccl").ring_busbw_bytes_s("all_gather", 4) == 6e7
    probed_at_4 = (replace(own[0], probe_ranks=4), own[1])
    assert replace(gloo, per_collective=probed_at_4).ring_busbw_bytes_s("all_gather", 8) == 6e7


def test_the_measured_library_sets_the_algorithm(fit_file):
    """A link measured with gloo is costed as gloo runs it; a preset link (a GPU cluster) as NCCL."""
    net, notes = build_network(fit_file(10.0), 2)
    assert net.algorithm.name == "gloo" and not net.algorithm.hierarchical
    assert any("one ring over all ranks" in n for n in notes)
    assert build_network(fit_file(10.0), 2, preset="ib-200")[0].algorithm.name == "nccl"
    assert build_network(None, 8)[0].algorithm.hierarchical


def test_expected_maximum_of_normal_draws_matches_its_closed_forms():
    """e(W), how far the slowest of W ranks lies above a typical one in standard deviations: 0 for one rank,
    1/sqrt(pi) for two, 3/(2 sqrt(pi)) for three, growing slowly (about sqrt(2 ln W)) beyond."""
    import math

    from advisor.model.sync_wait import expected_max_normal

    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)
    assert expected_max_normal(5) == pytest.approx(1.16296, rel=1e-4)  # tabulated
    values = [expected_max_normal(w) for w in (2, 4, 8, 32, 256)]
    assert values == sorted(values) and values[-1] < math.sqrt(2 * math.log(256))


def test_the_wait_for_the_slowest_rank_is_kept_at_one_rank_per_host(fit_file):
    """A 1-host trial whose ranks spent 40 ms a step in collectives beyond what its link costs waited for
    the slowest rank. That wait is no link's: at 2 hosts x 1 rank (no within-host part to scale) the same
    2 ranks wait as long again, beside the inter-host cost; the link ratio stays a transport ratio (at
    most 1). At 4 hosts the slowest of 4 lies further out: e(4)/e(2) times the wait."""
    from advisor.model.sync_wait import expected_max_normal

    path = fit_file(10.0)
    costed = costed_intra_s(path)
    trial = one_host_trial(comm_s=costed + 0.04)
    net, _ = build_network(path, 2)
    model = fit_time_model(trial, net)
    assert model.comm_factor[2] == pytest.approx(1.0)
    at_2 = model.predict(2, "bf16", 4, 1, 2, build_network(path, 1)[0])
    assert at_2.wait_s == pytest.approx(0.04, rel=1e-6)
    step, comm, _ = predict_from_one_host(trial, path, hosts=2, slots=1)
    inter = model.comm_seconds(2, 1, 1, 2, build_network(path, 1)[0])[1]
    assert step == pytest.approx(0.30 - costed - 0.04 + inter + 0.04, rel=1e-6)
    assert comm == pytest.approx(inter + 0.04, rel=1e-6)  # spent in collectives, so counted with them
    at_4 = model.predict(2, "bf16", 4, 1, 4, build_network(path, 1)[0])
    assert at_4.wait_s == pytest.approx(0.04 * expected_max_normal(4) / expected_max_normal(2), rel=1e-6)
    assert model.predict(2, "bf16", 4, 1, 1, build_network(path, 1)[0]).wait_s == 0.0  # one rank


def test_the_wait_repeats_with_each_synchronisation(fit_file):
    """ZeRO-2 reduces every micro-step, so at accumulation 4 its ranks meet (and wait) four times a step;
    a stage that reduces only at the boundary (here the same trial read as ZeRO-1) meets once."""
    path = fit_file(1.0)
    net, _ = build_network(path, 2)
    trial = one_host_trial(comm_s=costed_intra_s(path) + 0.02)
    zero2 = fit_time_model(trial, net)
    zero1 = fit_time_model(trial.assign(zero_stage=1), net)
    assert zero2.predict(2, "bf16", 4, 4, 1, net).wait_s == pytest.approx(4 * 0.02, rel=1e-6)
    assert zero1.predict(1, "bf16", 4, 4, 1, net).wait_s == pytest.approx(0.02, rel=1e-6)


def test_a_trial_at_its_links_cost_waits_for_nothing(fit_file):
    """The logged time at or below the link's cost leaves no wait (the transport ratio takes it)."""
    path = fit_file(1.0)
    net, _ = build_network(path, 2)
    model = fit_time_model(one_host_trial(comm_s=costed_intra_s(path) / 2), net)
    assert model.wait_sigma_s[2] == 0.0 and model.comm_factor[2] == pytest.approx(0.5)


def test_the_least_waiting_rank_splits_transport_from_wait(fit_file):
    """A trial that recorded every rank's time in collectives: the rank that spent least waited least, so
    its time is the transport (here twice the probe's cost: a ratio above 1 is kept, it is measured) and
    rank 0's excess over it is the wait, the ranks' spread, not all of rank 0's excess over the cost."""
    path = fit_file(1.0)
    net, _ = build_network(path, 2)
    costed = costed_intra_s(path)
    trial = one_host_trial(comm_s=2 * costed + 0.01).assign(comm_min_s=2 * costed)
    model = fit_time_model(trial, net)
    assert model.comm_factor[2] == pytest.approx(2.0, rel=1e-6)
    assert model.predict(2, "bf16", 4, 1, 1, net).wait_s == pytest.approx(0.01, rel=1e-6)
    # one node, as measured: the trial's own step, its transport and its wait
    assert model.predict(2, "bf16", 4, 1, 1, net).step_time_s == pytest.approx(0.30, rel=1e-6)
    # a trial without the per-rank figures keeps the older rule (excess over the cost = wait)
    old = fit_time_model(trial.drop(columns=["comm_min_s"]), net)
    assert old.comm_factor[2] == 1.0
    assert old.predict(2, "bf16", 4, 1, 1, net).wait_s == pytest.approx(costed + 0.01, rel=1e-6)
