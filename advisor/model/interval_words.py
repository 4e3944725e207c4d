"""The words for a figure's 95% interval: a range in the fewest significant figures that tell its ends
apart, in the unit the figure reads in, or words instead of a figure where the interval spans more than
the figure itself. Every floor that words an answer uses them (advisor.decide.outcome's verdict, the
terminal and the pages), so they live below all of them."""

from __future__ import annotations

import math

from advisor.model.time_to_train import HOUR_S

NOT_MEASURED_WELL = "not measured well enough"
"""What a figure is whose 95% interval spans more than the figure itself: no figure a person can act on."""
MEASURE_AGAIN = "run again on a quiet machine or raise --budget-minutes"
TOO_WIDE = f"{NOT_MEASURED_WELL}: {MEASURE_AGAIN}"


def too_wide(value: float, lo: float, hi: float) -> bool:
    """Whether an interval spans more than its figure (or reaches zero): the figure is then no figure."""
    return not lo > 0 or hi - lo > value


def significant(value: float, digits: int) -> str:
    """`value` to `digits` significant figures, in plain decimals (1200, 3.4, 0.052; never 1.2e+03)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    places = digits - 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, places)
    return f"{rounded:,.{max(places, 0)}f}"


def range_text(lo: float, hi: float, unit: str = "") -> str:
    """'2.9-3.4 min': two bounds in one unit, to the fewest significant figures (2 to 4) that tell them
    apart."""
    for digits in (2, 3, 4):
        a, b = significant(lo, digits), significant(hi, digits)
        if a != b:
            break
    shown = a if a == b else f"{a}-{b}"  # an interval of no width (nothing to spread it): the figure
    return shown + (f" {unit}" if unit else "")


def duration_unit(seconds: float) -> tuple[str, float]:
    """The unit advisor.model.time_to_train.hours gives `seconds`, and seconds per unit."""
    if seconds < HOUR_S:
        return "min", 60.0
    if seconds < 96 * HOUR_S:
        return "h", HOUR_S
    return "days", 24 * HOUR_S


def duration_range(seconds: float, lo: float, hi: float) -> str:
    """'2.9-3.4 min': a time's interval in the unit the time itself reads in."""
    unit, per = duration_unit(seconds)
    return range_text(lo / per, hi / per, unit)
