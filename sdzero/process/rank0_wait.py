"""Other ranks waiting for work only rank 0 does (an elastic checkpoint's conversion, the final export to a
shared filesystem), under a collective timeout sized for that work rather than --dist-timeout-s.

The process group's timeout (--dist-timeout-s) is sized for a training step's collectives, so that a dead
host is noticed. Rank 0 converting a large checkpoint or writing a pipeline to a slow shared filesystem
takes as long as its bytes take, and the ranks that wait in a collective meanwhile would time out and kill
a healthy run. They wait instead in a gloo group of their own whose timeout covers the bytes at a slow
storage rate (gloo: the answer is a small CPU object whatever the main backend).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

from sdzero.constants import MIB

SLOW_STORAGE_BYTES_PER_S = 20 * MIB
"""The slowest sustained rate a rank-0 job is given time for, per byte read or written: a shared filesystem
(NFS, a cloud file share) under the load of a whole job. An assumption on the safe side, not a measurement:
a rate slower than this times out."""
RANK0_WAIT_FLOOR_S = 600.0
"""Time always allowed on top of the bytes: loading libraries and components, the filesystem's latency."""


def rank0_timeout_s(work_bytes: float, base_timeout_s: float) -> float:
    """Seconds the other ranks wait for rank 0 to move `work_bytes` (read plus written)."""
    return max(base_timeout_s, RANK0_WAIT_FLOOR_S + work_bytes / SLOW_STORAGE_BYTES_PER_S)


def default_timeout_s() -> float:
    """The default group's collective timeout in seconds (--dist-timeout-s), as its backend holds it."""
    import torch
    import torch.distributed as dist

    try:  # private API: the backend's options (gloo's on the CPU side of any group)
        group = dist.distributed_c10d._get_default_group()
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # moved in another torch: torch's own default
        return float(dist.default_pg_timeout.total_seconds())


@contextlib.contextmanager
def waiting_for_rank0(work_bytes: float) -> Iterator[Callable[[Any], Any]]:
    """A collective context for work only rank 0 does: every rank enters it together (a gloo group is
    made, with a timeout sized for `work_bytes` of rank-0 reads and writes), rank 0 works inside it, and
    every rank then calls the yielded `share(answer)`, which returns rank 0's answer everywhere."""
    import torch.distributed as dist

    timeout_s = rank0_timeout_s(work_bytes, default_timeout_s())
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def share(answer: Any) -> Any:
        box = [answer]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    try:
        yield share
    finally:
        dist.destroy_process_group(group)
