"""The typed micro-batch (sdzero.models.step_input.StepInput): collated field by field from one-sample
StepInputs, online or cached and never a mix, moved and pinned as a whole, and picklable (DataLoader
workers send it across processes)."""

from __future__ import annotations

import pickle

import pytest
import torch
from step_input_fakes import tensors_of
from torch.utils.data._utils.pin_memory import pin_memory as loader_pin_memory

from sdzero.models.step_input import LatentPosterior, PromptEmbeds, StepInput


def sample(i: int, cached: bool, sd3: bool = False) -> StepInput:
    """One sample's StepInput, as a dataset item: no batch dimension."""
    g = torch.Generator().manual_seed(i)
    draws = {
        "noise": torch.randn(4, 2, 2, generator=g),
        "latent_eps": torch.randn(4, 2, 2, generator=g),
        "timestep": torch.tensor(10 * i),
        "index": torch.tensor(i),
        "original_size": torch.tensor([40 + i, 50]),
        "crop_top_left": torch.tensor([i, 0]),
        "target_size": torch.tensor([16, 16]),
        "flow_u": torch.tensor(0.1 * i) if sd3 else None,
    }
    if cached:
        embeds = PromptEmbeds(torch.randn(3, 8, generator=g), torch.randn(8, generator=g) if sd3 else None)
        return StepInput(
            **draws,
            posterior=LatentPosterior(torch.randn(4, 2, 2), torch.ones(4, 2, 2)),
            prompt_embeds=embeds,
        )
    tokens = (torch.arange(5) + i, torch.arange(5) - i)
    return StepInput(**draws, pixel_values=torch.rand(3, 16, 16), token_ids=tokens, requested=torch.tensor(i))


@pytest.mark.parametrize("cached", [False, True])
def test_collate_stacks_every_field_of_the_samples(cached):
    samples = [sample(i, cached, sd3=True) for i in range(3)]
    batch = StepInput.collate(samples)
    assert batch.cached is cached and len(batch) == 3
    parts = [tensors_of(s) for s in samples]
    stacked = tensors_of(batch)
    assert set(stacked) == set(parts[0]) and len(stacked) == 12
    for name, value in stacked.items():
        assert torch.equal(value, torch.stack([p[name] for p in parts])), name
    assert batch.index.tolist() == [0, 1, 2] and batch.original_size.shape == (3, 2)


def test_a_step_input_is_online_or_cached_never_both_or_neither():
    online, cached = sample(0, cached=False), sample(1, cached=True)
    with pytest.raises(ValueError, match="differ in which inputs"):
        StepInput.collate([online, cached])
    base = {
        k: v for k, v in tensors_of(online).items() if "." not in k and k not in ("pixel_values", "requested")
    }
    with pytest.raises(ValueError, match="online .* or cached"):
        StepInput(**base)  # neither
    with pytest.raises(ValueError, match="online .* or cached"):
        StepInput(**base, pixel_values=online.pixel_values)  # pixels without tokens
    with pytest.raises(ValueError, match="online .* or cached"):
        StepInput(
            **base, pixel_values=online.pixel_values, token_ids=online.token_ids, posterior=cached.posterior
        )
    with pytest.raises(ValueError, match="differ in which inputs"):
        StepInput.collate([sample(0, cached=True, sd3=True), sample(1, cached=True)])  # flow_u on one only


def test_moves_and_pins_as_a_whole_and_pickles(monkeypatch):
    batch = StepInput.collate([sample(i, cached=True, sd3=True) for i in range(2)])
    moved = batch.to("cpu", non_blocking=True)
    assert isinstance(moved, StepInput) and isinstance(moved.prompt_embeds, PromptEmbeds)
    assert all(torch.equal(v, tensors_of(batch)[k]) for k, v in tensors_of(moved).items())
    # The DataLoader's pin_memory thread calls `pin_memory()` on types it does not know; pinning itself
    # needs an accelerator, so the tensor method is replaced by one that marks what it was called on.
    pinned: list[int] = []

    def fake_pin(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        pinned.append(id(t))
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    out = loader_pin_memory(batch)
    assert isinstance(out, StepInput) and out.cached
    assert sorted(pinned) == sorted(id(t) for t in tensors_of(batch).values())  # every tensor, once
    again = pickle.loads(pickle.dumps(batch))
    assert all(torch.equal(v, tensors_of(batch)[k]) for k, v in tensors_of(again).items())
