"""DeepSpeed's own communication instruments, read by the probes (sdzero.training.measuring.probe): the
totals of its comms_logger over a measured window (`CommMeter`), and the seconds a rank blocks waiting on its
async collectives (`WaitMeter`), which the logger alone counts only where the accelerator synchronizes inside
its timer (CUDA).
"""

from __future__ import annotations

import time
from typing import Any

ASYNC_OPS = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "reduce",
    "all_to_all_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
)
"""DeepSpeed's communication backend methods (deepspeed.comm.torch.TorchBackend), named as comms_logger
names the ops that call them."""


class _TimedWork:
    """An async collective's handle whose `wait` adds the seconds it blocked to a WaitMeter."""

    __slots__ = ("_work", "_name", "_meter")

    def __init__(self, work: Any, name: str, meter: WaitMeter) -> None:
        self._work, self._name, self._meter = work, name, meter

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._meter.add(self._name, time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:  # is_completed, get_future, ...: the real handle's
        return getattr(self._work, name)


class WaitMeter:
    """Seconds the rank blocked in `wait()` on async collectives, per op.

    comms_logger times an op from its call to its return. An async op (ZeRO-3's parameter gathers, issued
    in bursts) returns at once, and only an accelerator that synchronizes inside the timer (CUDA) counts
    its transfer; on others (a CPU's gloo) the transfer is waited out later, in DeepSpeed's own code, and
    would pass for compute. This meter wraps DeepSpeed's communication backend so every async handle it
    returns times its wait: together with the logged launch, the time the rank spent in the collective,
    measured in the trial itself (on CUDA the wait finds the op done and adds about nothing).
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.seconds: dict[str, float] = {}
        self._installed = False

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def reset(self) -> None:
        self.seconds = {}

    def install(self) -> None:
        if self._installed or self.backend is None:
            return
        for name in ASYNC_OPS:
            original = getattr(self.backend, name, None)
            if original is not None:
                setattr(self.backend, name, self._wrap(name, original))
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            for name in ASYNC_OPS:
                vars(self.backend).pop(name, None)  # back to the class's method
            self._installed = False

    def _wrap(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            # torch.distributed returns a handle only for async_op=True (a blocking call returns None), so
            # the result tells, whichever way DeepSpeed passed the flag (by keyword, or by position).
            work = original(*args, **kwargs)
            return work if work is None else _TimedWork(work, name, self)

        return call


class CommMeter:
    """Totals of DeepSpeed's comms_logger over the measured window, per collective, with the time the rank
    then waited for the async ones (WaitMeter).

    comms_logger times each op with a timer that DeepSpeed (0.19) never resets, so every recorded latency
    is the running total for that op name. Resetting the timers at the window start and reading each
    timer's elapsed total at the end gives the window's true sum whichever way a version records.
    """

    def __init__(self) -> None:
        import deepspeed.comm as ds_comm

        self._comm = ds_comm
        self.enabled = bool(ds_comm.comms_logger.enabled)
        self.waits = WaitMeter(ds_comm.comm.cdb)

    def reset(self) -> None:
        if not self.enabled:
            return
        self._comm.reset_log()
        for timer in self._comm.comm.timers.get_timers().values():
            timer.reset()
        self.waits.install()
        self.waits.reset()

    def close(self) -> None:
        self.waits.uninstall()

    def elapsed_s(self) -> float | None:
        """Seconds this rank has spent in collectives since the window started (logged plus waited), read
        between steps to split the window per step; None without the logger."""
        if not self.enabled:
            return None
        timers = self._comm.comm.timers.get_timers()
        names = [n for n in self._comm.comms_logger.get_raw_data() if n in timers]
        return sum(timers[n].elapsed(reset=False) for n in names) / 1e3 + sum(self.waits.seconds.values())

    def totals(self, steps: int) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        ops: dict[str, dict[str, float]] = {}
        timers = self._comm.comm.timers.get_timers()
        for name, by_size in self._comm.comms_logger.get_raw_data().items():
            count = sum(v[0] for v in by_size.values())
            size = sum(msg_size * v[0] for msg_size, v in by_size.items())
            timer = timers.get(name)
            if timer is not None and len(timer.event_timers) == count:
                ms = timer.elapsed(reset=False)
            else:  # a DeepSpeed that records one latency per op
                ms = sum(sum(v[1]) for v in by_size.values())
            waited = self.waits.seconds.get(name, 0.0) / steps
            ops[name] = {
                "count_per_step": count / steps,
                "bytes_per_step": size / steps,
                "seconds_per_step": ms / 1e3 / steps + waited,
                "waited_seconds_per_step": waited,
            }
        return {
            "seconds_per_step": sum(o["seconds_per_step"] for o in ops.values()),
            "bytes_per_step": sum(o["bytes_per_step"] for o in ops.values()),
            "ops": ops,
        }


DS_TIMERS = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
"""DeepSpeed's global timers, summed over one optimizer step's micro-steps. Where communication lands
differs by stage: ZeRO-1 reduces gradients once at the boundary (`bwd_allreduce`); ZeRO-2 reduces buckets
inside backward hooks (`bwd_inner`, with overlap_comm) and waits for the last ones in `bwd_allreduce`;
ZeRO-3 also all-gathers parameters inside `fwd` and `bwd` and its reduce-scatters run in `bwd_inner`;
stages 1 and 2 all-gather the updated partitions inside `step`."""
