"""The machine's own drift, measured while the trials run: a reference config re-measured between them.

On a shared machine the same work runs faster in one minute than in the next (bench/testbed_noise.py:
two 10-step trials of the same work minutes apart differ by a median 11-14% on the 2-vCPU test machine,
with no steal time to show it). A trial measured in a slow minute then looks like a slow config. So one
config, the *reference* (the search's first seed), is measured again every few trials: these *brackets*
give the machine's speed over time, r(t), the reference's median step at each bracket. A trial measured
at time t, between brackets i and i+1, ran on a machine r(t)/r_base times as slow as at the first
bracket (r linearly interpolated between the brackets); dividing its step time by that *drift factor*
puts every trial on the first bracket's machine, so configs measured minutes apart compare as if side by
side.

The correction has its own uncertainty: the brackets' own intervals, and between two brackets that
disagree, where in the gap the speed changed (half the jump). A trial after the last bracket takes that
bracket's speed, with the typical jump between brackets as its uncertainty, until the next bracket
closes its gap. Trials whose gap jumped by more than DRIFT_RERUN_JUMP are run again (once) when the
budget allows (advisor.measure.runner).

One reference measured once per bracket carries its own noise into every trial near it: on the test
machine a bracket was once 0.109 s where the reference's other brackets and two grid runs around it
measured 0.13-0.18 s, and every trial of that run was "corrected" by up to 1.6x for a drift the other
configs measured twice in the same minutes did not show (advisor accuracy bench, round 5). So the
timeline is fitted to every repeat the run has: the reference's brackets and each other config measured
more than once (a trial run again for drift, a duel's legs), as one penalised least-squares problem in
ln(step) (`fit_timeline`): each measurement is its config's own speed times the machine's slowness at its
time, that slowness piecewise linear between the brackets, its changes penalised as a random walk whose
weight leave-one-out chooses. A jump that a later bracket or a repeat confirms is followed (the
brackets' interpolation, as before); a jump nothing confirms is shrunk towards a steady machine.

`noise_floor` is the reference's repeat spread: the mean |r_i / median(r) - 1| over its brackets, which is
what a model with no error at all would show as its mean absolute error against single uncorrected trials
on this machine. `corrected_floor` is what is left after the correction: each inner bracket predicted from
its neighbours by the same interpolation.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from advisor.measure.duel import Z95
from sdzero.atomic import write_json_atomic

DRIFT_RERUN_JUMP = 0.20
"""A gap between two brackets whose reference moved by more than this fraction: the trials in it were
measured on a machine of unknown speed, and are run again once (when the budget allows)."""
DRIFT_SCHEMA = 1


@dataclass(frozen=True)
class Bracket:
    """One measurement of the reference config."""

    at: float
    """Epoch seconds, the middle of its measured window."""
    step_s: float
    """Its median step, uncorrected."""
    lo_s: float
    hi_s: float
    contended: bool = False
    """Another process took the cores while it measured: not used for the drift."""
    trial_dir: str = ""

    @property
    def rel_halfwidth(self) -> float:
        if not (self.step_s > 0) or math.isnan(self.lo_s) or math.isnan(self.hi_s):
            return 0.0
        return (self.hi_s - self.lo_s) / 2 / self.step_s


@dataclass(frozen=True)
class Correction:
    factor: float
    """The machine's slowness at the trial's time against the first bracket's: divide times by it."""
    uncertainty: float
    """Relative uncertainty of the factor (one side), combined with the trial's own interval."""
    bracketed: bool
    """Whether a bracket after the trial closed its gap (else the factor is the last bracket's)."""
    jump: float = 0.0
    """|r_after / r_before - 1| of the trial's gap (0 outside a closed gap)."""


@dataclass(frozen=True)
class Repeat:
    """A clean measurement (raw median step) of a config other than the reference, one of two or more
    of that config: evidence on the machine's speed between the times it measured."""

    trial_id: str
    at: float
    step_s: float


@dataclass
class Drift:
    """The reference's brackets of one setup, in the order measured, and the other configs' repeats."""

    reference: str = ""
    setup: str = ""
    brackets: list[Bracket] = field(default_factory=list)
    repeats: list[Repeat] = field(default_factory=list)

    def clean(self) -> list[Bracket]:
        valid = [b for b in self.brackets if not b.contended and b.step_s > 0]
        return sorted(valid, key=lambda b: b.at)

    def timeline(self) -> list[Bracket]:
        """The clean brackets with the machine's fitted slowness in place of the reference's own steps
        (the first bracket's step times the fitted factor; its interval scaled alike and widened by the
        fit's own uncertainty where the repeats leave residuals): what the correction interpolates."""
        clean = self.clean()
        fitted = fit_timeline(clean, self.repeats)
        if fitted is None:
            return clean
        base = clean[0].step_s
        out = []
        for b, factor, spread in zip(clean, fitted.factors, fitted.spreads, strict=True):
            half = math.hypot(b.rel_halfwidth, spread)
            step = base * factor
            out.append(Bracket(b.at, step, step * (1 - half), step * (1 + half), False, b.trial_dir))
        return out

    @property
    def base_s(self) -> float | None:
        clean = self.clean()
        return clean[0].step_s if clean else None

    def jumps(self) -> list[float]:
        line = self.timeline()
        return [abs(b.step_s / a.step_s - 1) for a, b in zip(line, line[1:], strict=False)]

    def correction_at(self, at: float | None) -> Correction:
        clean = self.timeline()
        if not clean or at is None or math.isnan(at):
            return Correction(1.0, 0.0, False)
        base = clean[0].step_s
        if at <= clean[0].at:
            return Correction(1.0, clean[0].rel_halfwidth, len(clean) > 1)
        for before, after in zip(clean, clean[1:], strict=False):
            if before.at <= at <= after.at:
                x = (at - before.at) / (after.at - before.at) if after.at > before.at else 0.0
                speed = before.step_s + x * (after.step_s - before.step_s)
                own = (1 - x) * before.rel_halfwidth + x * after.rel_halfwidth
                jump = abs(after.step_s / before.step_s - 1)
                where = abs(after.step_s - before.step_s) / 2 / speed  # the change fell somewhere in the gap
                return Correction(speed / base, math.hypot(own, where), True, jump)
        last = clean[-1]
        typical = statistics.median(self.jumps()) if len(clean) > 1 else 0.0
        return Correction(last.step_s / base, math.hypot(last.rel_halfwidth, typical), False)

    def noise_floor(self) -> float | None:
        """The reference's repeat spread: mean |r_i / median - 1| over the clean brackets."""
        times = [b.step_s for b in self.clean()]
        if len(times) < 2:
            return None
        middle = statistics.median(times)
        return statistics.fmean(abs(t / middle - 1) for t in times)

    def corrected_floor(self) -> float | None:
        """Mean |r_i / interpolated(r_{i-1}, r_{i+1}) - 1| over inner brackets: the drift left after the
        correction (needs three clean brackets)."""
        clean = self.clean()
        errors = []
        for before, mid, after in zip(clean, clean[1:], clean[2:], strict=False):
            x = (mid.at - before.at) / (after.at - before.at) if after.at > before.at else 0.5
            errors.append(abs(mid.step_s / (before.step_s + x * (after.step_s - before.step_s)) - 1))
        return statistics.fmean(errors) if errors else None

    def summary_line(self) -> str:
        """One line for the answer: how much the machine drifted, and its noise floor."""
        clean = self.clean()
        if len(clean) < 2:
            return (
                f"drift: the reference {self.reference or '(none)'} was measured {len(clean)} time(s); "
                "no drift measured, trials uncorrected"
            )
        factors = [b.step_s / clean[0].step_s for b in clean]
        floor = self.noise_floor() or 0.0
        line = (
            f"drift: the reference {self.reference} measured {len(clean)} times, at {min(factors):.2f}-"
            f"{max(factors):.2f}x its first step time (repeat spread {floor:.1%}); trials corrected for it"
        )
        counts = Counter(r.trial_id for r in self.repeats)
        others = [trial for trial, n in counts.items() if n > 1]
        fitted = fit_timeline(clean, self.repeats)
        if fitted is not None:
            with_others = f" and {len(others)} other config(s) measured more than once" if others else ""
            line += (
                f", by a timeline fitted to its brackets{with_others}: the machine at "
                f"{min(fitted.factors):.2f}-{max(fitted.factors):.2f}x (smoothing {fitted.smoothing:g}, "
                f"chosen by leave-one-out; a left-out measurement predicted within {fitted.loo_error:.1%})"
            )
        return line

    # ---------------------------------------------------------------------------------------------- JSON

    def to_json(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        clean = self.clean()
        base = self.base_s
        fitted = fit_timeline(clean, self.repeats)
        return {
            "schema": DRIFT_SCHEMA,
            "reference": self.reference,
            "setup": self.setup,
            "noise_floor": self.noise_floor(),
            "corrected_floor": self.corrected_floor(),
            "largest_jump": max(self.jumps(), default=None),
            "base_step_s": base,
            "reference_step_s": [b.step_s for b in clean],
            "series": [
                {
                    "at": _iso(b.at),
                    "at_s": b.at,
                    "factor": b.step_s / base if base else None,
                    "fitted_factor": line.step_s / base if base else None,
                }
                for b, line in zip(clean, self.timeline(), strict=True)
            ],
            "brackets": [{**asdict(b), "at_iso": _iso(b.at)} for b in self.brackets],
            "repeats": [asdict(r) for r in self.repeats],
            "timeline": None
            if fitted is None
            else {"smoothing": fitted.smoothing, "loo_error": fitted.loo_error},
            "line": self.summary_line(),
            **(extra or {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Drift:
        fields = {f for f in Bracket.__dataclass_fields__}
        brackets = [Bracket(**{k: v for k, v in b.items() if k in fields}) for b in data.get("brackets", [])]
        repeats = [
            Repeat(str(r["trial_id"]), float(r["at"]), float(r["step_s"])) for r in data.get("repeats", [])
        ]
        return cls(str(data.get("reference", "")), str(data.get("setup", "")), brackets, repeats)


def _knot_weights(knots: Sequence[float], at: float) -> np.ndarray:
    """The machine's log-slowness at `at` as weights on its values at the knots: linear between two,
    the end knot's value outside them."""
    w = np.zeros(len(knots))
    if at <= knots[0]:
        w[0] = 1.0
    elif at >= knots[-1]:
        w[-1] = 1.0
    else:
        k = int(np.searchsorted(knots, at, side="right")) - 1
        span = knots[k + 1] - knots[k]
        x = (at - knots[k]) / span if span > 0 else 0.0
        w[k], w[k + 1] = 1.0 - x, x
    return w


SMOOTHING_CHOICES = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0)
"""Candidates for the ratio of one measurement's noise variance to one gap's drift variance: 0.01 follows
every bracket (the brackets' interpolation), 100 calls their differences noise about a steady machine.
`fit_timeline` picks the one that predicts each left-out measurement best."""


@dataclass(frozen=True)
class Timeline:
    """The machine's fitted slowness at each clean bracket."""

    factors: list[float]
    """Against the first bracket (1.0 there)."""
    spreads: list[float]
    """Relative 95% uncertainty of each factor (0 at the first: the base it is measured against)."""
    smoothing: float
    """The SMOOTHING_CHOICES value leave-one-out picked."""
    loo_error: float
    """RMS of ln(measured / predicted) over the left-out measurements at that smoothing."""


def fit_timeline(brackets: Sequence[Bracket], repeats: Sequence[Repeat]) -> Timeline | None:
    """The machine's slowness over time, fitted to the reference's brackets and the other configs' repeats.

    ln(step_i) = ln(speed of i's config) + L(t_i): L piecewise linear between the brackets' times, 0 at the
    first, and a penalty `smoothing` x sum (L_k - L_{k-1})^2 (a random-walk prior on the drift, in units
    of one measurement's noise). The smoothing is the SMOOTHING_CHOICES value whose fits, each without
    one measurement inside the bracketed span, predict the left-out ones best (a tie goes to the least
    smoothing: the brackets as measured), so the data decide whether a bracket that jumped was the
    machine or the bracket: a jump the next bracket or a repeat confirms is followed, one nothing
    confirms is shrunk. The factors' uncertainty is the fit's posterior spread with
    the left-out error as one measurement's noise. None with nothing to leave out (fewer than three
    brackets and no repeat between the first and the last): the brackets' own steps are then the
    timeline."""
    return _fit_timeline(tuple(brackets), tuple(repeats))


@functools.lru_cache(maxsize=64)
def _fit_timeline(brackets: tuple[Bracket, ...], repeats: tuple[Repeat, ...]) -> Timeline | None:
    """fit_timeline's body, cached: a correction asks for the same fit once per row."""
    knots = [b.at for b in brackets]
    groups: dict[str, list[Repeat]] = {}
    for r in repeats:
        if r.step_s > 0 and math.isfinite(r.at):
            groups.setdefault(r.trial_id, []).append(r)
    repeated = [g for g in groups.values() if len(g) > 1]
    if len(knots) < 2 or (len(knots) < 3 and not repeated):
        return None
    n, width = len(knots), len(knots) + len(repeated)  # L_1..L_{n-1}, then one speed per config
    rows, logs, times_of = [], [], []
    for config, measured in enumerate(
        [[(b.at, b.step_s) for b in brackets]] + [[(r.at, r.step_s) for r in g] for g in repeated]
    ):
        for at, step_s in measured:
            row = np.zeros(width)
            row[: n - 1] = _knot_weights(knots, at)[1:]  # L at the first bracket is 0: the base
            row[n - 1 + config] = 1.0
            rows.append(row)
            logs.append(math.log(step_s))
            times_of.append(at)
    a, y = np.array(rows), np.array(logs)
    penalty = np.zeros((n - 1, width))
    for k in range(n - 1):  # L_{k+1} - L_k, with L_0 = 0
        penalty[k, k] = 1.0
        if k:
            penalty[k, k - 1] = -1.0

    def solve(smoothing: float, keep: np.ndarray) -> np.ndarray:
        lhs = np.vstack([a[keep], math.sqrt(smoothing) * penalty])
        rhs = np.concatenate([y[keep], np.zeros(n - 1)])
        return np.linalg.lstsq(lhs, rhs, rcond=None)[0]

    # Left out in turn: the measurements strictly inside the bracketed span. Outside it the timeline
    # holds its end value whatever the smoothing, so they would score every choice alike.
    times = np.array(times_of)
    inner = [i for i in range(len(y)) if knots[0] < times[i] < knots[-1]]
    if not inner:
        return None

    def loo(smoothing: float) -> float:
        errors = []
        for i in inner:
            keep = np.arange(len(y)) != i
            errors.append(y[i] - a[i] @ solve(smoothing, keep))
        return float(np.sqrt(np.mean(np.square(errors))))

    scores = {smoothing: loo(smoothing) for smoothing in SMOOTHING_CHOICES}
    best = min(scores.values())
    smoothing = min(s for s, score in scores.items() if score <= best * (1 + 1e-9) + 1e-12)
    solution = solve(smoothing, np.ones(len(y), dtype=bool))
    precision = a.T @ a + smoothing * penalty.T @ penalty
    cov = scores[smoothing] ** 2 * np.linalg.inv(precision)
    levels = np.concatenate([[0.0], solution[: n - 1]])
    spreads = np.concatenate([[0.0], np.sqrt(np.clip(np.diag(cov)[: n - 1], 0.0, None))])
    return Timeline(
        [math.exp(v) for v in levels], [Z95 * float(v) for v in spreads], smoothing, scores[smoothing]
    )


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="seconds")


def read_drift(path: Path, setup: str) -> Drift:
    """The brackets an earlier run of this setup recorded in `path`; an empty Drift otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return Drift(setup=setup)
    if not isinstance(data, dict) or data.get("schema") != DRIFT_SCHEMA or data.get("setup") != setup:
        return Drift(setup=setup)
    return Drift.from_json(data)


def write_drift(path: Path, drift: Drift, extra: dict[str, Any] | None = None) -> None:
    write_json_atomic(Path(path), drift.to_json(extra))


def corrected_interval(
    raw_s: float, raw_lo_s: float, raw_hi_s: float, correction: Correction, contended_share: float = 0.0
) -> tuple[float, float, float]:
    """(median, lo, hi) of one trial on the first bracket's machine: its own interval and the
    correction's uncertainty combined (each side in quadrature); a contended trial's lower end also
    allows for the share of the cores it lost (it would have run up to that much faster alone)."""
    step = raw_s / correction.factor
    below = (raw_s - raw_lo_s) / raw_s if raw_s > 0 and not math.isnan(raw_lo_s) else 0.0
    above = (raw_hi_s - raw_s) / raw_s if raw_s > 0 and not math.isnan(raw_hi_s) else 0.0
    below = math.hypot(below, correction.uncertainty) + max(contended_share, 0.0)
    above = math.hypot(above, correction.uncertainty)
    return step, step * max(1 - below, 0.0), step * (1 + above)


def gap_trials(drift: Drift, measured_at: Sequence[tuple[str, float]], jump: float) -> list[str]:
    """trial_ids measured inside a closed gap whose reference moved by more than `jump`."""
    out = []
    for trial_id, at in measured_at:
        c = drift.correction_at(at)
        if c.bracketed and c.jump > jump:
            out.append(trial_id)
    return out
