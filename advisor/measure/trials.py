"""One trial: the trainer under the `deepspeed` launcher, watched, killed if stuck, and classified.

A trial runs `sdzero/train.py --profile-out` (see sdzero.training.measuring.probe) in its own session, with its output in
`<trial>/log.txt`. Every way it can end becomes data rather than an exception:

- ok: the trainer wrote its profile (a launcher that then hangs in teardown is killed, the result kept);
- oom: the log shows an out-of-memory error, or the measured peak passed `--mem-cap-gib`;
- timeout: no result within `--trial-timeout`, or no new training step for `--stall-timeout`;
- crash: anything else; the reason is the error line, and the last lines of the log come with it.

A trial measures at least `steps` steps and, with `target_rel_halfwidth`, goes on until the 95% interval
of its median step is that tight (sdzero.telemetry.step_interval), or `max_steps` / `max_measure_s` is
reached: the trainer's probe votes to stop (sdzero.training.measuring.probe). While a trial runs on this machine, the
watcher samples the machine's CPU time and the trial's own (advisor.measure.contention): what others took
over its window.

Where trials run: on this machine, or through the launcher on the hosts of `TrialSettings.hostfile`. A
machine without an accelerator that is given a hostfile (a cluster's login node) runs its trials on the
hostfile's first host, through a one-host hostfile (`first_host_hostfile`): the trials measure the
hardware the recommendation is for, not the login node's CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from advisor.measure.contention import CpuSample, others_cpu_share, sample
from advisor.measure.grid import TrialSpec
from sdzero.atomic import open_no_follow, write_text_atomic
from sdzero.checkpoint.checkpointer import CHECKPOINTS
from sdzero.cluster.hostfile import HostEntry, parse_hostfile
from sdzero.cluster.launch_command import TRAIN_SCRIPT, one_host_command
from sdzero.cluster.remote_launch import RemoteLaunch, launch_from_here, local_launch
from sdzero.config.user_file import parse_json_text, read_json_lines, read_user_text
from sdzero.constants import GIB
from sdzero.errors import UserError
from sdzero.telemetry.step_interval import StepInterval, median_interval

POLL_S = 0.5
# A rank that died is followed by the launcher's own clean-up; past this grace the whole session is
# killed (a rank whose data-loader workers ignore SIGTERM never exits by itself).
CRASH_GRACE_S = 30.0
LOG_TAIL_LINES = 20

OOM_PATTERNS = re.compile(
    r"OutOfMemoryError|CUDA out of memory|out of memory|DefaultCPUAllocator: can't allocate memory|"
    r"std::bad_alloc|Cannot allocate memory|exits with return code = -9",
    re.IGNORECASE,
)
"""What an out-of-memory death leaves in a log. Return code -9 is SIGKILL, on a host usually the kernel's
OOM killer (the launcher reports the code of the rank that died first)."""
CRASH_MARKERS = re.compile(r"Traceback \(most recent call last\)|exits with return code|Killing subprocess")
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+(?:Error|Exception|Crash)\b|sdzero: error:).*)$")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


TARGET_REL_HALFWIDTH = 0.03
"""A trial measures until its median step's 95% interval is within 3% of it on each side (or a cap): tight
enough to tell apart configs 5% apart, which is where the search's choices and the ties lie."""
MAX_MEASURE_S = 6.0
"""...or until this many seconds of measured steps: the cap that keeps a slow config's trial within the
budget (a 4-step-per-second tiny config reaches the step cap first)."""
STEP_CAP_FACTOR = 6
"""The step cap, in multiples of the least measured steps, where none is given."""


@dataclass(frozen=True)
class TrialSettings:
    """What every trial of one profile shares."""

    model: str
    """A local pipeline folder (absolute) or a hub id."""
    data: Path
    steps: int
    """Measured optimizer steps (after the warm-up): all of them, or the least with `target_rel_halfwidth`."""
    warmup_steps: int
    trial_timeout_s: float
    stall_timeout_s: float | None
    """Kill a trial that logged a step and then none for this long; None: only the trial timeout."""
    mem_cap_bytes: int | None = None
    hostfile: Path | None = None
    hosts: int = 1
    train_args: tuple[str, ...] = ()
    crash_grace_s: float = CRASH_GRACE_S
    target_rel_halfwidth: float | None = None
    """Measure until the median step's 95% interval is within this fraction of it (each side); None:
    exactly `steps` steps."""
    max_steps: int | None = None
    """With a target: measure at most this many steps (None: STEP_CAP_FACTOR x `steps`)."""
    max_measure_s: float | None = None
    """With a target: stop measuring after this many seconds of measured steps (None: no limit)."""
    sweep: str = ""
    """A launch of several configs (sdzero.training.measuring.sweep): `MB:GA,...`; "" for one config."""
    launch_measure_s: float = 0.0
    """A launch's seconds of timed steps, all its configs together (advisor.measure.launch)."""
    race: bool = False
    """A launch races its configs (`--profile-race`, sdzero.training.measuring.race.race): one clearly
    slower per sample than the leader stops being measured, and the launch ends once the configs left are
    measured to `target_rel_halfwidth` (or its time is spent)."""
    race_memory_cap_bytes: float | None = None
    """A racing launch's cap on a config's device peak per rank (the advisor's usable memory): a config over
    it cannot lead the race (`--profile-memory-cap-gib`); None: no cap."""

    @property
    def step_cap(self) -> int:
        """The most steps a trial measures."""
        if self.target_rel_halfwidth is None:
            return self.steps
        cap = self.max_steps if self.max_steps is not None else STEP_CAP_FACTOR * self.steps
        return max(self.steps, cap)


@dataclass
class TrialOutcome:
    status: str
    reason: str
    profile: dict[str, Any] | None
    wall_s: float
    returncode: int | None
    log_path: Path
    log_tail: str = ""
    notes: list[str] = field(default_factory=list)
    others_cpu_share: float | None = None
    """Share of the machine's cores other processes took over the trial's window (contention module)."""
    measured_at: float | None = None
    """Epoch seconds, the middle of the window in which it measured."""


def first_host_hostfile(hostfile: Path, path: Path) -> HostEntry:
    """Write a hostfile of `hostfile`'s first host alone (its line's host and slots) to `path`; return that
    host. Trials and 1-host legs launched through it run on that host with its slots as ranks."""
    first = parse_hostfile(Path(hostfile))[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, f"{first.host} slots={first.slots}\n")
    return first


def on_the_hosts(launch: RemoteLaunch) -> RemoteLaunch:
    """A hostfile launch whose ranks start on the hostfile's hosts even when it names one host alone:
    DeepSpeed's runner starts a one-host hostfile's ranks on this machine, without ssh, unless told
    `--force_multi` (harmless with several hosts, which it starts through pdsh anyway)."""
    return replace(launch, command=[launch.command[0], "--force_multi", *launch.command[1:]])


def trainer_args(settings: TrialSettings, ds_config: Path, trial_dir: Path) -> list[str]:
    """The trainer's own options for one trial; user options come last so they can add to them."""
    return [
        "--deepspeed_config",
        str(ds_config),
        "--model",
        settings.model,
        "--data",
        str(settings.data),
        "--output-dir",
        str(trial_dir / "run"),
        "--max-steps",
        str(settings.warmup_steps + settings.step_cap),
        "--profile-out",
        str(trial_dir / "profile.json"),
        "--profile-warmup-steps",
        str(settings.warmup_steps),
        *(sweep_args(settings) if settings.sweep else adaptive_args(settings)),
        *settings.train_args,
    ]


def sweep_args(settings: TrialSettings) -> list[str]:
    """A launch's configs, its least timed steps per config and its seconds of timed steps. No
    --sync-timing: a timed step takes no synchronization a user's run would not (the phases are timed
    with events on CUDA, read a step late)."""
    return [
        "--profile-configs",
        settings.sweep,
        "--profile-min-steps",
        str(settings.steps),
        "--profile-max-seconds",
        f"{settings.launch_measure_s:g}",
        *(race_args(settings) if settings.race else []),
    ]


def race_args(settings: TrialSettings) -> list[str]:
    """A racing launch: the configs left once the race has thinned them are measured to the trials' target
    half-width, and the race's leader is one that fits the memory cap."""
    args = ["--profile-race"]
    if settings.target_rel_halfwidth is not None:
        args += ["--profile-target-halfwidth", f"{settings.target_rel_halfwidth:g}"]
    if settings.race_memory_cap_bytes:
        args += ["--profile-memory-cap-gib", f"{settings.race_memory_cap_bytes / GIB:.6g}"]
    return args


def adaptive_args(settings: TrialSettings) -> list[str]:
    """The probe's stop rule: at least `steps`, then until the interval is tight or a cap is reached."""
    if settings.target_rel_halfwidth is None:
        return []
    args = [
        "--profile-min-steps",
        str(settings.steps),
        "--profile-target-halfwidth",
        f"{settings.target_rel_halfwidth:g}",
    ]
    if settings.max_measure_s:
        args += ["--profile-max-seconds", f"{settings.max_measure_s:g}"]
    return args


def trial_launch(
    spec: TrialSpec,
    settings: TrialSettings,
    ds_config: Path,
    trial_dir: Path,
    environ: Mapping[str, str] | None = None,
) -> RemoteLaunch:
    """The trial's launch: this host's ranks through DeepSpeed's per-node launcher (2-3 s sooner than the
    runner), or the hostfile's (one host's too: `on_the_hosts`) through sdzero.cluster.remote_launch, each
    remote rank in `trial_dir` (whatever its name) with the values of the advisor's folder's env file
    exactly, secrets by file."""
    args = trainer_args(settings, ds_config, trial_dir)
    if settings.hostfile is None:
        return local_launch(one_host_command(args, spec.ranks_per_node), environ)
    return on_the_hosts(
        launch_from_here(
            args,
            TRAIN_SCRIPT,
            trial_dir,
            hostfile=settings.hostfile,
            num_gpus=spec.ranks_per_node,
            environ=environ,
        )
    )


def trial_command(spec: TrialSpec, settings: TrialSettings, ds_config: Path, trial_dir: Path) -> list[str]:
    return trial_launch(spec, settings, ds_config, trial_dir).command


# --------------------------------------------------------------------------------------------------
# Running


class _Watch:
    """Reads the growing log and the metrics file of a running trial."""

    def __init__(
        self, log_path: Path, metrics_path: Path, profile_path: Path, session: int | None = None
    ) -> None:
        self.log_path, self.metrics_path, self.profile_path = log_path, metrics_path, profile_path
        self._offset = 0
        self._carry = ""
        self.crash_seen_at: float | None = None
        self.profile_seen_at: float | None = None
        self.metrics_size = 0
        self.last_progress_at: float | None = None
        self.steps_logged = 0
        self.session = session
        self.samples: list[CpuSample] = []
        """The machine's and the trial's CPU time at each poll (advisor.measure.contention)."""
        self.window: list[int | None] = [None, None]
        """Indexes into `samples`: the first poll that saw a step logged, the poll that saw the profile."""

    def poll(self, now: float) -> None:
        self._sample()
        with self.log_path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        text = self._carry + chunk.decode(errors="replace")
        lines = text.split("\n")
        self._carry = lines.pop()  # an unfinished line waits for the next poll
        if self.crash_seen_at is None and any(CRASH_MARKERS.search(line) for line in lines):
            self.crash_seen_at = now
        if self.profile_seen_at is None and self.profile_path.exists():
            self.profile_seen_at = now
        size = self.metrics_path.stat().st_size if self.metrics_path.exists() else 0
        if size != self.metrics_size:
            self.metrics_size, self.last_progress_at = size, now
            self.steps_logged = self.metrics_path.read_text().count("\n")
        last = len(self.samples) - 1
        if self.window[0] is None and self.steps_logged > 0 and last >= 0:
            self.window[0] = last
        if self.window[1] is None and self.profile_seen_at is not None and last >= 0:
            self.window[1] = last

    def _sample(self) -> None:
        if self.session is not None:
            taken = sample(self.session)
            if taken is not None:
                self.samples.append(taken)

    def measured_window(self) -> tuple[CpuSample, CpuSample] | None:
        """The samples around the training steps (first step logged to profile written); the whole
        trial where that window holds fewer than two polls (a trial of a few short steps).

        Only samples while the trial's CPU time still grows count: once its processes exit, their time
        leaves the session's sum and would pass for someone else's."""
        alive = 1
        while alive < len(self.samples) and self.samples[alive].trial_s >= self.samples[alive - 1].trial_s:
            alive += 1
        samples = self.samples[:alive]
        start, end = self.window
        end = min(end if end is not None else len(samples) - 1, len(samples) - 1)
        if start is not None and end - start >= 1:
            return samples[start], samples[end]
        if len(samples) >= 2:
            return samples[0], samples[-1]
        return None


def run_trial(
    spec: TrialSpec,
    settings: TrialSettings,
    ds_config: Path,
    trial_dir: Path,
    extra_env: Mapping[str, str] | None = None,
) -> TrialOutcome:
    """Run one trial to its end (or kill it) and classify how it ended. Never raises for a failed trial."""
    for stale in ("profile.json", "log.txt"):
        (trial_dir / stale).unlink(missing_ok=True)  # an earlier, interrupted attempt must not count
    metrics = trial_dir / "run" / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    log_path, profile_path = trial_dir / "log.txt", trial_dir / "profile.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    launch = trial_launch(spec, settings, ds_config, trial_dir, env)
    started = time.monotonic()
    with open_no_follow(log_path, "w") as log, launch.secrets_written():
        log.write("$ " + " ".join(launch.command) + "\n")
        log.flush()
        # Own session: the launcher, its ranks and their data-loader workers share one process group,
        # which is what gets killed when the trial hangs.
        process = launch.popen(stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        # Contention is read on this machine: a hostfile's ranks run outside the launcher's session (under
        # each host's sshd), on hosts whose load this machine's /proc/stat does not show.
        session = process.pid if settings.hostfile is None else None
        watch = _Watch(log_path, metrics, profile_path, session=session)
        try:
            killed_for = _wait(process, settings, watch, started)
        finally:
            if process.poll() is None:  # interrupted (Ctrl-C) or an error here: leave no ranks behind
                kill_session(process)
            # A killed trial's ranks save a preemption checkpoint on SIGTERM: no result, only disk used.
            shutil.rmtree(trial_dir / "run" / CHECKPOINTS, ignore_errors=True)
    wall_s = time.monotonic() - started
    outcome = classify_trial(process.returncode, killed_for, log_path, profile_path, settings, wall_s)
    window = watch.measured_window()
    if window is not None:
        first, last = window
        outcome.others_cpu_share = others_cpu_share(first, last)
        # monotonic -> epoch: the window's middle on the wall clock (brackets of other runs compare)
        outcome.measured_at = time.time() - (time.monotonic() - (first.at + last.at) / 2)
    else:
        outcome.measured_at = time.time()
    return outcome


def _wait(
    process: subprocess.Popen[bytes], settings: TrialSettings, watch: _Watch, started: float
) -> str | None:
    """Wait for the launcher; return why it was killed, or None if it exited by itself."""
    while process.poll() is None:
        time.sleep(POLL_S)
        now = time.monotonic()
        watch.poll(now)
        reason = _kill_reason(settings, watch, now, started)
        if reason is not None:
            kill_session(process)
            return reason
    return None


def _kill_reason(settings: TrialSettings, watch: _Watch, now: float, started: float) -> str | None:
    grace = settings.crash_grace_s
    if watch.profile_seen_at is not None and now - watch.profile_seen_at > grace:
        return f"teardown: the profile was written but the launcher had not exited {grace:.0f} s later"
    if watch.crash_seen_at is not None and now - watch.crash_seen_at > grace:
        return f"crash: a rank failed and the launcher had not exited {grace:.0f} s later"
    if now - started > settings.trial_timeout_s:
        return f"timeout: no result within --trial-timeout {settings.trial_timeout_s:g} s"
    stall = settings.stall_timeout_s
    if stall and watch.last_progress_at is not None and now - watch.last_progress_at > stall:
        return f"timeout: hung, no new step for {stall:g} s after step {watch.steps_logged} (--stall-timeout)"
    return None


def kill_session(process: subprocess.Popen[bytes]) -> None:
    """Stop the launcher's whole process group: SIGTERM, a grace, then SIGKILL for what is left.

    SIGKILL follows even when the launcher has exited: ranks and their data-loader workers share its group
    and may outlive it, or ignore SIGTERM.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10.0)
    process.wait()


# --------------------------------------------------------------------------------------------------
# Classifying


def read_profile(path: Path) -> dict[str, Any] | None:
    """A trial's profile.json, or None when missing or torn; a FIFO or a device there is one line."""
    if not os.path.lexists(path):
        return None
    try:
        profile = parse_json_text(read_user_text(path, "a trial's profile"), str(path))
    except UserError as exc:
        if "not JSON" in str(exc) or "nested deeper" in str(exc):
            return None  # torn by a kill: the trial is classified without it
        raise
    # one config's profile, or a launch's (sdzero.training.measuring.sweep: its configs' profiles inside)
    return profile if isinstance(profile, dict) and (profile.get("ranks") or "configs" in profile) else None


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, progress-bar redraws reduced to their final state."""
    text = path.read_text(errors="replace") if path.exists() else ""
    clean = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]
    return "\n".join([line for line in clean if line][-lines:])


def error_line(tail: str) -> str:
    """The most telling line of a failed run's log: its last exception, else its last line."""
    for line in reversed(tail.splitlines()):
        match = ERROR_LINE.match(line.strip())
        if match:
            return match.group(1)[:300]
    last = tail.splitlines()[-1] if tail else "(empty log)"
    return _RANK_PREFIX.sub("", last)[:300]


def classify_trial(
    returncode: int | None,
    killed_for: str | None,
    log_path: Path,
    profile_path: Path,
    settings: TrialSettings,
    wall_s: float,
) -> TrialOutcome:
    tail = log_tail(log_path)
    full_log = log_path.read_text(errors="replace") if log_path.exists() else ""
    profile = read_profile(profile_path)
    # a timeout's reason is why it was killed; for the others, being killed is worth a note
    notes = [killed_for] if killed_for and not killed_for.startswith("timeout") else []

    def outcome(status: str, reason: str) -> TrialOutcome:
        return TrialOutcome(status, reason, profile, wall_s, returncode, log_path, tail, notes)

    if profile is not None and "configs" in profile:  # a launch: each config is judged by its own profile
        return outcome("ok", "; ".join(notes))
    if profile is not None:
        cap = settings.mem_cap_bytes
        peak = int(profile["device_peak_bytes"])
        if cap is not None and peak > cap:
            rank = max(profile["ranks"], key=lambda r: r["device_peak_bytes"])["rank"]
            return outcome(
                "oom",
                f"memory cap: peak {peak / GIB:.3f} GiB on rank {rank} > --mem-cap-gib {cap / GIB:g}",
            )
        return outcome("ok", "; ".join(notes))
    oom = OOM_PATTERNS.search(full_log)
    if oom:
        line = full_log[: oom.end()].rsplit("\n", 1)[-1] + full_log[oom.end() :].split("\n", 1)[0]
        return outcome("oom", "out of memory: " + _RANK_PREFIX.sub("", line.strip())[:300])
    if killed_for and killed_for.startswith("timeout"):
        return outcome("timeout", killed_for.removeprefix("timeout: "))
    return outcome("crash", error_line(tail) + (f" (exit code {returncode})" if returncode else ""))


# --------------------------------------------------------------------------------------------------
# A profile's figures as one table row


def trial_step_times(profile: dict[str, Any] | None, trial_dir: Path, warmup_steps: int) -> list[float]:
    """The trial's measured step times (rank 0's): from its profile, or, for a profile written before
    the probe recorded them, from the metrics lines after the warm-up."""
    if profile is not None and profile.get("step_times_s"):
        return [float(t) for t in profile["step_times_s"]]
    metrics = trial_dir / "run" / "metrics.jsonl"
    if not os.path.lexists(metrics):
        return []
    times = []
    for _, record in read_json_lines(metrics, "a trial's metrics")[0]:  # a line cut by a kill: skipped
        step, seconds = record.get("step", 0), record.get("step_time_s")
        if isinstance(step, int) and step > warmup_steps and isinstance(seconds, (int, float)):
            times.append(float(seconds))
    return times


def interval_columns(interval: StepInterval) -> dict[str, Any]:
    """A trial's median step and its interval as measured (before its launch's tie puts it on the first
    launch's machine speed, advisor.measure.launch)."""
    if interval.steps == 0:
        return {}
    return {
        "step_s_raw": interval.median_s,
        "step_s_raw_lo": interval.lo_s,
        "step_s_raw_hi": interval.hi_s,
        "step_s_lo": interval.lo_s,
        "step_s_hi": interval.hi_s,
        "drift_factor": 1.0,
        "drift_uncertainty": 0.0,
    }


def profile_columns(profile: dict[str, Any] | None, step_times: list[float] | None = None) -> dict[str, Any]:
    """Flatten the trainer's profile into trials.csv columns (per-rank detail as JSON text)."""
    if profile is None:
        return {}
    interval = median_interval(step_times or [])
    ranks = profile["ranks"]
    states = [r["model_state_bytes"] for r in ranks]
    phases = profile.get("phases_s") or {}
    breakdown = profile.get("ds_breakdown_s") or {}
    comm = profile.get("comm") or {}
    row: dict[str, Any] = {
        "grad_accum": profile["grad_accum"],
        "world_size": profile["world_size"],
        "global_batch": profile["global_batch"],
        "samples_per_s": profile["samples_per_s"],
        "step_time_s": profile["step_time_s"],
        # The median measured step: what the advisor models, robust to a step slowed by another process.
        "step_time_median_s": profile.get("step_time_median_s"),
        **{k: phases.get(k) for k in ("data_s", "encode_s", "forward_s", "backward_s", "optimizer_s")},
        **{f"ds_{k}_s": breakdown.get(k) for k in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")},
        "comm_s": comm.get("seconds_per_step"),
        "comm_bytes": comm.get("bytes_per_step"),
        "comm_ops": json.dumps(comm.get("ops")) if comm else None,
        # Every rank's own time in collectives (sdzero.training.measuring.probe): the least is the closest to the transport
        # alone, the most adds the longest wait for a slower rank.
        **rank_comm_columns(ranks),
        "trained_params": profile["trained_params"],
        **{f"{k}_bytes": max(s[k] for s in states) for k in ("params", "grads", "master", "optimizer")},
        "model_state_bytes": max(r["model_state_total_bytes"] for r in ranks),
        "model_state_bytes_per_rank": json.dumps(states),
        "bucket_bytes": max(r["bucket_bytes"] for r in ranks),
        "offloaded_bytes": max(r["offloaded_bytes"] for r in ranks),
        "frozen_bytes": max(r["frozen_bytes"] for r in ranks),
        "activation_bytes": max(r["activation_bytes"] for r in ranks),
        "device_peak_bytes": profile["device_peak_bytes"],
        "peak_rss_bytes": profile["peak_rss_bytes"],
        "cuda_peak_bytes": max((r["cuda_peak_bytes"] or 0) for r in ranks) or None,
        "measured_steps": profile["measured_steps"],
        "stopped_by": profile.get("stopped_by"),
        **interval_columns(interval),
    }
    if interval.steps:  # the median of the very steps the interval is about
        row["step_time_median_s"] = interval.median_s
    return row


def rank_comm_columns(ranks: list[dict[str, Any]]) -> dict[str, float | None]:
    """comm_min_s / comm_max_s: the least and the most time a rank spent in collectives, per step (None
    for a profile written before ranks recorded it).

    Which rank arrives last at a collective, and so waits least, changes from step to step; a rank's mean
    over the steps holds its share of waiting in the others. Where every rank split its time per step
    (`comm_step_s`), the least and most are taken in each step and then averaged; else from each rank's
    mean (an upper bound on the transport)."""
    steps = [r.get("comm_step_s") or [] for r in ranks]
    if len(ranks) > 1 and steps[0] and all(len(s) == len(steps[0]) for s in steps):
        per_step = list(zip(*steps, strict=True))
        return {
            "comm_min_s": sum(map(min, per_step)) / len(per_step),
            "comm_max_s": sum(map(max, per_step)) / len(per_step),
        }
    seconds = [r["comm_s"] for r in ranks if r.get("comm_s") is not None]
    return {"comm_min_s": min(seconds, default=None), "comm_max_s": max(seconds, default=None)}
