"""Launches: one run of the trainer per ZeRO stage, precision and offload, measuring all its configs.

A *launch* starts the trainer once (sdzero.training.measuring.sweep: model, encoders, data and engine built
once) and measures every config asked of its group, interleaved A B C A B C, so that the machine's drift
over the launch falls on all of them alike. trials.csv keeps one row per config, as for a single trial;
the row's `trial_dir` is its launch's folder, `wall_s` what a run of the config alone would take (the
launch's start-up and the config's own steps).

- **Tie.** Every round of every launch times the same fixed matrix product; a launch's `drift_factor`
  is its tie's median over the first launch's, and its configs' steps are put on the first launch's
  machine speed by it (`step_time_median_s`, `step_s_lo/_hi`; `step_s_raw*` as measured).
- **Out of memory.** A config that runs out ends itself inside the launch (with the larger micro-batches
  of its accumulation). A launch that dies or hangs keeps the configs it finished (its partial file),
  marks the config it was measuring (oom when the log says so, else crash/timeout) and launches the rest
  once more without it. `--mem-cap-gib` is judged per config on its own peak.
- **Contention.** The launch's window is watched (advisor.measure.contention): a contended launch is
  launched again once when the budget has room; still contended, its rows are flagged, left out of the
  pick (advisor.decide.recommend) and said in one line.
- **Costs.** Each launch's start-up (wall time not spent in steps) and its seconds per step go to
  `<out>/launches.json`; the search plans the budget from them (advisor.decide.search).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.measure import trials as trial_module
from advisor.measure.contention import contention_line, is_contended
from advisor.measure.grid import TrialSpec, finished_trials, grad_accum_of, write_trial_config
from advisor.measure.trial_table import append_row, latest_rows, read_trials, trial_row
from advisor.measure.trials import OOM_PATTERNS, TrialOutcome, TrialSettings
from sdzero.atomic import write_json_atomic
from sdzero.config.user_file import parse_json_text, read_user_text
from sdzero.constants import GIB
from sdzero.errors import UserError
from sdzero.training.measuring.race import OVER_CAP

LAUNCHES_FILE = "launches.json"
LAUNCH_MEASURE_S = 24.0
"""A launch's seconds of timed steps when the caller plans none (`sdzero profile`): 6 s a config of four."""
MIN_LAUNCH_MEASURE_S = 4.0


def group_key(spec: TrialSpec) -> TrialSpec:
    """What one engine fixes: the spec without its micro-batch and accumulation."""
    return replace(spec, micro_batch=0, grad_accum=None, checkpointing=False)


def launch_name(spec: TrialSpec) -> str:
    """`z2-bf16-off-none-r2`: the group's id, its trial id without the micro-batch and accumulation."""
    kept = (p for p in spec.trial_id.split("-") if not (p.startswith("mb") or p.startswith("ga")))
    return "-".join(p for p in kept if p != "gc")


@dataclass
class LaunchRecord:
    """One launch as it ran: what launches.json keeps of it."""

    name: str
    folder: str
    configs: list[str]
    status: str
    wall_s: float
    startup_s: float
    """Wall time not spent in the launch's steps or its tie: processes, imports, model, data, engine."""
    steps_s: float
    """Seconds in every step of the launch (warm-up and instrumented included)."""
    timed_s: float
    """Seconds in its timed steps alone: the measurement itself."""
    timed_steps: int
    tie_s: float | None
    others_cpu_share: float | None
    round_medians_s: dict[str, list[float]] = field(default_factory=dict)
    at: float = 0.0
    raced: dict[str, str] = field(default_factory=dict)
    """Configs the launch stopped measuring as clearly slower per sample than its leader, and why
    (sdzero.training.measuring.race.race)."""

    @property
    def step_s(self) -> float:
        """Mean seconds of one timed step (all configs)."""
        return self.timed_s / self.timed_steps if self.timed_steps else math.nan


class LaunchRunner:
    """Runs the specs of one setup, one launch per group; called like the search's `run_specs`."""

    def __init__(
        self,
        settings: TrialSettings,
        base: dict[str, Any],
        profile_dir: Path,
        setup: str,
        say: Callable[[str], None] | None = None,
        deadline: float | None = None,
        trial_env: Callable[[TrialSpec], Mapping[str, str]] | None = None,
        run_trial: Callable[..., TrialOutcome] | None = None,
        launches_path: Path | None = None,
    ) -> None:
        self.settings, self.base, self.setup = settings, base, setup
        self.profile_dir = Path(profile_dir)
        self.csv_path = self.profile_dir / "trials.csv"
        self.launches_path = Path(launches_path) if launches_path else self.profile_dir / LAUNCHES_FILE
        self.say = say or (lambda message: None)
        self.deadline, self.trial_env = deadline, trial_env
        self._run_trial = run_trial or _run_trial
        self.launches: list[LaunchRecord] = read_launches(self.launches_path, setup)
        self.contended: list[str] = []

    # ------------------------------------------------------------------------------------ the protocol

    def __call__(self, specs: list[TrialSpec], measure_s: float | None = None) -> pd.DataFrame:
        """Launch the groups of the specs not yet finished (each group once, its specs together); return
        every trial of the setup (the last attempt of each). `measure_s`: each launch's seconds of timed
        steps (default LAUNCH_MEASURE_S)."""
        done = finished_trials(read_trials(self.csv_path), self.setup)
        groups: dict[TrialSpec, list[TrialSpec]] = {}
        for spec in specs:
            if spec.trial_id not in done:
                groups.setdefault(group_key(spec), []).append(spec)
        for members in groups.values():
            self.launch(members, measure_s or LAUNCH_MEASURE_S)
        return self.table()

    def table(self) -> pd.DataFrame:
        return latest_rows(read_trials(self.csv_path), self.setup)

    def launch(self, specs: list[TrialSpec], measure_s: float) -> list[str]:
        """One launch of these specs (one group): launched again without a config that killed it, and
        once more when another process took the cores while it measured and the budget has room."""
        left = sorted(specs, key=lambda s: (grad_accum_of(s, self.base), s.micro_batch))
        seen: list[str] = []
        while left:
            finished, record = self._launch_once(left, measure_s)
            if record.status == "contended" and self._room_for(record.wall_s):
                self.say(
                    contention_line(f"launch {record.name}", record.others_cpu_share or 0.0)
                    + ": launched again"
                )
                record.status = "contended, launched again"
                self._write_launches()
                finished, _ = self._launch_once([s for s in left if s.trial_id in finished], measure_s)
            elif record.status == "contended":
                self.say(self._contended_line(record))
            seen += finished
            left = [s for s in left if s.trial_id not in seen]
            if not finished:
                break  # nothing finished: the same failure would repeat
        return seen

    def answer_lines(self) -> list[str]:
        """One line per launch left contended: its configs were measured on fewer cores than they get."""
        return [self._contended_line(r) for r in self.launches if r.status == "contended"]

    @staticmethod
    def _contended_line(record: LaunchRecord) -> str:
        return (
            contention_line(f"launch {record.name}", record.others_cpu_share or 0.0)
            + ": its configs are left out of the pick (no budget left to measure them quiet)"
        )

    # ------------------------------------------------------------------------------------ one launch

    def _launch_once(self, specs: list[TrialSpec], measure_s: float) -> tuple[list[str], LaunchRecord]:
        """Launch `specs`; add a row per config it finished. Returns their trial ids and the launch."""
        name = launch_name(specs[0])
        n = sum(1 for r in self.launches if r.name == name)
        folder = self.profile_dir / "trials" / name / f"launch-{n}"
        config = write_trial_config(
            self.base, specs[0], folder, specs[0].ranks_per_node * self.settings.hosts
        )
        sweep = ",".join(_sweep_config(s, self.base) for s in specs)
        measure_s = max(measure_s, MIN_LAUNCH_MEASURE_S)
        settings = replace(
            self.settings,
            sweep=sweep,
            launch_measure_s=measure_s,
            trial_timeout_s=self.settings.trial_timeout_s + 2 * measure_s,
        )
        env = dict(self.trial_env(specs[0])) if self.trial_env else None
        self.say(f"launch {name}: {len(specs)} configs ({sweep}), {measure_s:.0f} s measuring ...")
        outcome = self._run_trial(specs[0], settings, config, folder, env)
        result = outcome.profile or _read_json(folder / "profile.partial.json") or {}
        launch = result.get("launch", {})
        configs = result.get("configs", {})
        record = self._record(name, folder, specs, outcome, launch)
        if outcome.status == "ok" and is_contended(outcome.others_cpu_share):
            record.status = "contended"
        self.launches.append(record)
        self._write_launches()
        self.say(self._line(record, outcome))
        finished: list[str] = []
        failed_here = False
        for spec in specs:
            key = f"mb{spec.micro_batch}-ga{grad_accum_of(spec, self.base)}" + ("-gc" * spec.checkpointing)
            row_outcome = self._config_outcome(key, outcome, configs, launch, record)
            if row_outcome is None:
                if failed_here:
                    continue  # not reached: launched again without the config that failed
                failed_here = True
                row_outcome = self._failed_config(outcome)
            append_row(self.csv_path, self._row(spec, row_outcome, folder, record))
            finished.append(spec.trial_id)
        return finished, record

    def _config_outcome(
        self,
        key: str,
        outcome: TrialOutcome,
        configs: dict[str, Any],
        launch: dict[str, Any],
        record: LaunchRecord,
    ) -> TrialOutcome | None:
        """The config's own outcome inside its launch; None when the launch ended before it finished."""
        oom = (launch.get("oom") or {}).get(key)
        profile = configs.get(key)
        if oom and profile is None:
            return TrialOutcome("oom", oom, None, record.startup_s, outcome.returncode, outcome.log_path)
        if profile is None:
            return None
        status, reason = "ok", ""
        cap = self.settings.mem_cap_bytes
        peak = int(profile["device_peak_bytes"])
        if cap is not None and peak > cap:
            rank = max(profile["ranks"], key=lambda r: r["device_peak_bytes"])["rank"]
            status = "oom"
            reason = f"memory cap: peak {peak / GIB:.3f} GiB on rank {rank} > --mem-cap-gib {cap / GIB:g}"
        # The wall time of a run of this config alone: the launch's start-up and its own steps (what the
        # time to train's start-up, advisor.model.time_to_train, reads back from a row).
        steps = len(profile.get("step_times_s") or []) + self.settings.warmup_steps
        alone_s = record.startup_s + steps * float(profile.get("step_time_median_s") or 0.0)
        return TrialOutcome(
            status,
            reason,
            profile,
            alone_s,
            outcome.returncode,
            outcome.log_path,
            notes=[f"launch {record.name}: {launch.get('rounds', 0)} interleaved rounds"]
            + ([f"raced out in {record.raced[key]}"] if key in record.raced else []),
            others_cpu_share=outcome.others_cpu_share,
            measured_at=profile.get("measured_at") or outcome.measured_at,
        )

    def _failed_config(self, outcome: TrialOutcome) -> TrialOutcome:
        """The config the launch was measuring when it died: oom when the log says so, else the launch's
        own end (crash, timeout)."""
        log = outcome.log_path.read_text(errors="replace") if outcome.log_path.exists() else ""
        status, reason = outcome.status, outcome.reason
        if status == "ok":  # the launcher exited cleanly without the config: count it a crash
            status, reason = "crash", "the launch ended before this config was measured"
        if OOM_PATTERNS.search(log):
            status = "oom"
            reason = reason if reason.startswith("out of memory") else f"out of memory: {reason}"
        return TrialOutcome(
            status, reason, None, outcome.wall_s, outcome.returncode, outcome.log_path, outcome.log_tail
        )

    def _row(
        self, spec: TrialSpec, outcome: TrialOutcome, folder: Path, record: LaunchRecord
    ) -> dict[str, Any]:
        row = trial_row(spec, outcome, self.setup, self.settings, folder)
        factor = self._tie_factor(record)
        raw = row.get("step_s_raw")
        if factor is not None and raw is not None and not math.isnan(float(raw)):
            row.update(
                drift_factor=factor,
                step_time_median_s=float(raw) / factor,
                step_s_lo=float(row["step_s_raw_lo"]) / factor,
                step_s_hi=float(row["step_s_raw_hi"]) / factor,
                step_time_s=float(row["step_time_s"]) / factor,
                samples_per_s=float(row["samples_per_s"]) * factor,
                bracketed=True,
            )
        return row

    def _tie_factor(self, record: LaunchRecord) -> float | None:
        """How much slower the machine ran this launch's tie than the first launch's (None: no tie)."""
        first = next((r.tie_s for r in self.launches if r.tie_s), None)
        if first is None or not record.tie_s:
            return None
        return record.tie_s / first

    def _record(
        self, name: str, folder: Path, specs: list[TrialSpec], outcome: TrialOutcome, launch: dict[str, Any]
    ) -> LaunchRecord:
        seconds = launch.get("seconds") or {}
        steps_s = sum(float(seconds.get(k, 0.0)) for k in ("warmup", "instrumented", "timed"))
        ties = [float(t) for t in launch.get("tie_s") or []]
        medians = launch.get("round_medians_s") or {}
        return LaunchRecord(
            name=name,
            folder=str(folder),
            configs=[s.trial_id for s in specs],
            status=outcome.status,
            wall_s=round(outcome.wall_s, 2),
            startup_s=round(max(outcome.wall_s - steps_s - float(seconds.get("tie", 0.0)), 0.0), 2),
            steps_s=round(steps_s, 3),
            timed_s=round(float(seconds.get("timed", 0.0)), 3),
            timed_steps=sum(len(v) for v in medians.values()) * int(launch.get("round_steps", 1) or 1),
            tie_s=statistics.median(ties) if ties else None,
            others_cpu_share=outcome.others_cpu_share,
            round_medians_s={k: [float(x) for x in v] for k, v in medians.items()},
            at=time.time(),
            raced={str(k): str(v) for k, v in (launch.get("raced") or {}).items()},
        )

    def _line(self, record: LaunchRecord, outcome: TrialOutcome) -> str:
        head = f"launch {record.name}: {outcome.status} in {record.wall_s:.0f} s"
        if outcome.status != "ok":
            return head + (f" ({outcome.reason})" if outcome.reason else "")
        share = record.timed_s / record.wall_s if record.wall_s else 0.0
        head += f" (start-up {record.startup_s:.0f} s, {record.timed_s:.0f} s measuring: {share:.0%})"
        over = [k for k, why in record.raced.items() if why.split(": ", 1)[-1].startswith(OVER_CAP)]
        slower = [k for k in record.raced if k not in over]
        if slower:
            head += f"; raced out: {', '.join(slower)} (slower per sample than the launch's leader)"
        if over:
            head += f"; left the race {OVER_CAP}: {', '.join(over)}"
        return head

    # ------------------------------------------------------------------------------------ budget

    def _room_for(self, seconds: float) -> bool:
        return self.deadline is None or time.monotonic() + seconds <= self.deadline

    def costs(self) -> tuple[float, float, float] | None:
        """(start-up seconds, seconds per timed step, seconds of untimed steps per config: warm-up,
        instrumented, settling) of the launches so far; None before any measured."""
        measured = [r for r in self.launches if r.timed_steps]
        if not measured:
            return None
        startup = statistics.median(r.startup_s for r in measured)
        step = sum(r.timed_s for r in measured) / sum(r.timed_steps for r in measured)
        untimed = sum(r.steps_s - r.timed_s for r in measured) / sum(len(r.configs) for r in measured)
        return startup, step, untimed

    def _write_launches(self) -> None:
        write_json_atomic(
            self.launches_path,
            {"setup": self.setup, "launches": [asdict(r) for r in self.launches]},
        )


def _sweep_config(spec: TrialSpec, base: dict[str, Any]) -> str:
    """The spec as the sweep's `--profile-configs` item: MB:GA, and `:gc` with gradient checkpointing."""
    return f"{spec.micro_batch}:{grad_accum_of(spec, base)}" + (":gc" if spec.checkpointing else "")


def read_launches(path: Path, setup: str | None = None) -> list[LaunchRecord]:
    """The launches of launches.json (of `setup` when given); none for a missing or foreign file."""
    data = _read_json(path)
    if not data or (setup is not None and data.get("setup") != setup):
        return []
    fields = set(LaunchRecord.__dataclass_fields__)
    return [LaunchRecord(**{k: v for k, v in r.items() if k in fields}) for r in data.get("launches", [])]


def repeat_halves(folder: Path) -> list[list[float]]:
    """Each config's two halves of its launch, [median of its first rounds, median of its last]: the
    same work measured twice, a half-launch apart, uncorrected (the run's noise floor,
    advisor.model.uncertainty.run_noise_floor). A round alone (a few steps) is noisier than a run is;
    halves are what a minute of this machine's drift does to a measurement."""
    for path in (folder / "profile" / LAUNCHES_FILE, folder / LAUNCHES_FILE):
        records = read_launches(path)
        if records:
            halves = []
            for record in (r for r in records if not r.status.startswith("contended")):
                for rounds in record.round_medians_s.values():
                    if len(rounds) >= 2:
                        mid = len(rounds) // 2
                        halves.append([statistics.median(rounds[:mid]), statistics.median(rounds[mid:])])
            return halves
    return []


def _read_json(path: Path) -> dict[str, Any] | None:
    """A record of an earlier launch, or None when missing or torn (a kill mid-write of an older version);
    a FIFO, a device or an oversized file is one line naming it (it once hung --replan for ever)."""
    if not os.path.lexists(path):
        return None
    text = read_user_text(path, "an earlier launch's record")
    try:
        data = parse_json_text(text, str(path))
    except UserError:
        return None
    return data if isinstance(data, dict) else None


def _run_trial(*args: Any) -> TrialOutcome:
    return trial_module.run_trial(*args)  # looked up when called: tests stand in for it there
