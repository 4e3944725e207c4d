"""What a launch of several configs (sdzero.training.measuring.sweep) does around the trainer's steps besides
measuring them: DeepSpeed's synchronizing instruments on for instrumented steps only (`Instruments`), the
engine-independent tie timed after every round (`time_tie`), a config's out-of-memory told apart and cleaned
up, and the launch's decisions shared by every rank.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

TIE_SIZE = 256
"""The tie's square matrices: a product of a few milliseconds on a CPU core, far less on a GPU."""
TIE_REPEATS = 8


class Instruments:
    """DeepSpeed's comms_logger and wall-clock timers: on for instrumented steps only, as the JSON set them."""

    def __init__(self, engine: Any) -> None:
        import deepspeed.comm as ds_comm
        from deepspeed.runtime.engine import EngineTimers

        self.engine, self.logger = engine, ds_comm.comms_logger
        self.logger_on = bool(self.logger.enabled)
        self.breakdown_on = bool(engine._config.wall_clock_breakdown)
        self.timers_on = engine.engine_timers
        self.timers_off = EngineTimers(enable_micro_timers=False, enable_global_timers=False)
        # ZeRO's optimizer got the engine's timers at init when the JSON asked for the breakdown: it times
        # (and on CUDA reads back) its gradient and all-gather phases every step unless they are swapped too.
        self.optimizer = getattr(engine, "optimizer", None)
        self.optimizer_timers = getattr(self.optimizer, "timers", None)

    def set(self, on: bool) -> None:
        from deepspeed.utils.timer import NoopTimer

        self.logger.enabled = self.logger_on and on
        self.engine._config.wall_clock_breakdown = self.breakdown_on and on
        self.engine.engine_timers = self.timers_on if on else self.timers_off
        if self.optimizer_timers is not None:
            self.optimizer.timers = self.optimizer_timers if on else NoopTimer()


def time_tie(device: torch.device) -> float:
    """Seconds of the engine-independent tie: the same matrix products every round, timed (synchronized:
    outside every timed step), so that launches of different engines can be put on one machine speed
    (advisor.measure.launch)."""
    a = torch.ones(TIE_SIZE, TIE_SIZE, device=device)
    start = time.perf_counter()
    for _ in range(TIE_REPEATS):
        a = (a @ a) * (1.0 / TIE_SIZE)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def free_after_oom(engine: Any) -> None:
    """What a step that ran out of memory left behind: its gradients and the allocator's cache."""
    with contextlib.suppress(Exception):  # best effort: the step's state is broken already
        engine.optimizer.zero_grad()
    engine.micro_steps = 0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def collective_device() -> torch.device:
    """gloo takes CPU tensors, NCCL CUDA ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank0_says(mine: bool) -> bool:
    """Rank 0's verdict for every rank (their step times differ a little)."""
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def any_rank(mine: bool) -> bool:
    """True on every rank if it is true on any (a rank's out-of-memory ends the config on all)."""
    flag = torch.tensor([float(mine)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
