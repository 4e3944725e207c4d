"""The scaling table (one row per node count), the rule that chooses the node count, and where each figure
comes from.

Per node count the row is the fastest config that fits and reaches the global batch; its scaling
efficiency is its samples/s per node over the smallest node count's (1.0 is linear), and its time and
GPU-hours to train are advisor.model.time_to_train's. The knee is the largest node count that keeps
--min-efficiency: past it, each added node buys less than that fraction of a node's worth of throughput.
The node count is chosen by one of the rules of NodeRule: the knee (the default), the fewest GPU-hours
that finish within --deadline-hours, the soonest finish within --max-gpu-hours, or --nodes. A node count
where no config reaches the global batch (strong scaling: more ranks than samples) or fits in memory is
kept as a row that says so; an unreachable one also says the smallest global batch that would reach it.

Provenance labels, the same words in the terminal, recommendation.json and the report:
``measured`` (a trial ran it), ``modelled`` (fitted to trials and the measured links), ``assumed`` (a preset
or a figure the user gave, e.g. the inter-node link when no hostfile was benchmarked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from advisor.decide.ties import pick_config
from advisor.model.input_rate import INPUT_COLUMNS
from advisor.model.uncertainty import ratio_bounds
from sdzero.errors import UserError

DEFAULT_MIN_EFFICIENCY = 0.8
"""80% parallel efficiency: below it, the last nodes added cost more than a fifth of their price for
nothing; the usual bar for strong scaling in HPC allocations, and well above the 32-node point where
the source guides saw communication dominate."""
MEASURED, MODELLED, ASSUMED = "measured", "modelled", "assumed"
INTERVAL_COLUMNS = tuple(
    f"{q}_{end}"
    for q in ("samples_per_s", "step_time_s", "time_to_train_s", "gpu_hours", "mem_per_rank_bytes")
    for end in ("lo", "hi")
)
"""A row's 95% intervals (advisor.model.uncertainty), where the predictions carry them."""
COLUMNS = (
    "node_count",
    "status",
    "config_id",
    "micro_batch",
    "grad_accum",
    "global_batch",
    "samples_per_s",
    "step_time_s",
    "time_to_train_s",
    "gpu_hours",
    "optimizer_steps",
    "efficiency",
    "efficiency_lo",
    "efficiency_hi",
    *INTERVAL_COLUMNS,
    "compare_halfwidth",
    "link_halfwidth",
    "interval_source",
    "exposed_comm_share",
    "limiting_link",
    "provenance",
    "knee",
    "smallest_batch",
    "reach_note",
    "larger_batch",
    "samples_factor",
    "comm_s",
    *INPUT_COLUMNS,
)


def link_provenance(source: str) -> str:
    """A Link.source (advisor.model.network) as measured / assumed (preset or user figure)."""
    if source.startswith("measured"):
        return MEASURED
    if source.startswith("described by"):
        return f"{ASSUMED} (user figure)"
    if source.startswith(ASSUMED):
        return f"{ASSUMED} ({source.removeprefix(ASSUMED).strip().split(',')[0]})"
    return f"{ASSUMED} ({source.split(' (')[0]})"


def short_provenance(text: str) -> str:
    """A scaling row's provenance in a few words, for table cells (the full sentence is in the JSON)."""
    if not text:
        return ""
    words = "measured" if "from a measured config" in text else "not measured"
    return words + (", link assumed" if ASSUMED in text else "")


def limiting_link(row: pd.Series) -> str:
    """The link whose exposed time is the larger: intra- or inter-node ('-' without exposed comm)."""
    intra, inter = float(row.get("exposed_intra_s", 0.0)), float(row.get("exposed_inter_s", 0.0))
    if intra <= 0 and inter <= 0:
        return "-"
    return "inter" if inter > intra else "intra"


def _status(rows: pd.DataFrame) -> str:
    if rows.empty:
        return "unreachable"
    return "ok" if rows["feasible"].astype(bool).any() else "out of memory"


def scaling_table(
    predictions: pd.DataFrame,
    nodes: list[int],
    min_efficiency: float,
    inter_source: str,
    measured_ids: set[str],
    reach: BatchReach | None = None,
) -> pd.DataFrame:
    """One row per node count (see the module doc); `measured_ids` are the config_ids a trial ran; `reach`
    gives an unreachable row the smallest global batch that would reach it."""
    rows: list[dict[str, Any]] = []
    for n in nodes:
        mine = predictions[predictions["node_count"] == n] if not predictions.empty else predictions
        status = _status(mine)
        row: dict[str, Any] = {"node_count": n, "status": status}
        if status == "ok":
            fits = mine[mine["feasible"].astype(bool)]
            best = pick_config(fits).row  # the recommendation's own rule, ties included
            row |= {k: best[k] for k in _BEST_COLUMNS if k in best}
            row["exposed_comm_share"] = float(best["exposed_comm_s"] / best["step_time_s"])
            row["limiting_link"] = limiting_link(best)
            row["provenance"] = row_provenance(n, str(best["config_id"]), inter_source, measured_ids)
        elif status == "unreachable" and reach is not None:
            row["smallest_batch"] = reach.smallest_batch(n)
        rows.append(row)
    table = pd.DataFrame(rows).reindex(columns=list(COLUMNS))
    ok = table[table["status"] == "ok"]
    if not ok.empty:
        first = ok.iloc[0]
        per_node = float(first["samples_per_s"]) / int(first["node_count"])
        table["efficiency"] = table["samples_per_s"] / (per_node * table["node_count"])
        half = efficiency_halfwidth(table, first)
        # multiplicative, as every interval (advisor.model.uncertainty.ratio_bounds): never reaching zero
        table["efficiency_lo"], table["efficiency_hi"] = ratio_bounds(table["efficiency"], half)
    table["knee"] = False
    knee = choose_node_count(table, min_efficiency)
    if knee is not None:
        table.loc[table["node_count"] == knee, "knee"] = True
    return table


_BEST_COLUMNS = (
    "config_id",
    "micro_batch",
    "grad_accum",
    "global_batch",
    "samples_per_s",
    "step_time_s",
    "time_to_train_s",
    "gpu_hours",
    "optimizer_steps",
    *INTERVAL_COLUMNS,
    "compare_halfwidth",
    "link_halfwidth",
    "interval_source",
    "larger_batch",
    "samples_factor",
    "comm_s",
    *INPUT_COLUMNS,
)


def at_asked_batch(table: pd.DataFrame) -> pd.DataFrame:
    """The ok rows at the global batch asked for: a node count answered at a larger batch is shown, never
    chosen by a rule (it trains more samples, advisor.model.batch_growth), unless --nodes names it."""
    ok = table[table["status"] == "ok"]
    if "larger_batch" not in ok:
        return ok
    return ok[~ok["larger_batch"].astype("boolean").fillna(False).astype(bool)]


def efficiency_halfwidth(table: pd.DataFrame, first: pd.Series) -> pd.Series:
    """Relative 95% half-width of each row's efficiency against the first row: where both run the same
    config its compute errs the same way at both counts and cancels, leaving the link's part; otherwise
    the two configs' comparison half-widths in quadrature. 0 where the predictions carry no intervals."""
    if "compare_halfwidth" not in table:
        return pd.Series(0.0, index=table.index)
    compare = pd.to_numeric(table["compare_halfwidth"], errors="coerce").fillna(0.0)
    link = pd.to_numeric(table.get("link_halfwidth", 0.0), errors="coerce")
    link = link.fillna(0.0) if isinstance(link, pd.Series) else pd.Series(0.0, index=table.index)
    own = float(pd.to_numeric(pd.Series([first.get("compare_halfwidth")]), errors="coerce").fillna(0.0)[0])
    same = table["config_id"] == first["config_id"]
    return link.where(same, (compare**2 + own**2) ** 0.5)


@dataclass(frozen=True)
class BatchReach:
    """What global batches a node count can run: micro-batch x accumulation x ranks, from the candidates'
    micro-batches."""

    micro_batches: tuple[int, ...]
    gpus_per_node: int
    lo: int
    """The global batch asked for (the lower end of a range)."""

    def smallest_batch(self, nodes: int) -> int:
        """The smallest global batch at or above the one asked for that `nodes` nodes reach: a multiple of
        micro-batch x ranks for some micro-batch."""
        world = nodes * self.gpus_per_node
        return min(math.ceil(self.lo / (m * world)) * m * world for m in self.micro_batches)


def choose_node_count(table: pd.DataFrame, min_efficiency: float) -> int | None:
    """The largest node count that fits, reaches the batch and keeps `min_efficiency` (the knee)."""
    ok = at_asked_batch(table)
    ok = ok[ok["efficiency"] >= min_efficiency - 1e-9]
    return int(ok["node_count"].max()) if not ok.empty else None


@dataclass(frozen=True)
class NodeRule:
    """How the node count is chosen: --nodes, else --deadline-hours, else --max-gpu-hours, else the knee."""

    min_efficiency: float = DEFAULT_MIN_EFFICIENCY
    nodes: int | None = None
    deadline_hours: float | None = None
    max_gpu_hours: float | None = None

    def __post_init__(self) -> None:
        given = [
            f
            for f, v in (
                ("--nodes", self.nodes),
                ("--deadline-hours", self.deadline_hours),
                ("--max-gpu-hours", self.max_gpu_hours),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise UserError(f"{' and '.join(given)}: give one rule for the node count, not several")
        for flag, value in (
            ("--deadline-hours", self.deadline_hours),
            ("--max-gpu-hours", self.max_gpu_hours),
        ):
            if value is not None and not value > 0:
                raise UserError(f"{flag} {value}: must be a positive number of hours")

    @property
    def name(self) -> str:
        if self.nodes is not None:
            return "nodes"
        if self.deadline_hours is not None:
            return "deadline"
        return "gpu_hours" if self.max_gpu_hours is not None else "efficiency"

    def describe(self, unit: str = "GPU-h") -> str:
        if self.nodes is not None:
            return f"--nodes {self.nodes}"
        if self.deadline_hours is not None:
            return f"the fewest {unit} that finish within --deadline-hours {self.deadline_hours:g}"
        if self.max_gpu_hours is not None:
            return f"the soonest finish within --max-gpu-hours {self.max_gpu_hours:g}"
        return f"the largest node count keeping scaling efficiency >= {self.min_efficiency:.0%} (the knee)"

    def choose(self, table: pd.DataFrame) -> tuple[int | None, str | None]:
        """(node count, why the rule could not be kept as asked, or None)."""
        ok = at_asked_batch(table)
        if self.nodes is not None:
            return self.nodes, None
        if self.name == "efficiency" or ok.empty or "time_to_train_s" not in ok:
            knee = choose_node_count(table, self.min_efficiency)
            if knee is None and not ok.empty:
                first = int(ok["node_count"].min())
                return (
                    first,
                    f"no node count keeps {self.min_efficiency:.0%} efficiency: the smallest is chosen",
                )
            return knee, None
        seconds = pd.to_numeric(ok["time_to_train_s"])
        gpu_hours = pd.to_numeric(ok["gpu_hours"])
        if self.deadline_hours is not None:
            within = ok[seconds <= self.deadline_hours * 3600]
            if within.empty:
                soonest = ok.loc[seconds.idxmin()]
                return int(soonest["node_count"]), (
                    f"no node count finishes within {self.deadline_hours:g} h: the soonest "
                    f"({int(soonest['node_count'])} nodes, {float(soonest['time_to_train_s']) / 3600:.3g} h) "
                    "is chosen"
                )
            pick = within.sort_values(["gpu_hours", "node_count"]).iloc[0]
            return int(pick["node_count"]), None
        assert self.max_gpu_hours is not None
        within = ok[gpu_hours <= self.max_gpu_hours]
        if within.empty:
            cheapest = ok.sort_values(["gpu_hours", "node_count"]).iloc[0]
            return int(cheapest["node_count"]), (
                f"no node count trains within {self.max_gpu_hours:g} GPU-hours: the fewest "
                f"({int(cheapest['node_count'])} nodes, {float(cheapest['gpu_hours']):.3g}) is chosen"
            )
        pick = within.sort_values(["time_to_train_s", "node_count"]).iloc[0]
        return int(pick["node_count"]), None


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


def node_confidence(rule: NodeRule, table: pd.DataFrame, chosen: int) -> str:
    """How sure the node-count choice is, in one line: whether the rule's bar falls inside the interval of
    the chosen count or of its neighbours, and which count would be sure where the choice is not."""
    ok = at_asked_batch(table).set_index("node_count", drop=False)  # larger-batch rows are never chosen
    if chosen not in ok.index or rule.name == "nodes":
        return ""
    row = ok.loc[chosen]
    if rule.name == "efficiency":
        bar = rule.min_efficiency
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
    if rule.name == "deadline":
        assert rule.deadline_hours is not None
        limit, column, unit, scale = rule.deadline_hours * 3600, "time_to_train_s", "h", 1 / 3600
    else:
        assert rule.max_gpu_hours is not None
        limit, column, unit, scale = rule.max_gpu_hours, "gpu_hours", "GPU-h", 1.0
    own = _figure(row, column)
    if own is None:
        return ""
    text = f"{_nodes(chosen)}: {own[0] * scale:.3g} {unit} ({own[1] * scale:.3g}-{own[2] * scale:.3g})"
    if own[2] <= limit:
        return f"node count sure: {text}, within {limit * scale:g} {unit} even at the interval's slow end"
    sure = [int(n) for n in ok.index if (f := _figure(ok.loc[n], column)) is not None and f[2] <= limit]
    fallback = f"; {_nodes(min(sure))} would be sure" if sure and rule.name == "deadline" else ""
    if sure and rule.name == "gpu_hours":
        fallback = f"; {_nodes(min(sure, key=lambda n: float(ok.loc[n, 'time_to_train_s'])))} would be sure"
    return (
        f"node count not sure: {text}, the {limit * scale:g} {unit} limit falls inside its interval{fallback}"
    )


def row_provenance(nodes: int, config_id: str, inter_source: str, measured_ids: set[str]) -> str:
    """Throughput at this node count: modelled; from a measured config or not; across an assumed link."""
    parts = [MODELLED + (" from a measured config" if config_id in measured_ids else ", config not measured")]
    if nodes > 1 and link_provenance(inter_source) != MEASURED:
        parts.append(f"inter-node link {link_provenance(inter_source)}")
    return "; ".join(parts)


def options_beside(table: pd.DataFrame) -> dict[str, int | None]:
    """The fastest (soonest to finish), the most efficient and the cheapest (fewest GPU-hours) node
    counts, the smallest one on a tie, for the terminal."""
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return {"fastest": None, "most_efficient": None, "fewest_gpu_hours": None}
    timed = "time_to_train_s" in ok and ok["time_to_train_s"].notna().all()
    by_time = ok.sort_values(["time_to_train_s", "node_count"]) if timed else None
    fastest = by_time.iloc[0] if by_time is not None else ok.loc[ok["samples_per_s"].idxmax()]
    efficient = ok.sort_values(["efficiency", "node_count"], ascending=[False, True]).iloc[0]["node_count"]
    cheapest = ok.sort_values(["gpu_hours", "node_count"]).iloc[0]["node_count"] if timed else None
    return {
        "fastest": int(fastest["node_count"]),
        "most_efficient": int(efficient),
        "fewest_gpu_hours": None if cheapest is None else int(cheapest),
    }


def table_records(table: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-ready rows (NaN -> None, numpy scalars -> plain)."""
    out = []
    whole = (
        "node_count",
        "micro_batch",
        "grad_accum",
        "global_batch",
        "optimizer_steps",
        "smallest_batch",
    )  # ints, not NaN-widened floats
    for record in table.to_dict("records"):
        record = {k: (int(v) if k in whole and pd.notna(v) else v) for k, v in record.items()}
        out.append(
            {k: (None if pd.isna(v) else (v.item() if hasattr(v, "item") else v)) for k, v in record.items()}
        )
    return out
