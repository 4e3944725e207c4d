"""What a larger global batch costs in samples: the rule that turns one training amount into another.

A node count whose ranks cannot spread the asked global batch is answered at the smallest batch that
reaches it (weak scaling). A larger batch does not reach the same quality in the same samples: past the
critical batch size each doubling buys less than half the steps (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training": S = S_min (1 + B_noise / B)), so the samples needed grow with the batch.
The rules here are power laws samples ~ (B / B_asked) ** k through one published pair, the simplest curve
through the only point each source gives; `same` assumes no growth (the default, and what it says).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sdzero.errors import UserError


@dataclass(frozen=True)
class SamplesRule:
    name: str
    exponent: float
    source: str

    def factor(self, batch: int, asked: int) -> float:
        """Samples to the same quality at `batch`, as a multiple of those at the `asked` batch."""
        return 1.0 if batch <= asked else float((batch / asked) ** self.exponent)

    def describe(self) -> str:
        if not self.exponent:
            return f"{self.name} rule: the same samples at any global batch ({self.source})"
        return f"{self.name} rule: samples x (batch / asked)^{self.exponent:.3f} ({self.source})"


SAMPLES_RULES = {
    "same": SamplesRule("same", 0.0, "default; --samples-rule flux or sd2 for a published rule"),
    "flux": SamplesRule(
        "flux",
        math.log(2.1) / math.log(8),
        "Flux: 8x the global batch took 2.1x the samples, as cited in issue #42",
    ),
    "sd2": SamplesRule(
        "sd2",
        math.log(2.0) / math.log(8),
        "SD 2: global batch 256 -> 2048 took about 2x the samples, as cited in issue #42",
    ),
}


def samples_rule(name: str) -> SamplesRule:
    if name not in SAMPLES_RULES:
        raise UserError(f"--samples-rule {name!r}: unknown; choose from {', '.join(SAMPLES_RULES)}")
    return SAMPLES_RULES[name]
