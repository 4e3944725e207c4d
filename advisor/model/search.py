"""Search economy: measure a small seed set, then let the model choose each next trial.

Seeds: the reference (advisor.measure.grid.GridPlan.reference, a middle rung of the first ladder: the
runner's drift probe and a second point for the compute slope), then the smallest micro-batch of every
ladder (one point per stage and precision, for the intercepts and the communication mix). Until a
precision has a second micro-batch measured its compute is taken as proportional to the micro-batch; the
model's first pick, its predicted best (a large micro-batch), then gives the slope. Then, until the
budget is spent: refit, predict every unmeasured grid point at the target node count, drop those predicted
not to fit (in the trial or at the target), those above an out-of-memory trial of their ladder, and those
predicted more than DOMINATED_MARGIN slower than the best prediction; measure the fastest of the rest.
It stops when nothing is left: the best predicted config is then measured.

Second micro-batches: when the model has nothing left to pick and the budget still has room for more than
the trials kept in reserve (`reserve_trials`: the check trials that come after the search), each ladder
measured at one micro-batch only gets a second one (`slope_specs`: its largest that fits), so that its
stage's compute has a line of its own (advisor.model.step_time) instead of the slope of the others; the
model then picks again. A 5-minute default run ended in 178 of its 300 s with ZeRO-3 measured at one
micro-batch and its micro-batches 2-8 off by 15-17% (docs/advisor.md, round 3).

Noise: configs are compared by measurements corrected for the machine's drift (advisor.measure.runner
brackets the trials with a reference config). When the two fastest measured configs are within each
other's intervals (`contenders`), the search has them measured again, A B B A (`rematch`: a duel,
advisor.measure.duel, when the runner offers it and the budget has room beside the reserve; it stops one
trial early to leave that room), so that a slow minute does not decide between them.

`run_specs` is injected: `sdzero advise` runs real trials, bench/advisor_accuracy.py replays a measured
full grid through the very same choices.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pandas as pd

from advisor.measure.duel import DUEL_ORDER
from advisor.measure.grid import GridPlan, TrialSpec
from advisor.model.memory import ZeroSettings
from advisor.model.network import Network
from advisor.model.predict import BatchTarget, Candidate, grad_accum_for
from advisor.model.prediction_error import Models, fit_models

DOMINATED_MARGIN = 0.0
"""A config is measured only if the model predicts it beats every measured one by more than this fraction
of the best; bench/advisor_accuracy.py measures what stopping there costs against the full grid."""


@dataclass
class SearchResult:
    trials: pd.DataFrame
    full_grid: int
    chosen_by_model: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


def seed_specs(plan: GridPlan) -> list[TrialSpec]:
    """The reference first (GridPlan.reference: the runner's drift probe, and a second rung of its ladder
    for the compute slope), then the smallest micro-batch of every ladder."""
    smallest = [ladder[0] for ladder in plan.ladders]
    reference = plan.reference
    return [reference, *(s for s in smallest if s != reference)] if reference else smallest


def slope_specs(
    plan: GridPlan,
    trials: pd.DataFrame,
    numels: tuple[int, ...],
    zero: ZeroSettings,
    measured_net: Network,
    usable_bytes: float,
    in_reach: Callable[[int], bool] = lambda micro_batch: True,
) -> list[TrialSpec]:
    """For each ladder with one micro-batch measured (ok) and no other, its largest unmeasured micro-batch
    that the model predicts to fit and the global batch can use (`in_reach`): the widest lever for the
    ladder's own slope where a prediction can need it. Fastest predicted first (on the trials' own
    machine), so that a budget with room for one measures the one that matters most."""
    ok = trials[trials["status"] == "ok"]
    if ok.empty:
        return []
    models = fit_models(trials, numels, zero, measured_net)
    measured = set(ok["trial_id"].astype(str))
    scored: list[tuple[float, TrialSpec]] = []
    for ladder in plan.ladders:
        if sum(spec.trial_id in measured for spec in ladder) != 1:
            continue
        for spec in reversed(ladder):
            if _blocked(spec, trials) or not in_reach(spec.micro_batch):
                continue
            rate = _own_machine_rate(models, spec, measured_net, usable_bytes)
            if rate is not None:
                scored.append((rate, spec))
                break
    scored.sort(key=lambda t: -t[0])
    return [spec for _, spec in scored]


def _own_machine_rate(
    models: Models, spec: TrialSpec, measured_net: Network, usable_bytes: float
) -> float | None:
    """Predicted samples/s of `spec` as a trial would run it (its ranks, one node, accumulation 1), or
    None where the model predicts it not to fit in `usable_bytes`."""
    mem = models.memory.per_rank_bytes(
        spec.zero_stage, spec.precision, spec.micro_batch, spec.offload, spec.ranks_per_node
    )
    if mem["total"] > usable_bytes:
        return None
    net = replace(measured_net, gpus_per_node=spec.ranks_per_node)
    step = models.timing.predict(spec.zero_stage, spec.precision, spec.micro_batch, 1, 1, net, spec.offload)
    return step.samples_per_s


def _reach(
    target_net: Network, target_nodes: int | Sequence[int], target: BatchTarget | None
) -> Callable[[int], bool]:
    """Whether the global batch admits a micro-batch at some node count the search judges."""
    node_counts = (target_nodes,) if isinstance(target_nodes, int) else tuple(target_nodes)

    def in_reach(micro_batch: int) -> bool:
        world = target_net.gpus_per_node
        return any(grad_accum_for(micro_batch, n * world, target) is not None for n in node_counts)

    return in_reach


def _blocked(spec: TrialSpec, trials: pd.DataFrame) -> bool:
    """Measured already, or above an out-of-memory trial of the same ladder."""
    mine = trials[trials["trial_id"] == spec.trial_id]
    if not mine.empty:
        return True
    ladder = (spec.zero_stage, spec.precision, spec.offload, spec.ranks_per_node)
    for _, row in trials[trials["status"] == "oom"].iterrows():
        other = (
            int(row["zero_stage"]),
            str(row["precision"]),
            str(row["offload"]),
            int(row["ranks_per_node"]),
        )
        if other == ladder and spec.micro_batch >= int(row["micro_batch"]):
            return True
    return False


def _rate(
    models: Models, c: Candidate, nodes: int, target_net: Network, target: BatchTarget | None
) -> float | None:
    """Predicted samples/s of `c` at `nodes` nodes, or None where the global batch is out of its reach."""
    accum = grad_accum_for(c.micro_batch, nodes * target_net.gpus_per_node, target)
    if accum is None:
        return None
    step = models.timing.predict(
        c.zero_stage, c.precision, c.micro_batch, accum, nodes, target_net, c.offload
    )
    return step.samples_per_s


def _best_measured(
    models: Models, trials: pd.DataFrame, nodes: int, target_net: Network, target: BatchTarget | None
) -> float:
    rates = [
        _rate(
            models,
            Candidate(
                int(r["zero_stage"]),
                str(r["precision"]),
                int(r["micro_batch"]),
                str(r.get("offload", "none")),
            ),
            nodes,
            target_net,
            target,
        )
        for _, r in trials[trials["status"] == "ok"].iterrows()
    ]
    return max((r for r in rates if r is not None), default=0.0)


def choose_next(
    plan: GridPlan,
    trials: pd.DataFrame,
    numels: tuple[int, ...],
    zero: ZeroSettings,
    measured_net: Network,
    target_net: Network,
    target_nodes: int | Sequence[int],
    usable_bytes: float,
    target: BatchTarget | None,
) -> tuple[TrialSpec | None, str]:
    """The next grid point to measure, or None and why the search is done.

    Each candidate is judged at every node count in `target_nodes` where the global batch is within its
    reach, against the best measured config at that same node count: under a fixed batch the largest
    node count admits only the smallest micro-batch, so judging there alone would leave every other
    micro-batch unmeasured (and the model's compute slope unfitted). The pick leads its node count's best
    measured config by the widest margin."""
    if (trials["status"] == "ok").sum() == 0:
        return None, "no trial succeeded, nothing to fit"
    node_counts = (target_nodes,) if isinstance(target_nodes, int) else tuple(target_nodes)
    models = fit_models(trials, numels, zero, measured_net)
    best = {n: _best_measured(models, trials, n, target_net, target) for n in node_counts}
    scored: list[tuple[float, float, int, TrialSpec]] = []
    for spec in (s for ladder in plan.ladders for s in ladder):
        if _blocked(spec, trials):
            continue
        c = Candidate(spec.zero_stage, spec.precision, spec.micro_batch, spec.offload)
        trial_mem = models.memory.per_rank_bytes(
            c.zero_stage, c.precision, c.micro_batch, c.offload, spec.ranks_per_node
        )
        for n in node_counts:
            rate = _rate(models, c, n, target_net, target)
            world = n * target_net.gpus_per_node
            target_mem = models.memory.per_rank_bytes(
                c.zero_stage, c.precision, c.micro_batch, c.offload, world
            )
            if rate is None or max(trial_mem["total"], target_mem["total"]) > usable_bytes:
                continue
            scored.append((rate / best[n] if best[n] > 0 else float("inf"), rate, n, spec))
    if not scored:
        return None, "every unmeasured grid point is measured, predicted not to fit, or above an OOM"
    scored.sort(key=lambda t: -t[0])
    lead, top_rate, nodes, top = scored[0]
    # While a precision has a single micro-batch measured its compute is taken as proportional to the
    # micro-batch, which cannot tell the micro-batches apart: measure the pick to learn the slope.
    if not models.timing.proportional and lead <= 1 + DOMINATED_MARGIN:
        return None, (
            f"no unmeasured config is predicted faster than the best measured one at any of "
            f"{', '.join(map(str, node_counts))} nodes ({top.trial_id} at {nodes}: {top_rate:.1f} vs "
            f"{best[nodes]:.1f} samples/s)"
        )
    return top, f"model's pick: {top.trial_id}, predicted {top_rate:.1f} samples/s at {nodes} nodes"


def run_search(
    plan: GridPlan,
    run_specs: Callable[[list[TrialSpec]], pd.DataFrame],
    numels: tuple[int, ...],
    zero: ZeroSettings,
    measured_net: Network,
    target_net: Network,
    target_nodes: int | Sequence[int],
    usable_bytes: float,
    target: BatchTarget | None,
    budget_s: float,
    max_trials: int | None = None,
    log: Callable[[str], None] | None = None,
    reserve_trials: int = 0,
) -> SearchResult:
    """Seeds, then model-chosen trials while the budget allows. `run_specs` returns the whole trial table.
    `reserve_trials` trials' worth of the budget is kept from the second micro-batches and the duel (not
    from the model's own picks) for what runs after the search: advise's check trials."""
    say = log or (lambda message: None)
    started = time.monotonic()
    result = SearchResult(pd.DataFrame(), plan.max_trials)
    trials = run_specs(seed_specs(plan))
    limit = max_trials if max_trials is not None else plan.max_trials
    per_trial = 0.0
    while len(trials) < limit:
        walls = pd.to_numeric(trials.get("wall_s", pd.Series(dtype=float)), errors="coerce").dropna()
        per_trial = float(walls.mean()) if len(walls) else 0.0
        left = budget_s - (time.monotonic() - started)
        if per_trial > left:
            result.log.append(f"stopped: --budget-minutes reached after {len(trials)} trials")
            break
        if _duel_now(run_specs, trials, per_trial, left, reserve_trials * per_trial):
            result.log.append(
                f"stopped after {len(trials)} trials to leave the budget's last "
                f"{left:.0f} s to a duel of the two closest configs"
            )
            break
        spec, why = choose_next(
            plan, trials, numels, zero, measured_net, target_net, target_nodes, usable_bytes, target
        )
        if spec is None:
            spec, why = _second_micro_batch(
                plan,
                trials,
                numels,
                zero,
                measured_net,
                usable_bytes,
                _reach(target_net, target_nodes, target),
                left,
                per_trial,
                reserve_trials,
                why,
            )
        result.log.append(why)
        say(why)
        if spec is None:
            break
        result.chosen_by_model.append(spec.trial_id)
        trials = run_specs([spec])
    reserve_s = reserve_trials * per_trial
    left = budget_s - (time.monotonic() - started) - reserve_s
    trials = _rematch(run_specs, trials, result, left, say, reserve_s)
    result.trials = trials
    return result


def _second_micro_batch(
    plan: GridPlan,
    trials: pd.DataFrame,
    numels: tuple[int, ...],
    zero: ZeroSettings,
    measured_net: Network,
    usable_bytes: float,
    in_reach: Callable[[int], bool],
    left_s: float,
    per_trial: float,
    reserve_trials: int,
    done_why: str,
) -> tuple[TrialSpec | None, str]:
    """Once the model has nothing left to pick (`done_why`): the first of `slope_specs`, if the budget has
    room for it beside the reserve; else None and `done_why`."""
    specs = slope_specs(plan, trials, numels, zero, measured_net, usable_bytes, in_reach)
    if not specs:
        return None, done_why
    if per_trial * (1 + reserve_trials) > left_s:
        return None, f"{done_why}; no room for a second micro-batch of {specs[0].trial_id}'s ladder"
    spec = specs[0]
    return spec, (
        f"second micro-batch: {spec.trial_id}, so that its stage's compute gets a slope of its own "
        f"({done_why.split(' (')[0]})"
    )


def contenders(trials: pd.DataFrame) -> list[str]:
    """The fastest measured config (samples/s here) and the fastest other one whose interval overlaps
    its own; only the fastest when none does (or the trials carry no intervals)."""
    if "step_s_lo" not in trials or "step_s_hi" not in trials:
        return []
    ok = trials[(trials["status"] == "ok")].copy()
    for column in ("global_batch", "step_time_median_s", "step_s_lo", "step_s_hi"):
        ok[column] = pd.to_numeric(ok[column], errors="coerce")
    ok = ok.dropna(subset=["global_batch", "step_time_median_s", "step_s_lo", "step_s_hi"])
    if ok.empty:
        return []
    rate = ok["global_batch"] / ok["step_time_median_s"]
    best = rate.idxmax()
    best_lo = ok.at[best, "global_batch"] / ok.at[best, "step_s_hi"]
    rival_hi = ok["global_batch"] / ok["step_s_lo"]
    rivals = rate[(rival_hi >= best_lo) & (ok.index != best)]
    picked = [best] if rivals.empty else [best, rivals.idxmax()]
    return [str(ok.at[i, "trial_id"]) for i in picked]


def _duel_now(
    run_specs: Callable[[list[TrialSpec]], pd.DataFrame],
    trials: pd.DataFrame,
    per_trial: float,
    left: float,
    reserve_s: float = 0.0,
) -> bool:
    """Whether the budget left, less `reserve_s`, holds a duel but not one more trial besides: with the two
    fastest measured configs within each other's intervals, telling them apart is then worth more than one
    more config."""
    if getattr(run_specs, "rematch", None) is None or len(contenders(trials)) < 2:
        return False
    legs = len(DUEL_ORDER) * per_trial + reserve_s
    return legs <= left < legs + per_trial


def _rematch(
    run_specs: Callable[[list[TrialSpec]], pd.DataFrame],
    trials: pd.DataFrame,
    result: SearchResult,
    left_s: float,
    say: Callable[[str], None],
    reserve_s: float = 0.0,
) -> pd.DataFrame:
    """The two closest contenders measured again back to back, when the runner can and time allows:
    `left_s` is the budget left less `reserve_s`, which the runner keeps free too."""
    rematch = getattr(run_specs, "rematch", None)
    pair = contenders(trials)
    if rematch is None or len(pair) < 2:
        return trials
    walls = pd.to_numeric(trials.get("wall_s", pd.Series(dtype=float)), errors="coerce").dropna()
    per_trial = float(walls.mean()) if len(walls) else math.inf
    if 2 * per_trial > left_s:
        result.log.append(f"no rematch: {pair[0]} and {pair[1]} overlap, but the budget has no room")
        return trials
    line = f"rematch: {pair[0]} and {pair[1]} are within each other's intervals; measured again"
    result.log.append(line)
    say(line)
    return rematch(pair, reserve_s=reserve_s)


CHECK_TRIALS = 2
"""Configs measured after the search only to check the model: predicted before they run, never fitted."""
CHECK_COST_TRIALS = CHECK_TRIALS + 2
"""The check trials' cost in mean trials: CHECK_TRIALS and the accumulation check (advisor.stages.measure),
counted twice: it runs 4 micro-steps a step (40 s against a mean trial's 19 s with bf16 emulated)."""


def check_specs(
    plan: GridPlan,
    trials: pd.DataFrame,
    numels: tuple[int, ...],
    zero: ZeroSettings,
    measured_net: Network,
    usable_bytes: float,
    n: int = CHECK_TRIALS,
) -> list[TrialSpec]:
    """The `n` unmeasured grid points the fitted model ranks fastest on the trials' own machine among
    those it predicts to fit: the configs whose predicted figures matter most, and a fair test of them."""
    if n <= 0 or (trials["status"] == "ok").sum() == 0:
        return []
    models = fit_models(trials, numels, zero, measured_net)
    scored = []
    for spec in (s for ladder in plan.ladders for s in ladder):
        rate = None if _blocked(spec, trials) else _own_machine_rate(models, spec, measured_net, usable_bytes)
        if rate is not None:
            scored.append((rate, spec))
    scored.sort(key=lambda t: -t[0])
    return [spec for _, spec in scored[:n]]
