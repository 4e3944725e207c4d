"""Intervals on every predicted figure (the tie rule that decides between configs the machine cannot tell
apart is advisor.decide.ties).

A predicted step time is uncertain for three reasons, each measured by the run itself:

- **the measurement**: a config a launch measured is pinned by it, whose 95% interval (trials.csv
  `step_s_lo`/`_hi`: the bootstrap over its timed steps) is its own, beside how far the fit's figure lies
  from that measurement (the fit's line through its stage's micro-batches, `fit_residuals`);
- **the fit**: a config nobody ran is as uncertain as the model is on configs it did not see. That is
  the spread of the held-out errors in validation.csv (the check trials and the leave-one-out refits),
  widened for the few errors it rests on (Student's t, not 1.96, with as many degrees of freedom as
  errors). Not every prediction leans on its trials alike (advisor.model.leverage): a check at
  micro-batch 8 predicted from trials at 1 and 4 is an extrapolation, 3-4x as uncertain in variance as a
  config between measured points. So each error is divided by the spread its own prediction had (its
  fit's relative variance at that config, plus one for the held-out trial's own noise), their rms is the
  spread of one trial's worth of evidence, and each unmeasured config's interval is that times the
  square root of its own relative variance under the final fit. The errors come in two
  kinds, kept apart: a trial held out while another trial of its ZeRO stage and precision stayed in the
  fit says how well the model interpolates inside a measured group (most unmeasured configs: another
  micro-batch); one held out as its group's only trial says how well the model borrows a group's costs
  from the others (a stage no trial ran). Pooled, the second kind, often several times larger, would
  widen every interval. A validation table without the fit's own rows (an older folder) is not
  scaled: the errors' rms less the held-out trials' own noise is the fit's spread on every config;
- **the link**, across nodes: the inter-node collectives are costed from alpha-beta fits whose relative
  residuals (comm_fit.json `rel_rmse`) say how far one op's time strays from its line; that share of the
  step's exposed inter-node time. A link that was assumed (a preset, a user figure) has no spread to give:
  the note says the interval leaves it out.

A figure is for a run of the config, which lands in some minute of this machine's own drift, so the
**prediction interval** adds the run's noise floor to the above: the spread between the two halves of
each config's launch (the same work measured twice, a half-launch apart; `run_noise_floor`), widened by
Student's t for the few configs it rests on.

Relative spreads are one-sigma fractions of the figure; halfwidths are the 95% ones. An interval is
multiplicative: a half-width h puts the figure's bounds at the figure / (1 + h) and x (1 + h)
(`interval_ratio`), so no bound reaches zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from advisor.measure.grid import is_checkpointed
from advisor.measure.launch import repeat_halves
from advisor.model.leverage import FitPoints, group_of
from advisor.stats import MEAN_ABS_TO_SIGMA, Z95, pooled_log_spread, rms, sigma_of_interval, t_quantile

MIN_MEMORY_SPREAD = 0.01
"""Memory is measured to the byte but varies with allocator state: never claim better than 1%."""
KEY_COLUMNS = ("zero_stage", "precision", "micro_batch", "offload")


ConfigKey = tuple
"""(stage, precision, micro-batch, offload), and a fifth item, True, for a config with gradient
checkpointing (`config_key`): keys of older folders and of configs without it are unchanged."""


@dataclass(frozen=True)
class Spread:
    """What the run measured about its own uncertainty (see the module doc); fractions, one sigma."""

    measured: dict[ConfigKey, float] = field(default_factory=dict)
    """Per config a trial ran (at its ranks on one node): its step's own relative sigma."""
    typical_measured: float = 0.0
    """The median of `measured`: the noise a trial of an unmeasured config would have."""
    model: float = 0.0
    """The fit's relative sigma on configs it did not see whose stage and precision a trial measured:
    per unit of relative variance (advisor.model.leverage) where `fit_points` is known, else on every
    such config alike (measurement noise taken out)."""
    model_dof: int = 0
    """How many held-out errors `model` rests on."""
    cross: float = 0.0
    """The same for configs of a stage and precision no trial measured."""
    cross_dof: int = 0
    measured_groups: frozenset[tuple[int, str]] = frozenset()
    residual: dict[ConfigKey, float] = field(default_factory=dict)
    """Each measured config's |ln(fit / measurement)|: the printed figure is the fit's, which a line
    through its stage's micro-batches can put a few percent off the config's own measurement."""
    contended: frozenset[ConfigKey] = frozenset()
    """Configs measured only while other processes took the cores (advisor.measure.launch): left out of
    the pick while any other config fits."""
    """(stage, precision) pairs some trial measured."""
    fit_points: FitPoints = field(default_factory=FitPoints)
    """The trials of the final fit, for each unmeasured config's relative variance (empty: an older
    folder, every unmeasured config at the model's spread)."""
    noise: float = 0.0
    """This machine's repeat spread as a sigma (the noise floor x sqrt(pi/2)); 0 when not measured."""
    noise_dof: int = 0
    """The degrees of freedom `noise` rests on: the run's repeats, less one per config (0: unknown)."""
    link: float = 0.0
    """Relative sigma of an inter-node op's cost; 0 for an assumed link."""
    memory: float = MIN_MEMORY_SPREAD
    memory_dof: int = 0
    startup_s: float = 0.0
    """Sigma of the start-up's seconds over the trials."""
    notes: tuple[str, ...] = ()

    @property
    def model_halfwidth(self) -> float:
        return t_quantile(self.model_dof) * self.model

    @property
    def cross_halfwidth(self) -> float:
        return t_quantile(self.cross_dof) * self.cross

    @property
    def noise_halfwidth(self) -> float:
        """The noise floor's 95% part: Student's t for the few repeats the floor rests on (a run lands in
        some later minute of a drift that a handful of brackets only sampled)."""
        return (t_quantile(self.noise_dof) if self.noise_dof else Z95) * self.noise

    def describe(self) -> str:
        """One line for the answer: where the intervals come from."""
        parts = [
            f"{len(self.measured)} measured config(s) by their own trial",
            f"the others by the fit's held-out spread ({self.model:.1%} sigma{self._per_trial} over "
            f"{self.model_dof} errors inside a measured stage, {self.cross:.1%} over {self.cross_dof} for a "
            "stage no trial ran)",
        ]
        parts.append(f"noise floor {self.noise / MEAN_ABS_TO_SIGMA:.1%}" if self.noise else "no noise floor")
        if self.link:
            parts.append(f"link {self.link:.1%} per op")
        return "95% intervals: " + "; ".join(parts)

    @property
    def _per_trial(self) -> str:
        if not self.fit_points.groups:
            return ""
        return " per trial's worth of evidence, scaled by how far each config is from the measured ones"

    def group_measured(self, key: ConfigKey) -> float:
        """The median own sigma of the measured configs of `key`'s stage, precision and offload (the
        typical trial's where none ran)."""
        mine = [v for k, v in self.measured.items() if (k[0], k[1], k[3]) == (key[0], key[1], key[3])]
        return float(np.median(mine)) if mine else self.typical_measured

    def fit_scale(self, key: ConfigKey) -> float:
        """How many `model` sigmas an unmeasured config of `key` is uncertain by: the square root of its
        relative variance under the final fit (1 where that is unknown)."""
        if not self.fit_points.groups:
            return 1.0
        variance = self.fit_points.relative_variance((key[0], key[1], key[3]), key[2])
        return math.sqrt(variance) if variance is not None else 1.0


def measured_spreads(trials: pd.DataFrame) -> dict[ConfigKey, float]:
    """Each config's relative sigma from its trials' corrected intervals (the tightest where it ran
    twice); configs whose trials carry no interval (an older folder) are left out."""
    out: dict[ConfigKey, float] = {}
    if trials.empty or "step_s_lo" not in trials or "step_s_hi" not in trials:
        return out
    ok = trials[trials["status"] == "ok"] if "status" in trials else trials
    from advisor.model.step_time import measured_step_s

    steps = measured_step_s(ok)
    lo = pd.to_numeric(ok["step_s_lo"], errors="coerce")
    hi = pd.to_numeric(ok["step_s_hi"], errors="coerce")
    for i, row in ok.iterrows():
        sigma = sigma_of_interval(float(steps[i]), float(lo[i]), float(hi[i]))
        if math.isnan(sigma):
            continue
        key = config_key(row)
        out[key] = min(out.get(key, math.inf), sigma)
    return out


def fit_residuals(validation: pd.DataFrame, trials: pd.DataFrame) -> dict[ConfigKey, float]:
    """|ln(predicted / measured)| of each config's step time in the fit it was part of (validation.csv's
    "used in fit" rows), by config."""
    needed = {"quantity", "held_out", "config_id", "predicted", "measured"}
    if validation.empty or not needed <= set(validation) or trials.empty or "trial_id" not in trials:
        return {}
    keys = {str(r["trial_id"]): config_key(r) for _, r in trials.iterrows()}
    rows = validation[(validation["quantity"] == "step_time_s") & ~validation["held_out"].astype(bool)]
    out: dict[ConfigKey, float] = {}
    for _, row in rows.iterrows():
        key = keys.get(str(row["config_id"]))
        predicted, measured = float(row["predicted"]), float(row["measured"])
        if key is not None and predicted > 0 and measured > 0:
            out[key] = max(out.get(key, 0.0), abs(math.log(predicted / measured)))
    return out


def contended_keys(trials: pd.DataFrame) -> frozenset[ConfigKey]:
    """Configs whose every ok row was contended (a quiet re-launch's row clears its config)."""
    if trials.empty or "contended" not in trials:
        return frozenset()
    flagged = trials["contended"].map(lambda v: str(v).strip().lower() in {"true", "1"})
    keys = [config_key(r) for _, r in trials.iterrows()]
    clean = {k for k, f in zip(keys, flagged, strict=True) if not f}
    return frozenset(k for k, f in zip(keys, flagged, strict=True) if f and k not in clean)


def config_key(row: pd.Series | dict) -> ConfigKey:
    stage, precision, offload = group_of(row)
    key = (stage, precision, int(row["micro_batch"]), offload)
    return (*key, True) if is_checkpointed(row) else key


def held_out_errors(validation: pd.DataFrame, quantity: str) -> np.ndarray:
    """Relative errors (predicted / measured - 1) of every held-out row of `quantity`: the check trials'
    and the leave-one-out refits'."""
    if validation.empty or "quantity" not in validation:
        return np.array([])
    rows = validation[(validation["quantity"] == quantity) & validation["held_out"].astype(bool)]
    measured = pd.to_numeric(rows["measured"], errors="coerce")
    predicted = pd.to_numeric(rows["predicted"], errors="coerce")
    keep = (measured > 0) & predicted.notna()
    return (predicted[keep] / measured[keep] - 1).to_numpy(dtype=float)


def link_spread(rel_rmse: Iterable[float]) -> float:
    """The median relative residual of the inter-node fits the link was built from."""
    values = [float(v) for v in rel_rmse if v is not None and math.isfinite(float(v)) and v >= 0]
    return float(np.median(values)) if values else 0.0


def _group_errors(
    validation: pd.DataFrame, trials: pd.DataFrame, quantity: str
) -> tuple[np.ndarray, np.ndarray]:
    """Held-out errors of `quantity` split by whether the held-out trial's stage and precision kept
    another trial in the fit (see the module doc): (inside a measured group, across groups)."""
    errors = held_out_errors(validation, quantity)
    if not errors.size or "config_id" not in validation or trials.empty or "trial_id" not in trials:
        return errors, np.array([])
    rows = validation[(validation["quantity"] == quantity) & validation["held_out"].astype(bool)]
    rows = rows[(pd.to_numeric(rows["measured"], errors="coerce") > 0) & rows["predicted"].notna()]
    ok = trials[trials["status"] == "ok"] if "status" in trials else trials
    group_of = {str(r["trial_id"]): (int(r["zero_stage"]), str(r["precision"])) for _, r in ok.iterrows()}
    sizes = pd.Series(list(group_of.values())).value_counts().to_dict() if group_of else {}
    inside = np.array([sizes.get(group_of.get(str(c)), 0) > 1 for c in rows["config_id"]], dtype=bool)
    return errors[inside], errors[~inside]


def _scaled_errors(validation: pd.DataFrame, trials: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """The held-out step-time errors, each divided by the sigma its prediction had in units of one trial's
    noise (sqrt(1 + the relative variance of its fit at that config), advisor.model.leverage): (those
    whose fit kept a trial of their group, the others unscaled). A check was predicted by the fit on the
    search's trials (validation's held_out false rows), a leave-one-out row by that fit less its own
    trial. None when the table cannot say which trials each fit had (an older folder)."""
    needed = {"config_id", "quantity", "held_out", "predicted", "measured"}
    if validation.empty or not needed <= set(validation) or trials.empty or "trial_id" not in trials:
        return None
    rows = validation[validation["quantity"] == "step_time_s"]
    held = rows["held_out"].astype(bool)
    fitted = set(rows.loc[~held, "config_id"].astype(str))
    ok = trials[trials["status"] == "ok"] if "status" in trials else trials
    by_id = {str(r["trial_id"]): r for r in ok.drop_duplicates("trial_id", keep="last").to_dict("records")}
    if not fitted or not fitted <= set(by_id):
        return None
    check = (
        rows["check"].fillna(False).astype(bool) if "check" in rows else pd.Series(False, index=rows.index)
    )
    inside, across = [], []
    for i, row in rows[held].iterrows():
        measured, predicted = pd.to_numeric(pd.Series([row["measured"], row["predicted"]]), errors="coerce")
        trial = by_id.get(str(row["config_id"]))
        if not measured > 0 or pd.isna(predicted):
            continue
        if trial is None:
            return None
        error = float(predicted / measured - 1)
        basis = fitted if check[i] else fitted - {str(row["config_id"])}
        variance = FitPoints.of(ok, only=basis).relative_variance(
            group_of(trial), float(trial["micro_batch"])
        )
        if variance is None:
            across.append(error)
        else:
            inside.append(error / math.sqrt(1 + variance))
    return np.array(inside), np.array(across)


def _fit_sigma(errors: np.ndarray, own: float) -> float:
    """The fit's sigma from held-out errors. A held-out error compares a prediction with one noisy
    measurement: that noise is taken out so it is not counted twice beside the noise floor. But a
    prediction rests on measurements as noisy as the typical trial, so it is never taken as surer than
    one (a few leave-one-out errors inside a well-pinned line can all be near zero)."""
    return max(math.sqrt(max(rms(errors) ** 2 - own**2, 0.0)), own)


def run_noise_floor(folder: Path) -> tuple[float | None, int]:
    """A run's noise floor and the degrees of freedom it rests on, from the halves of its launches
    (advisor.measure.launch.repeat_halves): their pooled sigma of ln(step), stated as the mean |deviation|
    a normal spread of that sigma has. None without repeats."""
    sigma, dof = pooled_log_spread(repeat_halves(folder))
    return (None if sigma is None else sigma / MEAN_ABS_TO_SIGMA), dof


def estimate_spread(
    trials: pd.DataFrame,
    validation: pd.DataFrame,
    noise_floor: float | None,
    link_rel: float,
    link_assumed: bool,
    startup_rest_s: Iterable[float] = (),
    noise_dof: int = 0,
) -> Spread:
    """The run's Spread from its trials, its held-out errors, its noise floor (with the repeats it rests
    on, less one) and its link fits."""
    measured = measured_spreads(trials)
    own = list(measured.values())
    typical_own = float(np.median(own)) if own else 0.0
    scaled = _scaled_errors(validation, trials)
    inside, across = scaled if scaled is not None else _group_errors(validation, trials, "step_time_s")
    pooled = np.concatenate([inside, across])
    if not inside.size:  # no group kept a second trial: the pooled errors are all there is
        inside = pooled
    if not across.size:
        across = pooled
    noise = (noise_floor or 0.0) * MEAN_ABS_TO_SIGMA
    notes: list[str] = []
    if not pooled.size:
        notes.append(
            "no held-out errors to size the fit's spread: unmeasured configs' intervals are too narrow"
        )
    if noise_floor is None:
        notes.append("no noise floor measured (no launch ran two rounds): intervals leave drift out")
    if link_assumed:
        notes.append("the inter-node link is assumed, not measured: its figures carry no interval")
    mem_errors = held_out_errors(validation, "mem_per_rank_bytes")
    rest = np.asarray(list(startup_rest_s), dtype=float)
    startup = float(1.4826 * np.median(np.abs(rest - np.median(rest)))) if rest.size > 1 else 0.0
    ok = trials[trials["status"] == "ok"] if "status" in trials and not trials.empty else trials
    groups = frozenset((int(r["zero_stage"]), str(r["precision"])) for _, r in ok.iterrows())
    return Spread(
        measured=measured,
        typical_measured=typical_own,
        # Scaled errors already count the held-out trial's own noise as one trial's worth of variance.
        model=max(rms(inside), typical_own)
        if scaled is not None and inside.size
        else _fit_sigma(inside, typical_own),
        model_dof=int(inside.size),
        cross=_fit_sigma(across, typical_own),
        cross_dof=int(across.size),
        measured_groups=groups,
        contended=contended_keys(ok),
        residual=fit_residuals(validation, ok),
        fit_points=FitPoints.of(trials) if scaled is not None else FitPoints(),
        noise=noise,
        noise_dof=noise_dof,
        link=0.0 if link_assumed else link_rel,
        memory=max(rms(mem_errors), MIN_MEMORY_SPREAD),
        memory_dof=int(mem_errors.size),
        startup_s=startup,
        notes=tuple(notes),
    )


def add_intervals(predictions: pd.DataFrame, spread: Spread) -> pd.DataFrame:
    """predictions.csv's interval columns (95%): step_time_s, samples_per_s, time_to_train_s, gpu_hours and
    mem_per_rank_bytes each get _lo and _hi; `compare_halfwidth` is the relative half-width the tie rule
    uses (measurement noise and the link, see the module doc), `link_halfwidth` the link's part of it;
    `interval_source` says whether a trial pinned the config ("measured") or the
    fit did ("model")."""
    if predictions.empty:
        return predictions
    table = predictions.copy()
    keys = [config_key(r) for r in table.to_dict("records")]
    own = np.array([spread.measured.get(k, math.nan) for k in keys], dtype=float)
    pinned = ~np.isnan(own)
    noise = Z95 * np.where(pinned, np.nan_to_num(own), spread.typical_measured)
    in_group = np.array([(k[0], k[1]) in spread.measured_groups for k in keys], dtype=bool)
    scale = np.array([spread.fit_scale(k) for k in keys]) * _fitted_share(table)
    # A config between measured ones rests on them: never surer than the typical trial of its group.
    floor = Z95 * np.array([spread.group_measured(k) for k in keys])
    borrowed = np.where(in_group, np.maximum(spread.model_halfwidth * scale, floor), spread.cross_halfwidth)
    residual = np.array([spread.residual.get(k, 0.0) for k in keys])
    # A stage no trial ran borrows the measured groups' costs: its interval holds their spread too.
    donors = _column(table, "borrowed_halfwidth")
    fit = np.where(pinned, np.hypot(Z95 * np.nan_to_num(own), residual), np.hypot(borrowed, donors))
    step = table["step_time_s"].to_numpy(dtype=float)
    inter = table["exposed_inter_s"].to_numpy(dtype=float) if "exposed_inter_s" in table else 0.0 * step
    link = Z95 * spread.link * np.divide(inter, step, out=np.zeros_like(step), where=step > 0)
    compare = np.sqrt(noise**2 + link**2)
    half = np.sqrt(fit**2 + link**2 + spread.noise_halfwidth**2)
    lo_step, hi_step = ratio_bounds(step, half)
    # Work no trial measured and the model cannot price only adds: it raises the upper bound alone.
    hi_step = ratio_bounds(step + _column(table, "unmeasured_s"), half)[1]
    batch = table["global_batch"].to_numpy(dtype=float)
    table["step_time_s_lo"], table["step_time_s_hi"] = lo_step, hi_step
    table["samples_per_s_lo"], table["samples_per_s_hi"] = batch / hi_step, batch / lo_step
    table["compare_halfwidth"] = compare
    table["link_halfwidth"] = link
    table["interval_source"] = np.where(pinned, "measured", "model")
    table["contended"] = [k in spread.contended for k in keys]
    if "time_to_train_s" in table and "optimizer_steps" in table:
        steps = table["optimizer_steps"].to_numpy(dtype=float)
        startup = table["time_to_train_s"].to_numpy(dtype=float) - steps * step
        up = Z95 * spread.startup_s
        table["time_to_train_s_lo"] = np.maximum(startup - up, 0.0) + steps * lo_step
        table["time_to_train_s_hi"] = startup + up + steps * hi_step
        scale = table["gpu_hours"].to_numpy(dtype=float) / table["time_to_train_s"].to_numpy(dtype=float)
        table["gpu_hours_lo"] = table["time_to_train_s_lo"] * scale
        table["gpu_hours_hi"] = table["time_to_train_s_hi"] * scale
    mem_half = t_quantile(spread.memory_dof) * spread.memory if spread.memory_dof else Z95 * spread.memory
    mem = table["mem_per_rank_bytes"].to_numpy(dtype=float)
    table["mem_per_rank_bytes_lo"], table["mem_per_rank_bytes_hi"] = ratio_bounds(mem, mem_half)
    return table


def interval_ratio(half: np.ndarray | float) -> np.ndarray | float:
    """A relative 95% half-width `h` stated as a ratio `r = 1 + h`: the interval runs from the figure / r
    to the figure x r. Its high end is the symmetric interval's; its low end never reaches zero however
    wide `h` is, so a reciprocal's (samples/s = batch / step: the step's bounds, swapped, with the same
    ratio) stays finite."""
    return 1 + np.abs(half)


def ratio_bounds(value: np.ndarray, half: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) = (value / r, value x r) for r = interval_ratio(half)."""
    ratio = interval_ratio(half)
    return value / ratio, value * ratio


def _column(table: pd.DataFrame, name: str) -> np.ndarray:
    """A numeric column as an array, zeros where it is missing (an older predictions table)."""
    if name not in table:
        return np.zeros(len(table))
    return pd.to_numeric(table[name], errors="coerce").fillna(0.0).to_numpy(dtype=float)


def _fitted_share(table: pd.DataFrame) -> np.ndarray:
    """Each row's step less its exposed inter-node time, as a share of the step: the part the trials'
    fit predicts (the inter-node part is costed from the link's fits, whose spread is the link's)."""
    step = table["step_time_s"].to_numpy(dtype=float)
    if "exposed_inter_s" not in table:
        return np.ones_like(step)
    inter = pd.to_numeric(table["exposed_inter_s"], errors="coerce").fillna(0.0).to_numpy(dtype=float)
    share = np.divide(step - inter, step, out=np.ones_like(step), where=step > 0)
    return np.clip(share, 0.0, 1.0)
