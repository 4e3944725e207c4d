"""How much a predicted step leans on the few trials behind it: the variance of the fitted line at a
micro-batch, in units of one trial's own noise.

The time model (advisor.model.step_time) fits each group's compute per micro-step (ZeRO stage, precision,
offload) as a line in the micro-batch: a line of its own where the group ran at two or more micro-batches,
else the group's trials and the slope the other groups share. A prediction between two measured
micro-batches is about as sure as one of their trials; one beyond them carries the slope's error once more
for every span it reaches out: micro-batch 8 from trials at 1 and 4 is 3-4x as uncertain (in variance) as
one of those trials. Unscaled, an extrapolated check's large error would size the intervals of configs
that sit between measured points, where the fit is much surer (docs/calibration/advisor-rounds.md).

So each held-out error is scaled by the variance its prediction had (`relative_variance` of the fit it
came from, plus one for the held-out trial's own noise) before the errors size the fit's spread, and each
unmeasured config's interval is that spread times the square root of its own relative variance under the
final fit (advisor.model.uncertainty).

A trial's noise is taken as relative (its sigma a fixed share of its step), so the lines are weighted
least squares with weights 1/step^2, and the variance is relative to the line's value at the micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

Group = tuple[int, str, str]
"""(ZeRO stage, precision, offload): the time model's groups."""
Point = tuple[float, float]
"""(micro-batch, measured seconds per micro-step) of one trial."""


def group_of(row: Mapping) -> Group:
    offload = row.get("offload", "none")
    offload = "none" if offload is None or (isinstance(offload, float) and np.isnan(offload)) else offload
    precision = row["precision"] if "precision" in row else row["dtype"]
    return (int(row["zero_stage"]), str(precision), str(offload))


@dataclass(frozen=True)
class FitPoints:
    """The trials a fit rests on, as points per group."""

    groups: Mapping[Group, tuple[Point, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, trials: pd.DataFrame, only: Iterable[str] | None = None) -> FitPoints:
        """The ok trials of `trials` (those whose trial_id is in `only`, when given), the last row of each
        trial_id (a trial run again replaces its first row, as in the fit)."""
        if trials.empty or "micro_batch" not in trials:
            return cls({})
        from advisor.model.step_time import measured_step_s

        rows = trials[trials["status"] == "ok"] if "status" in trials else trials
        if "trial_id" in rows:
            rows = rows.drop_duplicates("trial_id", keep="last")
            if only is not None:
                rows = rows[rows["trial_id"].astype(str).isin(set(only))]
        accum = pd.to_numeric(rows["grad_accum"], errors="coerce") if "grad_accum" in rows else 1.0
        per_micro = (measured_step_s(rows) / accum).to_numpy(dtype=float)
        groups: dict[Group, list[Point]] = {}
        for row, seconds in zip(rows.to_dict("records"), per_micro, strict=True):
            if seconds > 0:
                groups.setdefault(group_of(row), []).append((float(row["micro_batch"]), float(seconds)))
        return cls({g: tuple(points) for g, points in groups.items()})

    def relative_variance(self, group: Group, micro_batch: float) -> float | None:
        """Var(the fitted line at `micro_batch`) / (sigma x its value)^2, sigma a trial's relative noise;
        None when no trial of the group is in the fit (its costs are borrowed, not fitted)."""
        points = self.groups.get(group)
        if not points:
            return None
        m, y = np.array([p[0] for p in points]), np.array([p[1] for p in points])
        w = 1.0 / y**2
        if len(np.unique(m)) >= 2:  # its own line
            design = np.column_stack([np.ones_like(m), m])
            info = design.T @ (design * w[:, None])
            coef = np.linalg.solve(info, design.T @ (w * y))
            x = np.array([1.0, micro_batch])
            value = float(x @ coef)
            variance = float(x @ np.linalg.solve(info, x))
        else:  # its trials for the level, the shared slope for the rest
            centre, level = float(np.average(m, weights=w)), float(np.average(y, weights=w))
            slope, spread = self._shared_slope(group[1])
            if spread > 0:
                value = level + slope * (micro_batch - centre)
                variance = 1.0 / w.sum() + (micro_batch - centre) ** 2 / spread
            else:  # no slope anywhere: compute taken as proportional to the micro-batch
                value = level * micro_batch / centre
                variance = (micro_batch / centre) ** 2 / w.sum()
        return variance / value**2 if value > 0 else None

    def _shared_slope(self, precision: str) -> tuple[float, float]:
        """The pooled within-group slope of the groups of `precision` measured at two or more
        micro-batches, and its weighted spread of micro-batches (0: none)."""
        across, spread = 0.0, 0.0
        for (_, p, _), points in self.groups.items():
            m, y = np.array([q[0] for q in points]), np.array([q[1] for q in points])
            if p != precision or len(np.unique(m)) < 2:
                continue
            w = 1.0 / y**2
            dm = m - np.average(m, weights=w)
            across += float(np.sum(w * dm * (y - np.average(y, weights=w))))
            spread += float(np.sum(w * dm**2))
        return (across / spread if spread > 0 else 0.0), spread
