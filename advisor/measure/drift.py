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

`noise_floor` is the reference's repeat spread: the mean |r_i / median(r) - 1| over its brackets, which is
what a model with no error at all would show as its mean absolute error against single uncorrected trials
on this machine. `corrected_floor` is what is left after the correction: each inner bracket predicted from
its neighbours by the same interpolation.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

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


@dataclass
class Drift:
    """The reference's brackets of one setup, in the order measured."""

    reference: str = ""
    setup: str = ""
    brackets: list[Bracket] = field(default_factory=list)

    def clean(self) -> list[Bracket]:
        valid = [b for b in self.brackets if not b.contended and b.step_s > 0]
        return sorted(valid, key=lambda b: b.at)

    @property
    def base_s(self) -> float | None:
        clean = self.clean()
        return clean[0].step_s if clean else None

    def jumps(self) -> list[float]:
        clean = self.clean()
        return [abs(b.step_s / a.step_s - 1) for a, b in zip(clean, clean[1:], strict=False)]

    def correction_at(self, at: float | None) -> Correction:
        clean = self.clean()
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
        return (
            f"drift: the reference {self.reference} measured {len(clean)} times, at {min(factors):.2f}-"
            f"{max(factors):.2f}x its first speed (repeat spread {floor:.1%}); trials corrected for it"
        )

    # ---------------------------------------------------------------------------------------------- JSON

    def to_json(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        clean = self.clean()
        base = self.base_s
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
                {"at": _iso(b.at), "at_s": b.at, "factor": b.step_s / base if base else None} for b in clean
            ],
            "brackets": [{**asdict(b), "at_iso": _iso(b.at)} for b in self.brackets],
            "line": self.summary_line(),
            **(extra or {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Drift:
        fields = {f for f in Bracket.__dataclass_fields__}
        brackets = [Bracket(**{k: v for k, v in b.items() if k in fields}) for b in data.get("brackets", [])]
        return cls(str(data.get("reference", "")), str(data.get("setup", "")), brackets)


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
