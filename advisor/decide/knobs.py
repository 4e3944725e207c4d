"""`sdzero advise --tune-buckets`: overlap_comm and the reduce bucket, measured only where they matter.

DeepSpeed's autotuner measures every combination of its knobs. Here the model first predicts what each
setting would change: the bucket size sets how many reduction calls a step makes (a latency each) and
how big the last, never-hidden bucket is; overlap_comm decides whether ZeRO-2/3's reductions can hide
behind backward at all (advisor.model.collective_mix, `Collective.exposed_share`), and doubles ZeRO-1/2's
bucket memory. Only settings predicted to speed the recommended config up by KNOB_MATTERS or more, and to
fit in memory, are then run as trials, and the measured change is reported beside the predicted one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pandas as pd

from advisor.measure.grid import TrialSpec
from advisor.model.collective_cost import ops_from_mix
from advisor.model.collective_mix import collective_mix
from advisor.model.memory import MemoryModel, ZeroSettings
from advisor.model.network import Network
from advisor.model.step_time import TimeModel, measured_step_s

KNOB_MATTERS = 0.03
"""A setting is measured only if the model predicts it shortens the step by at least this fraction."""
MAX_KNOB_TRIALS = 2
BUCKET_FACTORS = (0.25, 4.0)
"""Bucket sizes tried besides the JSON's: a quarter (more, smaller calls; a smaller last bucket) and
four times (fewer calls; a bigger last bucket)."""


@dataclass(frozen=True)
class KnobChoice:
    overlap_comm: bool
    reduce_bucket_size: int
    predicted_step_s: float
    change: float
    """Predicted step over the JSON's settings' predicted step, minus 1 (negative: faster)."""
    fits: bool = True


def knob_choices(
    timing: TimeModel,
    numels: tuple[int, ...],
    zero: ZeroSettings,
    stage: int,
    precision: str,
    micro_batch: int,
    grad_accum: int,
    nodes: int,
    net: Network,
    offload: str = "none",
    memory: MemoryModel | None = None,
    usable_bytes: float = float("inf"),
) -> list[KnobChoice]:
    """Every other overlap_comm x bucket setting, predicted, fastest first. Both sides are costed from the
    derived mix, so the comparison is like for like whatever the trials logged."""
    if stage == 0:
        return []  # plain data parallel: DeepSpeed's own 500M-element bucket, no overlap_comm
    world = nodes * net.gpus_per_node

    def step_s(settings: ZeroSettings) -> float:
        mix = ops_from_mix(collective_mix(numels, stage, max(world, 2), settings))
        model = replace(timing, ops={**timing.ops, stage: mix})
        return model.predict(stage, precision, micro_batch, grad_accum, nodes, net, offload).step_time_s

    base = step_s(zero)
    buckets = {max(2, int(zero.reduce_bucket_size * f) // 2 * 2) for f in BUCKET_FACTORS}
    out = []
    for overlap in (False, True):
        for bucket in sorted(buckets | {zero.reduce_bucket_size}):
            settings = replace(zero, overlap_comm=overlap, reduce_bucket_size=bucket)
            if settings == zero:
                continue
            fits = memory is None or (
                replace(memory, zero=settings).per_rank_bytes(stage, precision, micro_batch, offload, world)[
                    "total"
                ]
                <= usable_bytes
            )
            predicted = step_s(settings)
            out.append(KnobChoice(overlap, bucket, predicted, predicted / base - 1, fits))
    return sorted(out, key=lambda c: c.predicted_step_s)


def worth_measuring(choices: list[KnobChoice], threshold: float = KNOB_MATTERS) -> list[KnobChoice]:
    return [c for c in choices if c.fits and -c.change >= threshold][:MAX_KNOB_TRIALS]


def tune_buckets(
    best: pd.Series, choices: list[KnobChoice], runner: Callable[[list[TrialSpec]], pd.DataFrame], ranks: int
) -> list[str]:
    """Run the recommended config with the settings worth measuring (and as the JSON has it, if not yet
    measured at these ranks); one note per setting: predicted and measured change."""
    chosen = worth_measuring(choices)
    if not choices:
        return ["--tune-buckets: ZeRO-0 has no bucket or overlap_comm setting to tune"]
    if not chosen:
        top = choices[0]
        return [
            f"--tune-buckets: no overlap_comm/bucket setting is predicted to shorten the step by "
            f"{KNOB_MATTERS:.0%} or more (best: overlap_comm {'on' if top.overlap_comm else 'off'}, "
            f"reduce_bucket_size {top.reduce_bucket_size:,}: {top.change:+.1%}); none measured"
        ]
    plain = TrialSpec(
        int(best["zero_stage"]), str(best["dtype"]), int(best["micro_batch"]), str(best["offload"]), ranks
    )
    specs = [plain] + [
        replace(plain, overlap_comm=c.overlap_comm, reduce_bucket_size=c.reduce_bucket_size) for c in chosen
    ]
    table = runner(specs).set_index("trial_id")

    def measured(spec: TrialSpec) -> float | None:
        if spec.trial_id not in table.index or table.loc[spec.trial_id, "status"] != "ok":
            return None
        return float(measured_step_s(table.loc[[spec.trial_id]]).iloc[0])

    reference = measured(plain)
    notes = []
    for c, spec in zip(chosen, specs[1:], strict=True):
        got = measured(spec)
        seen = "failed" if got is None or reference is None else f"measured {got / reference - 1:+.1%}"
        notes.append(
            f"--tune-buckets: overlap_comm {'on' if c.overlap_comm else 'off'}, reduce_bucket_size "
            f"{c.reduce_bucket_size:,}: predicted {c.change:+.1%}, {seen} ({spec.trial_id})"
        )
    return notes
