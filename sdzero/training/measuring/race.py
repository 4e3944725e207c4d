"""When a launch of several configs has measured enough, and which configs leave it before (`--profile-race`).

Without racing the launch ends, after any config's turn, once `--profile-max-seconds` of steps are measured
and every config has `--profile-min-steps` timed steps. With `--profile-race` it races its configs (`race`):
after each round, a config with at least `--profile-min-steps` timed steps whose samples/s interval (the 95%
bootstrap interval of its median step, sdzero.telemetry.step_interval) lies wholly below the leader's stops
being measured (it keeps what it measured; `launch.raced` says in which round and behind whom). The time the
race saves goes to the configs still in it (the leader and the rivals within its noise): the launch ends
once each of their intervals is within `--profile-target-halfwidth` (its pick decided, and its figures as
tight as asked) or its time is spent; without a target, once each leader is the only config left.
With `--profile-memory-cap-gib` a config whose device peak per rank (the largest rank's, read on its
instrumented step) is over the cap cannot be the pick: it neither leads the race nor keeps the launch going,
and once it has its least timed steps it stops being measured, its reason beginning `OVER_CAP`
(`launch.over_cap`). Configs race those of their own accumulation only: more micro-steps a step amortise
its once-per-step costs, so a config at another accumulation (the advisor's check) is no rival, and is
measured on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdzero.telemetry.step_interval import interval_is_tight, median_interval
from sdzero.training.measuring.configs import Entry
from sdzero.training.measuring.instruments import collective_device
from sdzero.training.measuring.probe import StopRule

OVER_CAP = "over the memory cap"
"""How `race` begins the reason of a config it stops for its memory (advisor.measure.launch reads it)."""


class Race:
    """The launch's end and, with racing on, who leaves it before; every rank holds the same verdicts."""

    def __init__(self, stop_rule: StopRule, racing: bool = False, memory_cap_bytes: float = 0.0) -> None:
        self.min_steps, self.max_seconds = stop_rule.min_steps, stop_rule.max_seconds
        self.target = stop_rule.target_rel_halfwidth
        self.racing, self.memory_cap = racing, memory_cap_bytes
        self.over_cap: set[str] = set()
        """Configs measured over the memory cap: they cannot be the pick (`race`'s `over`)."""

    def done(self, entries: list[Entry], timed_s: float) -> bool:
        """This rank's view of whether the launch has measured enough (`timed_s`: its timed steps' seconds)."""
        live = live_entries(entries)
        if not live:
            return True
        enough = all(len(e.probe.records) >= self.min_steps for e in live)
        if not enough:
            return False
        if timed_s >= self.max_seconds:
            return True
        if not self.racing:
            return False
        # Only the configs that may be the pick (they fit) keep the launch going.
        contenders = [e for e in live if e.config.key not in self.over_cap]
        if self.target:
            # The launch's seconds are spent on the leader and its rivals within noise until their figures
            # are as tight as asked: the pick is then decided, and what the fit reads of it is sure.
            return all(self._tight(e) for e in contenders)
        left = [e.config.grad_accum for e in contenders]
        # each accumulation's leader alone is left: the launch's pick is decided
        return any(e.raced for e in entries) and len(left) == len(set(left))

    def _tight(self, entry: Entry) -> bool:
        times = [r["step_time_s"] for r in entry.probe.records]
        return len(times) >= 2 and interval_is_tight(median_interval(times), self.target)

    def judge(self, entries: list[Entry], round_number: int) -> None:
        """Rank 0's race after a round, for every rank (collectives): configs clearly slower per sample than
        the leader, or over the memory cap, leave the rounds (`race`)."""
        classes = {e.config.key: e.config.grad_accum for e in entries}
        self.over_cap |= self._measured_over_cap(entries)
        rates = rate_intervals(entries)
        verdict = [race(rates, self.min_steps, classes, self.over_cap) if dist.get_rank() == 0 else {}]
        dist.broadcast_object_list(verdict, src=0)
        for entry in entries:
            if entry.config.key in verdict[0] and entry.raced is None:
                entry.raced = f"round {round_number}: {verdict[0][entry.config.key]}"

    def _measured_over_cap(self, entries: list[Entry]) -> set[str]:
        """The configs whose device peak on the largest rank is over `--profile-memory-cap-gib` (a collective:
        every rank takes part, every rank gets the same set)."""
        if not self.memory_cap:
            return set()
        peaks = torch.tensor(
            [float(e.probe._rank_figures()["device_peak_bytes"]) if e.probe.states else 0.0 for e in entries],
            dtype=torch.float64,
            device=collective_device(),
        )
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        return {
            e.config.key for e, peak in zip(entries, peaks.tolist(), strict=True) if peak > self.memory_cap
        }


def live_entries(entries: list[Entry]) -> list[Entry]:
    """The configs still measured: none out of memory, none raced out."""
    return [e for e in entries if e.oom is None and e.raced is None]


def rate_intervals(entries: list[Entry]) -> dict[str, tuple[float, float, float, int]]:
    """Per live config: (samples/s, its 95% low, high, timed steps) from its timed steps."""
    out = {}
    for e in live_entries(entries):
        times = [r["step_time_s"] for r in e.probe.records]
        interval = median_interval(times)
        if not interval.median_s > 0:
            continue
        samples = e.config.micro_batch * e.config.grad_accum * dist.get_world_size()
        lo_s = interval.lo_s if interval.lo_s == interval.lo_s else interval.median_s
        hi_s = interval.hi_s if interval.hi_s == interval.hi_s else interval.median_s
        out[e.config.key] = (samples / interval.median_s, samples / hi_s, samples / lo_s, len(times))
    return out


def race(
    rates: dict[str, tuple[float, float, float, int]],
    min_steps: int,
    classes: dict[str, int] | None = None,
    over: set[str] | frozenset[str] = frozenset(),
) -> dict[str, str]:
    """The configs to stop measuring, and why: those with at least `min_steps` timed steps whose samples/s
    interval (rate, lo, hi, steps) lies wholly below the leader's, the config of the highest rate among
    those of its class (`classes`: the accumulation; one class without) that fit the memory cap (`over`:
    those that do not, which cannot be the pick however fast). A config whose interval still overlaps the
    leader's may yet be the pick and goes on."""
    out: dict[str, str] = {}
    for kind in set((classes or {}).get(k, 0) for k in rates):
        mine = {k: v for k, v in rates.items() if (classes or {}).get(k, 0) == kind}
        fitting = [k for k in mine if k not in over]
        if len(mine) < 2 or not fitting:
            continue
        leader = max(fitting, key=lambda k: mine[k][0])
        floor = mine[leader][1]
        out |= {
            key: f"slower per sample than {leader} ({rate:.3g} vs {mine[leader][0]:.3g} samples/s; its "
            f"interval {lo:.3g}-{hi:.3g} below the leader's {floor:.3g})"
            for key, (rate, lo, hi, steps) in mine.items()
            if key != leader and steps >= min_steps and hi < floor
        }
        # measured enough for the fit, it cannot be the pick: its turns go to the configs that can
        out |= {
            key: f"{OVER_CAP} (it cannot be the pick; {leader} leads those that fit)"
            for key, (_, _, _, steps) in mine.items()
            if key in over and key not in out and steps >= min_steps
        }
    return out
