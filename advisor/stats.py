"""Statistics helpers the advisor's floors share: the normal and Student's t 95% quantiles, a normal
spread's sigma from its mean |deviation|, an interval's sigma, an rms, and the pooled spread of repeated
measurements. Nothing here knows about configs or trials."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

Z95 = 1.959964
"""The two-sided 95% quantile of the normal distribution."""

MEAN_ABS_TO_SIGMA = math.sqrt(math.pi / 2)
"""A normal spread's sigma over its mean absolute deviation: the noise floor is a mean |deviation|."""
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
_T975 |= {10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t_quantile(dof: int) -> float:
    """Student's t 97.5% quantile for `dof` degrees of freedom (the table's next lower entry, which
    errs wide; 1.96 beyond it)."""
    if dof < 1:
        return _T975[1]
    known = [d for d in _T975 if d <= dof]
    return _T975[max(known)] if dof <= max(_T975) else Z95


def sigma_of_interval(step: float, lo: float, hi: float) -> float:
    """The relative one-sigma of a 95% interval [lo, hi] around `step` (NaN where it is not one)."""
    if not (step > 0) or math.isnan(lo) or math.isnan(hi) or hi < lo:
        return math.nan
    return (hi - lo) / 2 / Z95 / step


def rms(values: Iterable[float]) -> float:
    """The root mean square (0 for no values)."""
    values = np.asarray(list(values), dtype=float)
    return float(np.sqrt(np.mean(values**2))) if values.size else 0.0


def pooled_log_spread(groups: Iterable[Sequence[float]]) -> tuple[float | None, int]:
    """The relative sigma of repeated measurements of the same work, pooled over groups (each group one
    config measured several times), and its degrees of freedom (the repeats less one per group): the
    sample sd of ln(step) about each group's mean. None with no repeats."""
    squares, dof = 0.0, 0
    for group in groups:
        logs = [math.log(x) for x in group if x > 0 and math.isfinite(x)]
        if len(logs) < 2:
            continue
        mean = sum(logs) / len(logs)
        squares += sum((v - mean) ** 2 for v in logs)
        dof += len(logs) - 1
    return (math.sqrt(squares / dof), dof) if dof else (None, 0)
