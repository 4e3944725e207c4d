"""Rank-side collectives benchmark in the manner of nccl-tests; runs inside every rank.

Started by `advisor.measure.collectives_launch.run_comm`, either under the `deepspeed` launcher (torch.distributed: nccl on GPUs,
gloo on CPUs) or under `mpirun` (mpi4py). Both paths share the sweep, the timing, the correctness check
and the CSV format; only the communicator differs.

For each link level (ranks within one node; one rank per node across nodes when there are several), for
message sizes min..max doubling, and for all-reduce, reduce-scatter and all-gather:
  1. fill buffers with a per-rank integer pattern and run the collective once: compare with the exact
     expected result (integers below 2**24 sum exactly in float32, in any order);
  2. more warm-up calls, then one timed call that sets the iteration count (agreed across ranks);
  3. `repeats` times: barrier, then `iters` back-to-back calls timed as a whole, the time per call being
     the slowest rank's (the collective is done only when every rank is done). The median of the
     repeats is reported, and their spread, so a rank descheduled on a busy machine shows as noise
     rather than passing for a property of the transport.
Sizes stop growing when the next one would overrun the time budget.
  4. a burst: `in_flight` all-gathers of the smallest size started back to back without waiting, then all
     waited for, timed per call. ZeRO-3 issues its parameter gathers like this (prefetch, the gather of
     persistent parameters after each step, hundreds per step), and a library that overlaps or pipelines
     them pays less than one blocking call's latency each (gloo does, over a link with latency). Its row
     has `in_flight` > 1 and is kept out of the line fit.

Rank 0 writes the rows as CSV with pandas. `size_bytes` follows nccl-tests: the whole buffer of an
all-reduce, the (larger) input of a reduce-scatter, the (larger) output of an all-gather.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from advisor.measure.alphabeta import COLLECTIVES, algbw_gbps, busbw_gbps
from advisor.measure.communicators import (
    DTYPE,
    ELEMENT_BYTES,
    Buffers,
    Communicator,
    MpiCommunicator,
    TorchCommunicator,
    element_count,
    make_buffers,
)
from sdzero.atomic import write_csv_atomic


@dataclass
class Row:
    """One measured (collective, size) point; its fields, in order, are the columns of comm.csv."""

    backend: str
    library: str
    collective: str
    link_level: str
    node: str
    ranks: int
    nodes: int
    size_bytes: int
    count: int
    dtype: str
    warmup: int
    iters: int
    repeats: int
    time_s: float
    time_spread: float
    algbw_gbps: float
    busbw_gbps: float
    correct: bool
    max_abs_error: float
    emulated: bool
    note: str
    in_flight: int = 1
    """Calls started before the first is waited for: 1 for the sweep's blocking calls, more in a burst."""


CSV_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Row))
"""Columns of comm.csv; bandwidths are GB/s with G = 1e9 bytes, as nccl-tests prints them."""


@dataclass(frozen=True)
class SweepSettings:
    min_bytes: int
    max_bytes: int
    budget_s: float
    """Seconds of measurement for this process's whole sweep, all link levels together."""
    warmup: int = 2
    min_iters: int = 1
    max_iters: int = 50
    """Calls per timed loop, at most."""
    repeats: int = 3
    """Timed loops per point; time_s is their median."""
    collectives: tuple[str, ...] = COLLECTIVES
    burst: int = 32
    """All-gathers in flight in the burst measurement (0: none)."""
    burst_repeats: int = 15
    """Timed bursts; their median is reported. A burst takes tens of milliseconds, and on shared cores the
    median of a few moved by 1.5x between probes: the time model multiplies it by hundreds of calls."""


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min, 2*min, 4*min, ... up to max (nccl-tests' -b/-e/-f 2)."""
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 2
    return sizes


# --------------------------------------------------------------------------------------------------
# The sweep


def _timed_calls(comm: Communicator, collective: str, buffers: Buffers, iters: int) -> float:
    """Seconds per call for `iters` back-to-back calls, the slowest rank's."""
    comm.barrier()
    comm.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        comm.run(collective, buffers)
    comm.synchronize()
    return comm.max_over_ranks((time.perf_counter() - start) / iters)


def _check_once(comm: Communicator, collective: str, buffers: Buffers) -> float:
    """Run once on fresh buffers; the largest absolute error over all ranks."""
    if collective == "all_reduce" and comm.in_place_all_reduce:
        buffers.recv.copy_(buffers.send)
    else:
        buffers.recv.fill_(float("nan"))  # so a collective that writes nothing cannot pass
    comm.run(collective, buffers)
    comm.synchronize()
    error = (buffers.recv - buffers.expected).abs().max().item()
    error = error if math.isfinite(error) else math.inf
    if collective == "all_reduce" and comm.in_place_all_reduce:
        # Timed in-place sums multiply the values by n per call and would overflow over many calls;
        # zeros stay zeros, and no backend's speed depends on the values (no compression, no denormals).
        buffers.recv.zero_()
    return comm.max_over_ranks(error)


def _timed_point(
    collective: str, count: int, group_size: int, times: list[float], error: float, **fields: Any
) -> dict[str, Any]:
    """The measured fields of a Row from the sorted per-call times of its repeats (their median is the
    point's time) and the largest error of its check."""
    time_s = times[len(times) // 2]
    size_bytes = count * ELEMENT_BYTES
    return {
        "collective": collective,
        "size_bytes": size_bytes,
        "count": count,
        "dtype": str(DTYPE).removeprefix("torch."),
        "repeats": len(times),
        "time_s": time_s,
        "time_spread": (times[-1] - times[0]) / time_s,
        "algbw_gbps": algbw_gbps(size_bytes, time_s),
        "busbw_gbps": busbw_gbps(collective, group_size, size_bytes, time_s),
        "correct": error == 0.0,
        "max_abs_error": error,
        **fields,
    }


def measure_point(
    comm: Communicator, collective: str, size_bytes: int, settings: SweepSettings, target_s: float
) -> dict[str, Any]:
    """Check and time one collective at one size; the measured fields of a Row."""
    count = element_count(size_bytes, comm.size)
    buffers = make_buffers(collective, count, comm.rank, comm.size, comm.device)
    max_abs_error = _check_once(comm, collective, buffers)
    for _ in range(settings.warmup - 1):
        comm.run(collective, buffers)
    # every rank must run the same number of calls, so the count comes from an agreed (max) probe
    probe_s = _timed_calls(comm, collective, buffers, 1)
    wanted = math.ceil(target_s / settings.repeats / max(probe_s, 1e-9))
    iters = int(min(settings.max_iters, max(settings.min_iters, wanted)))
    times = sorted(_timed_calls(comm, collective, buffers, iters) for _ in range(settings.repeats))
    note = comm.emulation_note(collective)
    return _timed_point(
        collective,
        count,
        comm.size,
        times,
        max_abs_error,
        warmup=settings.warmup + 1,  # the check call, the extra warm-ups, the probe
        iters=iters,
        emulated=bool(note),
        note=note,
    )


def measure_burst(comm: Communicator, size_bytes: int, settings: SweepSettings) -> dict[str, Any]:
    """Seconds per all-gather when `settings.burst` of them are in flight at once (see the module doc)."""
    count = element_count(size_bytes, comm.size)
    template = make_buffers("all_gather", count, comm.rank, comm.size, comm.device)
    # Own buffers per call: calls in flight together must not write into one another's output.
    sends = [template.send.clone() for _ in range(settings.burst)]
    recvs = [torch.empty_like(template.recv) for _ in range(settings.burst)]
    comm.all_gather_burst(sends, recvs)  # warm-up, and a check: every call must gather the same result
    error = max((r - template.expected).abs().max().item() for r in recvs)
    error = comm.max_over_ranks(error if math.isfinite(error) else math.inf)

    def timed() -> float:
        comm.barrier()
        comm.synchronize()
        start = time.perf_counter()
        comm.all_gather_burst(sends, recvs)
        comm.synchronize()
        return comm.max_over_ranks((time.perf_counter() - start) / settings.burst)

    times = sorted(timed() for _ in range(settings.burst_repeats))
    return _timed_point(
        "all_gather",
        count,
        comm.size,
        times,
        error,
        warmup=1,
        iters=settings.burst,
        emulated=False,
        note=f"{settings.burst} calls in flight, time per call",
        in_flight=settings.burst,
    )


def sweep(
    comm: Communicator, settings: SweepSettings, level_budget_s: float, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """All sizes and collectives for one group, stopping before a size would overrun the budget."""
    sizes = message_sizes(settings.min_bytes, settings.max_bytes)
    # spend about half of the budget in timed loops, spread over every point; big sizes take longer anyway
    target_s = min(0.5, 0.5 * level_budget_s / max(len(sizes) * len(settings.collectives), 1))
    start = time.perf_counter()
    last_size_s = 0.0
    points: list[dict[str, Any]] = []
    for size_bytes in sizes:
        elapsed = comm.max_over_ranks(time.perf_counter() - start)  # agreed, so all ranks stop together
        # sizes double and large messages are bandwidth-bound: the next size costs about twice the last
        if points and elapsed + 2.0 * last_size_s > level_budget_s:
            log(
                f"budget: stopping before {size_bytes} bytes ({elapsed:.1f} s of {level_budget_s:.1f} s used)"
            )
            break
        size_start = time.perf_counter()
        for collective in settings.collectives:
            point = measure_point(comm, collective, size_bytes, settings, target_s)
            points.append(point)
            log(_format_point(point))
        last_size_s = comm.max_over_ranks(time.perf_counter() - size_start)
    if settings.burst > 1 and "all_gather" in settings.collectives:
        point = measure_burst(comm, sizes[0], settings)
        points.append(point)
        log(_format_point(point))
    return points


def _format_point(point: dict[str, Any]) -> str:
    return (
        f"{point['collective']:>15} {point['size_bytes']:>12} B  {point['time_s'] * 1e6:>12.1f} us  "
        f"algbw {point['algbw_gbps']:8.3f}  busbw {point['busbw_gbps']:8.3f} GB/s  "
        f"spread {point['time_spread']:5.2f}  "
        f"{'ok' if point['correct'] else 'WRONG'}"
        + (f"  ({point['in_flight']} in flight)" if point.get("in_flight", 1) > 1 else "")
    )


# --------------------------------------------------------------------------------------------------
# Link levels: which ranks share a node


@dataclass(frozen=True)
class Topology:
    """Global ranks grouped by node, in order of their lowest rank."""

    nodes: tuple[tuple[int, ...], ...]
    hostnames: tuple[str, ...]

    @classmethod
    def from_hostnames(cls, per_rank: Sequence[str]) -> Topology:
        groups: dict[str, list[int]] = {}
        for rank, host in enumerate(per_rank):
            groups.setdefault(host, []).append(rank)
        ordered = sorted(groups.items(), key=lambda item: item[1][0])
        return cls(tuple(tuple(r) for _, r in ordered), tuple(h for h, _ in ordered))

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.nodes)

    def levels(self) -> list[str]:
        """`intra` when some node holds two ranks or more; `inter` when there are two nodes or more."""
        levels = []
        if any(len(ranks) >= 2 for ranks in self.nodes):
            levels.append("intra")
        if len(self.nodes) >= 2:
            levels.append("inter")
        return levels


def _level_rows(
    comm: Communicator | None,
    level: str,
    topo: Topology,
    world_rank: int,
    budget_s: float,
    settings: SweepSettings,
) -> list[dict[str, Any]]:
    """Rows this rank contributes for one level: only a group's rank 0 reports, others return []."""
    if comm is None:
        return []
    log = _rank0_printer(comm.rank == 0)
    points = sweep(comm, settings, budget_s, log)
    if comm.rank != 0:
        return []
    node = topo.hostnames[topo.node_of(world_rank)] if level == "intra" else "+".join(topo.hostnames)
    nodes = 1 if level == "intra" else len(topo.nodes)
    common = {"backend": comm.backend, "library": comm.library, "link_level": level, "node": node}
    return [{**common, "ranks": comm.size, "nodes": nodes, **point} for point in points]


def _rank0_printer(enabled: bool) -> Callable[[str], None]:
    def log(message: str) -> None:
        if enabled:
            print(f"[comm] {message}", flush=True)

    return log


def write_rows(rows: Sequence[dict[str, Any]], csv_path: Path) -> None:
    """Write rows as CSV through a temporary file, so a reader never sees half a table."""
    table = pd.DataFrame([asdict(Row(**row)) for row in rows], columns=list(CSV_COLUMNS))
    write_csv_atomic(table, csv_path)


# --------------------------------------------------------------------------------------------------
# Entry points for the two launchers


def run_torch(settings: SweepSettings, csv_path: Path, backend: str) -> None:
    """torch.distributed path: env:// rendezvous as set by the deepspeed launcher."""
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    from sdzero.telemetry.environment import share_cpu_threads

    share_cpu_threads()  # as the trainer does: gloo's reductions run on these threads
    dist.init_process_group(backend=backend)
    try:
        world_rank = dist.get_rank()
        hostnames: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(hostnames, socket.gethostname())
        topo = Topology.from_hostnames(hostnames)
        rows: list[dict[str, Any]] = []
        levels = topo.levels()
        for level in levels:
            group = _torch_level_group(level, topo, world_rank)
            comm = TorchCommunicator(group, device) if group is not None else None
            rows += _level_rows(comm, level, topo, world_rank, settings.budget_s / len(levels), settings)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        if world_rank == 0:
            write_rows([row for part in gathered for row in part], csv_path)
    finally:
        dist.destroy_process_group()


def _torch_level_group(level: str, topo: Topology, world_rank: int) -> Any | None:
    """The process group this rank measures `level` in, or None; every rank creates every group."""
    import torch.distributed as dist

    if level == "intra":
        mine = None
        for ranks in topo.nodes:  # new_group is collective over the world: same order on every rank
            group = dist.new_group(list(ranks))
            if world_rank in ranks and len(ranks) >= 2:
                mine = group
        return mine
    group = dist.new_group(list(topo.leaders))
    return group if world_rank in topo.leaders else None


def run_mpi(settings: SweepSettings, csv_path: Path) -> None:
    """mpi4py path: started by mpirun; MPI is initialised when mpi4py.MPI is imported."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    world_rank = world.Get_rank()
    topo = Topology.from_hostnames(world.allgather(socket.gethostname()))
    rows: list[dict[str, Any]] = []
    levels = topo.levels()
    for level in levels:
        sub = _mpi_level_comm(level, topo, world_rank)
        comm = MpiCommunicator(sub) if sub != MPI.COMM_NULL else None
        rows += _level_rows(comm, level, topo, world_rank, settings.budget_s / len(levels), settings)
        if sub != MPI.COMM_NULL:
            sub.Free()
    gathered = world.gather(rows, root=0)
    if world_rank == 0:
        write_rows([row for part in gathered for row in part], csv_path)


def _mpi_level_comm(level: str, topo: Topology, world_rank: int) -> Any:
    from mpi4py import MPI

    node = topo.node_of(world_rank)
    if level == "intra":
        color = node if len(topo.nodes[node]) >= 2 else MPI.UNDEFINED
    else:
        color = 0 if world_rank in topo.leaders else MPI.UNDEFINED
    return MPI.COMM_WORLD.Split(color, key=world_rank)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["torch", "mpi"], required=True)
    parser.add_argument("--torch-backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--csv", type=Path, required=True, help="where rank 0 writes its rows")
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=256 * 2**20)
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-iters", type=int, default=50)
    # the deepspeed launcher passes --local_rank unless told not to; LOCAL_RANK in the env is what we use
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = SweepSettings(
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes,
        budget_s=args.budget_s,
        warmup=max(args.warmup, 1),
        max_iters=args.max_iters,
    )
    if args.backend == "torch":
        run_torch(settings, args.csv, args.torch_backend)
    else:
        run_mpi(settings, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
