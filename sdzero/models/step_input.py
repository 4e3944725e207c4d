"""One micro-batch as the trainer feeds it to a family's encode and loss: `StepInput`.

The data path makes it once (sdzero.data.images.CaptionedImages for online encoding, sdzero.data.cache.
CachedSamples for a latent/text cache: one sample each, joined by `StepInput.collate` in the DataLoader);
the trainer moves it to its device, the family encodes it (sdzero.models.encoding) and forms the loss
(sdzero.models.objectives). A leaf module: the families, the data path and the trainer all import it, so
it imports none of them.

A StepInput is online (pixels for the VAE, token ids for the text encoders) or cached (the VAE posterior
and the text embeddings a cache stored), never a mix; `cached` says which. Everything else is the same
either way: the per-sample draws (noise, VAE posterior draw, timestep, SD3's flow draw) come from the
sample's own generator (sdzero.data.images.draw_noise), so a sample trains on the same noise online and
from a cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.utils.data import default_collate

T = TypeVar("T")


@dataclass(eq=False)
class PromptEmbeds:
    """A micro-batch's text conditioning, as the family's text encoders compute it (Family.encode_prompts)
    or a cache stored it. The field names are diffusers' and a cache's (`<position>/cond/<name>`)."""

    encoder_hidden_states: Tensor
    """(batch, tokens, width): the sequence the network attends to."""
    pooled_prompt_embeds: Tensor | None = None
    """(batch, width): SDXL's and SD3's pooled embedding; None for SD 1.x/2.x."""

    def by_name(self) -> dict[str, Tensor]:
        """The embeddings present, by name: how a cache stores them (sdzero.data.cache_build)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(eq=False)
class LatentPosterior:
    """Each image's VAE posterior, as a latent cache stores it: a cached run draws its own posterior
    sample `mean + std * latent_eps` every epoch, as online encoding does."""

    mean: Tensor
    std: Tensor


@dataclass(eq=False)
class StepInput:
    """One micro-batch (or, inside a dataset before `collate`, one sample of it: the same fields without
    the leading batch dimension). Shapes below are the micro-batch's; `C, h, w` are the latent's."""

    noise: Tensor
    """(B, C, h, w) float32: the diffusion noise (with --noise-offset's per-channel shift)."""
    latent_eps: Tensor
    """(B, C, h, w) float32: the draw that samples the VAE posterior."""
    timestep: Tensor
    """(B,) long: the DDPM timestep (SD, SDXL)."""
    index: Tensor
    """(B,) long: the dataset index of each sample served."""
    original_size: Tensor
    """(B, 2) long: the image's (height, width) before resizing; SDXL's micro-conditioning, as the next two."""
    crop_top_left: Tensor
    """(B, 2) long: the crop's (top, left)."""
    target_size: Tensor
    """(B, 2) long: the (height, width) trained at (an aspect-ratio bucket, or the square resolution)."""
    flow_u: Tensor | None = None
    """(B,) float32: SD3's place on the flow-matching schedule (objectives.flow_timesteps); None otherwise."""

    # online: what the frozen VAE and text encoders start from
    pixel_values: Tensor | None = None
    """(B, 3, H, W) float32 in [-1, 1]."""
    token_ids: tuple[Tensor, ...] = ()
    """One (B, tokens) long tensor per text encoder, in the family's order (CLIP-L, CLIP-G, T5)."""
    requested: Tensor | None = None
    """(B,) long: the index the sampler asked for; where it differs from `index`, the records between were
    found unreadable in a DataLoader worker (sdzero.data.images.LateFailures counts them)."""

    # cached: what a latent/text cache stored in their place
    posterior: LatentPosterior | None = None
    prompt_embeds: PromptEmbeds | None = None

    def __post_init__(self) -> None:
        online = self.pixel_values is not None
        cached = self.posterior is not None
        if online == cached or (online and not self.token_ids) or (cached and self.prompt_embeds is None):
            raise ValueError(
                "a StepInput is online (pixel_values and token_ids) or cached (posterior and prompt_embeds)"
            )

    @property
    def cached(self) -> bool:
        """True: from a latent/text cache (no VAE or text encoder needed); False: encoded online."""
        return self.posterior is not None

    def __len__(self) -> int:
        return len(self.index)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepInput:
        return _map_tensors(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> StepInput:
        """Page-locked copies, so that `to(cuda, non_blocking=True)` overlaps the copy with compute. The
        DataLoader's pin_memory thread calls this on types it does not know (it would pass them unpinned)."""
        return _map_tensors(self, lambda t: t.pin_memory())

    @classmethod
    def collate(cls, samples: Sequence[StepInput]) -> StepInput:
        """The DataLoader's `collate_fn`: samples stacked field by field. torch's default_collate does the
        stacking, so that in a worker it stacks straight into shared memory, as it does for tensors."""
        return _collate(list(samples))


def _map_tensors(value: T, fn: Callable[[Tensor], Tensor]) -> T:
    """`value` with `fn` applied to every tensor inside it (dataclasses and tuples rebuilt, None kept)."""
    if isinstance(value, Tensor):
        return fn(value)  # type: ignore[return-value]
    if isinstance(value, tuple):
        return tuple(_map_tensors(v, fn) for v in value)  # type: ignore[return-value]
    if is_dataclass(value) and not isinstance(value, type):
        parts = {f.name: _map_tensors(getattr(value, f.name), fn) for f in fields(value)}
        return type(value)(**parts)
    return value


def _collate(values: list[Any]) -> Any:
    """One value made of the samples' `values` (all of one kind: tensors, tuples, dataclasses or None)."""
    first = values[0]
    if any((v is None) != (first is None) for v in values):
        raise ValueError("samples of one micro-batch differ in which inputs they carry")
    if first is None:
        return None
    if isinstance(first, Tensor):
        return default_collate(values)
    if isinstance(first, tuple):
        return tuple(_collate(list(column)) for column in zip(*values, strict=True))
    return type(first)(**{f.name: _collate([getattr(v, f.name) for v in values]) for f in fields(first)})
