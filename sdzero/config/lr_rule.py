"""The one learning-rate rule, for the trainer (`--lr-scaling`, `--lr-reference-batch`) and the advisor.

An LR is tuned for one global batch, the *reference batch*. When a run's global batch differs from it the
LR is scaled by a rule of the ratio:

- ``sqrt`` (the default): lr x sqrt(batch / reference). The rule derived for Adam-type optimizers (Malladi
  et al., 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"); every shipped config
  trains with AdamW.
- ``linear``: lr x batch / reference (Goyal et al., 2017), derived for SGD; it needs a warm-up.
- ``none``: the LR as given.

Scaling is applied only when the batch differs from the reference; the factor is capped at
MAX_LR_FACTOR, with a warning above it: a rule extrapolated 30x past the batch an LR was tuned at is a
guess, and a diverged run costs more than a slower one. A factor above 1 comes with a recommended
warm-up (WARMUP_STEPS).

The reference batch, unless given: the batch the base DeepSpeed JSON describes (``reference_batch``):
its ``train_batch_size``, else micro-batch x accumulation x the ranks it is read for. The trainer reads
it at the run's own world size (so a JSON run as written keeps its LR); the advisor at one node of the
target cluster (its strong-scaling base, the batch it keeps unless --global-batch says otherwise).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from sdzero.errors import UserError

LR_SCALINGS = ("none", "linear", "sqrt")
DEFAULT_LR_SCALING = "sqrt"
MAX_LR_FACTOR = 4.0
"""The largest factor the rule may apply to the base LR. bench/lr_safety.py checks the capped LR on the
embedded model at the issue's 64x batch (see docs/advisor.md for its figures)."""
WARMUP_STEPS = 500
"""Recommended linear warm-up (optimizer steps) when the LR is raised: diffusers' text-to-image example's
default, in the spirit of Goyal et al.'s gradual warm-up. Not needed when the LR is unchanged."""
DEFAULT_BASE_LR = 1e-4
"""The trainer's and the advisor's LR when neither --lr nor the JSON's optimizer.params.lr gives one."""


@dataclass(frozen=True)
class LrChoice:
    """An LR and how it was reached: what the trainer logs and the advisor reports."""

    lr: float
    base_lr: float
    rule: str
    factor: float
    """What the base LR was multiplied by (after the cap)."""
    uncapped_factor: float
    global_batch: int
    reference_batch: int
    warmup_steps: int
    warning: str | None = None

    @property
    def capped(self) -> bool:
        return self.factor < self.uncapped_factor

    def describe(self) -> str:
        if self.factor == 1.0 and not self.capped:
            why = (
                f"global batch {self.global_batch} = reference"
                if self.global_batch == self.reference_batch
                else f"rule {self.rule}"
            )
            return f"lr {self.lr:.3g} (base LR unchanged: {why})"
        text = (
            f"lr {self.lr:.3g} = base {self.base_lr:.3g} x {self.factor:.3g} ({self.rule} rule: global batch "
            f"{self.global_batch} / reference {self.reference_batch})"
        )
        if self.capped:
            text += f", capped from x{self.uncapped_factor:.3g}"
        return text + (f"; warm up over {self.warmup_steps} steps" if self.warmup_steps else "")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"capped": self.capped, "describe": self.describe()}


def check_rule(rule: str, flag: str = "--lr-scaling") -> str:
    if rule not in LR_SCALINGS:
        raise UserError(f"{flag} {rule!r}: choose one of {', '.join(LR_SCALINGS)}")
    return rule


def reference_batch(ds_config: dict[str, Any], ranks: int) -> int:
    """The global batch a DeepSpeed JSON describes on `ranks` ranks (see the module doc)."""
    if "train_batch_size" in ds_config:
        return int(ds_config["train_batch_size"])
    micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
    return micro * int(ds_config.get("gradient_accumulation_steps", 1)) * ranks


def base_lr_of(ds_config: dict[str, Any]) -> float:
    return float(ds_config.get("optimizer", {}).get("params", {}).get("lr", DEFAULT_BASE_LR))


def rule_factor(rule: str, ratio: float) -> float:
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    return 1.0


def choose_lr(
    base_lr: float,
    global_batch: int,
    reference: int,
    rule: str = DEFAULT_LR_SCALING,
    max_factor: float = MAX_LR_FACTOR,
) -> LrChoice:
    """The LR for `global_batch` from `base_lr`, tuned at `reference`: the rule, capped at `max_factor`."""
    check_rule(rule)
    if global_batch < 1 or reference < 1:
        raise UserError(f"global batch {global_batch} and reference batch {reference} must be at least 1")
    uncapped = 1.0 if global_batch == reference else rule_factor(rule, global_batch / reference)
    factor = min(uncapped, max_factor)
    warning = None
    if factor < uncapped:
        warning = (
            f"the {rule} rule asks for {uncapped:.3g}x the base LR (global batch {global_batch} vs reference "
            f"{reference}); capped at {max_factor:.3g}x ({base_lr * factor:.3g}). Tune the LR at this batch, "
            "or give it with --lr"
        )
    warmup = WARMUP_STEPS if factor > 1.0 else 0
    return LrChoice(
        base_lr * factor, base_lr, rule, factor, uncapped, global_batch, reference, warmup, warning
    )
