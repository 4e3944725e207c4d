"""Building a latent/text cache (`sdzero cache`): each rank encodes its share of the shards.

Shard k is built by rank k mod world. A shard is written under a temporary name and renamed into place,
with the spec's digest and its position range in its metadata, so a killed build leaves only complete
shards and rerunning the same command skips exactly those. Rank 0 writes `cache.json` once every shard is
there. See sdzero.data.cache for the layout and docs/caching.md for the user's view.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sdzero.atomic import write_json_atomic
from sdzero.data.buckets import assign_buckets, image_sizes
from sdzero.data.cache import (
    BUILD_NAME,
    CACHE_FORMAT,
    FLIP_POLICIES,
    INDEX_NAME,
    CacheSpec,
    differences,
    read_index,
    run_spec,
    shard_name,
    spec_from,
)
from sdzero.data.images import Record, open_rgb, resize_and_crop
from sdzero.errors import UserError

log = logging.getLogger("sdzero.data.cache")


class BuildInterrupted(Exception):
    """Raised by a build told to stop after N shards (tests use it to interrupt a build for real)."""


class _Ranks:
    """This process's share of the build. Under a launcher (deepspeed, torchrun, or mpirun, whose ranks
    DeepSpeed discovers through mpi4py as the trainer's do) the ranks form a gloo group, only to agree on
    unreadable images and to wait for each other: CPU objects, so gloo even on GPUs."""

    def __init__(self, timeout_s: float = 1800.0) -> None:
        from sdzero.config.train_config import rank_from_env, world_size_from_env

        self.rank, self.world = rank_from_env(), world_size_from_env()
        self.group = False
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                from sdzero.process.distributed import start_distributed

                start_distributed(timeout_s, backend="gloo", set_device=False)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            self.group = True

    def gather(self, obj: Any) -> list[Any]:
        if not self.group:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.group:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _refuse_other(out: Path, existing: CacheSpec, rows: list[list[Any]], spec: CacheSpec, new_rows) -> None:
    diff = differences(existing, spec, rows, new_rows)
    if existing.flip != spec.flip:
        diff.append(f"--flip {existing.flip} vs {spec.flip}")
    if diff:
        raise UserError(
            f"--out {out} holds a cache built with other settings ({'; '.join(diff)}); choose an empty "
            "folder or delete that one"
        )


def _shard_done(path: Path, digest: str, first: int, count: int) -> bool:
    """A committed shard of these settings holding exactly positions [first, first + count)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return (meta.get("spec"), meta.get("first"), meta.get("count")) == (digest, str(first), str(count))
    except Exception:  # a foreign or damaged file is rebuilt, never trusted
        return False


@torch.no_grad()
def _encode_shard(
    comps: Any,
    items: list[tuple[int, Record, tuple[int, int]]],
    flip: str,
    batch_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every tensor of a shard's samples, keyed `<position>/<name>`."""
    from sdzero.models.loading import encode_prompts, tokenize

    dummy = np.random.default_rng(0)  # center crop draws nothing
    out: dict[str, torch.Tensor] = {}
    by_size: dict[tuple[int, int], list[tuple[int, Record]]] = {}
    for pos, rec, size in items:
        by_size.setdefault(size, []).append((pos, rec))
    for size, group in by_size.items():
        for start in range(0, len(group), batch_size):
            batch = group[start : start + batch_size]
            pixels, meta = [], []
            for pos, rec in batch:
                img = open_rgb(rec.path)
                original = (img.height, img.width)
                img, crop = resize_and_crop(img, size, dummy, random_crop=False)
                pixels.append(
                    torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
                )
                meta.append((pos, original, crop))
            px = torch.stack(pixels).to(device)
            vae = comps.vae
            views = {"": px, "flip/": px.flip(-1)} if flip == "both" else {"": px}
            tokens: dict[str, list[torch.Tensor]] = {}
            for _, rec in batch:
                for k, v in tokenize(comps, rec.text).items():
                    tokens.setdefault(k, []).append(v)
            cond = encode_prompts(comps, {k: torch.stack(v).to(device) for k, v in tokens.items()})
            for prefix, view in views.items():
                posterior = vae.encode(view.to(vae.dtype)).latent_dist
                for i, (pos, _, _) in enumerate(meta):
                    # clone: safetensors refuses tensors that share storage (slices of one batch)
                    out[f"{pos}/{prefix}mean"] = posterior.mean[i].contiguous().cpu().clone()
                    out[f"{pos}/{prefix}std"] = posterior.std[i].contiguous().cpu().clone()
            for i, (pos, original, crop) in enumerate(meta):
                for name, value in cond.items():
                    out[f"{pos}/cond/{name}"] = value[i].contiguous().cpu().clone()
                out[f"{pos}/original_size"] = torch.tensor(original, dtype=torch.long)
                out[f"{pos}/crop_top_left"] = torch.tensor(crop, dtype=torch.long)
                out[f"{pos}/target_size"] = torch.tensor(size, dtype=torch.long)
    return out


@dataclass
class BuildResult:
    out: Path
    samples: int
    shards: int
    built_here: int
    skipped_here: int
    seconds: float
    already_complete: bool = False


def build_cache(
    model: str,
    data: Path,
    out: Path,
    resolution: int | None = None,
    buckets: bool = False,
    flip: str = "none",
    dtype: str = "bf16",
    shard_size: int = 256,
    batch_size: int = 16,
    max_bad_fraction: float = 0.5,
    max_sequence_length: int | None = None,
    stop_after_shards: int | None = None,
) -> BuildResult:
    """Encode every readable image of `data` into `out`; this process builds shards k with k % world == rank."""
    from sdzero.data.images import check_bad_fraction, find_unreadable
    from sdzero.models.loading import DTYPES, load_components

    if flip not in FLIP_POLICIES:
        raise UserError(f"--flip must be one of {', '.join(FLIP_POLICIES)}, got {flip!r}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if shard_size < 1 or batch_size < 1:
        raise UserError("--shard-size and --batch-size must be at least 1")
    start = time.perf_counter()
    out, data = Path(out), Path(data)
    spec, records, rows = run_spec(model, data, resolution, buckets, flip, dtype, max_sequence_length)
    if (out / INDEX_NAME).is_file():
        index = read_index(out / INDEX_NAME)
        _refuse_other(out, spec_from(index["spec"]), index["data_files"], spec, rows)
        return BuildResult(out, len(index["samples"]), len(index["shards"]), 0, 0, 0.0, already_complete=True)
    if (out / BUILD_NAME).is_file():
        build = json.loads((out / BUILD_NAME).read_text())
        _refuse_other(out, spec_from(build["spec"]), build["data_files"], spec, rows)
    elif out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not a cache folder; choose an empty or new folder")

    ranks = _Ranks()
    try:
        if ranks.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                out / BUILD_NAME, {"format": CACHE_FORMAT, "spec": asdict(spec), "data_files": rows}
            )
        bad = {i for share in ranks.gather(find_unreadable(records, ranks.rank, ranks.world)) for i in share}
        check_bad_fraction(len(records), len(bad), max_bad_fraction, data)
        good = [r for i, r in enumerate(records) if i not in bad]
        if spec.buckets is not None:
            sizes_list = [tuple(s) for s in spec.buckets]
            sizes = [sizes_list[b] for b in assign_buckets(image_sizes([r.path for r in good]), sizes_list)]
        else:
            sizes = [(spec.resolution, spec.resolution)] * len(good)
        n_shards = (len(good) + shard_size - 1) // shard_size
        ranks.barrier()  # build.json exists before anyone writes a shard

        device = torch.device(
            f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
        )
        comps = load_components(model, dtype, device, max_sequence_length=max_sequence_length)
        built = skipped = 0
        for k in range(ranks.rank, n_shards, ranks.world):
            path = out / shard_name(k)
            first = k * shard_size
            items = [(p, good[p], sizes[p]) for p in range(first, min(first + shard_size, len(good)))]
            if path.is_file() and _shard_done(path, spec.digest, first, len(items)):
                skipped += 1
                continue
            tensors = _encode_shard(comps, items, flip, batch_size, device)
            from safetensors.torch import save_file

            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            meta = {
                "spec": spec.digest,
                "rank": str(ranks.rank),
                "first": str(first),
                "count": str(len(items)),
            }
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)  # the commit: a shard is either complete under its name or absent
            built += 1
            log.info("rank %d: shard %d of %d written (%d samples)", ranks.rank, k + 1, n_shards, len(items))
            if stop_after_shards is not None and built >= stop_after_shards:
                raise BuildInterrupted(f"stopped after {built} shard(s), as asked")
        ranks.barrier()  # every shard is committed
        if ranks.rank == 0:
            _write_index(
                out,
                data,
                spec,
                rows,
                good,
                sizes,
                n_shards,
                shard_size,
                comps,
                sorted(bad),
                records,
                time.perf_counter() - start,
            )
        ranks.barrier()
    finally:
        ranks.close()
    n = len(good)
    return BuildResult(out, n, n_shards, built, skipped, time.perf_counter() - start)


def _write_index(
    out: Path,
    data: Path,
    spec: CacheSpec,
    rows,
    good: list[Record],
    sizes,
    n_shards: int,
    shard_size: int,
    comps: Any,
    bad: list[int],
    records: list[Record],
    seconds: float,
) -> None:
    from safetensors import safe_open

    shards = []
    cond_keys: set[str] = set()
    for k in range(n_shards):
        path = out / shard_name(k)
        count = min(shard_size, len(good) - k * shard_size)
        if not _shard_done(path, spec.digest, k * shard_size, count):
            raise UserError(
                f"{path}: missing or incomplete after the build; rerun the same command to finish it"
            )
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            if k == 0:
                cond_keys = {key.split("/cond/", 1)[1] for key in f.keys() if "/cond/" in key}  # noqa: SIM118 (not a dict)
        shards.append(
            {
                "file": path.name,
                "rank": int(meta["rank"]),
                "first": int(meta["first"]),
                "count": int(meta["count"]),
                "bytes": path.stat().st_size,
            }
        )
    index = {
        "format": CACHE_FORMAT,
        "spec": asdict(spec),
        "spec_digest": spec.digest,
        "latent_shift": comps.latent_shift_factor,
        "latent_scale": comps.latent_scaling_factor,
        "cond_keys": sorted(cond_keys),
        "samples": [
            {
                "file_name": r.path.relative_to(data).as_posix(),
                "text": r.text,
                "shard": p // shard_size,
                "size": list(sizes[p]),
            }
            for p, r in enumerate(good)
        ],
        "shards": shards,
        "skipped_unreadable": [records[i].path.name for i in bad],
        "data_files": rows,
        "build_seconds": seconds,  # rank 0's last build session, model loading included
    }
    write_json_atomic(out / INDEX_NAME, index)


def launcher_command(cache_args: list[str], num_gpus: int | None, hostfile: Path | None) -> list[str]:
    """`deepspeed ... --module sdzero.cli cache ARGS`: every rank (on every host) builds its share."""
    from sdzero.cluster.launch_command import deepspeed_command

    # --no_local_rank: the ranks read RANK/LOCAL_RANK from the environment, as the trainer does.
    entry = ["--no_local_rank", "--module", "sdzero.cli", "cache"]
    return deepspeed_command(cache_args, num_gpus=num_gpus, hostfile=hostfile, entry=entry)
