"""Multi-NIC nodes: a rail-optimised node (one NIC per GPU) moves its inter-node share over all its NICs."""

from __future__ import annotations

import re

import pytest

from advisor.model.collective_cost import CommOp, op_seconds
from advisor.model.network import PRESETS, build_network
from sdzero.errors import UserError

GRADS = CommOp("all_reduce", 1.0, 2e9, False)  # 1 G parameters of bf16 gradients


def test_one_nic_per_gpu_divides_the_inter_node_time():
    one, _ = build_network(None, 8, "ib-400")
    rails, _ = build_network(None, 8, "ib-400", nics_per_node=8)
    assert rails.inter.busbw_bytes_s == pytest.approx(8 * one.inter.busbw_bytes_s)
    assert rails.inter.hop_latency_s == one.inter.hop_latency_s
    _, across_one = op_seconds(GRADS, 8, 16, one)
    _, across_rails = op_seconds(GRADS, 8, 16, rails)
    latency = 2 * 4 * one.inter.hop_latency_s  # tree latency, 16 nodes
    assert across_rails - latency == pytest.approx((across_one - latency) / 8)


def test_presets_carry_their_nics_and_a_flag_overrides_them():
    dgx, _ = build_network(None, 8, "dgx-h100")
    assert dgx.nics_per_node == 8 and dgx.inter.busbw_bytes_s == pytest.approx(8 * 48e9)
    assert build_network(None, 8, "dgx-h100", nics_per_node=2)[0].inter.busbw_bytes_s == pytest.approx(96e9)
    # more NICs than ranks: only as many carry traffic as there are ranks
    two_ranks, notes = build_network(None, 2, "dgx-h100")
    assert two_ranks.inter.busbw_bytes_s == pytest.approx(96e9) and any("only 2 carry" in n for n in notes)
    with pytest.raises(UserError, match="--nics-per-node 0"):
        build_network(None, 8, "ib-400", nics_per_node=0)


def test_every_preset_cites_its_sources():
    from pathlib import Path

    import advisor.model.network as network

    text = Path(network.__file__).read_text()
    for name, preset in PRESETS.items():
        keys = re.findall(r"\[([\w-]+)\]", preset.source)
        assert keys, name
        for key in keys:
            assert f"# [{key}]" in text, (name, key)
