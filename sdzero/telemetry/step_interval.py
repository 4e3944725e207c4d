"""The median of a run's step times and its 95% interval: a bootstrap over the measured steps.

A trial is judged by its median step (one step slowed by another process moves the mean, not the median).
How far that median can be trusted depends on how much the steps scatter and how many there are, so the
interval is resampled from the steps themselves: draw as many steps as were measured, with replacement,
take the median, many times; the 2.5% and 97.5% points of those medians bound the interval. The draws are
seeded, so the same steps always give the same interval (a trial's figures can be recomputed exactly).

The interval says how well the steps of *this* run pin their median. It cannot see a machine that is
slower for a whole minute: the advisor measures the configs it compares side by side, interleaved in one
launch, so that such a minute falls on all of them (advisor.measure.launch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
"""Bootstrap draws: enough that the interval's ends move by well under a step's own scatter between seeds."""
SEED = 0


@dataclass(frozen=True)
class StepInterval:
    """A median step time and its interval, in seconds; lo/hi are NaN with fewer than two steps."""

    median_s: float
    lo_s: float
    hi_s: float
    steps: int

    @property
    def rel_halfwidth(self) -> float:
        """Half the interval's width as a fraction of the median (inf where there is no interval)."""
        if self.steps < 2 or not self.median_s > 0 or math.isnan(self.lo_s):
            return math.inf
        return (self.hi_s - self.lo_s) / 2 / self.median_s


def median_interval(
    times_s: Sequence[float],
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> StepInterval:
    """The median of `times_s` and its bootstrap percentile interval at `confidence`."""
    times = np.asarray([t for t in times_s if t is not None and math.isfinite(t)], dtype=float)
    if times.size == 0:
        return StepInterval(math.nan, math.nan, math.nan, 0)
    median = float(np.median(times))
    if times.size < 2:
        return StepInterval(median, math.nan, math.nan, int(times.size))
    rng = np.random.default_rng(seed)
    draws = np.median(rng.choice(times, size=(resamples, times.size), replace=True), axis=1)
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(draws, [tail, 1 - tail])
    # the percentile interval of a median always holds the median itself: clip float noise at the ends
    return StepInterval(median, min(float(lo), median), max(float(hi), median), int(times.size))


def interval_is_tight(interval: StepInterval, target_rel_halfwidth: float) -> bool:
    """Whether the interval's half-width is within `target_rel_halfwidth` of the median."""
    return interval.rel_halfwidth <= target_rel_halfwidth
