"""What a LoRA run trains and what it keeps frozen, for the memory and communication models.

With `--lora-rank` in the trials' trainer options, the trained parameters are the adapters (peft's LoRA
layers on the network's attention projections, sdzero.models.lora): their gradients, optimizer states and
reductions are all ZeRO moves. The frozen base stays in the module DeepSpeed wraps: replicated on every rank
at ZeRO 0-2 (16-bit parameters, no gradient, no optimizer state), partitioned at ZeRO-3, where each forward
and backward gathers it like any other parameter.

`network_numels` returns the trained sizes as a `TrainedNumels`: a tuple of the trained parameters' element
counts in module order, exactly what the models took before, carrying the frozen base's counts beside them
(`frozen_base`, empty for a full fine-tune). The memory model adds the base to the parameters a rank holds
(advisor.model.memory.state_elements) and the collective mix adds it to ZeRO-3's gathers
(advisor.model.collective_mix); everything else sees the adapters alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TrainedNumels(tuple):  # noqa: SLOT001 (one attribute beside the tuple: the frozen base)
    """Element counts of the trained parameters in module order, with the frozen base's beside them."""

    frozen_base: tuple[int, ...]

    def __new__(cls, trained: Sequence[int], frozen_base: Sequence[int] = ()) -> TrainedNumels:
        made = super().__new__(cls, (int(n) for n in trained))
        made.frozen_base = tuple(int(n) for n in frozen_base)
        return made

    def __reduce__(self) -> tuple[Any, ...]:
        return TrainedNumels, (tuple(self), self.frozen_base)


def frozen_base_of(numels: Any) -> tuple[int, ...]:
    """The frozen base's element counts (a LoRA run's), () for a full fine-tune or plain sizes."""
    return tuple(getattr(numels, "frozen_base", ()))


@dataclass(frozen=True)
class LoraPlan:
    """A LoRA run's sizes: its settings and the element counts of adapters and base, in module order."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    adapter_numels: tuple[int, ...]
    base_numels: tuple[int, ...]

    @property
    def adapter_params(self) -> int:
        return sum(self.adapter_numels)

    @property
    def base_params(self) -> int:
        return sum(self.base_numels)

    def numels(self) -> TrainedNumels:
        return TrainedNumels(self.adapter_numels, self.base_numels)


def trainer_options(train_args: Sequence[str]) -> Any:
    """The trainer's own parser's reading of `train_args` (already checked by it: stages.fine_tune),
    with the options a trial sets itself not required."""
    from sdzero.config.train_config import build_parser

    parser = build_parser()
    for action in parser._actions:
        action.required = False
    return parser.parse_args(list(train_args))


def lora_plan(model: str | Path, train_args: Sequence[str]) -> LoraPlan | None:
    """The LoRA run `train_args` asks for on `model`, sized on the meta device (no weights), or None."""
    import torch

    from sdzero.models.families import detect_family
    from sdzero.models.lora import LoraSettings, add_lora

    options = trainer_options(train_args)
    family = detect_family(str(model))
    settings = LoraSettings.of(options, family)
    if settings is None:
        return None
    cls = family.network_class()
    with torch.device("meta"):
        net = add_lora(cls.from_config(cls.load_config(str(model), subfolder=family.subfolder)), settings)
    params = list(net.parameters())
    return LoraPlan(
        rank=settings.rank,
        alpha=settings.alpha,
        targets=settings.targets,
        adapter_numels=tuple(int(p.numel()) for p in params if p.requires_grad),
        base_numels=tuple(int(p.numel()) for p in params if not p.requires_grad),
    )


def lora_numels(model: str | Path, train_args: Sequence[str] = ()) -> TrainedNumels | None:
    """A LoRA run's trained sizes (the adapters, the frozen base beside them), None without --lora-rank."""
    plan = lora_plan(model, train_args) if train_args else None
    return plan.numels() if plan is not None else None


def network_numels(model: str | Path, train_args: Sequence[str] = ()) -> tuple[int, ...]:
    """What the trials train: the adapters under `--lora-rank`, else every parameter of the network
    (advisor.model.memory.trained_numels)."""
    from advisor.model.memory import trained_numels

    return lora_numels(model, train_args) or trained_numels(model)


def with_frozen_base(numels: Sequence[int], frozen_base: Sequence[int] | None) -> tuple[int, ...]:
    """Sizes read back from a plan record: a TrainedNumels where the record holds a frozen base."""
    return TrainedNumels(numels, frozen_base) if frozen_base else tuple(int(n) for n in numels)
