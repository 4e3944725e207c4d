"""The advisor plans a LoRA run (`--train-args "--lora-rank 16"`): what it trains, reduces and holds in the
optimizer is the adapters; the frozen base's parameters follow the stage (advisor.model.lora_sizing)."""

from __future__ import annotations

import pickle

import pytest

from advisor.model.collective_mix import collective_mix
from advisor.model.lora_sizing import (
    TrainedNumels,
    frozen_base_of,
    lora_plan,
    network_numels,
    with_frozen_base,
)
from advisor.model.memory import ZeroSettings, state_elements, trained_numels

LORA16 = ("--lora-rank", "16")
WORLD = 16  # two 8-GPU nodes


@pytest.fixture(scope="module")
def plan(tiny_model):
    """The embedded default's network (the tiny SD 1.x pipeline `sdzero advise` writes) at rank 16."""
    found = lora_plan(tiny_model, LORA16)
    assert found is not None
    return found


def real_adapter_params(model, rank: int) -> int:
    """The adapter of the network the trainer builds (real weights, not the meta device)."""
    from sdzero.models.families import detect_family
    from sdzero.models.loading import load_components
    from sdzero.models.lora import LoraSettings, add_lora

    comps = load_components(str(model), "fp32", "cpu", frozen=False)
    cfg = type(
        "Cfg", (), {"lora_rank": rank, "lora_alpha": None, "lora_dropout": 0.0, "lora_target_modules": []}
    )
    net = add_lora(comps.network, LoraSettings.of(cfg, detect_family(str(model))))
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def test_the_plan_trains_the_adapters_the_trainer_trains(plan, tiny_model):
    full = trained_numels(tiny_model)
    assert plan.adapter_params == real_adapter_params(tiny_model, 16)
    assert plan.base_params == sum(full)  # the base is the whole network, frozen
    assert 0 < plan.adapter_params < sum(full) // 10
    numels = network_numels(tiny_model, LORA16)
    assert sum(numels) == plan.adapter_params and sum(frozen_base_of(numels)) == sum(full)
    assert network_numels(tiny_model, ()) == full and frozen_base_of(network_numels(tiny_model)) == ()
    assert network_numels(tiny_model, ("--resolution", "64")) == full


def collective_bytes(mix, what: str) -> float:
    return sum(c.full_bytes for c in mix if c.what == what)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_0_to_2_communicate_the_adapters_only(plan, stage):
    """Per optimizer step: the gradient reduction moves the adapter's 16-bit gradients (factor 1 of its
    bytes, all-reduced), ZeRO-1/2's gather of the updated partitions the adapter's 16-bit weights (padded
    to 2N elements): within 5% of the adapter's bytes, nowhere near the base's."""
    numels = plan.numels()
    mix = collective_mix(numels, stage, WORLD, ZeroSettings())
    adapter_bytes = 2 * plan.adapter_params
    name = "gradient all-reduce" if stage == 0 else "gradient reduction"
    assert collective_bytes(mix, name) == pytest.approx(adapter_bytes, rel=0.05)
    if stage:
        assert collective_bytes(mix, "updated 16-bit partitions") == pytest.approx(adapter_bytes, rel=0.05)
    big = [c for c in mix if c.full_bytes > 1.05 * adapter_bytes]
    assert not big, big
    # The same plan without --lora-rank moves the whole network's gradients.
    full = collective_mix(tuple(numels.frozen_base), stage, WORLD, ZeroSettings())
    assert collective_bytes(full, name) == pytest.approx(2 * plan.base_params, rel=0.05)


def test_zero3_reduces_the_adapters_and_gathers_the_frozen_base_too(plan):
    numels = plan.numels()
    zero = ZeroSettings()
    mix = collective_mix(numels, 3, WORLD, zero)
    reduced = collective_bytes(mix, "gradient reduce-scatter")
    assert reduced == pytest.approx(2 * plan.adapter_params, rel=0.05)
    gathered = sum(c.full_bytes for c in mix if c.kind == "all_gather")
    # every parameter, adapters and base, is gathered in forward (and the persistent ones after the step)
    assert gathered >= 2 * (plan.adapter_params + plan.base_params) * 0.95


def test_memory_holds_the_base_whole_below_zero3_and_partitioned_at_it(plan):
    numels, zero = plan.numels(), ZeroSettings()
    adapters, base = plan.adapter_params, plan.base_params
    for stage in (0, 1, 2):
        kinds = state_elements(numels, stage, WORLD, zero.persistence_threshold, zero.overlap_comm)
        assert kinds["params"] == pytest.approx(adapters + base, rel=0.01)  # the base replicated
        assert kinds["master"] == kinds["optimizer"] <= adapters  # optimizer states: the adapters'
    # ZeRO-3 partitions the base (with no persistence threshold: the tiny net's layers are all below the
    # default one, which keeps them whole on every rank)
    kinds = state_elements(numels, 3, WORLD, 0)
    assert kinds["master"] == pytest.approx(adapters / WORLD, rel=0.2)
    assert kinds["params"] == pytest.approx((adapters + base) / WORLD, rel=0.05)


def test_the_sizes_survive_a_plan_record_and_a_pickle(plan):
    numels = plan.numels()
    again = with_frozen_base(list(numels), list(frozen_base_of(numels)))
    assert isinstance(again, TrainedNumels) and again == numels and again.frozen_base == numels.frozen_base
    copied = pickle.loads(pickle.dumps(numels))
    assert copied.frozen_base == numels.frozen_base
    assert with_frozen_base([1, 2], []) == (1, 2) and frozen_base_of(with_frozen_base([1, 2], None)) == ()
