"""`sdzero advise`: inputs -> measure -> fit -> predict -> recommend -> report, in one folder.

    <out>/profile/trials.csv       every trial (advisor.measure.profile's format; rerunning resumes it)
    <out>/comm/comm.csv, comm_fit.json
    <out>/trials.csv               the trials for the report (with its `dtype` column)
    <out>/predictions.csv, validation.csv, recommendation.json, recommended_ds_config.json,
    <out>/environment.json, <out>/report.html
    <out>/plan_inputs.json         what `sdzero advise --replan <out>` needs besides the trials (advisor.stages.replan)
    <out>/advise.log               library chatter, kept off the terminal

The files follow the data contract in advisor.report.build's docstring. Without --model/--data the embedded tiny
model and synthetic data are written into <out>/ first, so `sdzero advise --max-nodes 32` runs anywhere.

run_advise composes the stages of advisor.stages, each a function from the typed outputs of those before it
to its own; the options are one AdviseRequest (advisor.stages.request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from advisor.stages.fine_tune import (
    default_inputs as default_inputs,  # re-exported: bench/advisor_accuracy.py
)
from advisor.stages.fit import fit
from advisor.stages.inputs import read_inputs
from advisor.stages.measure import measure_hardware, measure_trials
from advisor.stages.predict import predict
from advisor.stages.recommend import recommend_config, write_recommendation
from advisor.stages.replan import replan_stages, write_plan_inputs
from advisor.stages.report import write_report
from advisor.stages.request import CPU_GRID as CPU_GRID  # re-exported: bench/advisor_accuracy.py
from advisor.stages.request import AdviseRequest


@dataclass
class AdviseResult:
    out_dir: Path
    recommendation: dict[str, Any]
    """recommendation.json's payload."""
    trials_run: int
    full_grid: int
    report: Path | None
    notes: list[str] = field(default_factory=list)


def run_advise(request: AdviseRequest) -> AdviseResult:
    """The whole advise pipeline; bad input raises UserError before any trial starts. With
    `request.replan` the inputs and measurements are an earlier run's (advisor.stages.replan)."""
    from sdzero.checkpoint.output_lock import release_output_dir

    try:
        return _advise(request)
    finally:
        release_output_dir(request.out_dir)  # the inputs stage claimed it


def _advise(request: AdviseRequest) -> AdviseResult:
    if request.replan is not None:
        inputs, hardware, measured = replan_stages(request)
    else:
        inputs = read_inputs(request)
        hardware = measure_hardware(inputs)
        measured = measure_trials(inputs, hardware)
        write_plan_inputs(inputs, hardware, measured)
    fitted = fit(measured, hardware)
    notes = [*inputs.notes, *hardware.notes, *measured.notes, *fitted.notes]
    predictions = predict(inputs, hardware, measured, fitted, notes)
    choice = recommend_config(inputs, hardware, measured, fitted, predictions)
    notes += choice.notes
    recommendation = write_recommendation(inputs, hardware, measured, predictions, choice, notes)
    report = write_report(inputs.out_dir)
    # One list: the payload in memory (not the file, already written) gets the report's note too.
    notes += report.notes
    trials_run = len(measured.trials)
    return AdviseResult(
        inputs.out_dir, recommendation, trials_run, measured.search.full_grid, report.path, notes
    )
