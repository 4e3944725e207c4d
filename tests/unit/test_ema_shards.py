"""Sharded EMA (sdzero.models.ema): each rank averages its own slice of the fp32 masters; joined, the slices equal
diffusers' EMAModel of the whole model, and a resume on another layout re-slices them."""

from __future__ import annotations

import pytest
import torch

from sdzero.models import ema as ema_mod

PARAMS = {"down.weight": (3, 4), "up.bias": (5,)}
# Two "ranks" that split the flat parameters the way ZeRO-1/2 does: one parameter spans both.
LAYOUT = {0: [("down.weight", 0, 7)], 1: [("down.weight", 7, 5), ("up.bias", 0, 5)]}


def fragments_for(rank: int, params: dict[str, torch.Tensor]):
    return [
        (ema_mod.Fragment(name, start, numel, PARAMS[name]), params[name].reshape(-1)[start : start + numel])
        for name, start, numel in LAYOUT[rank]
    ]


def test_ema_decay_matches_diffusers_ema_model():
    from diffusers.training_utils import EMAModel

    reference = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=0.999)
    for step in range(1, 40):
        assert ema_mod.ema_decay(0.999, step) == reference.get_decay(step)


def test_sharded_ema_equals_diffusers_ema_of_the_full_weights(tmp_path, monkeypatch):
    """Each rank averaging its own slice, then joining, gives what EMAModel gives on the whole model."""
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    params = {n: torch.randn(s) for n, s in PARAMS.items()}
    monkeypatch.setattr(ema_mod, "local_fp32_fragments", lambda rank: fragments_for(rank, params))
    shards = [ema_mod.ShardedEMA(rank, decay=0.8) for rank in (0, 1)]
    reference = EMAModel([torch.nn.Parameter(p.clone()) for p in params.values()], decay=0.8, foreach=True)
    for _ in range(6):
        for p in params.values():
            p.add_(torch.randn_like(p))  # an "optimizer step", in place like DeepSpeed's masters
        for shard in shards:
            shard.update()
        reference.step([torch.nn.Parameter(p.clone()) for p in params.values()])
    for rank, shard in enumerate(shards):
        shard.save(tmp_path, rank)
    joined, updates = ema_mod.assemble(tmp_path)
    assert updates == 6
    for (name, value), expected in zip(params.items(), reference.shadow_params, strict=True):
        torch.testing.assert_close(joined[name], expected, rtol=0, atol=1e-6, msg=name)
        assert not torch.allclose(joined[name], value)  # an average, not a copy of the weights

    # Resume: same layout reads its own file; a different layout re-slices the joined tensors.
    same = ema_mod.ShardedEMA(1, decay=0.8)
    same.load(tmp_path, 1)
    assert same.updates == 6 and torch.equal(same.shadow[1], shards[1].shadow[1])
    LAYOUT[2] = [("up.bias", 1, 4)]
    try:
        other = ema_mod.ShardedEMA(2, decay=0.8)
        other.load(tmp_path, 2)
        assert torch.equal(other.shadow[0], joined["up.bias"][1:])
    finally:
        del LAYOUT[2]


def test_assemble_refuses_incomplete_coverage(tmp_path, monkeypatch):
    params = {n: torch.zeros(s) for n, s in PARAMS.items()}
    monkeypatch.setattr(ema_mod, "local_fp32_fragments", lambda rank: fragments_for(rank, params))
    ema_mod.ShardedEMA(1, decay=0.9).save(tmp_path, 1)  # rank 0's file is missing
    with pytest.raises(ValueError, match="down.weight cover 5 of 12"):
        ema_mod.assemble(tmp_path)
