"""Distributed start-up, once for everything that forms a process group: the trainer, the cache build and
the benches.

`start_distributed` does, in this order, what each of them needs and what was easy to get wrong when each
kept its own copy:

1. `deepspeed.init_distributed` with a timeout on every collective (when a host dies mid-run, the
   survivors raise instead of waiting for ever) and MPI discovery: under mpirun (no RANK/MASTER_* set)
   DeepSpeed finds the ranks through mpi4py and would use port 29500 unless told; a MASTER_PORT given to
   mpirun (-x) is kept; a process no launcher started is rank 0 of a world of one
   (sdzero.process.rendezvous), and says so first;
2. a barrier, after which every rank has mapped its peers' shared-memory buffers (CPU hosts), so that
   this rank's buffer name can be unlinked (sdzero.process.shm: else DeepSpeed leaks 69 MB of /dev/shm per rank);
3. this rank's device: `init_distributed` does not pick it (the engine does, later), so without this every
   rank's early collectives and frozen models would land on cuda:0.

`ask_cpu_info_once` saves 1.2 s of every CPU rank's start (sdzero.process.exit saves as much at its exit).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch

from sdzero.process.rendezvous import SINGLE_RANK_NOTICE, made_world_of_one, world_of_one
from sdzero.process.shm import release_shm_buffer

DEFAULT_MASTER_PORT = 29500
"""DeepSpeed's default, used for MPI discovery when MASTER_PORT is not set."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the group."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    """The accelerator device this rank computes on (`cpu` on a CPU host)."""


def ask_cpu_info_once() -> None:
    """Memoise py-cpuinfo's `get_cpu_info` for this process.

    DeepSpeed's CPU op builder calls it twice for every JIT-loaded op (arch, then SIMD width), and each call
    starts a helper process that times the clock: 1.2 s a call on these hosts, paid by every rank of every
    launch while the first collective waits. The answer cannot change within a process. Each caller gets
    its own copy, so none can alter another's.
    """
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed then asks lscpu instead
        return
    ask = cpuinfo.get_cpu_info
    if getattr(ask, "asked_once", False):
        return
    cached = functools.cache(ask)

    def get_cpu_info() -> dict:
        return dict(cached())

    get_cpu_info.asked_once = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def start_distributed(
    timeout_s: float | None = None, backend: str | None = None, set_device: bool = True
) -> Ranks:
    """Form the process group (see the module docstring) and return this rank's place in it.

    `timeout_s` None keeps DeepSpeed's default (30 min); `backend` None lets DeepSpeed pick the
    accelerator's (nccl on CUDA, gloo on a CPU); `set_device` False leaves the current device alone (the
    cache build's group only carries CPU objects).
    """
    if world_of_one() or made_world_of_one():  # no launcher: rank 0 of one, not MPI discovery
        print(SINGLE_RANK_NOTICE, file=sys.stderr, flush=True)  # before DeepSpeed's first words
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    ask_cpu_info_once()  # before init_distributed, which JIT-loads the shared-memory op on a CPU
    options = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=True,
        distributed_port=int(os.environ.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))),
        **options,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has mapped its peers' shared-memory buffers by now
    release_shm_buffer(rank)
    accel = get_accelerator()
    local_rank = local_rank_from_env()
    if set_device:
        accel.set_device(local_rank)
    return Ranks(rank, world, local_rank, torch.device(accel.current_device_name()))
