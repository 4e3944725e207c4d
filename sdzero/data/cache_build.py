"""Building a latent/text cache (`sdzero cache`): each rank encodes its share of the shards.

Shard k is built by rank k mod world. A shard is written under a temporary name and renamed into place,
with the spec's digest and its position range in its metadata, so a killed build leaves only complete
shards and rerunning the same command skips exactly those; the temporary files a kill leaves are removed
by the next build. Each rank hashes the shards it holds, and rank 0 writes `cache.json`, with every shard's
size and sha256, once every shard is there. Rerunning the command on a complete cache checks every shard
against those and rebuilds the damaged ones. Rank 0 holds the folder's one-live-run lock for the build
(sdzero.config.output_lock): a second build into the folder is refused. See sdzero.data.cache for the
layout and docs/caching.md for the user's view.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sdzero.atomic import refuse_link, write_json_atomic
from sdzero.config.data_source import data_root
from sdzero.config.output_lock import LOCK_NAME, claim_output_dir, release_output_dir
from sdzero.data.buckets import assign_buckets
from sdzero.data.cache import (
    BUILD_NAME,
    CACHE_FORMAT,
    FLIP_POLICIES,
    INDEX_NAME,
    CacheSpec,
    differences,
    file_sha256,
    read_build_record,
    read_index,
    run_spec,
    shard_name,
    shard_problems,
    spec_from,
)
from sdzero.data.images import Record, open_rgb, resize_and_crop
from sdzero.errors import UserError

if TYPE_CHECKING:
    from sdzero.cluster.remote_launch import RemoteLaunch

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

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.group:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

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


def _pixels(
    group: list[tuple[int, Record]], size: tuple[int, int]
) -> tuple[torch.Tensor, list[tuple[int, tuple[int, int], tuple[int, int]]]]:
    """The images of `group` center-cropped to `size`, stacked in [-1, 1], and per image its (position,
    original (height, width), crop (top, left)): SDXL's micro-conditioning, stored beside the latents."""
    dummy = np.random.default_rng(0)  # center crop draws nothing
    pixels, meta = [], []
    for pos, rec in group:
        img = open_rgb(rec.image_source())
        original = (img.height, img.width)
        img, crop = resize_and_crop(img, size, dummy, random_crop=False)
        pixels.append(torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1))
        meta.append((pos, original, crop))
    return torch.stack(pixels), meta


DECODE_WORKERS = 4
"""DataLoader worker processes per rank that decode, resize and crop the images for the encoder, so the
rank's main thread only feeds the VAE and text encoders (PIL's decode holds the GIL)."""


class _PixelBatches(torch.utils.data.Dataset):
    """Item k: the k-th batch of a shard's images as pixels (`_pixels`), made in a DataLoader worker."""

    def __init__(self, batches: list[tuple[tuple[int, int], list[tuple[int, Record]]]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> tuple[torch.Tensor, list[tuple[int, tuple[int, int], tuple[int, int]]]]:
        size, batch = self.batches[k]
        return _pixels(batch, size)


@torch.no_grad()
def _encode_shard(
    comps: Any,
    items: list[tuple[int, Record, tuple[int, int]]],
    flip: str,
    batch_size: int,
    device: torch.device,
    workers: int = DECODE_WORKERS,
) -> dict[str, torch.Tensor]:
    """Every tensor of a shard's samples, keyed `<position>/<name>`; the images decoded by `workers`
    DataLoader processes (0: in this process), in order, while this one encodes."""
    from sdzero.models.loading import encode_prompts, tokenize
    from sdzero.process.preemption import ignore_preemption_signals

    out: dict[str, torch.Tensor] = {}
    by_size: dict[tuple[int, int], list[tuple[int, Record]]] = {}
    for pos, rec, size in items:
        by_size.setdefault(size, []).append((pos, rec))
    batches = [
        (size, group[start : start + batch_size])
        for size, group in by_size.items()
        for start in range(0, len(group), batch_size)
    ]
    loader = torch.utils.data.DataLoader(
        _PixelBatches(batches),
        batch_size=None,  # each item is a whole batch already
        num_workers=min(workers, len(batches), os.cpu_count() or 1),
        pin_memory=device.type == "cuda",
        worker_init_fn=ignore_preemption_signals,  # the rank handles SIGTERM
    )
    for (size, batch), (pixels, meta) in zip(batches, loader, strict=True):
        px = pixels.to(device)
        vae = comps.vae
        views = {"": px, "flip/": px.flip(-1)} if flip == "both" else {"": px}
        # One (batch, tokens) tensor per text encoder, in the family's order (a StepInput's token_ids).
        per_caption = [tokenize(comps, rec.text) for _, rec in batch]
        token_ids = tuple(torch.stack(slot).to(device) for slot in zip(*per_caption, strict=True))
        cond = encode_prompts(comps, token_ids).by_name()
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


@dataclass
class _Plan:
    """What every rank of a build agrees on before any shard is encoded."""

    spec: CacheSpec
    records: list[Record]
    """Every record of the metadata file, readable or not."""
    rows: list[list[Any]]
    """The data files' [name, size, mtime_ns] (sdzero.data.cache.data_files)."""
    good: list[Record]
    """The readable records: position p of the cache is good[p]."""
    bad: list[int]
    """Indices into `records` of the unreadable images, skipped."""
    sizes: list[tuple[int, int]]
    """Each good record's (height, width): its aspect-ratio bucket, or the square resolution."""
    shard_size: int

    @property
    def n_shards(self) -> int:
        return (len(self.good) + self.shard_size - 1) // self.shard_size

    def shard_items(self, k: int) -> list[tuple[int, Record, tuple[int, int]]]:
        """(position, record, size) of every sample in shard k."""
        first = k * self.shard_size
        return [
            (p, self.good[p], self.sizes[p])
            for p in range(first, min(first + self.shard_size, len(self.good)))
        ]


def _check_build_options(flip: str, dtype: str, shard_size: int, batch_size: int) -> None:
    from sdzero.models.loading import DTYPES

    if flip not in FLIP_POLICIES:
        raise UserError(f"--flip must be one of {', '.join(FLIP_POLICIES)}, got {flip!r}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if shard_size < 1 or batch_size < 1:
        raise UserError("--shard-size and --batch-size must be at least 1")


TMP_MARK = ".tmp-"


def _tmp_name(path: Path) -> Path:
    """Where a shard is written before its rename: hidden, and marked with the writer's pid."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def _leftovers(out: Path) -> list[Path]:
    """Temporary shard files in `out`: what a killed build leaves (never read as shards: another name)."""
    return sorted(p for p in out.glob(f".shard-*.safetensors{TMP_MARK}*") if p.is_file())


def _refuse_foreign(out: Path) -> None:
    """`out` must be new, empty, or a cache folder (its lock file and a killed build's temporary files do
    not count): a build never writes into, or takes the lock of, a folder that holds something else."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder; choose a new folder for the cache")
    if not out.is_dir() or (out / INDEX_NAME).is_file() or (out / BUILD_NAME).is_file():
        return
    ignored = {LOCK_NAME, *(p.name for p in _leftovers(out))}
    # A build's own index files while it writes them (sdzero.atomic: `.NAME.XXXX.tmp`, then renamed):
    # a second build arriving in that instant must hear that the folder is in use, not that it is foreign.
    own_temp = tuple(f".{name}." for name in (INDEX_NAME, BUILD_NAME, LOCK_NAME))
    if any(p.name not in ignored and not p.name.startswith(own_temp) for p in out.iterdir()):
        raise UserError(f"--out {out} exists and is not a cache folder; choose an empty or new folder")


def _finished_build(out: Path, spec: CacheSpec, rows: list[list[Any]], rank: int) -> BuildResult | None:
    """The result of a build already complete in `out` with these settings, None if there is work left;
    refuses a folder that holds another build's cache.

    A complete cache is checked shard by shard (size and sha256, a read of the whole cache): rank 0 deletes
    the damaged shards, and every rank goes on to build, which rebuilds exactly what is missing. The
    verdicts agree across ranks: a rank that checks after rank 0's deletions finds those shards missing."""
    if (out / INDEX_NAME).is_file():
        index = read_index(out / INDEX_NAME)
        _refuse_other(out, spec_from(index["spec"]), index["data_files"], spec, rows)
        problems = shard_problems(out, index, full=True)
        if not problems:
            return BuildResult(
                out, len(index["samples"]), len(index["shards"]), 0, 0, 0.0, already_complete=True
            )
        if rank == 0:
            for problem in problems:
                log.warning("%s: rebuilding it", problem)
            for k in range(len(index["shards"])):
                if any(problem.startswith(f"{out / shard_name(k)} ") for problem in problems):
                    (out / shard_name(k)).unlink(missing_ok=True)
        return None
    build = read_build_record(out)  # one line for a damaged or special build.json, never a traceback
    if build is not None:
        _refuse_other(out, spec_from(build["spec"]), build["data_files"], spec, rows)
    return None


def _plan(
    ranks: _Ranks,
    spec: CacheSpec,
    records: list[Record],
    rows: list[list[Any]],
    shard_size: int,
    max_bad_fraction: float,
    data: Path,
) -> _Plan:
    """Unreadable images found by all ranks together (each decodes a share, remembered for the next build
    or run: sdzero.data.listing; a collective) and every good image's size, so that all ranks cut the same
    shards. Decoded, not only checked from headers: a shard's positions are fixed before it is encoded."""
    from sdzero.data.listing import check_images, good_sizes

    checked = check_images(records, data, ranks, max_bad_fraction, decode=True)
    bad = set(checked.bad)
    good = [r for i, r in enumerate(records) if i not in bad]
    if spec.buckets is not None:
        sizes_list = [tuple(s) for s in spec.buckets]
        sizes = [sizes_list[b] for b in assign_buckets(good_sizes(checked), sizes_list)]
    else:
        sizes = [(spec.resolution, spec.resolution)] * len(good)
    return _Plan(spec, records, rows, good, sorted(bad), sizes, shard_size)  # type: ignore[arg-type]


def _write_shard(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tmp = _tmp_name(path)
    for name in (path, tmp):  # the temporary's name is predictable: a link planted there is refused
        refuse_link(name)
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)  # the commit: a shard is either complete under its name or absent


def _build_my_shards(
    out: Path,
    plan: _Plan,
    comps: Any,
    ranks: _Ranks,
    batch_size: int,
    device: torch.device,
    stop_after_shards: int | None,
) -> tuple[int, int, dict[int, str]]:
    """Encode and commit this rank's shards (k % world == rank), skipping those already committed;
    returns (built, skipped, the sha256 of each of its shards: read back while it is in the page cache)."""
    built = skipped = 0
    digest = plan.spec.digest
    sums: dict[int, str] = {}
    for k in range(ranks.rank, plan.n_shards, ranks.world):
        path, first, items = out / shard_name(k), k * plan.shard_size, plan.shard_items(k)
        if path.is_file() and _shard_done(path, digest, first, len(items)):
            skipped += 1
            sums[k] = file_sha256(path)
            continue
        tensors = _encode_shard(comps, items, plan.spec.flip, batch_size, device)
        meta = {"spec": digest, "rank": str(ranks.rank), "first": str(first), "count": str(len(items))}
        _write_shard(path, tensors, meta)
        sums[k] = file_sha256(path)
        built += 1
        log.info("rank %d: shard %d of %d written (%d samples)", ranks.rank, k + 1, plan.n_shards, len(items))
        if stop_after_shards is not None and built >= stop_after_shards:
            raise BuildInterrupted(f"stopped after {built} shard(s), as asked")
    return built, skipped, sums


@contextlib.contextmanager
def _build_lock(out: Path, rank: int) -> Iterator[None]:
    """Rank 0 holds `out`'s one-live-run lock for the build (the kernel drops it if the process dies)."""
    if rank == 0:
        claim_output_dir(out, flag="--out")
    try:
        yield
    finally:
        if rank == 0:
            release_output_dir(out)


def _remove_leftovers(out: Path) -> None:
    """A killed build's temporary files; none is being written now (this process holds the lock)."""
    for leftover in _leftovers(out):
        leftover.unlink(missing_ok=True)
        log.info("removed %s, left by an interrupted build", leftover)


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
    from sdzero.config.train_config import rank_from_env
    from sdzero.models.loading import load_components

    _check_build_options(flip, dtype, shard_size, batch_size)
    start = time.perf_counter()
    out, data = Path(out), Path(data)
    spec, records, rows = run_spec(model, data, resolution, buckets, flip, dtype, max_sequence_length)
    _refuse_foreign(out)  # before the lock, which would create a lock file in a foreign folder
    with _build_lock(out, rank_from_env()):
        finished = _finished_build(out, spec, rows, rank_from_env())
        if finished is not None:
            return finished
        ranks = _Ranks()
        try:
            if ranks.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                _remove_leftovers(out)
                write_json_atomic(
                    out / BUILD_NAME, {"format": CACHE_FORMAT, "spec": asdict(spec), "data_files": rows}
                )
            plan = _plan(ranks, spec, records, rows, shard_size, max_bad_fraction, data)
            ranks.barrier()  # build.json exists (and the leftovers are gone) before anyone writes a shard

            device = torch.device(
                f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
            )
            comps = load_components(model, dtype, device, max_sequence_length=max_sequence_length)
            built, skipped, mine = _build_my_shards(
                out, plan, comps, ranks, batch_size, device, stop_after_shards
            )
            sums = {k: digest for share in ranks.gather(mine) for k, digest in share.items()}  # collective
            if ranks.rank == 0:
                _write_index(out, data, plan, comps, sums, time.perf_counter() - start)
            ranks.barrier()
        finally:
            ranks.close()
    return BuildResult(out, len(plan.good), plan.n_shards, built, skipped, time.perf_counter() - start)


def _shard_entries(out: Path, plan: _Plan, sums: dict[int, str]) -> tuple[list[dict[str, Any]], set[str]]:
    """cache.json's entry of every shard, each checked committed, and the text embeddings' names."""
    from safetensors import safe_open

    shards = []
    cond_keys: set[str] = set()
    for k in range(plan.n_shards):
        path = out / shard_name(k)
        count = min(plan.shard_size, len(plan.good) - k * plan.shard_size)
        if not _shard_done(path, plan.spec.digest, k * plan.shard_size, count):
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
                "sha256": sums[k],
            }
        )
    return shards, cond_keys


def _write_index(
    out: Path, data: Path, plan: _Plan, comps: Any, sums: dict[int, str], seconds: float
) -> None:
    shards, cond_keys = _shard_entries(out, plan, sums)
    root = data_root(data)  # tar shards: names are `shard.tar#key`
    index = {
        "format": CACHE_FORMAT,
        "spec": asdict(plan.spec),
        "spec_digest": plan.spec.digest,
        "latent_shift": comps.latent_shift_factor,
        "latent_scale": comps.latent_scaling_factor,
        "cond_keys": sorted(cond_keys),
        "samples": [
            {
                "file_name": r.name_in(root),
                "text": r.text,
                "shard": p // plan.shard_size,
                "size": list(plan.sizes[p]),
            }
            for p, r in enumerate(plan.good)
        ],
        "shards": shards,
        "skipped_unreadable": [plan.records[i].name_in(root) for i in plan.bad],
        "data_files": plan.rows,
        "build_seconds": seconds,  # rank 0's last build session, model loading included
    }
    write_json_atomic(out / INDEX_NAME, index)


def cache_launch(cache_args: list[str], num_gpus: int | None, hostfile: Path | None) -> RemoteLaunch:
    """`deepspeed ... sdzero.cli cache ARGS`: every rank (on every host) builds its share.

    With a hostfile the ranks start through sdzero.cluster.remote_launch, in the folder the user ran
    `sdzero cache` from (so a relative --data or --out means what it did there, whatever the folder's
    name) and with the values of that folder's env file exactly; without one, DeepSpeed's runner starts
    this host's ranks, with no remote shell in between."""
    from sdzero.cluster.launch_command import deepspeed_command
    from sdzero.cluster.remote_launch import launch_from_here, local_launch

    if hostfile is None:
        # --no_local_rank: the ranks read RANK/LOCAL_RANK from the environment, as the trainer does.
        entry = ["--no_local_rank", "--module", "sdzero.cli", "cache"]
        return local_launch(deepspeed_command(cache_args, num_gpus=num_gpus, entry=entry))
    return launch_from_here(
        ["cache", *cache_args],
        ["-m", "sdzero.cli"],
        Path.cwd(),
        hostfile=hostfile,
        num_gpus=num_gpus,
        local_rank=False,
    )
