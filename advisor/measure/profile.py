"""`sdzero profile`: run the trial grid and add each trial's result to `<out>/trials.csv` as it ends.

Every trial is a short real run of sdzero/train.py through the `deepspeed` launcher (advisor.measure.trials), so
local ranks, hostfiles and the launcher environment are exactly the user's. Rerunning with the same
`--out` skips the trials already in trials.csv for the same setup (advisor.measure.grid.setup_id), so an
interrupted profile resumes where it stopped. The command's options are in advisor.commands.profile.

Each ladder (ZeRO stage, precision, offload) is one launch of the trainer that measures all its
micro-batches side by side, interleaved (advisor.measure.launch); an out-of-memory micro-batch ends itself
and the larger ones, not the launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.measure.grid import (
    GridPlan,
    GridRequest,
    TrialSpec,
    finished_trials,
    load_base_config,
    pending,
    plan_grid,
    setup_id,
)
from advisor.measure.launch import LaunchRunner, launch_name
from advisor.measure.trial_table import (
    latest_rows,
    read_trials,
)
from advisor.measure.trials import (
    GIB,
    MAX_MEASURE_S,
    TARGET_REL_HALFWIDTH,
    TrialSettings,
    run_trial,
)
from sdzero.cluster.launch_command import shipped_config
from sdzero.errors import UserError


@dataclass
class ProfileResult:
    csv_path: Path
    table: pd.DataFrame
    """Every row of trials.csv for this setup, the last attempt of each trial."""
    ran: list[str] = field(default_factory=list)
    """trial_ids run by this call, in order."""
    skipped: list[str] = field(default_factory=list)
    """trial_ids found finished in trials.csv and not run again."""
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Device and inputs


DEVICE_QUERY = (
    "import json, os; from deepspeed.accelerator import get_accelerator as g; a = g(); "
    "print('SDZERO_DEVICE ' + json.dumps({'device': a.device_name(), 'count': a.device_count(), "
    "'bf16': bool(a.is_bf16_supported()), 'fp16': bool(a.is_fp16_supported()), "
    "'host': os.uname().nodename{more}}))"
)
"""The question a trial's rank asks DeepSpeed's accelerator; its answer is one `SDZERO_DEVICE {json}` line."""
REMOTE_MORE = ", 'memory_bytes': int(a.total_memory())"
"""Asked on another host too: its device 0's memory (a CPU's: the host's), which this machine cannot read
(advisor.stages.target.device_memory_bytes asks here)."""
MARK = "SDZERO_DEVICE "


def device_support(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Ask DeepSpeed's accelerator, in a process started like a trial's ranks, what this device runs.

    A separate process sees exactly what the ranks will see (the same environment, the same
    sitecustomize), and keeps CUDA uninitialised in this one.
    """
    proc = subprocess.run(
        [sys.executable, "-c", DEVICE_QUERY.replace("{more}", "")],
        capture_output=True,
        text=True,
        env=dict(env or os.environ),
        timeout=300,
    )
    answer = device_answer(proc.stdout)
    if answer is None:
        raise UserError(f"could not query the device through DeepSpeed: {proc.stderr.strip()[-300:]}")
    return answer


def device_answer(output: str) -> dict[str, Any] | None:
    """The SDZERO_DEVICE line's answer in a process's output (the launcher prefixes a remote line with
    its host), or None."""
    for line in output.splitlines():
        if MARK in line:
            return dict(json.loads(line.split(MARK, 1)[1]))
    return None


@dataclass(frozen=True)
class TrialsHost:
    """The host the trials run on when it is not this machine, and what it runs."""

    host: str
    slots: int
    """Ranks per trial there: the hostfile line's slots=, what DeepSpeed starts on that host."""
    hostfile: Path
    """A hostfile of that host alone: TrialSettings.hostfile for every trial."""
    device: dict[str, Any]
    """Its device as DeepSpeed's accelerator reports it there, `count` set to `slots`."""


def trials_on_first_host(hostfile: Path, out_dir: Path, env: Mapping[str, str] | None = None) -> TrialsHost:
    """Write a hostfile of `hostfile`'s first host into `out_dir` and ask that host's accelerator, through
    the launcher the trials use (the same forwarded values and environment), what it runs.

    The question runs as one rank (`--num_gpus 1`): the launcher shows that rank one device, so the
    device count is not asked there; the host's slots= is what the hostfile gives DeepSpeed to start, and
    it is the ranks per trial."""
    from advisor.measure.trials import first_host_hostfile, on_the_hosts
    from sdzero.cluster.remote_launch import launch_from_here

    one_host = out_dir / "trials-hostfile"
    first = first_host_hostfile(hostfile, one_host)
    launch = on_the_hosts(
        launch_from_here(
            [],
            ["-c", DEVICE_QUERY.replace("{more}", REMOTE_MORE)],
            out_dir,
            hostfile=one_host,
            num_gpus=1,
            local_rank=False,  # `python -c CODE` has no place for --local_rank=N
            environ=env,
        )
    )
    with launch.secrets_written():
        proc = subprocess.run(
            launch.command,
            cwd=launch.runner_cwd,
            env=launch.runner_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    answer = device_answer(proc.stdout)
    if answer is None:
        tail = (proc.stdout + proc.stderr).strip()[-300:]
        raise UserError(
            f"could not query the device of {first.host} (the hostfile's first host, where the trials run) "
            f"through the deepspeed launcher: {tail}"
        )
    return TrialsHost(first.host, first.slots, one_host, {**answer, "count": first.slots})


def default_ranks(device: dict[str, Any]) -> int:
    """All local accelerators on a GPU machine; 2 ranks on a CPU (the smallest job that communicates)."""
    return int(device["count"]) if device["device"] != "cpu" and device["count"] > 0 else 2


def _check_inputs(
    model: str,
    data: Path,
    steps: int,
    warmup_steps: int,
    trial_timeout_s: float,
    stall_timeout_s: float | None,
    mem_cap_gib: float | None,
) -> None:
    from sdzero.config.data_source import is_shard_source
    from sdzero.models.loading import detect_family

    if not Path(data).is_dir() and not is_shard_source(data):
        raise UserError(f"--data {data}: no such folder; point it at an image folder with metadata.jsonl")
    detect_family(model)  # a wrong --model fails here once, not as a crash in every trial
    if steps < 1:
        raise UserError(f"--steps {steps}: measure at least 1 step per trial")
    if warmup_steps < 0:
        raise UserError(f"--warmup-steps {warmup_steps}: must be >= 0")
    if not trial_timeout_s > 0:
        raise UserError(f"--trial-timeout {trial_timeout_s}: must be a positive number of seconds")
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise UserError(f"--stall-timeout {stall_timeout_s}: must be positive (omit it to disable)")
    if mem_cap_gib is not None and not mem_cap_gib > 0:
        raise UserError(f"--mem-cap-gib {mem_cap_gib}: must be a positive number of GiB")


# --------------------------------------------------------------------------------------------------
# The driver


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler, `kill`) unwinds like Ctrl-C, so the running trial's ranks are killed too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Progress:
    """A rich progress bar: configs done, remaining (an upper bound while ladders may stop early), ETA."""

    def __init__(self, enabled: bool, remaining: int) -> None:
        self.enabled = enabled
        self.done = 0
        self.started = time.monotonic()
        self._progress: Any = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]profile"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[eta]}"),
                TextColumn("[dim]{task.description}"),
            )
            self._task = self._progress.add_task("", total=remaining, eta="")

    def _eta(self, remaining: int) -> str:
        if not self.done or remaining == 0:
            return "" if remaining else "done"
        per_config = (time.monotonic() - self.started) / self.done
        return f"~{per_config * remaining / 60:.1f} min left for {remaining} at most"

    def __enter__(self) -> _Progress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def starting(self, launch: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"launching {launch}")

    def finished(self, configs: int, remaining: int, last: str) -> None:
        self.done += configs
        if self._progress is not None:
            self._progress.update(
                self._task,
                total=self.done + remaining,
                completed=self.done,
                eta=self._eta(remaining),
                description=last,
            )


def _remaining(plan: GridPlan, done: dict[str, str]) -> int:
    """Trials still to run if no further ladder stops early: an upper bound that shrinks at each OOM."""
    return sum(1 for _ in pending(plan, done))


def trial_settings(
    model: str | Path,
    data: Path,
    steps: int,
    warmup_steps: int,
    trial_timeout_s: float,
    stall_timeout_s: float | None,
    mem_cap_gib: float | None,
    hostfile: Path | None,
    train_args: Sequence[str],
    target_rel_halfwidth: float | None = TARGET_REL_HALFWIDTH,
    max_steps: int | None = None,
    max_measure_s: float | None = MAX_MEASURE_S,
) -> TrialSettings:
    """Check the run options and fix them for every trial (paths absolute: ranks may start elsewhere).
    With `target_rel_halfwidth` a trial measures `steps` steps at least and then until its interval is
    that tight, `max_steps` or `max_measure_s` (advisor.measure.trials.TrialSettings)."""
    _check_inputs(str(model), data, steps, warmup_steps, trial_timeout_s, stall_timeout_s, mem_cap_gib)
    if target_rel_halfwidth is not None and not 0 < target_rel_halfwidth < 1:
        raise UserError(f"--target-halfwidth {target_rel_halfwidth}: a fraction of the median, in (0, 1)")
    if max_steps is not None and max_steps < steps:
        raise UserError(f"--max-steps {max_steps}: must be at least --steps {steps}")
    hosts = 1
    if hostfile is not None:
        from advisor.measure.collectives_launch import read_hostfile

        hosts = len(read_hostfile(Path(hostfile)))
    return TrialSettings(
        model=str(Path(model).resolve()) if Path(model).exists() else str(model),  # else a hub id
        data=data.resolve(),
        steps=steps,
        warmup_steps=warmup_steps,
        trial_timeout_s=trial_timeout_s,
        stall_timeout_s=stall_timeout_s,
        mem_cap_bytes=int(mem_cap_gib * GIB) if mem_cap_gib else None,
        hostfile=Path(hostfile).resolve() if hostfile else None,
        hosts=hosts,
        train_args=tuple(train_args),
        target_rel_halfwidth=target_rel_halfwidth,
        max_steps=max_steps,
        max_measure_s=max_measure_s,
    )


def trial_setup_id(base: dict[str, Any], settings: TrialSettings) -> str:
    """The hash trials.csv files this setup's trials under: `sdzero profile` and `sdzero advise` build it
    alike, so a rerun of either with the same --out resumes its own trials."""
    return setup_id(
        {
            "base": base,
            "model": settings.model,
            "data": str(settings.data),
            "steps": settings.steps,
            "warmup": settings.warmup_steps,
            "train_args": list(settings.train_args),
            "hosts": settings.hosts,
            "adaptive": [settings.target_rel_halfwidth, settings.step_cap, settings.max_measure_s],
        }
    )


def plan_for_device(request: GridRequest, device: dict[str, Any]) -> GridPlan:
    if not request.ranks_per_node:
        request = replace(request, ranks_per_node=(default_ranks(device),))
    return plan_grid(request, {p: bool(device[p]) for p in ("bf16", "fp16")})


def run_profile(
    model: str | Path,
    data: Path,
    out_dir: Path,
    grid: GridRequest | None = None,
    base_config: Path | None = None,
    steps: int = 5,
    warmup_steps: int = 2,
    trial_timeout_s: float = 900.0,
    stall_timeout_s: float | None = 300.0,
    mem_cap_gib: float | None = None,
    hostfile: Path | None = None,
    train_args: Sequence[str] = (),
    retry_failed: bool = False,
    trial_env: Callable[[TrialSpec], Mapping[str, str]] | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    target_rel_halfwidth: float | None = TARGET_REL_HALFWIDTH,
    max_steps: int | None = None,
    max_measure_s: float | None = MAX_MEASURE_S,
) -> ProfileResult:
    """Launch every ladder with pending configs once; return the table of this setup's trials.

    `grid` None means ZeRO 1-3 x bf16/fp16 x the micro-batch ladder x no offload x the default ranks.
    `trial_env` adds environment variables to one launch's ranks (per-launch NCCL settings; the tests
    inject failures with it). Failed configs are rows, not exceptions; bad input raises UserError before
    any launch starts. A launch measures `max_measure_s` seconds of timed steps per config (at least
    `steps` steps each), its configs interleaved (advisor.measure.launch).
    """
    say = log or (lambda message: None)
    out_dir = Path(out_dir).resolve()
    settings = trial_settings(
        model,
        Path(data),
        steps,
        warmup_steps,
        trial_timeout_s,
        stall_timeout_s,
        mem_cap_gib,
        hostfile,
        train_args,
        target_rel_halfwidth,
        max_steps,
        max_measure_s,
    )
    base = load_base_config(Path(base_config) if base_config else shipped_config("zero2_bf16.json"))
    plan = plan_for_device(grid or GridRequest(), device_support())
    for note in plan.notes:
        say(note)
    setup = trial_setup_id(base, settings)
    csv_path = out_dir / "trials.csv"
    done = finished_trials(read_trials(csv_path), setup, retry_failed)
    skipped = [s.trial_id for ladder in plan.ladders for s in ladder if s.trial_id in done]
    if skipped:
        say(f"{len(skipped)} trials already in {csv_path}: not run again")
    ran: list[str] = []
    runner = LaunchRunner(
        settings,
        base,
        out_dir,
        setup,
        say,
        trial_env=trial_env,
        run_trial=lambda *args: run_trial(*args),  # looked up when called: tests stand in for it here
    )
    per_config_s = max_measure_s or MAX_MEASURE_S
    with _sigterm_as_interrupt(), _Progress(progress, _remaining(plan, done)) as bar:
        for ladder in plan.ladders:
            specs = list(pending(GridPlan([ladder]), done))
            if not specs:
                continue
            bar.starting(launch_name(specs[0]))
            ids = runner.launch(specs, per_config_s * len(specs))
            statuses = finished_trials(runner.table(), setup)
            done.update({i: statuses[i] for i in ids if i in statuses})
            ran += ids
            bar.finished(len(ids), _remaining(plan, done), f"{launch_name(specs[0])}: {len(ids)} configs")
    return ProfileResult(csv_path, latest_rows(read_trials(csv_path), setup), ran, skipped, plan.notes)
