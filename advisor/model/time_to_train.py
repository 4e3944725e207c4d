"""Time, GPU-hours and cost to train: what a team decides in, from the predicted step time.

A fine-tune of S samples (an epoch of the data times --epochs) at global batch B takes ceil(S / B)
optimizer steps. Its wall time is those steps at the predicted step time plus the run's start-up and
shut-down (launcher, process group, model load, the first slow steps, teardown), measured here as what the
trials' wall time spent beyond their measured steps: a trial is a real run of the trainer, only shorter.
GPU-hours are the wall time times the ranks (GPUs) the run holds; the cost is GPU-hours times
--gpu-hour-price when given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sdzero.errors import UserError

HOUR_S = 3600.0


@dataclass(frozen=True)
class TrainAmount:
    """How much training the time is for."""

    samples_per_epoch: int
    epochs: float
    source: str
    """Where samples_per_epoch comes from (the data folder, --samples, the embedded default's fine-tune)."""

    @property
    def samples(self) -> int:
        """Samples trained in all, whole ones."""
        return max(math.ceil(self.samples_per_epoch * self.epochs), 1)

    def describe(self) -> str:
        epochs = f"{self.epochs:g} epoch{'s' if self.epochs != 1 else ''}"
        return f"{epochs} of {self.samples_per_epoch:,} samples ({self.source}) = {self.samples:,} samples"


def train_amount(
    samples: int | None, epochs: float | None, dataset_images: int, dataset_source: str
) -> TrainAmount:
    """--samples (samples in one epoch; default the dataset's) times --epochs (default 1)."""
    if samples is not None and samples < 1:
        raise UserError(f"--samples {samples}: the samples in one epoch, at least 1")
    if epochs is not None and not epochs > 0:
        raise UserError(f"--epochs {epochs}: must be a positive number of epochs")
    if samples is not None:
        return TrainAmount(samples, epochs or 1.0, "--samples")
    return TrainAmount(dataset_images, epochs or 1.0, dataset_source)


@dataclass(frozen=True)
class StartUp:
    """Seconds a run spends outside its steady steps, and from how many trials."""

    seconds: float
    trials: int

    def describe(self) -> str:
        if not self.trials:
            return "start-up not measured (no trial recorded its wall time): counted as 0 s"
        return (
            f"start-up and shut-down {self.seconds:.0f} s, measured here: the median over {self.trials} "
            "trials of their wall time less their measured steps"
        )


def startup_s(trials: pd.DataFrame) -> StartUp:
    """The median over ok trials of wall time less the steps measured and warmed up at their median step
    time: what a run of any length pays once (the first steps' excess over a steady one included)."""
    rest = startup_rests(trials)
    if rest.empty:
        return StartUp(0.0, 0)
    return StartUp(float(np.median(rest)), int(len(rest)))


def startup_rests(trials: pd.DataFrame) -> pd.Series:
    """Each ok trial's wall time less its steps: the start-up one run paid (its spread is the start-up's
    interval, advisor.model.uncertainty)."""
    ok = trials[trials["status"] == "ok"] if "status" in trials else trials
    if ok.empty or "wall_s" not in ok:
        return pd.Series(dtype=float)
    from advisor.model.step_time import measured_step_s

    step = measured_step_s(ok)
    steps = _column(ok, "measured_steps") + _column(ok, "warmup_steps")
    rest = pd.to_numeric(ok["wall_s"], errors="coerce") - steps * step
    return rest[rest.notna() & (rest >= 0)]


def _column(rows: pd.DataFrame, name: str) -> pd.Series:
    if name not in rows:
        return pd.Series(0.0, index=rows.index)
    return pd.to_numeric(rows[name], errors="coerce").fillna(0.0)


def add_time_to_train(predictions: pd.DataFrame, amount: TrainAmount, startup: StartUp) -> pd.DataFrame:
    """predictions.csv's time columns: optimizer_steps, time_to_train_s, gpu_hours (rank-hours)."""
    if predictions.empty:
        return predictions
    # a row at a larger batch than asked trains its rule's multiple of the samples (advisor.model.batch_growth)
    factor = predictions.get("samples_factor", 1.0)
    steps = np.ceil(np.ceil(amount.samples * factor) / predictions["global_batch"].astype(float))
    seconds = startup.seconds + steps * predictions["step_time_s"]
    return predictions.assign(
        optimizer_steps=steps.astype(int),
        time_to_train_s=seconds,
        gpu_hours=seconds / HOUR_S * predictions["world_size"],
    )


def hours(seconds: float) -> str:
    """A duration as a team reads it: minutes under an hour, hours under four days, then days."""
    if seconds < HOUR_S:
        return f"{seconds / 60:.3g} min"
    if seconds < 96 * HOUR_S:
        return f"{seconds / HOUR_S:.3g} h"
    return f"{seconds / HOUR_S / 24:.3g} days"


def money(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.2f}"


def cost_of(gpu_hours: float, price: float | None) -> float | None:
    return None if price is None else gpu_hours * price


def row_summary(row: dict, unit: str, price: float | None) -> str:
    """'8 nodes: 5.1 h, 41 GPU-h' (and the cost when priced)."""
    text = f"{int(row['node_count'])} node{'s' if int(row['node_count']) != 1 else ''}: "
    text += f"{hours(float(row['time_to_train_s']))}, {float(row['gpu_hours']):.3g} {unit}"
    if row.get("larger_batch") is True:
        factor = float(row.get("samples_factor") or 1.0)
        text += f" (global batch {int(row['global_batch'])}, larger than asked: {factor:.3g}x the samples)"
    cost = cost_of(float(row["gpu_hours"]), price)
    return text + (f", {money(cost)} at {price:g} per {unit}" if cost is not None else "")


def trade_line(rows: list[dict], chosen: int, fastest: int | None, unit: str, price: float | None) -> str:
    """The chosen node count against the other end of the trade, one line: against the fastest when that
    is another node count, else against the one with the fewest GPU-hours."""
    ok = {int(r["node_count"]): r for r in rows if r.get("status") == "ok" and r.get("time_to_train_s")}
    if chosen not in ok:
        return ""
    cheapest = min(ok.values(), key=lambda r: (float(r["gpu_hours"]), int(r["node_count"])))
    other = fastest if fastest is not None and fastest != chosen else int(cheapest["node_count"])
    mine = ok[chosen]
    if other == chosen or other not in ok:
        return f"{row_summary(mine, unit, price)}: both the soonest finish and the fewest {unit}"
    a, b = (mine, ok[other]) if other > chosen else (ok[other], mine)
    sooner = float(a["time_to_train_s"]) / float(b["time_to_train_s"])
    more = float(b["gpu_hours"]) / float(a["gpu_hours"])
    return (
        f"{row_summary(a, unit, price)}; {row_summary(b, unit, price)}: "
        f"{sooner:.2g}x sooner for {more:.2g}x the {unit}"
    )
