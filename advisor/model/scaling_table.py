"""The scaling table (one row per node count), the node count chosen by efficiency, and where each figure
comes from.

Per node count the row is the fastest config that fits and reaches the global batch; its scaling
efficiency is its samples/s per node over the smallest node count's (1.0 is linear). The recommended node
count is the largest one that keeps --min-efficiency: past it, each added node buys less than that
fraction of a node's worth of throughput. The knee is that node count. A node count where no config
reaches the global batch (strong scaling: more ranks than samples) or fits in memory is kept as a row
that says so.

Provenance labels, the same words in the terminal, recommendation.json and the report:
``measured`` (a trial ran it), ``modelled`` (fitted to trials and the measured links), ``assumed`` (a preset
or a figure the user gave, e.g. the inter-node link when no hostfile was benchmarked).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

DEFAULT_MIN_EFFICIENCY = 0.8
"""80% parallel efficiency: below it, the last nodes added cost more than a fifth of their price for
nothing; the usual bar for strong scaling in HPC allocations, and well above the 32-node point where
the source guides saw communication dominate."""
MEASURED, MODELLED, ASSUMED = "measured", "modelled", "assumed"
COLUMNS = (
    "node_count",
    "status",
    "config_id",
    "micro_batch",
    "grad_accum",
    "global_batch",
    "samples_per_s",
    "step_time_s",
    "efficiency",
    "exposed_comm_share",
    "limiting_link",
    "provenance",
    "knee",
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
) -> pd.DataFrame:
    """One row per node count (see the module doc); `measured_ids` are the config_ids a trial ran."""
    rows: list[dict[str, Any]] = []
    for n in nodes:
        mine = predictions[predictions["node_count"] == n] if not predictions.empty else predictions
        status = _status(mine)
        row: dict[str, Any] = {"node_count": n, "status": status}
        if status == "ok":
            fits = mine[mine["feasible"].astype(bool)]
            best = fits.loc[fits["samples_per_s"].idxmax()]
            row |= {
                k: best[k]
                for k in (
                    "config_id",
                    "micro_batch",
                    "grad_accum",
                    "global_batch",
                    "samples_per_s",
                    "step_time_s",
                )
            }
            row["exposed_comm_share"] = float(best["exposed_comm_s"] / best["step_time_s"])
            row["limiting_link"] = limiting_link(best)
            row["provenance"] = row_provenance(n, str(best["config_id"]), inter_source, measured_ids)
        rows.append(row)
    table = pd.DataFrame(rows).reindex(columns=list(COLUMNS))
    ok = table[table["status"] == "ok"]
    if not ok.empty:
        first = ok.iloc[0]
        per_node = float(first["samples_per_s"]) / int(first["node_count"])
        table["efficiency"] = table["samples_per_s"] / (per_node * table["node_count"])
    table["knee"] = False
    knee = choose_node_count(table, min_efficiency)
    if knee is not None:
        table.loc[table["node_count"] == knee, "knee"] = True
    return table


def row_provenance(nodes: int, config_id: str, inter_source: str, measured_ids: set[str]) -> str:
    """Throughput at this node count: modelled; from a measured config or not; across an assumed link."""
    parts = [MODELLED + (" from a measured config" if config_id in measured_ids else ", config not measured")]
    if nodes > 1 and link_provenance(inter_source) != MEASURED:
        parts.append(f"inter-node link {link_provenance(inter_source)}")
    return "; ".join(parts)


def choose_node_count(table: pd.DataFrame, min_efficiency: float) -> int | None:
    """The largest node count that fits, reaches the batch and keeps `min_efficiency` (the knee)."""
    ok = table[(table["status"] == "ok") & (table["efficiency"] >= min_efficiency - 1e-9)]
    return int(ok["node_count"].max()) if not ok.empty else None


def options_beside(table: pd.DataFrame) -> dict[str, int | None]:
    """The fastest and the most efficient node counts (the smallest one on a tie), for the terminal."""
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return {"fastest": None, "most_efficient": None}
    fastest = ok.loc[ok["samples_per_s"].idxmax(), "node_count"]
    efficient = ok.sort_values(["efficiency", "node_count"], ascending=[False, True]).iloc[0]["node_count"]
    return {"fastest": int(fastest), "most_efficient": int(efficient)}


def table_records(table: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-ready rows (NaN -> None, numpy scalars -> plain)."""
    out = []
    whole = ("node_count", "micro_batch", "grad_accum", "global_batch")  # ints, not NaN-widened floats
    for record in table.to_dict("records"):
        record = {k: (int(v) if k in whole and pd.notna(v) else v) for k, v in record.items()}
        out.append(
            {k: (None if pd.isna(v) else (v.item() if hasattr(v, "item") else v)) for k, v in record.items()}
        )
    return out
