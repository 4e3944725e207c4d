"""Host RAM per node: what a config keeps in the node's memory beside the devices, against the node's RAM.

Per node, for the ranks it runs (each figure per rank x ranks per node, unless said):

- **offloaded states**: with optimizer offload, each rank's fp32 master partition and Adam's moments live in
  host memory, and with parameter offload (ZeRO-3) its 16-bit parameter shard too (advisor.model.memory,
  `offloaded`); with `pin_memory` (the offload section's default here, advisor.measure.grid.CPU_OFFLOAD)
  they are page-locked and cannot be swapped out;
- **pinned buffers**: with optimizer offload DeepSpeed also keeps each rank's fp32 gradient partition on the
  host (ZeRO-1/2 `single_partition_of_fp32_groups` grads, filled during backward; ZeRO-3 its fp32 grad
  partition), and the CPU optimizer's own temporaries at the step (`step_host_transient`);
- **a CPU EMA** (`--ema-decay` with optimizer offload: sdzero keeps the EMA of the rank's fp32 master slice
  on the CPU, sdzero.training.callbacks): one more fp32 partition;
- **loader workers**: `--num-workers` per rank, each holding torch's default `prefetch_factor` (2)
  micro-batches ahead, and the pinned copy of the next one: decoded pixels (3 x resolution^2 fp32 per
  sample), or with `--cache-dir` the cache's bytes per sample. The workers' interpreters are not counted;
- **the page cache a latent cache needs**: every epoch reads the whole `--cache-dir` on every node, so its
  size (measured on disk here) should stay in the page cache, or each epoch reads it from disk again.

The node's RAM is measured here (when the target is this machine), declared (`--host-memory-gib`), or a
machine preset's (`HOST_RAM_GIB`, vendors' datasheets); unknown, nothing is refused and the answer says
the check was not made. A config whose need is over it is not feasible, with a one-line reason.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from advisor.model.memory import MemoryModel
from sdzero.constants import GIB

HOST_RAM_GIB: dict[str, float] = {
    "dgx-a100": 1024.0,
    "dgx-h100": 2048.0,
    "hgx-h200": 2048.0,
    "dgx-b200": 2048.0,
    "gb200-nvl72": 17408.0,
}
"""System memory of the machine presets (advisor.model.network.MACHINES), from the vendors' datasheets:
DGX A100 1 TB (the 640 GB model: 2 TB; the smaller is taken), DGX H100 and DGX H200 2 TB, DGX B200 2 TB
(up to 4 TB), GB200 NVL72 up to 17 TB LPDDR5X per rack (one 72-GPU node here)."""
PREFETCH_FACTOR = 2
"""torch.utils.data.DataLoader's default batches loaded ahead per worker."""
FP32 = 4


@dataclass(frozen=True)
class HostSetup:
    """What of the run besides the config decides host memory."""

    ranks_per_node: int
    node_bytes: float | None
    """The node's RAM; None: unknown, nothing is checked."""
    source: str
    """Where `node_bytes` comes from: "measured here", "--host-memory-gib", a preset's name, or why unknown."""
    num_workers: int = 2
    ema: bool = False
    sample_bytes: float = 0.0
    """Bytes of one sample as a loader worker holds it (decoded pixels, or the cache's per sample)."""
    cache_bytes: float = 0.0
    """The latent cache's size on disk (0: no --cache-dir)."""


def host_bytes(memory: MemoryModel, setup: HostSetup, row: pd.Series) -> dict[str, float]:
    """One config's host bytes per node, by part, and their `total`."""
    stage, precision, offload = int(row["zero_stage"]), str(row["dtype"]), str(row["offload"])
    world, mb = int(row["world_size"]), int(row["micro_batch"])
    rank = memory.per_rank_bytes(stage, precision, mb, offload, world)
    states = memory.state_bytes(stage, precision, world)
    partition = states["master"] / memory.element_bytes(stage, precision, "master") * FP32
    offloaded = offload != "none"
    ranks = setup.ranks_per_node
    batch = setup.sample_bytes * mb * (PREFETCH_FACTOR * setup.num_workers + 1)
    parts = {
        "offloaded_states": ranks * rank["offloaded"],
        "pinned_buffers": ranks * ((partition + rank["step_host_transient"]) if offloaded else 0.0),
        "cpu_ema": ranks * (partition if offloaded and setup.ema else 0.0),
        "loader_workers": ranks * batch,
        "page_cache": setup.cache_bytes,
    }
    return parts | {"total": sum(parts.values())}


def add_host_memory(table: pd.DataFrame, memory: MemoryModel, setup: HostSetup) -> pd.DataFrame:
    """predictions with `host_bytes_per_node`, `host_usable_bytes` and `host_fits`; a config over the
    node's RAM is not `feasible`, and `host_reason` says why in one line."""
    if table.empty:
        return table
    out = table.copy()
    needs = [host_bytes(memory, setup, row) for _, row in out.iterrows()]
    out["host_bytes_per_node"] = [n["total"] for n in needs]
    out["host_usable_bytes"] = setup.node_bytes
    fits = [setup.node_bytes is None or n["total"] <= setup.node_bytes for n in needs]
    out["host_fits"] = fits
    out["host_reason"] = ["" if ok else over_host_ram(n, setup) for ok, n in zip(fits, needs, strict=True)]
    out["feasible"] = out["feasible"].astype(bool) & out["host_fits"]
    return out


def over_host_ram(need: dict[str, float], setup: HostSetup) -> str:
    """The one line for a config over the node's RAM: its need, its largest parts, the RAM and its source."""
    named = sorted(((v, k) for k, v in need.items() if k != "total" and v > 0), reverse=True)[:3]
    parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.3g}" for v, k in named)
    return (
        f"host RAM: needs {need['total'] / GIB:.3g} GiB per node ({parts}) over the node's "
        f"{(setup.node_bytes or 0) / GIB:.3g} GiB ({setup.source})"
    )


def node_ram(
    declared_gib: float | None, preset: str | None, target_is_here: bool
) -> tuple[float | None, str]:
    """The node's RAM and where it comes from: declared, a preset's, else this machine's when the target
    is nodes like it; (None, why) otherwise."""
    if declared_gib is not None:
        return declared_gib * GIB, "--host-memory-gib"
    if preset in HOST_RAM_GIB:
        return HOST_RAM_GIB[preset] * GIB, f"the {preset} preset's datasheet"
    if target_is_here:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "measured here"
    return None, "unknown: give --host-memory-gib to check the plan's host RAM"


def folder_bytes(folder: Path | None) -> float:
    """Bytes of the files under `folder` (0 for None or a folder that is not there)."""
    if folder is None or not Path(folder).is_dir():
        return 0.0
    return float(sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()))


def option_value(args: Sequence[str], flag: str) -> str | None:
    """A trainer option's value in `args` (`--flag value` or `--flag=value`); None if absent."""
    for i, word in enumerate(args):
        if word == flag and i + 1 < len(args):
            return args[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def host_setup(
    train_args: Sequence[str],
    ranks_per_node: int,
    resolution: int,
    samples: int,
    node: tuple[float | None, str],
    default_workers: int,
) -> HostSetup:
    """The HostSetup of a run from its trainer options (`--num-workers`, `--ema-decay`, `--cache-dir`),
    its resolution and the samples of an epoch (the cache's bytes per sample)."""
    workers = option_value(train_args, "--num-workers")
    cache = option_value(train_args, "--cache-dir")
    cache_bytes = folder_bytes(Path(cache)) if cache else 0.0
    sample = cache_bytes / max(samples, 1) if cache_bytes else 3.0 * resolution * resolution * FP32
    return HostSetup(
        ranks_per_node,
        node[0],
        node[1],
        int(workers) if workers is not None else default_workers,
        option_value(train_args, "--ema-decay") is not None,
        sample,
        cache_bytes,
    )
