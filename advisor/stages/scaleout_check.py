"""Scale-out check: predict the multi-host step time from a 1-host trial plus the measured inter-host link,
then run the same config on the hosts and report the error, at any number of hosts and ranks per host.

The 1-host trial runs on the hostfile's first host with its `slots` ranks, through the launcher and a
hostfile of that host alone (advisor.measure.trials.first_host_hostfile): one node of the very kind the
multi-host run spans, as a user's 1-node run would be, wherever the check is started from (a login node
without GPUs included). The links are measured by `sdzero comm`: within a host with `slots` ranks on the
first host, and between hosts with one rank per host (`probe_links`; inside `sdzero advise` the measure
stage's benchmark over the hostfile gives both). The time model fitted on the 1-host trial then predicts
the configuration at `hosts` nodes x `slots` ranks over the measured inter-host link, the collectives
costed from the trained network's sizes where the trial had none to log (one rank per host). The measured
multi-host run is the same config launched through the whole hostfile, `hosts` x `slots` ranks. With
several ranks per host (e.g. 2 hosts x 2), the prediction costs each collective as the measured library
runs it (gloo: one ring over all ranks, advisor.model.network.CollectiveAlgorithm); the table also gives
the hierarchical (NCCL's) and the all-flat account beside it.

bench/scaleout_accuracy.py measures its own 1-host trial (hosts x slots ranks on this machine, the same
world size, under the hosts' CPU share) and hands it to `check_config`.

In `sdzero advise --hostfile`, `prepare_hostfile` checks the hosts first and `scaleout_check` runs the
recommended config through all of this and records its error.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.measure.alphabeta import FIT_SCHEMA, load_fits
from advisor.measure.grid import TrialSpec, write_trial_config
from advisor.measure.trials import TrialSettings, first_host_hostfile, run_trial
from advisor.model.memory import ZeroSettings
from advisor.model.network import NCCL, CollectiveAlgorithm, Network, build_network
from advisor.model.step_time import StepPrediction, fit_time_model, measured_step_s
from sdzero.atomic import write_json_atomic
from sdzero.constants import MIB


def probe_link(
    out_dir: Path,
    ranks: int,
    hostfile: Path | None,
    budget_s: float,
    log: Callable[[str], None] | None = None,
) -> Path:
    """`sdzero comm` with `ranks` on this machine (no hostfile) or `ranks` per host across the hostfile (one
    host's: the within-host link there; several hosts' at one rank each: the inter-host link); its
    comm_fit.json."""
    from advisor.measure.collectives_launch import run_comm

    run_comm(
        out_dir,
        num_ranks=ranks,
        hostfile=hostfile,
        backends=("torch",),
        max_bytes=16 * MIB,
        budget_s=budget_s,
        log=log,
    )
    return out_dir / "comm_fit.json"


def merge_fits(paths: list[Path], merged: Path) -> Path:
    """One comm_fit.json holding every fit of `paths` (an intra and an inter probe)."""
    fits = [fit.to_dict() for path in paths for fit in load_fits(path)]
    merged.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(merged, {"schema": FIT_SCHEMA, "fits": fits})
    return merged


def probe_links(
    out_dir: Path, hostfile: Path, slots: int, budget_s: float, log: Callable[[str], None] | None = None
) -> Path:
    """`sdzero comm` twice: `slots` ranks on the hostfile's first host (the within-host link the 1-host
    trial used; none to measure at one slot) and one rank per host across the hostfile (the inter-host
    link); the fits merged into one comm_fit.json."""
    fits = []
    if slots > 1:
        first = out_dir / "intra" / "first-host"
        first_host_hostfile(hostfile, first)
        fits.append(probe_link(out_dir / "intra", slots, first, budget_s, log))
    fits.append(probe_link(out_dir / "inter", 1, hostfile, budget_s, log))
    return merge_fits(fits, out_dir / "comm_fit.json")


@dataclass(frozen=True)
class ScaleoutRow:
    config: str
    hosts: int
    slots: int
    predicted_step_s: float
    measured_step_s: float
    predicted_comm_s: float
    one_host_step_s: float
    inter_busbw_gbit_s: float
    grad_accum: int = 1
    predicted_compute_s: float = float("nan")
    """Compute per step the model took from the 1-host trial; predicted_comm_s is the exposed rest."""
    predicted_wait_s: float = float("nan")
    """The part of predicted_comm_s that is the wait for the slowest rank (the rest is the links')."""
    measured_comm_s: float = float("nan")
    """Time the multi-host run's ranks spent in collectives (logged plus waited), per step (rank 0's)."""
    measured_comm_min_s: float = float("nan")
    """The least time any rank of the multi-host run spent in collectives per step: the rank that waited
    least for the others, the closest measure of what the transport alone costs."""
    measured_comm_max_s: float = float("nan")
    """The most time any rank spent in collectives: the transport plus the longest wait for a slower rank."""
    one_host_comm_s: float = float("nan")
    flat_ring_step_s: float = float("nan")
    """With several ranks per host: the step costed as one flat ring over all ranks, latency included
    (see flat_ring_step_s)."""
    hierarchy_step_s: float = float("nan")
    """With several ranks per host: the step costed hierarchically, as NCCL runs collectives."""
    measured_halfwidth: float = float("nan")
    """Relative 95% half-width of the multi-host run's median step (its bootstrap interval)."""
    one_host_halfwidth: float = float("nan")
    """The same for the 1-host trial the prediction rests on."""

    @property
    def error(self) -> float:
        return self.predicted_step_s / self.measured_step_s - 1

    def error_halfwidth(self, one_host_spread: float = 0.0) -> float:
        """The error's own 95% half-width: the two runs' intervals and, when the 1-host trial ran again
        after the hosts' runs (bracketing), half the difference of the two, in quadrature: an error
        inside it is as small as this machine lets one be measured."""
        parts = [self.measured_halfwidth, self.one_host_halfwidth, abs(one_host_spread) / 2]
        return math.hypot(*(p for p in parts if not math.isnan(p)))


def trial_table(
    spec: TrialSpec, settings: TrialSettings, base: dict[str, Any], trial_dir: Path, nodes: int
) -> pd.DataFrame:
    """Run one trial and return it as a one-row table in advisor.measure.profile's format."""
    from advisor.measure.trial_table import trial_row

    config = write_trial_config(base, spec, trial_dir, spec.ranks_per_node * nodes)
    outcome = run_trial(spec, settings, config, trial_dir)
    row = trial_row(spec, outcome, "scaleout", replace(settings, hosts=nodes), trial_dir)
    if outcome.status != "ok":
        raise RuntimeError(
            f"trial {trial_dir.name} ended {outcome.status}: {outcome.reason}\n{outcome.log_tail}"
        )
    return pd.DataFrame([row])


@dataclass(frozen=True)
class TrainedSizes:
    """The trained network's parameter sizes and the JSON's ZeRO settings: with them the time model costs
    the collectives a trial did not run (a 1-host trial of one rank logs none), advisor.model.step_time."""

    numels: tuple[int, ...]
    zero: ZeroSettings


def predict_from_one_host(
    one_host: pd.DataFrame,
    fit_path: Path,
    hosts: int,
    slots: int,
    algorithm: CollectiveAlgorithm | None = None,
    sizes: TrainedSizes | None = None,
) -> tuple[float, float, Network]:
    """(predicted step s, predicted exposed comm s, target network) for `hosts` x `slots` from 1-host trials;
    `algorithm` overrides the one the measured library implies."""
    step, net = predict_step(one_host, fit_path, hosts, slots, algorithm, sizes)
    return step.step_time_s, step.exposed_comm_s, net


def predict_step(
    one_host: pd.DataFrame,
    fit_path: Path,
    hosts: int,
    slots: int,
    algorithm: CollectiveAlgorithm | None = None,
    sizes: TrainedSizes | None = None,
) -> tuple[StepPrediction, Network]:
    """The whole prediction (compute, link and wait parts) for `hosts` x `slots`, and the target network."""
    local_ranks = int(one_host["ranks_per_node"].iloc[0])
    measured_net, _ = build_network(fit_path, local_ranks)
    target_net, _ = build_network(fit_path, slots)
    if algorithm is not None:
        target_net = replace(target_net, algorithm=algorithm)
    model = (
        fit_time_model(one_host, measured_net, sizes.numels, sizes.zero)
        if sizes
        else fit_time_model(one_host, measured_net)
    )
    row = one_host.iloc[0]
    step = model.predict(
        int(row["zero_stage"]),
        str(row["precision"]),
        int(row["micro_batch"]),
        int(row["grad_accum"]),
        hosts,
        target_net,
        str(row["offload"]),
    )
    return step, target_net


def check_config(
    spec: TrialSpec,
    base: dict[str, Any],
    local: TrialSettings,
    remote: TrialSettings,
    fit_path: Path,
    hosts: int,
    slots: int,
    work_dir: Path,
    one_host: pd.DataFrame | None = None,
    one_host_ranks: int | None = None,
    sizes: TrainedSizes | None = None,
) -> tuple[ScaleoutRow, pd.DataFrame]:
    """1-host trial (unless given), prediction, then the measured `hosts` x `slots` run of the same config.

    The 1-host trial runs under `local` (a one-host hostfile's settings: the first host) with
    `one_host_ranks` ranks, `slots` unless given: one node as the hosts run it."""
    if one_host is None:
        one_host = trial_table(
            replace(spec, ranks_per_node=one_host_ranks or slots),
            local,
            base,
            work_dir / f"{spec.trial_id}-1host",
            nodes=1,
        )
    prediction, net = predict_step(one_host, fit_path, hosts, slots, sizes=sizes)
    predicted, comm = prediction.step_time_s, prediction.exposed_comm_s
    remote_spec = replace(spec, ranks_per_node=slots)
    measured = trial_table(
        remote_spec, remote, base, work_dir / f"{remote_spec.trial_id}-{hosts}hosts", nodes=hosts
    )
    accum = int(one_host["grad_accum"].iloc[0])
    flat = flat_ring_step_s(one_host, fit_path, hosts, slots, sizes) if slots > 1 else float("nan")
    hierarchy = (
        predict_from_one_host(one_host, fit_path, hosts, slots, NCCL, sizes)[0] if slots > 1 else float("nan")
    )
    return (
        ScaleoutRow(
            config=f"ZeRO-{spec.zero_stage} {spec.precision} mb{spec.micro_batch}"
            + (f" accum {accum}" if accum > 1 else ""),
            hosts=hosts,
            slots=slots,
            predicted_step_s=predicted,
            measured_step_s=float(measured_step_s(measured).iloc[0]),
            predicted_comm_s=comm,
            one_host_step_s=float(measured_step_s(one_host).iloc[0]),
            inter_busbw_gbit_s=net.inter.busbw_bytes_s * 8 / 1e9,
            grad_accum=accum,
            predicted_compute_s=predicted - comm,
            predicted_wait_s=prediction.wait_s,
            measured_comm_s=_comm_s(measured),
            measured_comm_min_s=_comm_s(measured, "comm_min_s"),
            measured_comm_max_s=_comm_s(measured, "comm_max_s"),
            one_host_comm_s=_comm_s(one_host),
            flat_ring_step_s=flat,
            hierarchy_step_s=hierarchy,
            measured_halfwidth=_halfwidth(measured),
            one_host_halfwidth=_halfwidth(one_host),
        ),
        one_host,
    )


def _halfwidth(trial: pd.DataFrame) -> float:
    """Relative 95% half-width of a trial's corrected median step; NaN without an interval."""
    if not {"step_s_lo", "step_s_hi"} <= set(trial.columns):
        return float("nan")
    lo, hi = (float(pd.to_numeric(trial[c], errors="coerce").mean()) for c in ("step_s_lo", "step_s_hi"))
    step = float(measured_step_s(trial).mean())
    return (hi - lo) / 2 / step if step > 0 else float("nan")


def flat_ring_step_s(
    one_host: pd.DataFrame, fit_path: Path, hosts: int, slots: int, sizes: TrainedSizes | None = None
) -> float:
    """The step at `hosts` x `slots` if every collective is one ring over all hosts x slots ranks in rank
    order, as gloo runs them (it knows no hosts): each step of the ring waits for its slowest hop, a hop
    across hosts, and each host's link carries the ring's crossing edge, 2(W-1)/W of the buffer for an
    all-reduce over W ranks, not the 2(H-1)/H of a within-host-then-across-hosts hierarchy. That is what
    W hosts x 1 rank cost on the inter-host link."""
    return predict_from_one_host(one_host, fit_path, hosts * slots, 1, sizes=sizes)[0]


def _comm_s(trial: pd.DataFrame, column: str = "comm_s") -> float:
    """A trial's seconds per step in collectives (`column`); NaN where it was not recorded."""
    if column not in trial:
        return float("nan")
    return float(pd.to_numeric(trial[column], errors="coerce").iloc[0])


def rows_table(rows: list[ScaleoutRow], **extra: Any) -> pd.DataFrame:
    return pd.DataFrame(
        [{**extra, **vars(r), "error": r.error, "error_halfwidth": r.error_halfwidth()} for r in rows]
    )


# ------------------------------------------------------------------------- the check inside `sdzero advise`


def prepare_hostfile(hostfile: Path | None, say: Callable[[str], None]) -> list[Any]:
    """Check the hosts (as `sdzero launch` does) and write the .deepspeed_env their ranks need."""
    if hostfile is None:
        return []
    from sdzero.cluster.hostfile import prepare_hosts

    entries, master, interface, env_file, merge = prepare_hosts(Path(hostfile))
    say(
        f"{len(entries)} hosts; master {master} over {interface}; {env_file}: added {sorted(merge.added) or 'nothing'}"
    )
    return entries


def scaleout_check(
    best: Any,
    base: dict[str, Any],
    settings: Any,
    hostfile: Path,
    hosts: list[Any],
    fit_path: Path,
    out_dir: Path,
    say: Callable[[str], None],
    numels: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Predict the recommended config on the hostfile's hosts from a 1-host trial on the first host plus
    the measured link, then run it across the hosts: the prediction's error, measured, in
    recommendation.json and scaleout.csv. `numels`: the trained network's parameter sizes (the
    collectives of a one-rank 1-host trial are costed from them)."""
    slots = hosts[0].slots
    if any(h.slots != slots for h in hosts):
        return {"skipped": "hosts with different slots= counts; the check needs the same ranks on each"}
    spec = TrialSpec(
        int(best["zero_stage"]), str(best["dtype"]), int(best["micro_batch"]), str(best["offload"]), slots
    )
    work_dir = out_dir / "scaleout"
    first = first_host_hostfile(Path(hostfile), work_dir / "first-host")
    one_host = replace(settings, hostfile=(work_dir / "first-host").resolve(), hosts=1)
    remote = replace(settings, hostfile=Path(hostfile).resolve(), hosts=len(hosts))
    sizes = TrainedSizes(numels, ZeroSettings.from_config(base)) if numels else None
    say(
        f"scale-out check: {spec.trial_id} on 1 host ({first.host}) x {slots} ranks, then "
        f"{len(hosts)} hosts x {slots}"
    )
    try:
        row, measured_one_host = check_config(
            spec, base, one_host, remote, fit_path, len(hosts), slots, work_dir, sizes=sizes
        )
    except RuntimeError as exc:
        return {"failed": str(exc).splitlines()[0]}
    legs = {
        "one_host_leg": {
            "host": first.host,
            "ranks": int(measured_one_host["world_size"].iloc[0]),
            "trial_dir": str(measured_one_host["trial_dir"].iloc[0]),
        },
        "multi_host_leg": {"hosts": [h.host for h in hosts], "ranks_per_host": slots},
    }
    rows_table([row]).to_csv(out_dir / "scaleout.csv", index=False)
    say(
        f"scale-out check: predicted {row.predicted_step_s:.3f} s/step, measured {row.measured_step_s:.3f} s "
        f"({row.error:+.1%} ± {row.error_halfwidth():.1%}, the two runs' own intervals)"
    )
    return {**vars(row), "error": row.error, "error_halfwidth": row.error_halfwidth(), **legs}
