"""The rules that choose the node count, one object each: the knee (the default), --nodes, --deadline-hours
and --max-gpu-hours. `node_rule` picks one from the options, once; afterwards every caller asks the rule
(what it chooses, how it words itself, how sure its choice is, what recommendation.json records of it) and
nothing else tells the rules apart.

Every rule carries the minimum efficiency: the scaling table marks its knee with it whichever rule chooses
(advisor.decide.scaling_table.scaling_table computes the knee, the only place that does); the rules read
that mark (`table_knee`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import pandas as pd

from advisor.decide.scaling_table import DEFAULT_MIN_EFFICIENCY, at_asked_batch
from sdzero.errors import UserError


def table_knee(table: pd.DataFrame) -> int | None:
    """The node count the scaling table marked as its knee; None: none keeps the minimum efficiency."""
    if "knee" not in table:
        return None
    marked = table.loc[table["knee"].astype(bool), "node_count"]
    return int(marked.iloc[0]) if not marked.empty else None


def _figure(row: pd.Series, column: str) -> tuple[float, float, float] | None:
    """(value, lo, hi) of one scaling-table figure; None where the row has no interval for it."""
    values = [
        pd.to_numeric(pd.Series([row.get(c)]), errors="coerce")[0]
        for c in (column, f"{column}_lo", f"{column}_hi")
    ]
    return None if any(pd.isna(v) for v in values) else tuple(float(v) for v in values)  # type: ignore[return-value]


def _range(figure: tuple[float, float, float]) -> str:
    """' (lo-hi)' of a percentage, or nothing where the interval has no width: a range of one value says
    nothing a reader can act on."""
    lo, hi = f"{figure[1]:.1%}", f"{figure[2]:.1%}"
    return "" if lo == hi else f" ({lo}-{hi})"


def _nodes(n: int) -> str:
    return f"{n} node{'s' if n != 1 else ''}"


@dataclass(frozen=True, kw_only=True)
class NodeRule(ABC):
    """How the node count is chosen (see the module doc)."""

    name: ClassVar[str]
    """The rule's name in recommendation.json's node_choice.rule_name."""
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY
    """The knee's bar: the scaling table marks its knee with it, whichever rule chooses."""

    @abstractmethod
    def describe(self, unit: str = "GPU-h") -> str:
        """The rule in words, for the answer's node_choice.rule."""

    @abstractmethod
    def choose(self, table: pd.DataFrame) -> tuple[int | None, str | None]:
        """(node count, why the rule could not be kept as asked, or None)."""

    @abstractmethod
    def confidence(self, table: pd.DataFrame, chosen: int) -> str:
        """How sure the choice is, in one line: whether the rule's bar falls inside the interval of the
        chosen count or of its neighbours, and which count would be sure where the choice is not."""

    @property
    def verdict_words(self) -> str:
        """How the verdict's closing names the rule ('node count by ...')."""
        return f"{self.name.replace('_', ' ')} rule"

    def record(self) -> dict[str, Any]:
        """What recommendation.json's node_choice keeps of the rule."""
        return {
            "rule_name": self.name,
            "min_efficiency": self.min_efficiency,
            "deadline_hours": None,
            "max_gpu_hours": None,
        }

    def knee_choice(self, table: pd.DataFrame) -> tuple[int | None, str | None]:
        """The knee; where none keeps the bar, the smallest node count, saying so."""
        ok = at_asked_batch(table)
        knee = table_knee(table)
        if knee is None and not ok.empty:
            first = int(ok["node_count"].min())
            return first, f"no node count keeps {self.min_efficiency:.0%} efficiency: the smallest is chosen"
        return knee, None


@dataclass(frozen=True, kw_only=True)
class EfficiencyRule(NodeRule):
    """The knee: the largest node count that keeps the minimum efficiency."""

    name: ClassVar[str] = "efficiency"

    def describe(self, unit: str = "GPU-h") -> str:
        return f"the largest node count keeping scaling efficiency >= {self.min_efficiency:.0%} (the knee)"

    def choose(self, table: pd.DataFrame) -> tuple[int | None, str | None]:
        return self.knee_choice(table)

    def confidence(self, table: pd.DataFrame, chosen: int) -> str:
        ok = at_asked_batch(table).set_index("node_count", drop=False)  # larger-batch rows are never chosen
        if chosen not in ok.index:
            return ""
        row = ok.loc[chosen]
        bar = self.min_efficiency
        own = _figure(row, "efficiency")
        larger = [int(n) for n in ok.index if int(n) > chosen]
        after = _figure(ok.loc[larger[0]], "efficiency") if larger else None
        if own is None:
            return ""
        keep = "keeps" if chosen == 1 else "keep"
        text = f"{_nodes(chosen)} {keep} {own[0]:.1%} efficiency{_range(own)}"
        if after is not None:
            text += f"; {_nodes(larger[0])} {after[0]:.1%}{_range(after)}"
        borderline = own[1] < bar or (after is not None and after[2] >= bar)
        # The same config at both counts: its compute cancels and the interval is the link's alone, which
        # an assumed preset does not have; zero width there is not certainty.
        unknown_link = own[1] == own[2] and "link assumed" in str(row.get("provenance", ""))
        caveat = (
            " (the intervals hold the link's spread alone, and the link is assumed: --hostfile measures it)"
        )
        if not borderline:
            where = "both intervals" if after is not None else "its interval, and no larger count was asked"
            return f"node count sure: {text}, the {bar:.0%} bar outside {where}" + (
                caveat if unknown_link else ""
            )
        which = larger[0] if after is not None and after[2] >= bar else chosen
        return f"node count borderline: {text}; the {bar:.0%} bar falls inside {_nodes(which)}' interval"


@dataclass(frozen=True, kw_only=True)
class FixedNodes(NodeRule):
    """--nodes N: that count, whatever the table says of it."""

    name: ClassVar[str] = "nodes"
    nodes: int

    def describe(self, unit: str = "GPU-h") -> str:
        return f"--nodes {self.nodes}"

    def choose(self, table: pd.DataFrame) -> tuple[int | None, str | None]:
        return self.nodes, None

    def confidence(self, table: pd.DataFrame, chosen: int) -> str:
        return ""  # the user's count: nothing to be sure of

    @property
    def verdict_words(self) -> str:
        return "--nodes"


@dataclass(frozen=True, kw_only=True)
class _LimitRule(NodeRule):
    """A rule that keeps one figure of the table within a limit (time to train, GPU-hours)."""

    column: ClassVar[str]
    """The scaling-table figure the limit is on."""
    unit: ClassVar[str]
    scale: ClassVar[float]
    """Of the figure to the limit's unit."""

    @property
    @abstractmethod
    def limit(self) -> float:
        """In the column's own unit."""

    @abstractmethod
    def pick(self, ok: pd.DataFrame) -> tuple[int, str | None]:
        """The choice among the timed rows at the asked batch."""

    @abstractmethod
    def sure_fallback(self, ok: pd.DataFrame, sure: list[int]) -> int:
        """Of the counts sure to keep the limit, the one to name."""

    def choose(self, table: pd.DataFrame) -> tuple[int | None, str | None]:
        ok = at_asked_batch(table)
        if ok.empty or "time_to_train_s" not in ok:  # no time to train: the knee
            return self.knee_choice(table)
        return self.pick(ok)

    def confidence(self, table: pd.DataFrame, chosen: int) -> str:
        ok = at_asked_batch(table).set_index("node_count", drop=False)
        if chosen not in ok.index:
            return ""
        limit, column, unit, scale = self.limit, self.column, self.unit, self.scale
        own = _figure(ok.loc[chosen], column)
        if own is None:
            return ""
        text = f"{_nodes(chosen)}: {own[0] * scale:.3g} {unit} ({own[1] * scale:.3g}-{own[2] * scale:.3g})"
        if own[2] <= limit:
            return f"node count sure: {text}, within {limit * scale:g} {unit} even at the interval's slow end"
        sure = [int(n) for n in ok.index if (f := _figure(ok.loc[n], column)) is not None and f[2] <= limit]
        fallback = f"; {_nodes(self.sure_fallback(ok, sure))} would be sure" if sure else ""
        return f"node count not sure: {text}, the {limit * scale:g} {unit} limit falls inside its interval{fallback}"


@dataclass(frozen=True, kw_only=True)
class DeadlineRule(_LimitRule):
    """--deadline-hours: the fewest GPU-hours among the counts that finish in time."""

    name: ClassVar[str] = "deadline"
    column: ClassVar[str] = "time_to_train_s"
    unit: ClassVar[str] = "h"
    scale: ClassVar[float] = 1 / 3600
    hours: float

    @property
    def limit(self) -> float:
        return self.hours * 3600

    def describe(self, unit: str = "GPU-h") -> str:
        return f"the fewest {unit} that finish within --deadline-hours {self.hours:g}"

    def record(self) -> dict[str, Any]:
        return super().record() | {"deadline_hours": self.hours}

    def pick(self, ok: pd.DataFrame) -> tuple[int, str | None]:
        seconds = pd.to_numeric(ok["time_to_train_s"])
        within = ok[seconds <= self.limit]
        if within.empty:
            soonest = ok.loc[seconds.idxmin()]
            return int(soonest["node_count"]), (
                f"no node count finishes within {self.hours:g} h: the soonest "
                f"({int(soonest['node_count'])} nodes, {float(soonest['time_to_train_s']) / 3600:.3g} h) "
                "is chosen"
            )
        return int(within.sort_values(["gpu_hours", "node_count"]).iloc[0]["node_count"]), None

    def sure_fallback(self, ok: pd.DataFrame, sure: list[int]) -> int:
        return min(sure)


@dataclass(frozen=True, kw_only=True)
class GpuHourCap(_LimitRule):
    """--max-gpu-hours: the soonest finish among the counts within the GPU-hours."""

    name: ClassVar[str] = "gpu_hours"
    column: ClassVar[str] = "gpu_hours"
    unit: ClassVar[str] = "GPU-h"
    scale: ClassVar[float] = 1.0
    gpu_hours: float

    @property
    def limit(self) -> float:
        return self.gpu_hours

    def describe(self, unit: str = "GPU-h") -> str:
        return f"the soonest finish within --max-gpu-hours {self.gpu_hours:g}"

    def record(self) -> dict[str, Any]:
        return super().record() | {"max_gpu_hours": self.gpu_hours}

    def pick(self, ok: pd.DataFrame) -> tuple[int, str | None]:
        within = ok[pd.to_numeric(ok["gpu_hours"]) <= self.gpu_hours]
        if within.empty:
            cheapest = ok.sort_values(["gpu_hours", "node_count"]).iloc[0]
            return int(cheapest["node_count"]), (
                f"no node count trains within {self.gpu_hours:g} GPU-hours: the fewest "
                f"({int(cheapest['node_count'])} nodes, {float(cheapest['gpu_hours']):.3g}) is chosen"
            )
        return int(within.sort_values(["time_to_train_s", "node_count"]).iloc[0]["node_count"]), None

    def sure_fallback(self, ok: pd.DataFrame, sure: list[int]) -> int:
        return min(sure, key=lambda n: float(ok.loc[n, "time_to_train_s"]))


def node_rule(
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY,
    nodes: int | None = None,
    deadline_hours: float | None = None,
    max_gpu_hours: float | None = None,
) -> NodeRule:
    """The one rule the options ask for: --nodes, else --deadline-hours, else --max-gpu-hours, else the
    knee; more than one, or a limit that is not a positive number of hours, is refused."""
    given = [
        flag
        for flag, value in (
            ("--nodes", nodes),
            ("--deadline-hours", deadline_hours),
            ("--max-gpu-hours", max_gpu_hours),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)}: give one rule for the node count, not several")
    for flag, value in (("--deadline-hours", deadline_hours), ("--max-gpu-hours", max_gpu_hours)):
        if value is not None and not value > 0:
            raise UserError(f"{flag} {value}: must be a positive number of hours")
    if nodes is not None:
        return FixedNodes(min_efficiency=min_efficiency, nodes=nodes)
    if deadline_hours is not None:
        return DeadlineRule(min_efficiency=min_efficiency, hours=deadline_hours)
    if max_gpu_hours is not None:
        return GpuHourCap(min_efficiency=min_efficiency, gpu_hours=max_gpu_hours)
    return EfficiencyRule(min_efficiency=min_efficiency)
