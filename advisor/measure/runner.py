"""Runs the trials of one setup into trials.csv, watching the machine while it does.

Every trial the search (or `sdzero profile`) asks for runs once; a finished one is never run again. Around
them:

- **Brackets.** The reference config (`reference` when given, else the first trial that succeeds: the
  search's first seed, advisor.measure.grid.GridPlan.reference) is measured
  again every `bracket_every` trials or `bracket_every_s` seconds, whichever comes first, and once more
  after a batch of trials (the check trials) or when the budget has room for no more than a bracket.
  Its repeats go to `<trial>/bracket-N/` and drift.json, not to trials.csv (they are not new configs).
  After every bracket each trial's row is corrected for the machine's drift (advisor.measure.drift):
  `step_time_median_s` and the columns beside it become the time on the first bracket's machine. The
  drift is fitted to the brackets and to every other config measured more than once (`_repeats`).
- **Contention.** A trial during which other processes took the cores (advisor.measure.contention) is run
  again at once, once; if the second run is contended too it stays flagged (`contended`, its interval
  widened by the share it lost) and the line says so.
- **Too much drift.** Trials whose gap between two brackets saw the reference move by more than
  DRIFT_RERUN_JUMP are run again once, after that bracket, one at a time: each re-run joins the
  timeline's fit, and the trials left are run again only while the fitted jump still exceeds it.
- **Duel.** `rematch` measures the two configs the search cannot tell apart again, A B B A, close in
  time (advisor.measure.duel), when the budget has room for four legs (else once each, back to back);
  each one's legs are pooled into its row and the pair's ratio goes to duel.json (advisor.model.search
  calls it on the closest contenders).

Re-runs and brackets spend the budget only while `deadline` (a time.monotonic() value) leaves room for
them; the trials asked for always run. A resumed run reads the brackets of drift.json back.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.measure import trials as trial_module
from advisor.measure.contention import contention_line, is_contended
from advisor.measure.drift import (
    DRIFT_RERUN_JUMP,
    Bracket,
    Drift,
    Repeat,
    corrected_interval,
    gap_trials,
    read_drift,
    write_drift,
)
from advisor.measure.duel import (
    DUEL_FILE,
    DUEL_ORDER,
    POOLED_NOTE,
    POOLED_STOP,
    Duel,
    Leg,
    Pooled,
    paired,
    pool,
    read_duels,
    write_duels,
)
from advisor.measure.grid import TrialSpec, finished_trials, grad_accum_of, write_trial_config
from advisor.measure.trial_table import append_row, latest_rows, read_trials, trial_row, write_trials
from advisor.measure.trials import TrialOutcome, TrialSettings, trial_step_times
from sdzero.telemetry.step_interval import median_interval

BRACKET_EVERY_TRIALS = 4
"""Trials between two measurements of the reference: on 2 CPU cores, a bracket about every minute."""
BRACKET_EVERY_S = 150.0
"""...or this many seconds, whichever comes first (long GPU trials)."""


@dataclass(frozen=True)
class RunnerPolicy:
    bracket_every: int = BRACKET_EVERY_TRIALS
    """0: no brackets (no drift correction)."""
    bracket_every_s: float = BRACKET_EVERY_S
    rerun_contended: bool = True
    rerun_jump: float = DRIFT_RERUN_JUMP


NO_BRACKETS = RunnerPolicy(bracket_every=0, rerun_jump=math.inf)


@dataclass
class _Record:
    """What the runner has seen in this process: for the schedule and the drift.json extras."""

    trials_since_bracket: int = 0
    last_bracket_at: float | None = None
    """time.monotonic() of the last bracket of this process."""
    reference_walls: list[float] = field(default_factory=list)
    trial_walls: list[float] = field(default_factory=list)
    contended: list[dict[str, Any]] = field(default_factory=list)
    reruns: list[dict[str, str]] = field(default_factory=list)
    rerun_done: set[str] = field(default_factory=set)
    calls: int = 0
    batch_left: int = 0
    """Trials of the current call still to run, the one starting included: their room is kept from drift
    re-runs (the caller counted on it: advise's check trials)."""


class TrialRunner:
    """Runs specs of one setup (see the module docstring); called like the search's `run_specs`."""

    def __init__(
        self,
        settings: TrialSettings,
        base: dict[str, Any],
        profile_dir: Path,
        setup: str,
        say: Callable[[str], None] | None = None,
        drift_path: Path | None = None,
        policy: RunnerPolicy = RunnerPolicy(),
        deadline: float | None = None,
        trial_env: Callable[[TrialSpec], Mapping[str, str]] | None = None,
        run_trial: Callable[..., TrialOutcome] | None = None,
        reference: TrialSpec | None = None,
    ) -> None:
        self.settings, self.base, self.setup = settings, base, setup
        self.profile_dir = Path(profile_dir)
        self.csv_path = self.profile_dir / "trials.csv"
        self.drift_path = Path(drift_path) if drift_path else self.profile_dir / "drift.json"
        self.say = say or (lambda message: None)
        self.policy, self.deadline, self.trial_env = policy, deadline, trial_env
        self._run_trial = run_trial or _run_trial
        self.drift = read_drift(self.drift_path, setup)
        self.duel_path = self.drift_path.with_name(DUEL_FILE)
        self.duels: list[Duel] = read_duels(self.duel_path, setup)
        self.reference: TrialSpec | None = None
        self.wanted_reference = reference
        """The trial to adopt as the reference (None: the first that succeeds); should it fail or be
        ruled out by an out-of-memory trial below it, the next trial that succeeds is adopted instead."""
        self.specs: dict[str, TrialSpec] = {}
        self.seen = _Record()

    # ------------------------------------------------------------------------------------ the protocol

    def __call__(self, specs: list[TrialSpec]) -> pd.DataFrame:
        """Run the specs not yet finished; return every trial of the setup (the last attempt of each)."""
        self.seen.calls += 1
        done = finished_trials(read_trials(self.csv_path), self.setup)
        todo = [spec for spec in specs if spec.trial_id not in done]
        ran = 0
        for spec in todo:
            self.seen.batch_left = len(todo) - ran
            self.run_one(spec)
            ran += 1
        self.seen.batch_left = 0
        if ran and (len(specs) > 1 and self.seen.calls > 1 or self._only_a_bracket_left()):
            self.close()  # a batch (the check trials), or the budget's end: close the open gap now
        return self.table()

    def table(self) -> pd.DataFrame:
        return latest_rows(read_trials(self.csv_path), self.setup)

    def run_one(self, spec: TrialSpec) -> TrialOutcome:
        """One trial (after a bracket if one is due), run again if contended; its row added."""
        self.specs[spec.trial_id] = spec
        if self._bracket_due():
            self.bracket()
        outcome = self._measure(spec, self._trial_dir(spec))
        self.seen.trials_since_bracket += 1
        self.seen.trial_walls.append(outcome.wall_s)
        if self.reference is None and self.drift.reference in ("", spec.trial_id) and self._may_adopt(spec):
            self._adopt_reference(spec, outcome)
        if self.wanted_reference and _rules_out(spec, outcome.status, self.wanted_reference):
            self.wanted_reference = None  # it failed or cannot fit: the next trial that succeeds instead
        self._correct()
        return outcome

    def close(self) -> None:
        """A last bracket after the trials since the previous one, when the budget leaves room."""
        if self.seen.trials_since_bracket and self._room_for(self._bracket_cost()):
            self.bracket()

    def rematch(self, trial_ids: list[str], reserve_s: float = 0.0) -> pd.DataFrame:
        """Measure the first two of these configs again: a duel, A B B A (advisor.measure.duel), when the
        budget has room for its four legs; else once each, back to back, their new rows replacing the old.
        `reserve_s` of the budget stays free for what comes after (advise's check trials)."""
        specs = [self.specs[t] for t in trial_ids if t in self.specs][:2]
        if len(specs) < 2:
            return self.table()
        if self._room_for(len(DUEL_ORDER) * self._trial_cost() + reserve_s):
            return self.duel(specs[0], specs[1])
        if not self._room_for(sum(self._trial_cost() for _ in specs) + reserve_s):
            return self.table()
        self.say("rematch: " + " and ".join(s.trial_id for s in specs) + " measured again, back to back")
        for spec in specs:
            self._measure(spec, self._trial_dir(spec))
            self.seen.trials_since_bracket += 1
        self._correct()
        return self.table()

    def duel(self, a: TrialSpec, b: TrialSpec) -> pd.DataFrame:
        """`a` and `b` measured A B B A; each one's legs pooled into its row, the pair's ratio in duel.json.
        A leg that fails or is contended ends the duel with the rows as they were (and says so)."""
        self.say(f"duel: {a.trial_id} and {b.trial_id} are within each other's intervals; measured A B B A")
        legs: list[Leg] = []
        last: dict[str, tuple[TrialOutcome, Path]] = {}
        for n, which in enumerate(DUEL_ORDER, 1):
            spec = (a, b)[which]
            trial_dir = self._trial_dir(spec) / f"duel-{n}"
            outcome = self._run(spec, trial_dir)
            self.seen.trials_since_bracket += 1
            self.seen.trial_walls.append(outcome.wall_s)
            interval = median_interval(
                trial_step_times(outcome.profile, trial_dir, self.settings.warmup_steps)
            )
            if outcome.status != "ok" or is_contended(outcome.others_cpu_share) or not interval.steps:
                why = outcome.reason if outcome.status != "ok" else "contended or no steps measured"
                self.say(f"duel: leg {n} ({spec.trial_id}) {outcome.status}: {why}; duel abandoned")
                return self.table()
            legs.append(
                Leg(spec.trial_id, interval.median_s, interval.lo_s, interval.hi_s, _num(outcome.measured_at))
            )
            last[spec.trial_id] = (outcome, trial_dir)
        for spec in (a, b):
            outcome, trial_dir = last[spec.trial_id]
            self._add_pooled_row(
                spec, outcome, trial_dir, pool([g for g in legs if g.trial_id == spec.trial_id])
            )
        batch_ratio = (
            a.micro_batch * grad_accum_of(a, self.base) / (b.micro_batch * grad_accum_of(b, self.base))
        )
        result = paired(a.trial_id, b.trial_id, legs, batch_ratio)  # same ranks: samples a step per rank
        self.duels.append(result)
        write_duels(self.duel_path, self.setup, self.duels)
        self.say(result.line())
        self._correct()
        return self.table()

    def _add_pooled_row(
        self, spec: TrialSpec, outcome: TrialOutcome, trial_dir: Path, pooled: Pooled
    ) -> None:
        """The config's row from its pooled legs: raw median and interval, time; _correct does the rest."""
        row = trial_row(spec, outcome, self.setup, self.settings, trial_dir)
        leg_median = _num(row.get("step_s_raw"))
        scale = pooled.step_s / leg_median if leg_median > 0 else 1.0
        row.update(
            step_s_raw=pooled.step_s,
            step_s_raw_lo=pooled.lo_s,
            step_s_raw_hi=pooled.hi_s,
            step_s_lo=pooled.lo_s,
            step_s_hi=pooled.hi_s,
            step_time_median_s=pooled.step_s,
            step_time_s=_num(row.get("step_time_s")) * scale,
            samples_per_s=_num(row.get("samples_per_s")) / scale,
            measured_at=pooled.at,
            stopped_by=POOLED_STOP,  # no one trial's stop rule: its interval is the legs' and their spread
            notes=f"the pooled median of its {pooled.legs} {POOLED_NOTE} (trials/{spec.trial_id}/duel-*)",
        )
        append_row(self.csv_path, row)

    def answer_lines(self) -> list[str]:
        """What the answer says about the machine: its drift, and each trial left contended."""
        lines = [self.drift.summary_line()] if self.drift.brackets else []
        lines += [duel.line() for duel in self.duels]
        rows = self.table()
        if "contended" in rows:
            flagged = rows[(rows["status"] == "ok") & rows["contended"].map(_truthy)]
            lines += [
                contention_line(str(r.trial_id), _num(r.others_cpu_share, 0.0))
                + ": flagged, its interval widened (not a clean measurement)"
                for r in flagged.itertuples()
            ]
        return lines

    # ------------------------------------------------------------------------------------ brackets

    def bracket(self) -> Bracket | None:
        """Measure the reference again; correct every row for the drift the brackets now show."""
        if self.reference is None:
            return None
        n = len(self.drift.brackets)
        trial_dir = self._trial_dir(self.reference) / f"bracket-{n}"
        self.say(f"bracket {n}: the reference {self.reference.trial_id} again")
        outcome = self._run(self.reference, trial_dir)
        self.seen.reference_walls.append(outcome.wall_s)
        self.seen.last_bracket_at = time.monotonic()
        self.seen.trials_since_bracket = 0
        added = self._bracket_of(outcome, trial_dir)
        if added is None:
            self.say(f"bracket {n}: the reference {outcome.status} ({outcome.reason}); no drift measured")
            return None
        if added.contended:
            self.say(contention_line(f"bracket {n}", outcome.others_cpu_share or 0.0) + ": not used")
        previous = self.drift.clean()
        self.drift.brackets.append(added)
        if previous and not added.contended:
            self.say(
                f"bracket {n}: the reference's step at {added.step_s / previous[0].step_s:.2f}x its first"
            )
        self._correct()
        self._rerun_drifted()
        return added

    def _may_adopt(self, spec: TrialSpec) -> bool:
        wanted = self.wanted_reference
        return wanted is None or spec.trial_id == wanted.trial_id or bool(self.drift.brackets)

    def _adopt_reference(self, spec: TrialSpec, outcome: TrialOutcome) -> None:
        """The first trial that measured steps becomes the reference, its run bracket 0."""
        if self.drift.brackets:  # a resumed run: the reference of drift.json, its brackets kept
            self.reference = spec
            return
        added = self._bracket_of(outcome, self._trial_dir(spec))
        if added is None:
            return
        self.reference = spec
        self.drift = Drift(spec.trial_id, self.setup, [added])
        self.seen.reference_walls.append(outcome.wall_s)
        self.seen.last_bracket_at = time.monotonic()
        self.seen.trials_since_bracket = 0

    def _bracket_of(self, outcome: TrialOutcome, trial_dir: Path) -> Bracket | None:
        times = trial_step_times(outcome.profile, trial_dir, self.settings.warmup_steps)
        interval = median_interval(times)
        if outcome.status != "ok" or not interval.steps or outcome.measured_at is None:
            return None
        return Bracket(
            outcome.measured_at,
            interval.median_s,
            interval.lo_s,
            interval.hi_s,
            is_contended(outcome.others_cpu_share),
            str(trial_dir),
        )

    def _bracket_due(self) -> bool:
        if self.reference is None or not self.policy.bracket_every:
            return False
        if not self.drift.clean():
            return self.seen.trials_since_bracket > 0  # no clean base yet: measure one
        if self.seen.last_bracket_at is None:  # resumed: this process has not bracketed yet
            return True
        elapsed = time.monotonic() - self.seen.last_bracket_at
        busy = self.seen.trials_since_bracket >= self.policy.bracket_every
        return (busy or elapsed >= self.policy.bracket_every_s and self.seen.trials_since_bracket > 0) and (
            self._room_for(self._bracket_cost())
        )

    # ------------------------------------------------------------------------------------ running

    def _trial_dir(self, spec: TrialSpec) -> Path:
        return self.profile_dir / "trials" / spec.trial_id

    def _run(self, spec: TrialSpec, trial_dir: Path) -> TrialOutcome:
        config = write_trial_config(self.base, spec, trial_dir, spec.ranks_per_node * self.settings.hosts)
        env = dict(self.trial_env(spec)) if self.trial_env else None
        name = spec.trial_id + ("" if trial_dir == self._trial_dir(spec) else f" ({trial_dir.name})")
        self.say(f"trial {name} ...")
        outcome = self._run_trial(spec, self.settings, config, trial_dir, env)
        self.say(
            f"trial {name}: {outcome.status} in {outcome.wall_s:.0f} s" + _figures(outcome, self.settings)
        )
        return outcome

    def _measure(self, spec: TrialSpec, trial_dir: Path) -> TrialOutcome:
        """Run the trial and add its row; a contended run is recorded and run again once, time allowing."""
        outcome = self._run(spec, trial_dir)
        if outcome.status == "ok" and is_contended(outcome.others_cpu_share):
            share = outcome.others_cpu_share or 0.0
            again = self.policy.rerun_contended and self._room_for(outcome.wall_s)
            self.say(contention_line(spec.trial_id, share) + (": run again" if again else ": flagged"))
            self.seen.contended.append({"trial_id": spec.trial_id, "share": share, "run_again": again})
            if again:
                outcome.notes.append(f"contended ({share:.0%} of the cores taken): run again")
                self._add_row(spec, outcome, trial_dir)
                _keep_attempt(trial_dir, len(self.seen.contended))
                outcome = self._run(spec, trial_dir)
                if is_contended(outcome.others_cpu_share):
                    share = outcome.others_cpu_share or 0.0
                    self.say(contention_line(spec.trial_id, share) + " again: flagged, not fitted as clean")
                    self.seen.contended.append(
                        {"trial_id": spec.trial_id, "share": share, "run_again": False}
                    )
        if is_contended(outcome.others_cpu_share):
            outcome.notes.append(f"contended: {outcome.others_cpu_share:.0%} of the cores taken by others")
        self._add_row(spec, outcome, trial_dir)
        return outcome

    def _add_row(self, spec: TrialSpec, outcome: TrialOutcome, trial_dir: Path) -> None:
        row = trial_row(spec, outcome, self.setup, self.settings, trial_dir)
        append_row(self.csv_path, row)

    def _rerun_drifted(self) -> None:
        """Trials of a gap whose reference moved by more than the policy allows: once more, one at a time,
        time allowing. Each re-run is a repeat that the timeline's fit weighs beside the brackets
        (advisor.measure.drift), so the gaps are judged again after each: when the repeats say the jump
        was the bracket's own noise, not the machine's, the fitted jump falls below the policy and the
        rest are not run again (calibration round 8, default: a bracket 42% off had four trials re-run;
        after two of them the fitted jump was 13%)."""
        reference = self.reference.trial_id if self.reference else None
        while True:
            pending = [
                (trial_id, at)
                for trial_id, at in self._drifted()
                if trial_id not in self.seen.rerun_done and trial_id != reference and trial_id in self.specs
            ]
            # a re-run, and then the call's own trials: re-runs that crowded out the check trials ran
            # a 5-minute advise 64 s over (calibration round 12, default: three re-runs before three checks)
            if not pending or not self._room_for(self._trial_cost() * (1 + self.seen.batch_left)):
                break
            trial_id, at = pending[0]
            self.seen.rerun_done.add(trial_id)
            jump = self.drift.correction_at(at).jump
            self.say(f"drift: the reference moved {jump:.0%} around {trial_id}: run again")
            self.seen.reruns.append({"trial_id": trial_id, "why": f"reference moved {jump:.0%} in its gap"})
            self._measure(self.specs[trial_id], self._trial_dir(self.specs[trial_id]))
            self.seen.trials_since_bracket += 1
            self._correct()  # the repeat joins the timeline's fit before the next gap is judged

    def _drifted(self) -> list[tuple[str, float]]:
        """(trial_id, measured_at) of this setup's ok rows inside a gap that jumped beyond the policy."""
        rows = self.table()
        if rows.empty or "measured_at" not in rows:
            return []
        at = pd.to_numeric(rows["measured_at"], errors="coerce")
        ok = rows[(rows["status"] == "ok") & at.notna()]
        stamps = [(str(r.trial_id), float(r.measured_at)) for r in ok.itertuples()]
        drifted = set(gap_trials(self.drift, stamps, self.policy.rerun_jump))
        return [(trial_id, at) for trial_id, at in stamps if trial_id in drifted]

    # ------------------------------------------------------------------------------------ budget

    def _room_for(self, seconds: float) -> bool:
        return self.deadline is None or time.monotonic() + seconds <= self.deadline

    def _trial_cost(self) -> float:
        walls = self.seen.trial_walls
        return sum(walls) / len(walls) if walls else 0.0

    def _bracket_cost(self) -> float:
        walls = self.seen.reference_walls or self.seen.trial_walls
        return sum(walls) / len(walls) if walls else 0.0

    def _only_a_bracket_left(self) -> bool:
        """The budget fits a bracket but no further trial after it: the last chance to close the gap."""
        if self.deadline is None:
            return False
        return self._room_for(self._bracket_cost()) and not self._room_for(
            self._bracket_cost() + self._trial_cost()
        )

    # ------------------------------------------------------------------------------------ correction

    def _repeats(self, rows: pd.DataFrame) -> list[Repeat]:
        """Clean raw measurements of each config besides the reference measured more than once (a trial
        run again, a duel's legs beside the config's trial): the timeline's evidence beside the brackets
        (advisor.measure.drift.fit_timeline). A duel's pooled row is its legs, not one more."""
        found = [
            Repeat(str(row["trial_id"]), _num(row.get("measured_at")), _num(row.get("step_s_raw")))
            for row in rows.to_dict("records")
            if str(row.get("stopped_by")) != POOLED_STOP
            and not _truthy(row.get("contended"))
            and str(row["trial_id"]) != self.drift.reference
        ]
        found += [Repeat(leg.trial_id, leg.at, leg.step_s) for duel in self.duels for leg in duel.legs]
        found = [r for r in found if r.step_s > 0 and math.isfinite(r.at)]
        counts = Counter(r.trial_id for r in found)
        return [r for r in found if counts[r.trial_id] > 1]

    def _correct(self) -> None:
        """Every row of this setup corrected for the brackets so far; drift.json written."""
        table = read_trials(self.csv_path)
        if table.empty:
            return
        mine = table.index[(table["setup_id"].astype(str) == self.setup) & (table["status"] == "ok")]
        self.drift.repeats = self._repeats(table.loc[mine])
        changed = False
        for i in mine:
            row = table.loc[i]
            raw = _num(row.get("step_s_raw"))
            if math.isnan(raw):
                continue
            correction = self.drift.correction_at(_num(row.get("measured_at")))
            old = _num(row.get("drift_factor"), 1.0)
            share = _num(row.get("others_cpu_share"), 0.0) if _truthy(row.get("contended")) else 0.0
            step, lo, hi = corrected_interval(
                raw, _num(row.get("step_s_raw_lo")), _num(row.get("step_s_raw_hi")), correction, share
            )
            new = correction.factor
            updates = {
                "step_time_median_s": step,
                "step_s_lo": lo,
                "step_s_hi": hi,
                "drift_factor": new,
                "drift_uncertainty": correction.uncertainty,
                "bracketed": correction.bracketed,
                "step_time_s": _num(row.get("step_time_s")) * old / new,
                "samples_per_s": _num(row.get("samples_per_s")) * new / old,
            }
            for column, value in updates.items():
                if column in table.columns:
                    if table[column].dtype != object and isinstance(value, bool):
                        table[column] = table[column].astype(object)
                    table.at[i, column] = value
            changed = True
        if changed:
            write_trials(self.csv_path, table)
        if self.drift.brackets:
            write_drift(
                self.drift_path,
                self.drift,
                {
                    "contended_trials": self.seen.contended,
                    "reruns": self.seen.reruns,
                    "bracket_every": self.policy.bracket_every,
                },
            )


def _rules_out(spec: TrialSpec, status: str, reference: TrialSpec) -> bool:
    """Whether this outcome means the reference will not measure: it failed itself, or ran out of memory
    at or below the reference's micro-batch on its ladder (the ladder stops there)."""
    if status == "ok":
        return False
    if spec.trial_id == reference.trial_id:
        return True
    ladder = lambda s: (s.zero_stage, s.precision, s.offload, s.ranks_per_node)  # noqa: E731
    return status == "oom" and ladder(spec) == ladder(reference) and spec.micro_batch <= reference.micro_batch


def _keep_attempt(trial_dir: Path, n: int) -> None:
    """The contended attempt's log and profile, kept beside the next attempt's (which replaces them)."""
    for name in ("log.txt", "profile.json"):
        path = trial_dir / name
        if path.exists():
            path.replace(trial_dir / f"{path.stem}.contended-{n}{path.suffix}")


def _figures(outcome: TrialOutcome, settings: TrialSettings) -> str:
    """`, median step 0.104 s +-2.1% (12 steps)` for a trial that measured steps; its reason if it failed."""
    if outcome.status != "ok":
        return f" ({outcome.reason})" if outcome.reason else ""
    times = trial_step_times(outcome.profile, Path(outcome.log_path).parent, settings.warmup_steps)
    interval = median_interval(times)
    if not interval.steps:
        return ""
    width = "" if math.isinf(interval.rel_halfwidth) else f" +-{interval.rel_halfwidth:.1%}"
    return f", median step {interval.median_s:.3f} s{width} ({interval.steps} steps)"


def _run_trial(*args: Any) -> TrialOutcome:
    return trial_module.run_trial(*args)  # looked up when called: tests stand in for it there


def _num(value: Any, default: float = math.nan) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(number) else number


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value) and not (isinstance(value, float) and math.isnan(value))
