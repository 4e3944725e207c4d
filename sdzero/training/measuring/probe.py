"""A trial's measurements taken inside the trainer, for `sdzero profile` (the advisor runs the real trainer).

`start_probe` returns a `Probe`, a Trainer callback (sdzero.training.callbacks) on four events: step begin, step
queued, the step's metrics record once read back, and the run's finish. With `--profile-out FILE` it
records, after `--profile-warmup-steps` uncounted steps:

- throughput and step time, the trainer's own phase timers, DeepSpeed's `wall_clock_breakdown` timers and
  its `comms_logger` totals (when the DeepSpeed JSON enables them);
- per rank, the exact bytes of model states the rank holds, read from the engine, by kind: 16-bit
  parameters, gradients, fp32 master weights, optimizer states (plus gradient buckets, reported apart);
- per rank, activation bytes: the storages autograd saves during one micro-step's forward of the trained
  network (saved-tensor hooks), parameters excluded;
- per rank, peak RSS, the CUDA allocator's peak, and the peak a device would hold (see `device_peak`).

The memory meters live in sdzero.telemetry.memory, DeepSpeed's communication meters in
sdzero.training.measuring.comm_meters; a launch of several configs measures each with a `ConfigProbe`
(sdzero.training.measuring.config_probe), installed in the same place by the launch's driver.

Rank 0 writes FILE as JSON once every rank has reported. Without `--profile-out` the Trainer runs no
probe at all.

With `--profile-target-halfwidth` the trial's length adapts to its noise (`StopRule`): after
`--profile-min-steps` measured steps, the probe votes to stop once the 95% interval of the median step
(sdzero.telemetry.step_interval) is within that fraction of it, or `--profile-max-seconds` of steps are
measured; `--max-steps` stays the cap. The vote travels with the step's statistics, so every rank stops at
the same step; a trial's stop saves nothing (sdzero.training.callbacks.ends_as_a_trial). The profile
records every measured step (`step_times_s`), the interval and what stopped it (`stopped_by`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sdzero.atomic import write_json_atomic
from sdzero.errors import UserError
from sdzero.telemetry.memory import (
    STATE_KINDS,
    ActivationMeter,
    compute_device_type,
    cuda_peak_bytes,
    model_state_bytes,
    module_bytes,
    peak_rss_bytes,
    trained_param_count,
)
from sdzero.telemetry.step_interval import interval_is_tight, median_interval
from sdzero.training.callbacks import Callback
from sdzero.training.measuring.comm_meters import DS_TIMERS, CommMeter

PROFILE_VERSION = 1


@dataclass(frozen=True)
class StopRule:
    """When a trial has measured enough: its interval is tight, or its time is up (--max-steps aside)."""

    target_rel_halfwidth: float = 0.0
    """0: no early stop, every step up to --max-steps is measured."""
    min_steps: int = 3
    max_seconds: float = 0.0
    """0: no time limit."""

    def verdict(self, step_times: list[float]) -> str | None:
        """Why to stop after these measured steps ("interval", "time cap"), or None to go on."""
        if not self.target_rel_halfwidth or len(step_times) < max(self.min_steps, 2):
            return None
        if interval_is_tight(median_interval(step_times), self.target_rel_halfwidth):
            return "interval"
        if self.max_seconds and sum(step_times) >= self.max_seconds:
            return "time cap"
        return None


class Probe(Callback):
    """The Trainer's measurements for `--profile-out FILE`."""

    def __init__(
        self,
        engine: Any,
        ds: Any,
        frozen: tuple[torch.nn.Module, ...],
        out: Path,
        warmup_steps: int,
        stop_rule: StopRule = StopRule(),
    ) -> None:
        self.engine, self.ds, self.frozen = engine, ds, frozen
        self.out, self.warmup_steps = out, warmup_steps
        self.stop_rule = stop_rule
        self.stopped_by: str | None = None
        """Why this rank voted to stop (None: it never did)."""
        # Instruments run on the last uncounted step (or step 1 without warm-up), so their own overhead
        # (a Python call per saved tensor) stays out of the measured window.
        self.instrument_step = max(1, warmup_steps)
        self.records: list[dict[str, Any]] = []
        self.ds_timers: list[dict[str, float]] = []
        self.states: dict[str, int] | None = None
        self.activations: ActivationMeter | None = None
        self._handles: list[Any] = []
        self._wrapped: list[tuple[Any, str]] = []
        self._first_step: int | None = None
        self.comm = CommMeter()
        self.comm_marks: list[float] = []
        """This rank's time in collectives since the window started, at the end of each measured step."""

    def on_step_begin(self, trainer: Any, step: int) -> None:
        if self._first_step is None:
            self._first_step = step
        n = self._nth(step)
        if n == self.instrument_step:
            self._arm_instruments()
        if n == self.warmup_steps + 1:
            self.comm.reset()

    def on_step_queued(self, trainer: Any, step: int) -> None:
        """At the step's own end: instruments off, DeepSpeed's timers of this step read."""
        n = self._nth(step)
        if n == self.instrument_step:
            self._disarm_instruments()
        if n > self.warmup_steps:
            mark = self.comm.elapsed_s()
            if mark is not None:
                self.comm_marks.append(mark)
        if n > self.warmup_steps and self.engine.wall_clock_breakdown():
            # refreshed by engine.step() before DeepSpeed logs and resets its timers (in ms)
            cache = self.engine.get_wall_clock_timers()
            self.ds_timers.append({k: cache[k] / 1e3 for k in DS_TIMERS if k in cache})

    def on_metrics(self, trainer: Any, step: int, record: dict[str, Any]) -> None:
        """The step's metrics line, once read back (on CUDA, a step after `on_step_queued`). The stop rule
        is judged here, after the step's time was taken (on a CPU), so the bootstrap is not in it."""
        if self._nth(step) > self.warmup_steps:
            self.records.append(record)
            if self.stopped_by is None:
                self.stopped_by = self.stop_rule.verdict([r["step_time_s"] for r in self.records])

    def wants_stop(self, trainer: Any) -> bool:
        return self.stopped_by is not None

    def _nth(self, step: int) -> int:
        """1 for the first step this run takes (a resumed run starts after its checkpoint's step)."""
        return step - (self._first_step or step) + 1

    def _arm_instruments(self) -> None:
        self.activations = ActivationMeter()
        meter = self.activations
        module = self.engine.module
        state = {"ctx": None, "done": False}

        def pre_forward(_module: Any, _args: Any) -> None:
            if not state["done"]:
                state["ctx"] = meter.hooks()
                state["ctx"].__enter__()

        def post_forward(_module: Any, _args: Any, _output: Any) -> None:
            if state["ctx"] is not None:
                state["ctx"].__exit__(None, None, None)
                state["ctx"], state["done"] = None, True  # one micro-step is enough: activations repeat

        self._handles = [
            module.register_forward_pre_hook(pre_forward),
            module.register_forward_hook(post_forward),
        ]
        # Model states are read at three points of this one step and each kind keeps its largest reading,
        # its resident size: before the gradient reduction (ZeRO-1 still holds every full gradient), right
        # before the optimizer step (gradients complete, nothing freed) and right after it (Adam creates its
        # states lazily in its first step). The two methods are wrapped on these instances for this step.
        self._wrap_once(self.engine, "allreduce_gradients")
        self._wrap_once(self.engine.optimizer, "step", after=True)

    def _wrap_once(self, owner: Any, name: str, after: bool = False) -> None:
        original = getattr(owner, name)

        def measured(*args: Any, **kwargs: Any) -> Any:
            self._read_states()
            vars(owner).pop(name, None)  # back to the class's method
            result = original(*args, **kwargs)
            if after:
                self._read_states()
            return result

        setattr(owner, name, measured)
        self._wrapped.append((owner, name))

    def _read_states(self) -> None:
        reading = model_state_bytes(self.engine)
        old = self.states or {}
        self.states = {k: max(v, old.get(k, 0)) for k, v in reading.items()}

    def _disarm_instruments(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for owner, name in self._wrapped:  # a wrapped method that never ran is unwrapped here
            vars(owner).pop(name, None)
        self._wrapped = []

    def on_finish(self, trainer: Any) -> None:
        self.finish()

    def finish(self) -> dict[str, Any] | None:
        """Gather every rank's figures and write the profile (rank 0). A collective: every rank calls it."""
        self.comm.close()
        mine = self._rank_figures()
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() != 0:
            return None
        profile = self._summary(ranks)
        write_json_atomic(self.out, profile)
        return profile

    def _rank_figures(self) -> dict[str, Any]:
        states = self.states or {}
        activation = self.activations.bytes if self.activations else 0
        frozen = module_bytes(*self.frozen)
        cuda_peak = self.cuda_peak()
        on_device = sum(states.get(k, 0) for k in (*STATE_KINDS, "buckets")) - states.get("offloaded", 0)
        # This rank's own time in collectives per step (logged plus waited; the profile's `comm` is rank
        # 0's alone). A collective ends for every rank when the last one arrives, so a rank's time is the
        # transfer plus its wait for the slowest: the rank that spent least is the one that waited least,
        # its time the closest measure of the transport itself, and the spread over ranks is waiting.
        comm = self.comm_totals()
        marks = [0.0, *self.comm_marks]
        return {
            "rank": dist.get_rank(),
            "comm_s": comm["seconds_per_step"] if comm else None,
            "comm_waited_s": sum(o["waited_seconds_per_step"] for o in comm["ops"].values())
            if comm
            else None,
            # per measured step: which rank arrives last changes from step to step, so the least waiting
            # is told per step (advisor.measure.trials.rank_comm_columns), not from each rank's mean
            "comm_step_s": [b - a for a, b in pairwise(marks)],
            "model_state_bytes": {k: states.get(k, 0) for k in STATE_KINDS},
            "model_state_total_bytes": sum(states.get(k, 0) for k in STATE_KINDS),
            "bucket_bytes": states.get("buckets", 0),
            "offloaded_bytes": states.get("offloaded", 0),
            "frozen_bytes": frozen,
            "activation_bytes": activation,
            "activation_tensors": self.activations.tensors if self.activations else 0,
            "peak_rss_bytes": peak_rss_bytes(),
            "cuda_peak_bytes": cuda_peak,
            # Without a device allocator (CPU), the peak a device would hold: model states on the compute
            # device, buckets, frozen modules and one micro-batch's activations. RSS would add the Python and
            # library runtime, which no accelerator holds. This is the sum of the memory model's own
            # forward/backward parts, not a measurement: it cannot check the model's optimizer-step term
            # (advisor/model/memory.py `step_bytes`), and adding that term here would make the check
            # circular. Only a device allocator's peak (cuda_peak) measures the step.
            "device_peak_bytes": cuda_peak if cuda_peak is not None else on_device + frozen + activation,
        }

    def comm_totals(self) -> dict[str, Any] | None:
        """The collectives over the measured window, per step (None without steps or the logger)."""
        return self.comm.totals(len(self.records)) if self.records else None

    def cuda_peak(self) -> int | None:
        """The CUDA allocator's peak this probe reports (the whole run's)."""
        return cuda_peak_bytes()

    def _summary(self, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        steps = len(self.records)
        step_times = [r["step_time_s"] for r in self.records]
        total_time = sum(step_times)
        phases = ("data_s", "encode_s", "forward_s", "backward_s", "optimizer_s")
        ds_breakdown = None
        if self.ds_timers:
            ds_breakdown = {k: statistics.fmean(t.get(k, 0.0) for t in self.ds_timers) for k in DS_TIMERS}
        ds = self.ds
        return {
            "version": PROFILE_VERSION,
            "zero_stage": ds.zero_stage,
            "dtype": ds.dtype,
            "micro_batch": ds.micro_batch,
            "grad_accum": ds.grad_accum,
            "world_size": ds.world_size,
            "global_batch": ds.global_batch,
            "offload_optimizer": ds.offload_optimizer,
            "offload_param": ds.offload_param,
            "device": compute_device_type(),
            "warmup_steps": self.warmup_steps,
            "measured_steps": steps,
            "trained_params": trained_param_count(self.engine.module),
            "samples_per_s": ds.global_batch * steps / total_time if total_time > 0 else None,
            "step_time_s": total_time / steps if steps else None,
            "step_time_median_s": statistics.median(step_times) if steps else None,
            "step_times_s": step_times,
            **_interval_fields(step_times),
            "stopped_by": self.stopped_by or ("step cap" if self.stop_rule.target_rel_halfwidth else "steps"),
            "phases_s": {k: statistics.fmean(r.get(k, 0.0) for r in self.records) for k in phases}
            if steps
            else None,
            "ds_breakdown_s": ds_breakdown,
            "comm": self.comm_totals(),
            "ranks": ranks,
            "device_peak_bytes": max(r["device_peak_bytes"] for r in ranks),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        }


def _interval_fields(step_times: list[float]) -> dict[str, float | None]:
    """The median step's 95% interval (rank 0's steps), None where fewer than two steps were measured."""
    interval = median_interval(step_times)
    if interval.steps < 2:
        return {"step_s_lo": None, "step_s_hi": None}
    return {"step_s_lo": interval.lo_s, "step_s_hi": interval.hi_s}


def stop_rule(cfg: Any) -> StopRule:
    """The trial's stop rule from its options, checked: one line for a value that cannot work."""
    rule = StopRule(
        float(getattr(cfg, "profile_target_halfwidth", 0.0) or 0.0),
        int(getattr(cfg, "profile_min_steps", 3)),
        float(getattr(cfg, "profile_max_seconds", 0.0) or 0.0),
    )
    if not 0 <= rule.target_rel_halfwidth < 1:
        raise UserError(f"--profile-target-halfwidth {rule.target_rel_halfwidth}: a fraction in [0, 1)")
    if rule.min_steps < 1 or rule.max_seconds < 0:
        raise UserError("--profile-min-steps must be >= 1 and --profile-max-seconds >= 0")
    return rule


def start_probe(cfg: Any, ds: Any, engine: Any, comps: Any) -> Probe | None:
    """The Trainer's probe for `--profile-out`; None without it (no measurements, no per-step cost), or with
    `--profile-configs` (the launch's driver installs each config's probe in its place,
    sdzero.training.measuring.sweep)."""
    out = getattr(cfg, "profile_out", None)
    if not out or getattr(cfg, "profile_configs", None):
        return None
    warmup = int(getattr(cfg, "profile_warmup_steps", 0) or 0)
    # Every frozen module the family loaded (VAE, one to three text encoders; none when training from a cache).
    return Probe(engine, ds, comps.frozen_modules(), Path(out), warmup, stop_rule(cfg))
