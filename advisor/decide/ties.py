"""The tie rule: which config to run among those the machine cannot tell apart.

A **tie** is a difference the measurements cannot resolve: two configs are tied when the 95% interval of
their difference, from their measurement noise alone, holds zero. A measured config brings its trial's
interval; one nobody ran brings the typical trial's (what measuring it would give). The fit's spread is
left out on purpose: a config the model knows little about is not "as good as" the fastest, it is
unknown, and the fastest prediction is still the best bet (its interval says how far to trust it). The
machine's drift is left out too: configs of one launch were measured side by side, interleaved, and
launches are put on one machine speed by their tie (advisor.measure.launch). The difference's interval is
tighter than asking whether two intervals overlap, which calls ties up to 1.4x the difference's own
half-width. One exception: an unmeasured config whose interval holds work the model cannot price (a
ZeRO-3 config predicted from ZeRO-1/2 trials, advisor.model.step_time.unmeasured_handling_s) ties with
every measured config its interval reaches, so measured evidence decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

SIMILAR_MEMORY = 0.10
"""Tied configs whose memory per rank is within this fraction of the device's usable memory (the
predictions' `usable_bytes`) above the least count as needing the same memory: they leave the same
headroom in practice, and the faster-predicted one should not lose for a saving the run cannot use.
Without the usable memory: this fraction of the least."""


def is_tie(a: pd.Series, b: pd.Series) -> bool:
    """Whether two configs' throughputs cannot be told apart: the 95% interval of their difference holds
    zero (each side's comparison half-width, in quadrature)."""
    fa, fb = float(a["samples_per_s"]), float(b["samples_per_s"])
    if not (fa > 0 and fb > 0):
        return False
    ha, hb = _halfwidth(a), _halfwidth(b)
    return abs(math.log(fa / fb)) <= math.hypot(ha, hb)


def _within_unpriced(measured: pd.Series, unmeasured: pd.Series) -> bool:
    """Whether a measured config lies inside the interval of an unmeasured one whose interval holds work
    the model cannot price (predictions' `unmeasured_s`, advisor.model.step_time.unmeasured_handling_s):
    its figure is then no better evidence than the measurement, and the two count as tied."""
    if not is_measured(measured) or is_measured(unmeasured) or _value(unmeasured, "unmeasured_s") <= 0:
        return False
    low = _value(unmeasured, "samples_per_s_lo")
    return low > 0 and float(measured["samples_per_s"]) >= low


def _value(row: pd.Series, column: str) -> float:
    value = row.get(column, 0.0)
    return 0.0 if value is None or pd.isna(value) else float(value)


def _halfwidth(row: pd.Series) -> float:
    return _value(row, "compare_halfwidth")


TIE_RULE = (
    "a tie (their difference within noise) goes to a measured config, then to the least memory per rank "
    f"(configs within "
    f"{SIMILAR_MEMORY:.0%} of the device's usable memory of it count as equal), then the simpler ZeRO "
    "stage, then the faster prediction"
)


@dataclass(frozen=True)
class Pick:
    """The config chosen among those that fit at one node count."""

    row: pd.Series
    fastest: pd.Series
    """The fastest predicted config (the pick unless a tie was broken)."""
    tied: list[str]
    """config_ids tied with the fastest (the fastest included); one id when there was no tie."""
    measured_tied: bool = False
    """Whether a measured config was among the tied (the pick is then one of them)."""

    @property
    def unmeasured(self) -> bool:
        """The pick is a config no trial measured: no measured config is within noise of it."""
        return not is_measured(self.row)

    @property
    def broke_tie(self) -> bool:
        return str(self.row["config_id"]) != str(self.fastest["config_id"])

    def describe(self) -> str:
        if len(self.tied) < 2:
            return ""
        others = [c for c in self.tied if c != str(self.row["config_id"])]
        verb = "chosen over the faster-predicted" if self.broke_tie else "tied with"
        how = "within noise"
        if self.broke_tie and not is_tie(self.row, self.fastest):
            how = "inside its interval, which holds work no trial measured"
        return f"{self.row['config_id']} {verb} {', '.join(others)} {how}: {TIE_RULE}"


def _memory_scale(rows: pd.DataFrame, least: float) -> float:
    """What memory differences are measured against (SIMILAR_MEMORY): the device's usable bytes where the
    predictions carry them (never less than the least config's own), else the least config's memory."""
    if "usable_bytes" not in rows:
        return least
    usable = pd.to_numeric(rows["usable_bytes"], errors="coerce").max()
    return max(float(usable), least) if pd.notna(usable) else least


def is_measured(row: pd.Series) -> bool:
    """Whether a trial pinned the config (advisor.model.uncertainty.add_intervals' `interval_source`);
    predictions without the column (an older folder) count every config as measured, as they did."""
    source = row.get("interval_source")
    return source is None or pd.isna(source) or str(source) == "measured"


def pick_config(rows: pd.DataFrame) -> Pick:
    """The config to run among `rows` (those that fit at one node count): the fastest, unless others tie
    with it, when TIE_RULE decides among the tied. A config measured only under contention is left out
    while another fits: its step was the machine's, not the config's. Measured evidence decides a tie
    first: a config nobody ran is recommended over a measured one only when none is within noise of it
    (its figures are the model's, which can miss a stage's own costs by more than any interval says)."""
    if "contended" in rows and not rows["contended"].fillna(False).astype(bool).all():
        rows = rows[~rows["contended"].fillna(False).astype(bool)]
    fastest = rows.loc[rows["samples_per_s"].astype(float).idxmax()]
    tied = rows[[is_tie(r, fastest) or _within_unpriced(r, fastest) for _, r in rows.iterrows()]]
    if len(tied) < 2:
        return Pick(fastest, fastest, [str(fastest["config_id"])], is_measured(fastest))
    ids = [str(c) for c in tied.sort_values("samples_per_s", ascending=False)["config_id"]]
    measured = tied[[is_measured(r) for _, r in tied.iterrows()]]
    if not measured.empty:
        tied = measured
    least = float(tied["mem_per_rank_bytes"].min())
    similar = least + SIMILAR_MEMORY * _memory_scale(tied, least)
    light = tied[tied["mem_per_rank_bytes"].astype(float) <= similar]
    ordered = light.sort_values(["zero_stage", "samples_per_s"], ascending=[True, False])
    return Pick(ordered.iloc[0], fastest, ids, not measured.empty)
