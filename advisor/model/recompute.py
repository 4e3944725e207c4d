"""Gradient checkpointing in the models: what recomputation costs in compute and saves in activations.

With checkpointing the network keeps only its checkpointed blocks' inputs for the backward and runs each
block's forward again inside it: the forward is counted twice. So:

- **compute**: a checkpointed config's per-sample compute is the same config's without it, plus `share`
  of it. Where trials ran with checkpointing (in the same launch as those without,
  sdzero.training.measuring.sweep), `share` is measured: the median over them of their compute beyond the
  fitted compute of the same config without it, per unit of that config's per-sample compute; per ZeRO
  stage, precision and offload where that group ran with it (`by_group`: at ZeRO-3 the recomputed
  forward gathers its parameters again), the median over the groups elsewhere. Where none did, it is the forward pass's share of the trials' compute (their phase timers: forward / (forward +
  backward)), labelled modelled. The fixed per-micro-step costs (ZeRO's hooks, the optimizer) do not
  repeat.
- **memory**: a checkpointed config's activations are fitted, as the others' are (a + b x micro-batch), on
  the trials that ran with checkpointing; ZeRO does not change them, so one launch's checkpointed trials
  serve every stage. Without such a trial the activations are taken as without checkpointing: the model
  never predicts that checkpointing makes a config fit before a trial has shown it.

The trials with checkpointing are kept out of the fits of the configs without it (`split`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from advisor.measure.grid import is_checkpointed
from advisor.model.memory import ActivationFit

MEASURED = "measured"
MODELLED = "modelled"


@dataclass(frozen=True)
class Recompute:
    share: float
    """Compute added per sample by checkpointing, as a fraction of the per-sample compute without it."""
    source: str
    """MEASURED (trials with checkpointing ran) or MODELLED (the forward's share of the compute)."""
    activations: ActivationFit | None = None
    """Activation bytes with checkpointing, fitted to its trials; None: none ran."""
    trials: int = 0
    by_group: dict[tuple[int, str, str], float] = field(default_factory=dict)
    """The measured share of each (stage, precision, offload) that ran with checkpointing."""

    def share_of(self, group: tuple[int, str, str]) -> float:
        return self.by_group.get(group, self.share)

    def describe(self) -> str:
        how = (
            f"measured on {self.trials} trial(s) with it"
            if self.source == MEASURED
            else "modelled: the forward's share of the trials' compute, run twice"
        )
        return f"checkpointing: +{self.share:.0%} compute per sample ({how})"


def split(trials: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the trials without checkpointing, those with it). Where every ok trial had it (nothing else to
    fit), all are returned as the first and none as the second."""
    if trials.empty or "checkpointing" not in trials:
        return trials, trials.iloc[0:0]
    flagged = trials.apply(is_checkpointed, axis=1).astype(bool)
    ok = trials["status"] == "ok"
    if not (ok & ~flagged).any():
        return trials, trials.iloc[0:0]
    return trials[~flagged], trials[flagged]


def forward_share(trials: pd.DataFrame) -> float:
    """The forward pass's share of the trials' forward and backward time (their phase timers), the
    compute checkpointing runs again; nan where no trial timed its phases."""
    if trials.empty or not {"forward_s", "backward_s"} <= set(trials.columns):
        return math.nan
    ok = trials[trials["status"] == "ok"]
    forward = pd.to_numeric(ok["forward_s"], errors="coerce")
    backward = pd.to_numeric(ok["backward_s"], errors="coerce")
    shares = (forward / (forward + backward)).dropna()
    shares = shares[(shares > 0) & (shares < 1)]
    return float(shares.median()) if len(shares) else math.nan


def fit_recompute(
    plain: pd.DataFrame,
    checkpointed: pd.DataFrame,
    extra_per_sample: list[tuple[tuple[int, str, str], float]],
) -> Recompute:
    """The Recompute of a run: `extra_per_sample` holds, per ok checkpointed trial, its group and its
    measured compute beyond the plain fit's for its config, divided by that config's per-sample compute
    (the caller, advisor.model.prediction_error, has the time model)."""
    ok = checkpointed[checkpointed["status"] == "ok"] if not checkpointed.empty else checkpointed
    activations = None
    if not ok.empty:
        activations = ActivationFit.fit(ok["micro_batch"].to_numpy(), ok["activation_bytes"].to_numpy())
    measured = [(g, e) for g, e in extra_per_sample if math.isfinite(e)]
    if measured:
        groups: dict[tuple[int, str, str], list[float]] = {}
        for group, extra in measured:
            groups.setdefault(group, []).append(extra)
        by_group = {g: max(float(np.median(v)), 0.0) for g, v in groups.items()}
        overall = float(np.median(list(by_group.values())))
        return Recompute(overall, MEASURED, activations, len(measured), by_group)
    share = forward_share(plain)
    return Recompute(0.0 if math.isnan(share) else share, MODELLED, activations, 0)
