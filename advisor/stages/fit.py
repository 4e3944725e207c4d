"""The fit stage: the memory and step-time models, fitted on every trial that ran (the checks included, now
that their held-out error is recorded)."""

from __future__ import annotations

from dataclasses import dataclass, field

from advisor.model.memory import MemoryModel
from advisor.model.prediction_error import fit_models
from advisor.model.step_time import TimeModel
from advisor.stages.measure import HardwareFigures, MeasuredTrials


@dataclass
class FittedModels:
    """The models the predictions and the recommendation use."""

    memory: MemoryModel
    """Bytes per rank of any config at any world size."""
    timing: TimeModel
    """Step time of any config at any node count, compute and exposed communication apart."""
    notes: list[str] = field(default_factory=list)
    """What each fit had to assume (the memory model's first, then the timing model's)."""


def fit(measured: MeasuredTrials, hardware: HardwareFigures) -> FittedModels:
    models = fit_models(measured.trials, measured.numels, measured.zero, hardware.measured_net)
    return FittedModels(models.memory, models.timing, models.memory.notes + models.timing.notes)
