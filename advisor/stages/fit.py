"""The fit stage: the memory and step-time models, fitted on every trial that ran (the checks included, now
that their held-out error is recorded)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from advisor.model.memory import MemoryModel
from advisor.model.prediction_error import fit_models
from advisor.model.step_time import TimeModel
from advisor.model.target_compute import ComputeBasis
from advisor.stages.measure import HardwareFigures, MeasuredTrials
from advisor.stages.profile_source import fit_profile, is_profile_trials


@dataclass
class FittedModels:
    """The models the predictions and the recommendation use."""

    memory: MemoryModel
    """Bytes per rank of any config at any world size."""
    timing: TimeModel
    """Step time of any config at any node count, compute and exposed communication apart."""
    notes: list[str] = field(default_factory=list)
    """What each fit had to assume (the memory model's first, then the timing model's)."""
    basis: ComputeBasis | None = None
    """Where the target's compute comes from when the fit itself settles it (a profile measured on the
    target's node); None: the predict stage settles it from the request."""


def fit(measured: MeasuredTrials, hardware: HardwareFigures) -> FittedModels:
    if is_profile_trials(
        measured.trials
    ):  # measured on the target's own node (advisor.stages.profile_source)
        return FittedModels(*fit_profile(measured, hardware))
    trials, note = clean_trials(measured.trials)
    models = fit_models(trials, measured.numels, measured.zero, hardware.measured_net)
    notes = ([note] if note else []) + models.memory.notes + models.timing.notes
    return FittedModels(models.memory, models.timing, notes)


def clean_trials(trials: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The trials to fit: those another process did not slow (`contended`, advisor.measure.runner) where
    that leaves each ZeRO stage and precision a trial; a contended trial stays only where its group would
    otherwise have none. Its step time is the machine's, not the config's: fitted, it would make its whole
    group look slow. Returns the trials and a note saying what was left out or kept."""
    if "contended" not in trials or trials.empty:
        return trials, ""
    flagged = trials["contended"].map(lambda v: str(v).strip().lower() in {"true", "1", "yes"})
    flagged &= trials["status"] == "ok"
    if not flagged.any():
        return trials, ""
    group = trials["zero_stage"].astype(str) + "/" + trials["precision"].astype(str)
    clean_groups = set(group[(trials["status"] == "ok") & ~flagged])
    drop = flagged & group.isin(clean_groups)
    kept = sorted(set(trials.loc[flagged & ~drop, "trial_id"].astype(str)))
    note = ""
    if drop.any():
        note = f"{int(drop.sum())} contended trial(s) left out of the fit (another process slowed them)"
    if kept:
        note += (
            "; " if note else ""
        ) + f"contended and fitted, the only trial(s) of their group: {', '.join(kept)}"
    return trials[~drop], note
