"""Time per optimizer step of a ZeRO config at any node count: fitted compute plus costed communication.

Compute per micro-step is fitted to the trials as a + b x micro_batch, with an intercept per ZeRO stage,
precision and offload (the stage changes hooks, gathers and the optimizer's share; offload moves the
optimizer to the CPU) and a slope per precision, shared by the groups measured at one micro-batch (the
network's work per sample is the same at every stage). A group measured at two or more micro-batches
gets a line of its own (`group_slopes`): what the stage adds per micro-step grows with the micro-batch
too (ZeRO-3's step grows faster with the micro-batch than ZeRO-1's: docs/calibration/advisor-rounds.md),
and a shared slope would put the average growth on every stage's unmeasured micro-batches. A trial's compute is its step time minus the
time its ranks spent inside collectives (DeepSpeed's comms_logger, plus the time they then waited for
async calls, which the trial times itself: sdzero.training.measuring.comm_meters.WaitMeter).

Once-per-step compute (the optimizer step, less the collectives inside it) is measured per group from
the trials' optimizer phase and charged once per step; the rest of a micro-step's compute is charged per
micro-step (see docs/performance-model.md).

Communication is the op mix each stage issues: derived from the network's parameter sizes and the JSON
(advisor.model.collective_mix) and, where a trial at 2+ ranks logged the stage, scaled to the logged
volumes (comms_logger); each op is costed at the target as advisor.model.collective_cost says (NCCL's
hierarchy, gloo's flat ring).

Transport and the wait for the slowest rank: per stage, the time the 1-node trials spent in collectives
against what the alpha-beta model says the same ops cost there. Where the trial recorded every rank's
time, the least any rank spent (per step) is the transport, whose ratio to the cost (`comm_factor`)
scales the within-node part, and rank 0's excess over it is its wait. Without per-rank figures: below the
cost the ratio (at most 1) is the transport; above it the excess is taken as the wait. A rank that
arrives first at a collective waits there for the slowest one (advisor.model.sync_wait); the wait is
carried as its own term (`wait_sigma_s`), per synchronisation, grown with the expected maximum of the
target's ranks, so a hosts x 1 prediction, whose within-node part is zero, keeps it. Neither is overlap:
the logged time is the collectives' own, not the step's.

Overlap: the bucket-level account of advisor.model.overlap, within and across nodes alike: what is issued
during forward or backward (all but the last reduce bucket with overlap_comm, all but the first ZeRO-3
prefetch) hides behind that phase's compute of the micro-step, measured as the trials' phase split;
collectives at the boundary and after the step never hide. Only on a device whose collectives run beside
compute (CUDA trials, `side_stream`); on a CPU, where DeepSpeed has no side stream, all is exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from advisor.model.collective_cost import CommOp, op_seconds, ops_by_mix, ops_from_mix, ops_from_trial
from advisor.model.collective_mix import Collective, collective_mix
from advisor.model.memory import ZeroSettings
from advisor.model.network import Network
from advisor.model.overlap import OpCost, Windows, exposed_s
from advisor.model.sync_wait import predicted_wait_s, sigma_s, wait_s
from advisor.model.target_compute import TargetCompute


@dataclass
class StepPrediction:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_time_s: float
    samples_per_s: float
    exposed_intra_s: float = 0.0
    """The link part of exposed_comm_s within nodes (exposed_inter_s: across nodes)."""
    exposed_inter_s: float = 0.0
    wait_s: float = 0.0
    """The part of exposed_comm_s spent waiting for the slowest rank (advisor.model.sync_wait): in
    collectives, but no link's."""


Group = tuple[int, str, str]
"""(ZeRO stage, precision, offload): what sets a config's fixed cost per micro-step (hooks, gathers, the
optimizer's share and, with offload, the CPU optimizer and its transfers)."""


def _closest_pair(values: dict[Group, tuple[float, float]], group: Group) -> tuple[float, float]:
    """`_closest` for a pair of figures."""
    first = _closest({g: v[0] for g, v in values.items()}, group)
    return first, _closest({g: v[1] for g, v in values.items()}, group)


def _closest(values: dict[Group, float], group: Group) -> float:
    """The group's own figure, else the mean over groups of its precision and offload, else of its precision."""
    return float(np.mean([values[g] for g in _donors(values, group)]))


def _donors(values: dict[Group, float], group: Group) -> list[Group]:
    """The groups whose figures `_closest` takes for `group`: itself, else those of its precision and
    offload, else of its precision, else all."""
    if group in values:
        return [group]
    for same in ((lambda g: g[1:] == group[1:]), (lambda g: g[1] == group[1])):
        near = [g for g in values if same(g)]
        if near:
            return near
    return list(values)


@dataclass
class TimeModel:
    intercepts: dict[Group, float]
    slopes: dict[str, float]
    ops: dict[int, list[CommOp]]
    comm_factor: dict[int, float] = field(default_factory=dict)
    """Per stage: measured / costed communication of the trials within one node, at most 1: the transport
    (see the module doc), applied to the within-node part."""
    notes: list[str] = field(default_factory=list)
    once_per_step_s: dict[Group, float] = field(default_factory=dict)
    """Per group: compute that runs once per optimizer step whatever the accumulation (the optimizer
    step, less the collectives inside it), measured as the trials' optimizer phase; 0 where unmeasured.
    `compute_per_micro_s` includes it (one micro-step at accumulation 1)."""
    derived_stages: set[int] = field(default_factory=set)
    """Stages whose collectives come from the derived mix alone: no trial at 2+ ranks logged them."""
    unbucketed_ops: dict[int, list[CommOp]] = field(default_factory=dict)
    """Per derived stage: its ops with one call per tensor (no bucket, no prefetch coalescing): the most
    calls the stage's per-parameter work can take (`unmeasured_handling_s`)."""
    proportional: dict[Group, float] = field(default_factory=dict)
    """Seconds per sample of a group whose precision has one measured micro-batch only: its compute is
    taken as proportional to the micro-batch (no intercept can be told from a slope)."""
    side_stream: bool = False
    """Collectives run beside compute (CUDA trials: DeepSpeed's side stream), so the overlap account
    applies; on a CPU every collective blocks its rank and all communication is exposed."""
    phase_shares: dict[Group, tuple[float, float]] = field(default_factory=dict)
    """Per group: forward and backward compute as shares of a micro-step's per-micro-step compute (the
    windows of advisor.model.overlap), from the trials' phase split less the collectives inside it."""
    wait_sigma_s: dict[int, float] = field(default_factory=dict)
    """Per stage: the ranks' compute spread per synchronisation, seconds, from what the 1-node trials'
    ranks spent in collectives beyond the link's cost (advisor.model.sync_wait); 0 where unmeasured."""
    group_slopes: dict[Group, float] = field(default_factory=dict)
    """Seconds per sample of a group measured at 2+ micro-batches, fitted on its own trials (its intercept
    in `intercepts` is then its own line's); the other groups of its precision use `slopes`."""
    target: TargetCompute | None = None
    """The target's own compute (advisor.model.target_compute) when the trials' device is not the target's:
    it replaces the fitted compute of every config, the overlap windows (a GPU's side stream, the FLOP
    split of forward and backward), the trials' transport ratio and their ranks' wait."""

    recompute_share: float = 0.0
    """Compute added per sample by gradient checkpointing, a fraction of the per-sample compute
    (advisor.model.recompute): applied to the per-sample part of a checkpointed config's micro-step."""
    recompute_shares: dict[Group, float] = field(default_factory=dict)
    """The share per group measured with checkpointing (the others take `recompute_share`)."""
    recompute_source: str = ""
    """Whether `recompute_share` was measured (trials with checkpointing) or modelled; "" before fitted."""

    def for_target(self, target: TargetCompute | None) -> TimeModel:
        """This model with the target's compute (unchanged for None)."""
        return self if target is None else replace(self, target=target)

    def syncs(self, stage: int, grad_accum: int) -> int:
        """Synchronisations a step: per micro-step where the stage's large collectives repeat per
        micro-step (ZeRO-2's reductions, ZeRO-3's gathers), once per step otherwise."""
        repeats = any(op.per_micro_step for op in self.ops.get(stage, []))
        return grad_accum if repeats else 1

    def compute_per_micro_s(
        self,
        stage: int,
        precision: str,
        micro_batch: int,
        offload: str = "none",
        checkpointing: bool = False,
    ) -> float:
        fixed, per_sample = self._compute_parts(stage, precision, micro_batch, offload)
        share = self.recompute_shares.get((stage, precision, offload), self.recompute_share)
        again = share if checkpointing else 0.0
        if self.target is not None:
            return max(per_sample * (1 + again), self.target.micro_floor_s)
        return max(fixed + per_sample * (1 + again), 1e-9)

    def _compute_parts(
        self, stage: int, precision: str, micro_batch: int, offload: str
    ) -> tuple[float, float]:
        """A micro-step's compute without checkpointing as (fixed, per-sample x micro_batch)."""
        if self.target is not None:
            return 0.0, self.target.per_sample(stage, precision, offload) * micro_batch
        if precision not in self.slopes and not any(g[1] == precision for g in self.proportional):
            # A precision never measured borrows a measured one's figures (the same network and data).
            precision = sorted(self.slopes)[0] if self.slopes else sorted(self.proportional)[0][1]
        group = (stage, precision, offload)
        if group in self.group_slopes:
            return self.intercepts[group], self.group_slopes[group] * micro_batch
        if precision in self.slopes:
            # A group with a line of its own lends neither figure: its intercept pairs with its own slope.
            fitted = {
                g: v for g, v in self.intercepts.items() if g[1] == precision and g not in self.group_slopes
            } or {g: v for g, v in self.intercepts.items() if g[1] == precision}
            return _closest(fitted, group), self.slopes[precision] * micro_batch
        mine = {g: v for g, v in self.proportional.items() if g[1] == precision}
        return 0.0, _closest(mine, group) * micro_batch

    def per_sample_part_s(self, stage: int, precision: str, micro_batch: int, offload: str = "none") -> float:
        """The per-sample part of a micro-step's compute without checkpointing (what recomputation
        repeats a share of)."""
        return self._compute_parts(stage, precision, micro_batch, offload)[1]

    def borrowed_compute_s(
        self, stage: int, precision: str, micro_batch: int, offload: str = "none"
    ) -> list[float]:
        """A micro-step's compute as each group this config borrows from would give it (each donor's own
        figure at this micro-batch); empty where the config's group was measured, or the target's compute
        replaces the fitted one. Their spread is how much the borrowing alone leaves open."""
        if self.target is not None:
            return []
        group = (stage, precision, offload)
        fitted = set(self.intercepts) | set(self.proportional)
        if group in fitted or not fitted:
            return []
        donors = _donors(dict.fromkeys(fitted, 0.0), group)
        return [self.compute_per_micro_s(g[0], g[1], micro_batch, g[2]) for g in donors]

    def unmeasured_handling_s(
        self,
        stage: int,
        precision: str,
        offload: str,
        grad_accum: int,
        ranks_per_node: int,
        nodes: int,
        net: Network,
    ) -> float:
        """Seconds per step a config may spend beyond its prediction in work no trial measured: a stage no
        trial ran that gathers parameters per micro-step (ZeRO-3), predicted from groups whose stages do
        not, borrows compute that holds none of its per-parameter fetch and release. The model cannot
        price that work; at worst it goes one tensor at a time, each at the measured link's per-call cost:
        the stage's collectives with one call per tensor, less those the prediction costs. 0 where the
        group was measured, the stage's collectives were logged, or a measured stage gathers alike."""
        if not self.borrowed_compute_s(stage, precision, 1, offload) or stage not in self.unbucketed_ops:
            return 0.0
        measured = {g[0] for g in (*self.intercepts, *self.proportional)}
        if any(_gathers_per_micro_step(self.ops.get(s, [])) for s in measured):
            return 0.0
        if not _gathers_per_micro_step(self.ops.get(stage, [])):
            return 0.0
        worst = replace(self, ops={stage: self.unbucketed_ops[stage]})
        return max(
            sum(worst.comm_seconds(stage, grad_accum, ranks_per_node, nodes, net))
            - sum(self.comm_seconds(stage, grad_accum, ranks_per_node, nodes, net)),
            0.0,
        )

    def once_s(self, stage: int, precision: str, offload: str, per_micro_s: float) -> float:
        """The once-per-step compute of this group (its own, else the closest group's), never above one
        micro-step's compute."""
        if self.target is not None:
            return min(self.target.once_per_step_s, per_micro_s)
        if not self.once_per_step_s:
            return 0.0
        return min(_closest(self.once_per_step_s, (stage, precision, offload)), per_micro_s)

    def windows(self, group: Group, per_micro_compute_s: float) -> Windows | None:
        """The compute windows of one micro-step (advisor.model.overlap); None where nothing can hide (no
        side stream) or the phase split was never measured."""
        if self.target is not None:  # a GPU target: DeepSpeed's side stream, the FLOP split of the passes
            share = self.target.forward_share
            return Windows(share * per_micro_compute_s, (1 - share) * per_micro_compute_s)
        if not self.side_stream or not self.phase_shares:
            return None
        forward, backward = _closest_pair(self.phase_shares, group)
        return Windows(forward * per_micro_compute_s, backward * per_micro_compute_s)

    def exposed_comm_s(
        self,
        stage: int,
        grad_accum: int,
        ranks_per_node: int,
        nodes: int,
        net: Network,
        windows: Windows | None = None,
    ) -> tuple[float, float]:
        """Communication per step that compute does not hide, (within nodes, across nodes): each op's cost
        (the within-node part at the measured transport) through the overlap account."""
        factor = 1.0 if self.target is not None else self.comm_factor.get(stage, 1.0)
        costs = []
        for op in self.ops.get(stage, []):
            intra, inter = op_seconds(op, ranks_per_node, nodes, net)
            costs.append(OpCost(op.phase, op.per_micro_step, op.exposed_share, intra * factor, inter))
        return exposed_s(costs, grad_accum, windows)

    def comm_seconds(
        self, stage: int, grad_accum: int, ranks_per_node: int, nodes: int, net: Network
    ) -> tuple[float, float]:
        """Alpha-beta cost of the stage's collectives per step: (within nodes, across nodes)."""
        intra = inter = 0.0
        for op in self.ops.get(stage, []):
            repeat = grad_accum if op.per_micro_step else 1
            a, b = op_seconds(op, ranks_per_node, nodes, net)
            intra, inter = intra + a * repeat, inter + b * repeat
        return intra, inter

    def predict(
        self,
        stage: int,
        precision: str,
        micro_batch: int,
        grad_accum: int,
        nodes: int,
        net: Network,
        offload: str = "none",
        checkpointing: bool = False,
    ) -> StepPrediction:
        per_micro = self.compute_per_micro_s(stage, precision, micro_batch, offload, checkpointing)
        once = self.once_s(stage, precision, offload, per_micro)
        compute = once + grad_accum * (per_micro - once)
        intra, inter = self.comm_seconds(stage, grad_accum, net.gpus_per_node, nodes, net)
        windows = self.windows((stage, precision, offload), per_micro - once)
        exposed_intra, exposed_inter = self.exposed_comm_s(
            stage, grad_accum, net.gpus_per_node, nodes, net, windows
        )
        world = nodes * net.gpus_per_node
        # the trials' ranks' spread is their device's, not the target's
        sigma = 0.0 if self.target is not None else self.wait_sigma_s.get(stage, 0.0)
        wait = predicted_wait_s(sigma, world, self.syncs(stage, grad_accum))
        exposed = exposed_intra + exposed_inter + wait
        step = compute + exposed
        return StepPrediction(
            compute,
            intra + inter,
            exposed,
            step,
            micro_batch * grad_accum * world / step,
            exposed_intra,
            exposed_inter,
            wait,
        )


def _gathers_per_micro_step(ops: list[CommOp]) -> bool:
    return any(op.collective == "all_gather" and op.per_micro_step for op in ops)


def measured_step_s(rows: pd.DataFrame) -> pd.Series:
    """The step time the model is fitted to and judged by: the median of a trial's measured steps (one
    step slowed by another process on a shared machine moves the mean, not the median); the mean for
    trials recorded before the median was."""
    mean = pd.to_numeric(rows["step_time_s"], errors="coerce")
    if "step_time_median_s" not in rows:
        return mean
    return pd.to_numeric(rows["step_time_median_s"], errors="coerce").fillna(mean)


def measured_compute_s(rows: pd.DataFrame) -> pd.Series:
    """Compute of one micro-step at accumulation 1: the step less its communication, with the per-micro-step
    part divided by the accumulation and the once-per-step part (`once_s`, where known) counted once."""
    comm = pd.to_numeric(rows["comm_s"], errors="coerce").fillna(0.0)
    once = pd.to_numeric(rows["once_s"], errors="coerce").fillna(0.0) if "once_s" in rows else 0.0
    return (measured_step_s(rows) - comm - once) / rows["grad_accum"] + once


def _unlogged_burst_s(row: pd.Series, net: Network) -> float:
    """Seconds per step of the trial's bursts that its comms_logger did not time (see BURST_CALLS): what they
    cost on the trial's network less what was logged, never below zero."""
    if not isinstance(row.get("comm_ops"), str):
        return 0.0
    accum = int(row["grad_accum"])
    ops = ops_from_trial(row["comm_ops"], int(row["zero_stage"]), int(row["world_size"]), accum)
    missed = 0.0
    for op in (o for o in ops if o.burst and not o.waits_measured):
        costed = sum(op_seconds(op, int(row["ranks_per_node"]), int(row.get("nodes", 1) or 1), net))
        missed += max(costed - op.logged_s, 0.0) * (accum if op.per_micro_step else 1)
    return missed


def _mixes(
    numels: tuple[int, ...] | None, zero: ZeroSettings | None, ok: pd.DataFrame
) -> dict[int, list[Collective]]:
    """Every stage's derived collectives (advisor.model.collective_mix), at the trials' largest world size
    (the world size only pads ZeRO-3's shards); none without the network's parameter sizes."""
    if numels is None:
        return {}
    world = max(int(pd.to_numeric(ok["world_size"], errors="coerce").max()), 2)
    return {stage: collective_mix(numels, stage, world, zero or ZeroSettings()) for stage in (0, 1, 2, 3)}


def _unbucketed_ops(
    numels: tuple[int, ...] | None, zero: ZeroSettings | None, ok: pd.DataFrame, stages: set[int]
) -> dict[int, list[CommOp]]:
    """The derived stages' ops as `_mixes` builds them, but one call per tensor: no reduce bucket holds
    two gradients, no prefetch two parameters (see TimeModel.unmeasured_handling_s)."""
    if numels is None or not stages:
        return {}
    world = max(int(pd.to_numeric(ok["world_size"], errors="coerce").max()), 2)
    single = replace(zero or ZeroSettings(), reduce_bucket_size=1, prefetch_bucket_size=0)
    return {stage: ops_from_mix(collective_mix(numels, stage, world, single)) for stage in stages}


def _trial_ops(row: pd.Series, mixes: dict[int, list[Collective]]) -> list[CommOp]:
    stage, world, accum = int(row["zero_stage"]), int(row["world_size"]), int(row["grad_accum"])
    comm_ops = row["comm_ops"] if isinstance(row.get("comm_ops"), str) else None
    if stage in mixes:
        return ops_by_mix(comm_ops, mixes[stage], world, accum)
    return ops_from_trial(comm_ops, stage, world, accum)


def _once_s(row: pd.Series, mixes: dict[int, list[Collective]]) -> float:
    """The trial's once-per-step compute: its optimizer phase less the collectives inside it (the derived
    mix says which: ZeRO-1/2's gather of the updated partitions, ZeRO-3's of persistent parameters)."""
    optimizer = pd.to_numeric(pd.Series([row.get("optimizer_s")]), errors="coerce").iloc[0]
    if pd.isna(optimizer):
        return math.nan
    inside = sum(op.logged_s for op in _trial_ops(row, mixes) if op.phase == "step")
    return max(float(optimizer) - inside, 0.0)


def fit_time_model(
    trials: pd.DataFrame,
    measured_net: Network,
    numels: tuple[int, ...] | None = None,
    zero: ZeroSettings | None = None,
) -> TimeModel:
    """Fit on the ok trials given; `measured_net` is the network the trials ran on (for the overlap).

    With the trained network's parameter sizes (`numels`) and the JSON's settings (`zero`), every stage
    gets the collectives derived from first principles (advisor.model.collective_mix): a stage measured
    at 2+ ranks keeps its logged volumes, split by the mix into per-micro-step and once-per-step parts;
    a stage never measured there (ZeRO-0 not in the trials, ZeRO-3 measured on one rank) is costed from
    the mix alone."""
    ok = trials[trials["status"] == "ok"].reset_index(drop=True)
    if ok.empty:
        raise ValueError("no successful trial to fit the time model on")
    # Bursts the logger missed are communication, not compute: moved over before anything is fitted.
    unlogged = ok.apply(lambda r: _unlogged_burst_s(r, measured_net), axis=1)
    ok["comm_s"] = pd.to_numeric(ok["comm_s"], errors="coerce").fillna(0.0) + unlogged
    mixes = _mixes(numels, zero, ok)
    ok["once_s"] = ok.apply(lambda r: _once_s(r, mixes), axis=1) if mixes else math.nan
    compute = measured_compute_s(ok)
    notes: list[str] = []
    # A slope per precision needs two micro-batch sizes of it; a precision measured at one size only is
    # modelled per (stage, precision) as proportional to the micro-batch.
    fitted = [
        p
        for p in sorted(set(ok["precision"].astype(str)))
        if ok.loc[ok["precision"] == p, "micro_batch"].nunique() >= 2
    ]
    if "offload" not in ok:
        ok["offload"] = "none"
    ok["offload"] = ok["offload"].fillna("none").astype(str)
    proportional: dict[Group, float] = {}
    for (stage, precision, offload), rows in ok.groupby(["zero_stage", "precision", "offload"]):
        if str(precision) not in fitted:
            proportional[(int(stage), str(precision), str(offload))] = float(
                np.mean(compute[rows.index] / rows["micro_batch"])
            )
    if proportional:
        notes.append(
            "compute: one micro-batch measured for "
            + ", ".join(sorted({g[1] for g in proportional}))
            + ", so compute is taken as proportional to it"
        )
    fit = ok[ok["precision"].astype(str).isin(fitted)].reset_index(drop=True)
    y = measured_compute_s(fit).to_numpy(dtype=float)
    groups: list[Group] = sorted(
        {
            (int(s), str(p), str(o))
            for s, p, o in zip(fit["zero_stage"], fit["precision"], fit["offload"], strict=True)
        }
    )
    columns = [f"a{g}" for g in groups] + [f"b{p}" for p in fitted]
    design = np.zeros((len(fit), len(columns)))
    for i, row in fit.iterrows():
        design[i, groups.index((int(row["zero_stage"]), str(row["precision"]), str(row["offload"])))] = 1.0
        design[i, len(groups) + fitted.index(str(row["precision"]))] = float(row["micro_batch"])
    coef = np.linalg.lstsq(design, y, rcond=None)[0] if len(fit) else np.zeros(0)
    intercepts = {g: float(coef[i]) for i, g in enumerate(groups)}
    slopes = {p: float(coef[len(groups) + j]) for j, p in enumerate(fitted)}
    model = TimeModel(intercepts, slopes, {}, {}, notes, proportional=proportional)
    for group, (intercept, slope) in _own_lines(fit, y).items():
        model.intercepts[group], model.group_slopes[group] = intercept, slope
    measured_once = ok[ok["once_s"].notna()]
    for (stage, precision, offload), rows in measured_once.groupby(["zero_stage", "precision", "offload"]):
        model.once_per_step_s[(int(stage), str(precision), str(offload))] = float(rows["once_s"].median())
    _set_ops(model, ok, mixes)
    model.unbucketed_ops = _unbucketed_ops(numels, zero, ok, model.derived_stages)
    for stage, rows in ok.groupby("zero_stage"):
        _calibrate(model, int(stage), rows, measured_net)
    model.side_stream = _side_stream(ok)
    if model.side_stream:
        model.phase_shares = _phase_shares(ok, model, mixes)
    return model


def _own_lines(fit: pd.DataFrame, compute: np.ndarray) -> dict[Group, tuple[float, float]]:
    """(intercept, slope) of each group measured at two or more micro-batches, fitted on its trials alone.
    A line whose slope comes out negative (two noisy points close together: more samples cannot cost
    less) is not kept; the group stays on its precision's shared slope."""
    lines: dict[Group, tuple[float, float]] = {}
    for (stage, precision, offload), rows in fit.groupby(["zero_stage", "precision", "offload"]):
        mb = rows["micro_batch"].to_numpy(dtype=float)
        if len(np.unique(mb)) < 2:
            continue
        slope, intercept = np.polyfit(mb, compute[rows.index], 1)
        if slope > 0:
            lines[(int(stage), str(precision), str(offload))] = (float(intercept), float(slope))
    return lines


def _side_stream(ok: pd.DataFrame) -> bool:
    """The trials ran on CUDA (a device peak was recorded by torch.cuda), where DeepSpeed's collectives run
    on a side stream beside compute; on a CPU there is none."""
    if "cuda_peak_bytes" not in ok:
        return False
    return bool((pd.to_numeric(ok["cuda_peak_bytes"], errors="coerce").fillna(0) > 0).any())


def _phase_shares(
    ok: pd.DataFrame, model: TimeModel, mixes: dict[int, list[Collective]]
) -> dict[Group, tuple[float, float]]:
    """Per group, forward and backward compute per micro-step as shares of the per-micro-step compute: the
    trials' phase times (per step, over all micro-steps) less the collectives logged in that phase."""
    if not {"forward_s", "backward_s"} <= set(ok.columns):
        return {}
    shares: dict[Group, list[tuple[float, float]]] = {}
    for _, r in ok.iterrows():
        accum = int(r["grad_accum"])
        group = (int(r["zero_stage"]), str(r["precision"]), str(r["offload"]))
        per_micro = model.compute_per_micro_s(*group[:2], int(r["micro_batch"]), group[2])
        per_micro -= model.once_s(*group, per_micro)
        ops = _trial_ops(r, mixes)
        windows = []
        for phase in ("forward", "backward"):
            measured = pd.to_numeric(pd.Series([r.get(f"{phase}_s")]), errors="coerce").iloc[0]
            inside = sum(op.logged_s for op in ops if op.phase == phase and op.per_micro_step)
            windows.append(max(float(measured) / accum - inside, 0.0) if pd.notna(measured) else math.nan)
        if per_micro > 0 and not any(math.isnan(w) for w in windows):
            shares.setdefault(group, []).append((windows[0] / per_micro, windows[1] / per_micro))
    return {
        g: (float(np.median([v[0] for v in vs])), float(np.median([v[1] for v in vs])))
        for g, vs in shares.items()
    }


def _set_ops(model: TimeModel, ok: pd.DataFrame, mixes: dict[int, list[Collective]]) -> None:
    """Each stage's ops: logged at 2+ ranks where a trial ran there, else derived (see fit_time_model)."""
    for stage in sorted(set(mixes) | {int(s) for s in ok["zero_stage"]}):
        rows = ok[(ok["zero_stage"] == stage) & (pd.to_numeric(ok["world_size"]) >= 2)]
        if not rows.empty:
            model.ops[stage] = _trial_ops(rows.iloc[0], mixes)
        elif stage in mixes:
            model.ops[stage] = ops_from_mix(mixes[stage])
            model.derived_stages.add(stage)
            if (ok["zero_stage"] == stage).any():
                model.notes.append(
                    f"ZeRO-{stage}: measured on one rank only, where DeepSpeed skips its "
                    "collectives; they are costed from the derived mix"
                )
        else:  # no parameter sizes: what the one-rank trial logged (nothing, at world size 1)
            row = ok[ok["zero_stage"] == stage].iloc[0]
            model.ops[stage] = _trial_ops(row, mixes)


def _calibrate(model: TimeModel, stage: int, rows: pd.DataFrame, measured_net: Network) -> None:
    """Measured against costed communication within a node, per stage, from the 1-node trials. Below the
    cost, the ratio is the transport (one node's collectives may run faster than the benchmark measured),
    which says nothing about the inter-node link; above it, the excess is the ranks' wait for the slowest
    one (advisor.model.sync_wait), which no link explains and every world size of ranks pays. Multi-node
    trials are not used: across nodes the link is costed as measured and the overlap account says what
    hides."""
    intra_ratios, sigmas = [], []
    for _, r in rows.iterrows():
        if int(r.get("nodes", 1) or 1) != 1:
            continue
        intra, _ = model.comm_seconds(stage, int(r["grad_accum"]), int(r["ranks_per_node"]), 1, measured_net)
        comm = float(r["comm_s"]) if pd.notna(r["comm_s"]) else 0.0
        if intra > 0:
            ratio, wait = _transport_and_wait(comm, r.get("comm_min_s"), intra)
            intra_ratios.append(ratio)
            accum = int(r["grad_accum"])
            sigma = sigma_s(wait, int(r["world_size"]), model.syncs(stage, accum))
            if sigma is not None:
                sigmas.append(sigma)
    model.comm_factor[stage] = float(np.median(intra_ratios)) if intra_ratios else 1.0
    model.wait_sigma_s[stage] = float(np.median(sigmas)) if sigmas else 0.0


def _transport_and_wait(comm: float, least: object, costed: float) -> tuple[float, float]:
    """(transport ratio, wait) of one 1-node trial from rank 0's time in collectives (`comm`), the least
    any rank spent there (`least`, comm_min_s; NaN or None for a trial that did not record it) and the
    ops' alpha-beta cost on the measured link (`costed`, > 0).

    A collective ends for all ranks when the last arrives, so the rank that spent least in collectives
    waited least: its time is the transport as the trial ran it, and rank 0's excess over it is rank 0's
    wait. Measured so, the ratio is the transport's alone, above 1 where the trial's collectives ran slower
    than the probe's (docs/calibration/scaleout-rounds.md), and the wait is the ranks' spread only (the
    rule below, without per-rank figures, reads more).
    Without per-rank figures the two cannot be told apart: below the cost the ratio is the transport (at
    most 1) and above it the excess is taken as the wait (advisor.model.sync_wait)."""
    least_s = pd.to_numeric(pd.Series([least]), errors="coerce").iloc[0]
    if pd.notna(least_s) and 0 < float(least_s) <= comm:
        return float(least_s) / costed, comm - float(least_s)
    return min(comm / costed, 1.0), wait_s(comm, costed)
