"""Stand-ins for the Trainer's unit tests (tests/unit/test_trainer.py, test_gpu_speed.py): a CUDA event
and a DeepSpeed engine, so the loop runs on a CPU without a model."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class FakeEvent:
    """A CUDA event stand-in: a recorded event is one 'GPU millisecond' after the previous one; `waits`
    counts host waits on an event (tests reset both class counters before they read them)."""

    clock_ms = 0.0
    waits = 0

    def record(self) -> None:
        FakeEvent.clock_ms += 1.0
        self.at_ms = FakeEvent.clock_ms

    def synchronize(self) -> None:
        FakeEvent.waits += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


class FakeEngine:
    """What the Trainer asks of a DeepSpeed engine; `global_samples` counts micro-steps."""

    def __init__(self) -> None:
        self.module = torch.nn.Linear(2, 2)
        self.monitor = SimpleNamespace(enabled=False)
        self.global_samples = 0
        self.skipped_steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        pass

    def step(self) -> None:
        self.global_samples += 1

    def get_lr(self) -> list[float]:
        return [1e-4]

    def fp16_enabled(self) -> bool:
        return False
