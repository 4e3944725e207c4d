"""A duel: two configs the search cannot tell apart, measured again in pairs, A B B A, close in time.

Two trials measured minutes apart carry the machine's drift between them, and the brackets correct
that only as well as the reference's speed follows theirs (on the test machine the reference and a
larger config measured in the same minutes moved by different amounts). So when the two fastest
configs are within each other's intervals (advisor.model.search.contenders), they are measured again
back to back in the order A B B A: each adjacent pair shares its minute, and a drift that is linear over
the four legs cancels from the mean of the two pairs' ratios (it slows the second leg of the first pair
as much as the first leg of the second).

What the duel gives:
- `log_ratio`: ln(step_A / step_B) from the legs' raw medians, each config's level fitted beside a drift
  line over the legs' times (`paired`; not the brackets' correction: the legs ran within a few minutes,
  and the line is fitted to them, not to another config);
- `rate_log_ratio`: ln(throughput_A / throughput_B), the figure the verdict is on: the two configs may
  take different batches a step (micro-batch 8 against 4), and then a longer step can be the faster one;
- `halfwidth`: its 95% half-width, from the legs' own intervals and how far the legs strayed from the
  line (one degree of freedom with four legs: a rough figure, added to the legs' own noise, not
  instead of it);
- each config's pooled measurement: the geometric mean of its legs, whose interval holds the legs' own
  noise and the spread between them; it replaces the config's row in trials.csv, so the fit and the
  intervals use all the duel measured.

advisor.model.uncertainty then calls the two a tie, or not, from the duel's interval alone.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdzero.atomic import write_json_atomic

Z95 = 1.959964
"""The two-sided 95% quantile of the normal distribution (advisor.model.uncertainty uses this one too)."""
DUEL_ORDER = (0, 1, 1, 0)
"""A B B A: the legs' order, indexes into the duel's two configs."""
DUEL_SCHEMA = 1
DUEL_FILE = "duel.json"
"""Beside drift.json: the duels of the setup."""
POOLED_NOTE = "duel legs"
"""In the notes of a config's row pooled from its duel legs (not a measurement of its own)."""
POOLED_STOP = "duel"
"""That row's `stopped_by`: its interval is the legs' pooled one, not one trial's stop rule."""


@dataclass(frozen=True)
class Leg:
    """One measurement of a duel: its raw median step and 95% interval, and when it measured."""

    trial_id: str
    step_s: float
    lo_s: float
    hi_s: float
    at: float

    @property
    def sigma(self) -> float:
        """Relative one-sigma of the median (0 when the leg had no interval)."""
        if not (self.step_s > 0) or math.isnan(self.lo_s) or math.isnan(self.hi_s):
            return 0.0
        return (self.hi_s - self.lo_s) / 2 / self.step_s / Z95


@dataclass(frozen=True)
class Pooled:
    """One config's legs pooled: the geometric mean, a relative sigma, the mean time."""

    step_s: float
    sigma: float
    at: float
    legs: int

    @property
    def lo_s(self) -> float:
        return self.step_s * max(1 - Z95 * self.sigma, 0.0)

    @property
    def hi_s(self) -> float:
        return self.step_s * (1 + Z95 * self.sigma)


def pool(legs: list[Leg]) -> Pooled:
    """The legs of one config as one measurement (see the module doc)."""
    logs = [math.log(leg.step_s) for leg in legs]
    k = len(legs)
    within = math.sqrt(sum(leg.sigma**2 for leg in legs)) / k
    between = statistics.stdev(logs) / math.sqrt(k) if k > 1 else 0.0
    at = statistics.fmean(leg.at for leg in legs)
    return Pooled(math.exp(statistics.fmean(logs)), math.hypot(within, between), at, k)


@dataclass(frozen=True)
class Duel:
    a: str
    b: str
    log_ratio: float
    """ln(step_a / step_b), drift line removed: > 0 when b is the faster."""
    halfwidth: float
    """95% half-width of log_ratio."""
    pairs: int
    legs: tuple[Leg, ...] = ()
    batch_log_ratio: float = 0.0
    """ln(samples a step of a / of b): 0 for configs with the same batch a step (duel files before it)."""

    @property
    def rate_log_ratio(self) -> float:
        """ln(throughput_a / throughput_b): > 0 when a is the faster. Its 95% half-width is `halfwidth`
        (the batches are exact; only the steps were measured)."""
        return self.batch_log_ratio - self.log_ratio

    @property
    def tied(self) -> bool:
        return abs(self.rate_log_ratio) <= self.halfwidth

    def line(self) -> str:
        faster, slower = (self.a, self.b) if self.rate_log_ratio > 0 else (self.b, self.a)
        gap = abs(self.rate_log_ratio)
        ratio, lo, hi = math.exp(gap), math.exp(gap - self.halfwidth), math.exp(gap + self.halfwidth)
        verdict = "within noise: a tie" if self.tied else f"{faster} is faster"
        return (
            f"duel: {self.a} and {self.b} measured again A B B A ({self.pairs} pairs): {faster} "
            f"{ratio:.3f}x the samples/s of {slower} (95% {lo:.3f}-{hi:.3f}), {verdict}"
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tied": self.tied, "line": self.line()}


def paired(a: str, b: str, legs: list[Leg], batch_ratio: float = 1.0) -> Duel:
    """The duel of `a` and `b` from its legs (in DUEL_ORDER): ln(step) fitted as each config's own level
    plus one drift line over the legs' times, by least squares. `batch_ratio`: samples a step of `a` over
    those of `b` (what turns the step ratio into the throughput ratio the verdict is on).

    A B B A with a drift that is linear over the four legs gives each config the same mean time, so the
    drift leaves their difference; the one residual degree of freedom left measures how far the machine
    strayed from a line, and that (as each leg's extra noise) with the legs' own intervals sizes the
    difference's interval. With fewer than four legs there is no drift line: only the legs' own noise."""
    y = np.log([leg.step_s for leg in legs])
    is_a = np.array([leg.trial_id == a for leg in legs], dtype=float)
    columns = [is_a, 1 - is_a]
    if len(legs) >= 4:
        t = np.array([leg.at for leg in legs], dtype=float)
        columns.append(t - t.mean())
    x = np.column_stack(columns)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    dof = len(legs) - x.shape[1]
    strayed = float(np.sum((y - x @ coef) ** 2) / dof) if dof > 0 else 0.0
    own = statistics.fmean(leg.sigma**2 for leg in legs)
    contrast = np.zeros(x.shape[1])
    contrast[:2] = (1.0, -1.0)
    variance = float(contrast @ np.linalg.pinv(x.T @ x) @ contrast) * (own + strayed)
    return Duel(
        a,
        b,
        float(coef[0] - coef[1]),
        Z95 * math.sqrt(variance),
        len(legs) // 2,
        tuple(legs),
        math.log(batch_ratio),
    )


def write_duels(path: Path, setup: str, duels: list[Duel]) -> None:
    write_json_atomic(path, {"schema": DUEL_SCHEMA, "setup": setup, "duels": [d.to_json() for d in duels]})


def read_duels(path: Path, setup: str | None = None) -> list[Duel]:
    """The duels a run recorded, of `setup` when given (none for a missing, foreign or damaged file)."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("schema") != DUEL_SCHEMA or setup is not None and data.get("setup") != setup:
            return []
        return [
            Duel(
                str(d["a"]),
                str(d["b"]),
                float(d["log_ratio"]),
                float(d["halfwidth"]),
                int(d["pairs"]),
                tuple(Leg(**leg) for leg in d.get("legs", ())),
                float(d.get("batch_log_ratio", 0.0)),
            )
            for d in data["duels"]
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def pooled_log_spread(groups: Iterable[Sequence[float]]) -> tuple[float | None, int]:
    """The relative sigma of repeated measurements of the same work, pooled over groups (each group one
    config measured several times), and its degrees of freedom (the repeats less one per group): the
    sample sd of ln(step) about each group's mean. None with no repeats."""
    squares, dof = 0.0, 0
    for group in groups:
        logs = [math.log(x) for x in group if x > 0 and math.isfinite(x)]
        if len(logs) < 2:
            continue
        mean = statistics.fmean(logs)
        squares += sum((v - mean) ** 2 for v in logs)
        dof += len(logs) - 1
    return (math.sqrt(squares / dof), dof) if dof else (None, 0)


def repeat_groups(folder: Path) -> list[list[float]]:
    """Every repeat a run made of the same work, raw (uncorrected) median steps grouped by config: the
    reference's clean brackets (drift.json), and each config measured more than once (a duel's legs
    with the config's earlier trial, a trial run again for drift) from duel.json and the run's
    trials.csv. Contended trials and a duel's pooled rows are not measurements of their own."""
    folder = Path(folder)
    groups: list[list[float]] = []
    try:
        steps = json.loads((folder / "drift.json").read_text()).get("reference_step_s") or []
        groups.append([float(x) for x in steps])
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    by_trial: dict[str, list[float]] = {}
    for path in (folder / "profile" / "trials.csv", folder / "trials.csv"):
        if path.is_file():
            for trial, step in _clean_raw_steps(path):
                by_trial.setdefault(trial, []).append(step)
            break
    for duel in read_duels(folder / DUEL_FILE):
        for leg in duel.legs:
            by_trial.setdefault(leg.trial_id, []).append(leg.step_s)
    return groups + [steps for steps in by_trial.values() if len(steps) > 1]


def _clean_raw_steps(path: Path) -> list[tuple[str, float]]:
    """(trial_id, raw median step) of every clean measurement in a trials.csv, in file order."""
    from advisor.measure.trial_table import read_trials
    from sdzero.errors import UserError

    try:
        table = read_trials(path)
    except UserError:  # not the runner's table (an advise folder's own trials.csv): no repeats in it
        return []
    if table.empty or "step_s_raw" not in table:
        return []
    out = []
    for row in table.to_dict("records"):
        pooled = POOLED_NOTE in str(row.get("notes") or "")
        contended = str(row.get("contended")).lower() in ("true", "1")
        step = float(row["step_s_raw"]) if row.get("step_s_raw") is not None else math.nan
        if row.get("status") == "ok" and not pooled and not contended and step > 0:
            out.append((str(row["trial_id"]), step))
    return out
