"""What gradient checkpointing costs and what it buys, said once in the answer: the compute it adds per
sample (advisor.model.recompute) and the micro-batch it lets the pick's ZeRO stage, precision and offload
reach at the chosen node count, against the largest that fits without it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from advisor.measure.grid import is_checkpointed

FLAG = "--gradient-checkpointing"


def with_checkpointing(train_args: Sequence[str], best: pd.Series) -> tuple[str, ...]:
    """The trainer options of the recommended launch: the user's, with the checkpointing flag where the
    pick recomputes its activations."""
    args = tuple(train_args)
    return (*args, FLAG) if is_checkpointed(best) and FLAG not in args else args


def _largest_fitting(rows: pd.DataFrame) -> int | None:
    fits = rows[rows["feasible"].astype(bool)]
    return int(fits["micro_batch"].max()) if not fits.empty else None


def checkpointing_trade(
    predictions: pd.DataFrame, best: pd.Series, share: float | None, source: str
) -> dict[str, Any]:
    """{"share", "source", "picked", "largest_with", "largest_without", "line"} where the predictions hold
    configs with checkpointing; {} where the grid had none."""
    if predictions.empty or "checkpointing" not in predictions or share is None:
        return {}
    gc = predictions.apply(is_checkpointed, axis=1).astype(bool)
    if not gc.any():
        return {}
    same = (
        (predictions["node_count"] == best["node_count"])
        & (predictions["zero_stage"] == best["zero_stage"])
        & (predictions["dtype"] == best["dtype"])
        & (predictions["offload"] == best["offload"])
    )
    with_it, without = _largest_fitting(predictions[same & gc]), _largest_fitting(predictions[same & ~gc])
    picked = is_checkpointed(best)
    line = f"+{share:.0%} compute per sample ({source})"
    n = int(best["node_count"])
    where = f"ZeRO-{int(best['zero_stage'])} {best['dtype']} at {n} node{'s' if n != 1 else ''}"
    if with_it is not None and (without is None or with_it > without):
        line += (
            f", allows micro-batch {with_it} where "
            + (f"{without} fit" if without is not None else "none fits")
            + f" without ({where})"
        )
    elif without is not None:
        line += f", allows no larger micro-batch than the {without} that fits without it ({where})"
    line += "; the pick uses it" if picked else "; the pick runs without it"
    return {
        "share": share,
        "source": source,
        "picked": picked,
        "largest_with": with_it,
        "largest_without": without,
        "line": line,
    }
