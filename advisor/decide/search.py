"""Search economy: one launch per group (ZeRO stage, precision, offload), as many groups as the budget holds.

A launch (advisor.measure.launch) starts the trainer once and measures all its configs side by side, so a
config costs its steps, not a start-up. Each group's launch takes every micro-batch of its ladder that the
global batch can use and the fitted model does not predict to run out of memory (`launch_specs`), plus
its largest micro-batch at accumulation 4: the check, held out of the fit that predicts it (every other
config of the grid runs at the base accumulation; the plans run at others, so this is the figure that
says how far to trust them).

The first launch is the first ladder's (the reference's group). Its measured cost, start-up seconds and
seconds per step (`LaunchCosts`), plans the rest: the budget left is split evenly over the launches it
holds, each measuring for its share less the start-up, and the log says up front what the budget covers.
Without --budget-minutes the default budget follows the model's cost (`default_budget_s`). Each next
group is the one whose config the model ranks most promising (`choose_next`, judged at every node count
the global batch reaches); groups the budget cannot hold are predicted, borrowing the measured ones'
costs.

`run_specs` is injected: `sdzero advise` launches real trials; tests replay a synthetic grid through the
very same choices.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import pandas as pd

from advisor.measure.grid import (
    ACCUMULATION_CHECK,
    GridPlan,
    TrialSpec,
    accumulation_check,
    is_checkpointed,
)
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
    """The configs launched, in order."""
    log: list[str] = field(default_factory=list)
    check_ids: list[str] = field(default_factory=list)
    """The accumulation checks that measured: held out of the fit that predicts them."""
    budget_s: float = 0.0
    """The budget the search ran under (the default one may follow the first launch's cost)."""


def _own_machine_rate(
    models: Models, spec: TrialSpec, measured_net: Network, usable_bytes: float
) -> float | None:
    """Predicted samples/s of `spec` as a trial would run it (its ranks, one node, accumulation 1), or
    None where the model predicts it not to fit in `usable_bytes`."""
    mem = models.memory.per_rank_bytes(
        spec.zero_stage,
        spec.precision,
        spec.micro_batch,
        spec.offload,
        spec.ranks_per_node,
        spec.checkpointing,
    )
    if mem["total"] > usable_bytes:
        return None
    net = replace(measured_net, gpus_per_node=spec.ranks_per_node)
    step = models.timing.predict(
        spec.zero_stage, spec.precision, spec.micro_batch, 1, 1, net, spec.offload, spec.checkpointing
    )
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
    ladder = (spec.zero_stage, spec.precision, spec.offload, spec.ranks_per_node, spec.checkpointing)
    for _, row in trials[trials["status"] == "oom"].iterrows():
        other = (
            int(row["zero_stage"]),
            str(row["precision"]),
            str(row["offload"]),
            int(row["ranks_per_node"]),
            is_checkpointed(row),
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
        c.zero_stage, c.precision, c.micro_batch, accum, nodes, target_net, c.offload, c.checkpointing
    )
    return step.samples_per_s


def _best_measured(
    models: Models,
    trials: pd.DataFrame,
    nodes: int,
    target_net: Network,
    target: BatchTarget | None,
    usable_bytes: float = math.inf,
) -> float:
    """The best predicted samples/s at `nodes` of the measured configs that fit `usable_bytes` there: a
    faster one that does not fit (measured before the memory model knew) is no leader to beat."""
    rates = []
    world = nodes * target_net.gpus_per_node
    for _, r in trials[trials["status"] == "ok"].iterrows():
        c = Candidate(
            int(r["zero_stage"]),
            str(r["precision"]),
            int(r["micro_batch"]),
            str(r.get("offload", "none")),
            is_checkpointed(r),
        )
        mem = models.memory.per_rank_bytes(
            c.zero_stage, c.precision, c.micro_batch, c.offload, world, c.checkpointing
        )
        if mem["total"] <= usable_bytes:
            rates.append(_rate(models, c, nodes, target_net, target))
    return max((r for r in rates if r is not None), default=0.0)


@dataclass(frozen=True)
class Judged:
    """Where the search judges a config: on the target's network, at these node counts, within this memory
    per rank, towards this global batch."""

    target_net: Network
    target_nodes: int | Sequence[int]
    usable_bytes: float
    target: BatchTarget | None


def choose_next(
    plan: GridPlan, trials: pd.DataFrame, models: Models | None, judged: Judged
) -> tuple[TrialSpec | None, str]:
    """The next grid point to measure, or None and why the search is done.

    Each candidate is judged at every node count in `target_nodes` where the global batch is within its
    reach, against the best measured config at that same node count: under a fixed batch the largest
    node count admits only the smallest micro-batch, so judging there alone would leave every other
    micro-batch unmeasured (and the model's compute slope unfitted). The pick leads its node count's best
    measured config by the widest margin."""
    if models is None:
        return None, "no trial succeeded, nothing to fit"
    scored = _scored(plan, trials, models, judged)
    if not scored:
        return None, "every unmeasured grid point is measured, predicted not to fit, or above an OOM"
    lead, top_rate, nodes, top, best = scored[0]
    # While a precision has a single micro-batch measured its compute is taken as proportional to the
    # micro-batch, which cannot tell the micro-batches apart: measure the pick to learn the slope.
    if not models.timing.proportional and lead <= 1 + DOMINATED_MARGIN:
        return None, (
            f"no unmeasured config is predicted faster than the best measured one at any of "
            f"{', '.join(map(str, _counts(judged.target_nodes)))} nodes ({top.trial_id} at {nodes}: "
            f"{top_rate:.1f} vs {best:.1f} samples/s)"
        )
    return top, f"model's pick: {top.trial_id}, predicted {top_rate:.1f} samples/s at {nodes} nodes"


def _counts(target_nodes: int | Sequence[int]) -> tuple[int, ...]:
    return (target_nodes,) if isinstance(target_nodes, int) else tuple(target_nodes)


def _scored(
    plan: GridPlan, trials: pd.DataFrame, models: Models, judged: Judged
) -> list[tuple[float, float, int, TrialSpec, float]]:
    """Every unmeasured grid point that fits, at every judged node count the global batch reaches:
    (predicted rate over that count's best measured one, predicted rate, node count, spec, best measured
    rate), the widest lead first."""
    target_net, usable_bytes, target = judged.target_net, judged.usable_bytes, judged.target
    node_counts = _counts(judged.target_nodes)
    best = {n: _best_measured(models, trials, n, target_net, target, usable_bytes) for n in node_counts}
    scored: list[tuple[float, float, int, TrialSpec, float]] = []
    for spec in (s for ladder in plan.ladders for s in ladder):
        if _blocked(spec, trials):
            continue
        c = Candidate(spec.zero_stage, spec.precision, spec.micro_batch, spec.offload, spec.checkpointing)
        trial_mem = models.memory.per_rank_bytes(
            c.zero_stage, c.precision, c.micro_batch, c.offload, spec.ranks_per_node, c.checkpointing
        )
        for n in node_counts:
            rate = _rate(models, c, n, target_net, target)
            world = n * target_net.gpus_per_node
            target_mem = models.memory.per_rank_bytes(
                c.zero_stage, c.precision, c.micro_batch, c.offload, world, c.checkpointing
            )
            if rate is None or max(trial_mem["total"], target_mem["total"]) > usable_bytes:
                continue
            scored.append((rate / best[n] if best[n] > 0 else float("inf"), rate, n, spec, best[n]))
    scored.sort(key=lambda t: -t[0])
    return scored


def decided(
    groups: Sequence[Sequence[TrialSpec]], trials: pd.DataFrame, models: Models | None, judged: Judged
) -> str | None:
    """Why launching the groups left would not change the pick, or None while one might: every config of
    them that is predicted to fit is predicted slower than the best measured one by more than
    DECIDED_MARGIN at every judged node count. Never while nothing is measured or while a precision's
    compute is still taken as proportional to the micro-batch (one micro-batch measured)."""
    if not groups or models is None or models.timing.proportional:
        return None
    scored = _scored(GridPlan(list(groups)), trials, models, judged)
    if not scored:  # the memory model is least sure of the stages not launched: measure them
        return None
    lead, rate, nodes, top, best = scored[0]
    if lead >= 1 - DECIDED_MARGIN:
        return None
    return (
        f"the best of the groups left, {top.trial_id}, is predicted {1 - lead:.0%} slower than the best "
        f"measured at {nodes} nodes ({rate:.1f} vs {best:.1f} samples/s)"
    )


FIRST_LAUNCH_MEASURE_SHARE = 0.5
"""The first launch's share of its slot of the budget spent measuring: nothing is known of the start-up
yet, so it is taken to cost as much as the measuring."""
MIN_TIMED_STEPS = 6
"""The fewest timed steps a config gets in a launch: three interleaved rounds of two."""
UNTIMED_STEPS = 7
"""Steps per config a launch takes besides the timed ones: a warm-up, the instrumented step and a round of
two settling in its first visit, the second instrumented step opening its second visit, and up to a round
of two past the measuring time in its last."""
END_RESERVE = 0.04
END_RESERVE_S = 30.0
"""The budget kept for what follows the launches (fit, prediction, report; their time is in
docs/calibration/advisor-launches.md): this many seconds and END_RESERVE of the budget."""


def _usable(budget_s: float) -> float:
    """The budget's seconds the launches may take."""
    return budget_s * (1 - END_RESERVE) - END_RESERVE_S


CHECK_TRIALS = 1
"""Check configs per launch: its largest micro-batch at accumulation ACCUMULATION_CHECK, held out of the
fit that predicts it."""


@dataclass(frozen=True)
class LaunchCosts:
    """What a launch costs, measured by the first: its start-up and the seconds of one timed step."""

    startup_s: float
    step_s: float
    untimed_per_config_s: float | None = None
    """Seconds of a launch's steps besides its timed ones, per config (None: UNTIMED_STEPS steps)."""

    def min_measure_s(self, configs: int) -> float:
        return configs * MIN_TIMED_STEPS * self.step_s

    def untimed_s(self, configs: int) -> float:
        """A launch's steps besides its timed ones: each config's first round (warm-up, instrumented
        step, settling) and the last round's overshoot past the measuring time."""
        per_config = self.untimed_per_config_s
        return configs * (UNTIMED_STEPS * self.step_s if per_config is None else per_config)

    def launch_s(self, configs: int, measure_s: float) -> float:
        return self.startup_s + self.untimed_s(configs) + max(measure_s, self.min_measure_s(configs))


def default_budget_s(base_s: float, costs: LaunchCosts, groups: int, configs: int, spent_s: float) -> float:
    """The default budget's rule: `base_s` (5 minutes on a CPU, 30 on a GPU), or the time every group's
    launch takes once at the first launch's measured cost (its start-up and MIN_TIMED_STEPS of each
    config), whichever is longer. --budget-minutes replaces it (and caps it)."""
    every_group = spent_s + groups * costs.launch_s(configs, 0.0)
    return max(base_s, (every_group + END_RESERVE_S) / (1 - END_RESERVE))


def launch_specs(
    ladder: Sequence[TrialSpec],
    trials: pd.DataFrame,
    in_reach: Callable[[int], bool],
    fits: Callable[[TrialSpec], bool],
) -> list[TrialSpec]:
    """A group's launch: every micro-batch of its ladder the global batch can use and the model does not
    predict to run out of memory (in-launch, an out-of-memory one ends itself and the larger ones), and
    the largest of them again at accumulation ACCUMULATION_CHECK: the check, held out of the fit."""
    specs = [s for s in ladder if in_reach(s.micro_batch) and not _blocked(s, trials) and fits(s)]
    if not specs:
        specs = [s for s in ladder[:1] if not _blocked(s, trials)]
    # the check is the largest config without checkpointing where there is one (what most plans run)
    checked = [s for s in specs if not s.checkpointing] or specs
    if checked and (checked[-1].grad_accum or 1) < ACCUMULATION_CHECK:
        check = accumulation_check(checked[-1])
        if not _blocked(check, trials):
            specs.append(check)
    return specs


def run_search(
    plan: GridPlan,
    run_specs: Callable[..., pd.DataFrame],
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
    default_base_s: float | None = None,
) -> SearchResult:
    """One launch per group (a ladder: ZeRO stage, precision, offload), the reference's group first, then
    the group the model ranks most promising, while the budget has room; see the module docstring.
    `run_specs(specs, measure_s=...)` returns the whole trial table. `default_base_s`: the budget is the
    default one (no --budget-minutes), which the first launch's cost may raise (`default_budget_s`)."""
    say = log or (lambda message: None)
    started = time.monotonic()
    result = SearchResult(pd.DataFrame(), plan.max_trials)
    in_reach = _reach(target_net, target_nodes, target)
    groups = list(plan.ladders)
    limit = max_trials if max_trials is not None else math.inf
    trials = pd.DataFrame(columns=["trial_id", "status"])
    costs: LaunchCosts | None = None
    judged = Judged(target_net, target_nodes, usable_bytes, target)
    _hold_to(run_specs, started + _usable(budget_s))
    while groups and len(trials) < limit:
        left = _usable(budget_s) - (time.monotonic() - started)
        # fitted once per launch decision: the stop, the next group and what fits all read these models
        models = fit_models(trials, numels, zero, measured_net) if (trials["status"] == "ok").any() else None
        why_done = decided(groups, trials, models, judged)
        if why_done is not None:
            result.log.append(f"stopped: the pick is decided; {len(groups)} groups not launched: {why_done}")
            say(result.log[-1])
            break
        group = _next_group(groups, trials, models, judged)
        groups.remove(group)
        fits = _fits(models, usable_bytes)
        specs = launch_specs(group, trials, in_reach, fits)
        if not specs:
            continue
        if costs is None:
            measure_s = left / (len(groups) + 1) * FIRST_LAUNCH_MEASURE_SHARE
        else:
            if costs.launch_s(len(specs), 0.0) > left:
                result.log.append(f"stopped: --budget-minutes reached; {len(groups) + 1} groups not launched")
                say(result.log[-1])
                break
            covered = max(1, min(len(groups) + 1, int(left // costs.launch_s(len(specs), 0.0))))
            slot = left / covered - costs.startup_s - costs.untimed_s(len(specs))
            measure_s = max(slot, costs.min_measure_s(len(specs)))
        why = f"launch {len(result.chosen_by_model) + 1}: {_group_name(group)}, {len(specs)} configs"
        result.log.append(why)
        result.chosen_by_model += [s.trial_id for s in specs]
        trials = run_specs(specs, measure_s=measure_s)
        if costs is None:
            costs = _costs(run_specs, trials)
            if costs is not None:
                if default_base_s is not None:
                    spent = time.monotonic() - started
                    budget_s = default_budget_s(default_base_s, costs, len(plan.ladders), len(specs), spent)
                    _hold_to(run_specs, started + _usable(budget_s))
                line = _budget_line(costs, budget_s, time.monotonic() - started, groups, len(specs))
                result.log.append(line)
                say(line)
    result.check_ids = sorted(
        trials.loc[
            (trials["status"] == "ok") & trials["trial_id"].astype(str).isin(_check_ids(trials)), "trial_id"
        ]
    )
    result.trials = trials
    result.budget_s = budget_s
    return result


DECIDED_MARGIN = 0.15
"""The search stops launching groups once every config of the groups left is predicted slower than the
best measured one by more than this fraction (their costs are borrowed, so the margin is wider than one
measurement's noise): a larger grid then costs the launches that can change the pick, not one per group."""


def _hold_to(run_specs: Callable[..., pd.DataFrame], deadline: float) -> None:
    """The runner's own deadline (a contended launch is launched again only before it): the search's."""
    if hasattr(run_specs, "deadline"):
        run_specs.deadline = deadline


def _next_group(
    groups: list[list[TrialSpec]], trials: pd.DataFrame, models: Models | None, judged: Judged
) -> list[TrialSpec]:
    """The group of the model's pick (choose_next over the groups not launched); the first of them while
    nothing is measured or the model picks none."""
    if models is None:
        return groups[0]
    pick, _ = choose_next(GridPlan(groups), trials, models, judged)
    return next((g for g in groups if pick is not None and pick in g), groups[0])


def _fits(models: Models | None, usable_bytes: float) -> Callable[[TrialSpec], bool]:
    def fits(spec: TrialSpec) -> bool:
        if models is None:
            return True
        mem = models.memory.per_rank_bytes(
            spec.zero_stage,
            spec.precision,
            spec.micro_batch,
            spec.offload,
            spec.ranks_per_node,
            spec.checkpointing,
        )
        return mem["total"] <= usable_bytes

    return fits


def _costs(run_specs: Callable[..., pd.DataFrame], trials: pd.DataFrame) -> LaunchCosts | None:
    """The launches' measured costs (the runner's); where a runner keeps none (a replay of recorded
    trials), the first launch's configs' wall times, each a run of the config alone, as its start-up."""
    measured = getattr(run_specs, "costs", None)
    found = measured() if callable(measured) else None
    if found is not None:
        return LaunchCosts(*found)
    walls = pd.to_numeric(trials.get("wall_s", pd.Series(dtype=float)), errors="coerce").dropna()
    return LaunchCosts(float(walls.sum()), 0.0) if len(walls) else None


def _budget_line(costs: LaunchCosts, budget_s: float, spent_s: float, groups: list, configs: int) -> str:
    """What the budget covers, said once the first launch measured its cost."""
    left = _usable(budget_s) - spent_s
    per_launch = costs.launch_s(configs, 0.0)
    covered = min(len(groups), max(0, int(left // per_launch))) if per_launch > 0 else len(groups)
    names = ", ".join(_group_name(g) for g in groups[:covered]) or "none"
    return (
        f"budget: {budget_s / 60:.1f} min; the first launch measured a start-up of {costs.startup_s:.0f} s and "
        f"{costs.step_s:.2f} s a step, so the {left:.0f} s left cover {covered} of the {len(groups)} other "
        f"groups ({names})" + ("" if covered == len(groups) else "; the rest are predicted, not measured")
    )


def _group_name(group: Sequence[TrialSpec]) -> str:
    return "-".join(p for p in group[0].trial_id.split("-") if not p.startswith(("mb", "ga")) and p != "gc")


def _check_ids(trials: pd.DataFrame) -> set[str]:
    """The accumulation checks: rows at ACCUMULATION_CHECK."""
    accum = pd.to_numeric(trials.get("grad_accum", pd.Series(dtype=float)), errors="coerce")
    ids = trials.loc[accum == ACCUMULATION_CHECK, "trial_id"].astype(str)
    return {i for i in ids if i.endswith(f"-ga{ACCUMULATION_CHECK}")}
