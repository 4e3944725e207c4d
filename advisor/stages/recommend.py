"""The recommend stage: the config and node count to run, its LR, and what the user is told about them.

recommend_config writes <out>/recommended_ds_config.json; write_recommendation writes
<out>/recommendation.json (advisor.decide.outcome.build_recommendation's payload, with the launch command and,
across a hostfile's hosts, the scale-out check).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.decide.checkpointing import with_checkpointing
from advisor.decide.outcome import Outcome, build_recommendation
from advisor.decide.recommend import launch_command, recommend
from advisor.decide.scaling_table import scaling_table
from advisor.model.prediction_error import ERROR_EXPLAINED, error_summary
from advisor.model.step_time import TimeModel
from advisor.stages.fit import FittedModels
from advisor.stages.inputs import AdviseInputs
from advisor.stages.measure import HardwareFigures, MeasuredTrials
from advisor.stages.predict import Predictions
from advisor.stages.scaleout_check import scaleout_check
from sdzero.atomic import write_json_atomic
from sdzero.config.lr_rule import LrChoice, base_lr_of


@dataclass
class Choice:
    """The recommended config, as chosen from the predictions."""

    best: pd.Series
    """Its predictions row (config, node count, global batch, predicted figures)."""
    config: dict[str, Any]
    """Its DeepSpeed JSON, LR included."""
    config_path: Path
    """<out>/recommended_ds_config.json."""
    runners: list[dict[str, Any]]
    """The other configs at the chosen node count, each with why it lost."""
    lr: LrChoice
    notes: list[str] = field(default_factory=list)
    """Why the node-count rule could not be kept as asked, and --tune-buckets' findings."""


def recommend_config(
    inputs: AdviseInputs,
    hardware: HardwareFigures,
    measured: MeasuredTrials,
    fitted: FittedModels,
    predictions: Predictions,
) -> Choice:
    """Choose the node count by the request's rule and the fastest config that fits there; measure its
    buckets if asked."""
    r = inputs.request
    rule = inputs.rule
    table = scaling_table(predictions.table, inputs.node_list, rule.min_efficiency, "", set())
    nodes, rule_note = rule.choose(table)
    best, config, runners, lr = recommend(
        predictions.table,
        inputs.base,
        hardware.usable_bytes,
        r.lr_scaling,
        inputs.lr_reference,
        nodes,
        rule.min_efficiency,
    )
    notes = [rule_note] if rule_note else []
    if r.tune_buckets:
        notes += tuned_buckets(inputs, hardware, measured, fitted, predictions, best)
    config_path = inputs.out_dir / "recommended_ds_config.json"
    write_json_atomic(config_path, config)
    return Choice(best, config, config_path, runners, lr, notes)


def tuned_buckets(
    inputs: AdviseInputs,
    hardware: HardwareFigures,
    measured: MeasuredTrials,
    fitted: FittedModels,
    predictions: Predictions,
    best: pd.Series,
) -> list[str]:
    """overlap_comm and bucket sizes, measured only where the model says they matter; one note each."""
    from advisor.decide.knobs import knob_choices, tune_buckets

    choices = knob_choices(
        predictions.timing,
        measured.numels,
        measured.zero,
        int(best["zero_stage"]),
        str(best["dtype"]),
        int(best["micro_batch"]),
        int(best["grad_accum"]),
        int(best["node_count"]),
        predictions.target_net,
        str(best["offload"]),
        fitted.memory,
        hardware.usable_bytes,
    )
    return tune_buckets(best, choices, measured.runner, inputs.ranks)


def write_recommendation(
    inputs: AdviseInputs,
    hardware: HardwareFigures,
    measured: MeasuredTrials,
    predictions: Predictions,
    choice: Choice,
    notes: list[str],
) -> dict[str, Any]:
    """recommendation.json's payload, written; `notes` (the run's, in order) go into it as they are."""
    outcome = _outcome(inputs, hardware, measured, predictions, choice, notes)
    recommendation = build_recommendation(outcome)
    timed = predictions.basis.timed
    recommendation["launch_command"] = launch_command(
        choice.config_path,
        inputs.model,
        inputs.data,
        # without the target's compute no node count is chosen: the command is one node's, said so
        int(choice.best["node_count"]) if timed else 1,
        inputs.target_gpus,
        inputs.request.hostfile,
        inputs.out_dir / "run",
        with_checkpointing(inputs.user_args, choice.best),
        choice.lr,
    )
    if not timed:
        recommendation["launch_command"] += " (one node shown: the node count is yours to choose)"
    recommendation["error_explained"] = ERROR_EXPLAINED
    if len(inputs.hosts) >= 2 and inputs.request.hostfile is not None:
        recommendation["scaleout_check"] = scaleout_check(
            choice.best,
            inputs.base,
            inputs.settings,
            inputs.request.hostfile,
            inputs.hosts,
            hardware.fit_path,
            inputs.out_dir,
            inputs.say,
            measured.numels,
        )
    write_json_atomic(inputs.out_dir / "recommendation.json", recommendation)
    return recommendation


def _outcome(
    inputs: AdviseInputs,
    hardware: HardwareFigures,
    measured: MeasuredTrials,
    predictions: Predictions,
    choice: Choice,
    notes: list[str],
) -> Outcome:
    r = inputs.request
    return Outcome(
        best=choice.best,
        runners=choice.runners,
        lr=choice.lr,
        trials=measured.trials,
        predictions=predictions.table,
        node_list=inputs.node_list,
        rule=inputs.rule,
        target=inputs.target,
        target_asked=inputs.target_asked,
        base_batch=inputs.base_batch,
        target_net=predictions.target_net,
        measured_net=hardware.measured_net,
        trial_device=inputs.device,
        trial_ranks=inputs.ranks,
        differs=inputs.differs,
        memory_bytes=hardware.memory_bytes,
        memory_source=hardware.memory_source,
        usable_bytes=hardware.usable_bytes,
        errors=error_summary(measured.validation),
        check_ids=measured.check_ids,
        search=measured.search,
        elapsed_s=time.monotonic() - inputs.started,
        budget_s=measured.budget_s,
        per_trial_s=measured.per_trial_s,
        notes=notes,
        amount=inputs.amount,
        startup=predictions.startup,
        gpu_hour_price=r.gpu_hour_price,
        micro_batches=tuple(sorted({c.micro_batch for c in predictions.candidates})),
        base_lr=base_lr_of(inputs.base),
        lr_reference=inputs.lr_reference,
        lr_scaling=r.lr_scaling,
        embedded=inputs.embedded,
        noise_floor=noise_floor(inputs.out_dir),
        intervals=predictions.spread.describe(),
        interval_notes=predictions.spread.notes,
        compute=predictions.basis,
        samples_rule=r.samples_rule,
        recompute=(recompute_share_of(predictions.timing, choice.best), predictions.timing.recompute_source),
    )


def noise_floor(out_dir: Path) -> float | None:
    """The run's noise floor (advisor.model.uncertainty.run_noise_floor), None when the run has none."""
    from advisor.model.uncertainty import run_noise_floor

    return run_noise_floor(out_dir)[0]


def recompute_share_of(timing: TimeModel, best: pd.Series) -> float:
    """What checkpointing adds per sample for the pick's ZeRO stage, precision and offload."""
    group = (int(best["zero_stage"]), str(best["dtype"]), str(best["offload"]))
    return timing.recompute_shares.get(group, timing.recompute_share)
