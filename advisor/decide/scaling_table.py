"""The scaling table (one row per node count), the rule that chooses the node count, and where each figure
comes from.

Per node count the row is the fastest config that fits and reaches the global batch; its scaling
efficiency is its samples/s per node over the smallest node count's (1.0 is linear), and its time and
GPU-hours to train are advisor.model.time_to_train's. The knee is the largest node count that keeps
--min-efficiency: past it, each added node buys less than that fraction of a node's worth of throughput.
The knee is computed here, once per table, and marked in its `knee` column; the node count is chosen
by one of the rules of advisor.decide.node_rules: the knee (the default), the fewest GPU-hours that finish
within --deadline-hours, the soonest finish within --max-gpu-hours, or --nodes. A node count
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
    """The largest node count that fits, reaches the batch and keeps `min_efficiency` (the knee): computed
    here alone, marked in the table; the rules read the mark (advisor.decide.node_rules.table_knee)."""
    ok = at_asked_batch(table)
    ok = ok[ok["efficiency"] >= min_efficiency - 1e-9]
    return int(ok["node_count"].max()) if not ok.empty else None


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
