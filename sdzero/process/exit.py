"""The end of a rank process's entry point (`sdzero/train.py`, `sdzero` commands run as ranks)."""

from __future__ import annotations

import gc


def freeze_heap_for_exit() -> None:
    """Call as the last thing before the entry point returns.

    With torch, DeepSpeed, diffusers and transformers loaded, the interpreter's final garbage collections
    walk millions of objects: 1.0-1.5 s of every exit on these hosts (bench/launch_overhead.py), which the
    test suite and the advisor's trials pay for every rank they start. Freezing moves those objects out of
    the collector's reach; reference counting still frees them and closes what they hold, and atexit
    handlers (wandb's, the data loader's) still run. What it gives up is collecting reference cycles, whose
    memory goes back with the process: a file held only by a cycle would not be flushed, which is why
    everything sdzero writes is closed before its entry point returns.
    """
    gc.freeze()
