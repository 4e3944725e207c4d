"""The communicators the collectives benchmark (advisor.measure.collectives_rank) times, and the buffers they move.

`TorchCommunicator` runs torch.distributed over one process group (nccl on GPUs, gloo on CPUs);
`MpiCommunicator` runs mpi4py on host buffers shared with torch CPU tensors. Both offer what the sweep
needs: one blocking collective, a burst of all-gathers in flight, a barrier, a device sync and a max over
ranks. Buffers hold a per-rank integer pattern whose exact result every collective can be checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

DTYPE = torch.float32
ELEMENT_BYTES = 4
PATTERN_PERIOD = 251
"""Input element i on group rank r is (r + 1) * (i % 251 + 1): sums stay exact in float32 up to ~360 ranks."""

GLOO_REDUCE_SCATTER_NOTE = (
    "emulated by torch: ProcessGroupGloo runs reduce_scatter as an all_reduce of a copy and keeps this "
    "rank's chunk, so it moves all-reduce traffic"
)
SDZERO_REDUCE_SCATTER_NOTE = (
    "emulated by sdzero: this torch's gloo has no reduce_scatter; all_reduce then slice"
)


@dataclass
class Buffers:
    send: torch.Tensor
    recv: torch.Tensor
    expected: torch.Tensor


class Communicator(Protocol):
    """What the sweep needs from torch.distributed or MPI, over one group of ranks."""

    backend: str
    in_place_all_reduce: bool
    """torch's all_reduce reduces `recv` in place; MPI's reads `send` and writes `recv`."""
    library: str
    rank: int
    size: int
    device: torch.device

    def run(self, collective: str, buffers: Buffers) -> None: ...
    def all_gather_burst(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        """Start one all-gather per pair without waiting, then wait for all of them."""
        ...

    def barrier(self) -> None: ...
    def synchronize(self) -> None: ...
    def max_over_ranks(self, value: float) -> float: ...
    def emulation_note(self, collective: str) -> str: ...


def element_count(size_bytes: int, group_size: int) -> int:
    """Elements in the full buffer, rounded down to a multiple of the group size (as nccl-tests does)."""
    count = size_bytes // ELEMENT_BYTES
    return max(count - count % group_size, group_size)


def input_pattern(count: int, rank: int, device: torch.device) -> torch.Tensor:
    base = torch.arange(count, dtype=torch.int64, device=device) % PATTERN_PERIOD + 1
    return (base * (rank + 1)).to(DTYPE)


def make_buffers(collective: str, count: int, rank: int, size: int, device: torch.device) -> Buffers:
    """Out-of-place buffers and the exact expected result for this rank."""
    chunk = count // size
    rank_sum = size * (size + 1) // 2  # sum over group ranks r of (r + 1)
    if collective == "all_reduce":
        send = input_pattern(count, rank, device)
        expected = input_pattern(count, 0, device) * rank_sum
        return Buffers(send, torch.empty_like(send), expected)
    if collective == "reduce_scatter":
        send = input_pattern(count, rank, device)
        expected = (input_pattern(count, 0, device) * rank_sum)[rank * chunk : (rank + 1) * chunk]
        return Buffers(send, torch.empty(chunk, dtype=DTYPE, device=device), expected)
    if collective == "all_gather":
        send = input_pattern(count, rank, device)[rank * chunk : (rank + 1) * chunk].clone()
        expected = torch.cat(
            [input_pattern(count, r, device)[r * chunk : (r + 1) * chunk] for r in range(size)]
        )
        return Buffers(send, torch.empty(count, dtype=DTYPE, device=device), expected)
    raise ValueError(f"unknown collective {collective!r}")


# --------------------------------------------------------------------------------------------------
# torch.distributed


def _torch_reduce_scatter_fn() -> Callable[..., Any]:
    # torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single and deprecated the old name
    return (
        getattr(torch.distributed, "reduce_scatter_single", None) or torch.distributed.reduce_scatter_tensor
    )


def _torch_all_gather_fn() -> Callable[..., Any]:
    return getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


class TorchCommunicator:
    """torch.distributed over one process group (the whole world or a subgroup)."""

    backend = "torch"
    in_place_all_reduce = True

    def __init__(self, group: Any, device: torch.device) -> None:
        import torch.distributed as dist

        self.group = group
        self.device = device
        self.library = dist.get_backend(group)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._reduce_scatter = _torch_reduce_scatter_fn()
        self._all_gather = _torch_all_gather_fn()
        self._native_reduce_scatter = self._probe_reduce_scatter()

    def _probe_reduce_scatter(self) -> bool:
        # Some torch releases' gloo raise "does not support reduce_scatter" before any traffic, on every
        # rank alike, so a failed probe leaves the group usable and every rank takes the same fallback.
        out = torch.empty(1, dtype=DTYPE, device=self.device)
        try:
            self._reduce_scatter(
                out, torch.ones(self.size, dtype=DTYPE, device=self.device), group=self.group
            )
        except RuntimeError:
            return False
        return True

    def emulation_note(self, collective: str) -> str:
        if collective != "reduce_scatter" or self.library != "gloo":
            return ""
        return GLOO_REDUCE_SCATTER_NOTE if self._native_reduce_scatter else SDZERO_REDUCE_SCATTER_NOTE

    def run(self, collective: str, buffers: Buffers) -> None:
        import torch.distributed as dist

        if collective == "all_reduce":
            dist.all_reduce(buffers.recv, group=self.group)  # in place: see _check_once and measure_point
        elif collective == "reduce_scatter" and not self._native_reduce_scatter:
            full = buffers.send.clone()
            dist.all_reduce(full, group=self.group)
            buffers.recv.copy_(full.chunk(self.size)[self.rank])
        elif collective == "reduce_scatter":
            self._reduce_scatter(buffers.recv, buffers.send, group=self.group)
        elif collective == "all_gather":
            self._all_gather(buffers.recv, buffers.send, group=self.group)
        else:
            raise ValueError(f"unknown collective {collective!r}")

    def all_gather_burst(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        works = [
            self._all_gather(r, s, group=self.group, async_op=True) for s, r in zip(sends, recvs, strict=True)
        ]
        for work in works:
            work.wait()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def synchronize(self) -> None:
        # note: NCCL calls return before the GPU is done; this is the sync point that makes timing honest
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def max_over_ranks(self, value: float) -> float:
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return float(tensor.item())


# --------------------------------------------------------------------------------------------------
# MPI (mpi4py), on host buffers shared with torch CPU tensors


def mpi_library_name() -> str:
    from mpi4py import MPI

    first_line = MPI.Get_library_version().strip().splitlines()[0]
    return first_line.split(",")[0].strip()


class MpiCommunicator:
    """mpi4py over one MPI communicator; buffers are CPU tensors viewed as numpy arrays."""

    backend = "mpi"
    in_place_all_reduce = False
    device = torch.device("cpu")

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.library = mpi_library_name()
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    def emulation_note(self, collective: str) -> str:
        return ""

    def run(self, collective: str, buffers: Buffers) -> None:
        send, recv = buffers.send.numpy(), buffers.recv.numpy()
        if collective == "all_reduce":
            self.comm.Allreduce(send, recv)
        elif collective == "reduce_scatter":
            self.comm.Reduce_scatter_block(send, recv)
        elif collective == "all_gather":
            self.comm.Allgather(send, recv)
        else:
            raise ValueError(f"unknown collective {collective!r}")

    def all_gather_burst(self, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        from mpi4py import MPI

        requests = [self.comm.Iallgather(s.numpy(), r.numpy()) for s, r in zip(sends, recvs, strict=True)]
        MPI.Request.Waitall(requests)

    def barrier(self) -> None:
        self.comm.Barrier()

    def synchronize(self) -> None:
        """MPI calls on host buffers are complete when they return."""

    def max_over_ranks(self, value: float) -> float:
        from mpi4py import MPI

        return float(self.comm.allreduce(value, op=MPI.MAX))
