"""On-disk latent and text-embedding caches: encode once with the frozen VAE and text encoders, then train
without loading them.

Layout of a cache folder (no pickle anywhere):

    build.json                  what the cache is being built for (written first; a resume must match it)
    shard-00000.safetensors     the samples of positions [first, first + count): per sample the VAE
    shard-00001.safetensors     posterior mean and std (and those of the mirrored image with --flip both),
    ...                         every text embedding the family's `encode_prompts` returns, and SDXL's
                                original_size / crop_top_left / target_size
    cache.json                  the index: what made it, every sample's file name, shard and size; written
                                last, so its presence means the build is complete

The posterior mean and std are stored, not one latent sample, so that every epoch still draws its own
posterior sample from the sample's `latent_eps`, exactly as online encoding does. Shards are written
under a temporary name and renamed: a killed build leaves only complete shards, and rerunning the same
command skips them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from sdzero.buckets import assign_buckets, bucket_sizes, image_sizes
from sdzero.data import (
    Record,
    SampleSpec,
    draw_noise,
    open_rgb,
    read_metadata,
    resize_and_crop,
    sample_generator,
)
from sdzero.errors import UserError

log = logging.getLogger("sdzero.cache")

CACHE_FORMAT = 1
INDEX_NAME = "cache.json"
BUILD_NAME = "build.json"
FLIP_POLICIES = ("none", "both")
TRAINED_NETS = ("unet", "transformer")  # not part of the cache's fingerprint: the cache never uses them
SKIPPED_PARTS = (*TRAINED_NETS, "scheduler")


# ---------------------------------------------------------------------------------------------------
# What made a cache


def _model_file(model: str, relpath: str) -> Path:
    local = Path(model) / relpath
    if Path(model).is_dir():
        return local
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(model, relpath))


def _read_json(model: str, relpath: str) -> dict[str, Any]:
    try:
        return json.loads(_model_file(model, relpath).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"--model {model}: cannot read {relpath} ({exc})") from exc


@dataclass(frozen=True)
class NetGeometry:
    """What the cache and buckets need to know about the model, read from its config files alone."""

    native_resolution: int
    vae_scale_factor: int
    granularity: int
    """Sides of a training image must be multiples of this: VAE downsampling x the net's own (UNet levels or
    transformer patch)."""


def net_geometry(model: str) -> NetGeometry:
    index = _read_json(model, "model_index.json")
    net = next((n for n in TRAINED_NETS if n in index), "unet")
    net_cfg = _read_json(model, f"{net}/config.json")
    vae_cfg = _read_json(model, "vae/config.json")
    vae_factor = 2 ** (len(vae_cfg.get("block_out_channels", [0])) - 1)
    if net_cfg.get("patch_size"):
        net_factor = int(net_cfg["patch_size"])
    else:
        net_factor = 2 ** (len(net_cfg.get("block_out_channels", [0])) - 1)
    return NetGeometry(int(net_cfg["sample_size"]) * vae_factor, vae_factor, vae_factor * net_factor)


def _sampled_digest(path: Path, samples: int = 16, chunk: int = 65536) -> str:
    """A content digest that reads ~1 MiB of a multi-GB weight file: the safetensors header (names, shapes,
    dtypes, offsets) or first bytes, plus chunks at evenly spaced offsets."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        if path.suffix == ".safetensors" and len(head) == 8:
            h.update(f.read(min(int.from_bytes(head, "little"), 100_000_000)))
        for k in range(samples):
            f.seek(size * k // samples)
            h.update(f.read(chunk))
    return h.hexdigest()


def model_fingerprint(model: str) -> str:
    """Digest of the parts a cache depends on: the VAE, text encoders and tokenizers (configs in full,
    weights sampled), not the trained network, so a fine-tuned UNet reuses the cache of its base."""
    h = hashlib.sha256(json.dumps(_read_json(model, "model_index.json"), sort_keys=True).encode())
    root = Path(model)
    if not root.is_dir():
        return h.hexdigest()  # a hub id: model_index.json only (the hub pins parts by revision)
    parts = sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SKIPPED_PARTS)
    for part in parts:
        for path in sorted(p for p in part.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            small = path.stat().st_size <= 4_000_000
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if small else _sampled_digest(path)
            h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()


def data_files(data: Path, records: list[Record]) -> list[list[Any]]:
    """[file name, size, mtime_ns] of every listed image and of the metadata file itself."""
    rows = []
    for path in [
        *(p for p in Path(data).iterdir() if p.name.startswith("metadata.")),
        *(r.path for r in records),
    ]:
        try:
            st = path.stat()
            rows.append([path.relative_to(data).as_posix(), st.st_size, st.st_mtime_ns])
        except OSError:
            rows.append([path.relative_to(data).as_posix(), -1, -1])
    return rows


def data_fingerprint(rows: list[list[Any]], records: list[Record]) -> str:
    h = hashlib.sha256(json.dumps(rows).encode())
    h.update(json.dumps([r.text for r in records]).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class CacheSpec:
    """What a cache was built for. Training refuses a cache whose spec differs from the run's."""

    family: str
    model_fingerprint: str
    resolution: int
    buckets: list[list[int]] | None
    """[height, width] of each aspect-ratio bucket, or None: every image center-cropped to a square."""
    flip: str
    """"none": images as they are; "both": the mirrored image is cached too (serves --random-flip)."""
    dtype: str
    """Compute precision the frozen parts ran in (the VAE runs fp32 under fp16, as in training)."""
    data_fingerprint: str
    text_tokens: int | None = None
    """SD3's T5 sequence length (--max-sequence-length); None for families without T5."""
    crop: str = "center"
    model: str = ""
    data: str = ""

    COMPARED = ("family", "model_fingerprint", "resolution", "buckets", "dtype", "data_fingerprint",
                "text_tokens", "crop")  # fmt: skip

    @property
    def digest(self) -> str:
        keys = (*self.COMPARED, "flip")  # shards of a --flip both cache hold more than a --flip none one
        return hashlib.sha256(json.dumps([getattr(self, k) for k in keys]).encode()).hexdigest()[:16]


def run_spec(
    model: str,
    data: Path,
    resolution: int | None,
    buckets: bool,
    flip: str,
    dtype: str,
    max_sequence_length: int | None = None,
) -> tuple[CacheSpec, list[Record], list[list[Any]]]:
    """The spec a run with these options needs (used by the cache build and by training alike)."""
    from sdzero.models import DEFAULT_MAX_SEQUENCE_LENGTH, detect_family

    family = detect_family(model)
    tokens = (max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH) if family == "sd3" else None
    geometry = net_geometry(model)
    res = resolution or geometry.native_resolution
    sizes = [list(s) for s in bucket_sizes(res, geometry.granularity)] if buckets else None
    records = read_metadata(Path(data))
    rows = data_files(Path(data), records)
    spec = CacheSpec(
        family=family, model_fingerprint=model_fingerprint(model), resolution=res, buckets=sizes, flip=flip,
        dtype=dtype, data_fingerprint=data_fingerprint(rows, records), text_tokens=tokens, model=str(model),
        data=str(Path(data).resolve()),
    )  # fmt: skip
    return spec, records, rows


def differences(
    cache: CacheSpec, run: CacheSpec, cache_rows: list[list[Any]], run_rows: list[list[Any]]
) -> list[str]:
    """One phrase per way the cache differs from what the run needs."""
    out = []
    if cache.family != run.family:
        out.append(f"model family {cache.family} vs {run.family}")
    if cache.model_fingerprint != run.model_fingerprint:
        out.append(f"VAE/text encoders differ (cache made from {cache.model}, run uses {run.model})")
    if cache.resolution != run.resolution:
        out.append(f"resolution {cache.resolution} vs {run.resolution}")
    if cache.buckets != run.buckets:
        describe = lambda b: "no buckets" if b is None else f"buckets {[f'{h}x{w}' for h, w in b]}"  # noqa: E731
        out.append(f"{describe(cache.buckets)} vs {describe(run.buckets)}")
    if cache.text_tokens != run.text_tokens:
        out.append(f"--max-sequence-length {cache.text_tokens} vs {run.text_tokens}")
    if cache.dtype != run.dtype:
        out.append(f"precision {cache.dtype} vs {run.dtype}")
    if cache.data_fingerprint != run.data_fingerprint:
        before, after = {r[0]: r[1:] for r in cache_rows}, {r[0]: r[1:] for r in run_rows}
        changed = sorted(n for n in before.keys() & after.keys() if before[n] != after[n])
        added, removed = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
        parts = [f"{len(x)} {what} (e.g. {', '.join(x[:3])})" for x, what in
                 ((changed, "changed"), (added, "added"), (removed, "removed")) if x]  # fmt: skip
        out.append(f"data {cache.data} vs {run.data}: " + ("; ".join(parts) or "captions differ"))
    return out


# ---------------------------------------------------------------------------------------------------
# Building


class BuildInterrupted(Exception):
    """Raised by a build told to stop after N shards (tests use it to interrupt a build for real)."""


class _Ranks:
    """This process's share of the build. Under a launcher (deepspeed, torchrun, or mpirun, whose ranks
    DeepSpeed discovers through mpi4py as the trainer's do) the ranks form a gloo group, only to agree on
    unreadable images and to wait for each other: CPU objects, so gloo even on GPUs."""

    def __init__(self, timeout_s: float = 1800.0) -> None:
        from sdzero.config import rank_from_env, world_size_from_env

        self.rank, self.world = rank_from_env(), world_size_from_env()
        self.group = False
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                import deepspeed

                deepspeed.init_distributed(
                    dist_backend="gloo",
                    timeout=timedelta(seconds=timeout_s),
                    auto_mpi_discovery=True,
                    distributed_port=int(os.environ.get("MASTER_PORT", "29500")),
                )
                from sdzero.shm import release_shm_buffer

                dist.barrier()  # every rank has mapped its peers' shared-memory buffers (CPU hosts)
                release_shm_buffer(dist.get_rank())  # else DeepSpeed leaks 69 MB of /dev/shm per rank
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


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _spec_from(obj: dict[str, Any]) -> CacheSpec:
    names = {f.name for f in fields(CacheSpec)}
    return CacheSpec(**{k: v for k, v in obj.items() if k in names})


def _refuse_other(out: Path, existing: CacheSpec, rows: list[list[Any]], spec: CacheSpec, new_rows) -> None:
    diff = differences(existing, spec, rows, new_rows)
    if existing.flip != spec.flip:
        diff.append(f"--flip {existing.flip} vs {spec.flip}")
    if diff:
        raise UserError(
            f"--out {out} holds a cache built with other settings ({'; '.join(diff)}); choose an empty "
            "folder or delete that one"
        )


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _shard_done(path: Path, digest: str) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get("spec") == digest
    except Exception:  # a foreign or damaged file is rebuilt, never trusted
        return False


@torch.no_grad()
def _encode_shard(comps: Any, items: list[tuple[int, Record, tuple[int, int]]], flip: str,
                  batch_size: int, device: torch.device) -> dict[str, torch.Tensor]:  # fmt: skip
    """Every tensor of a shard's samples, keyed `<position>/<name>`."""
    from sdzero.models import encode_prompts, tokenize

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
    from sdzero.data import check_bad_fraction, find_unreadable
    from sdzero.models import DTYPES, load_components

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
        index = json.loads((out / INDEX_NAME).read_text())
        _refuse_other(out, _spec_from(index["spec"]), index["data_files"], spec, rows)
        return BuildResult(out, len(index["samples"]), len(index["shards"]), 0, 0, 0.0, already_complete=True)
    if (out / BUILD_NAME).is_file():
        build = json.loads((out / BUILD_NAME).read_text())
        _refuse_other(out, _spec_from(build["spec"]), build["data_files"], spec, rows)
    elif out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not a cache folder; choose an empty or new folder")

    ranks = _Ranks()
    try:
        if ranks.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(
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
            if path.is_file() and _shard_done(path, spec.digest):
                skipped += 1
                continue
            first = k * shard_size
            items = [(p, good[p], sizes[p]) for p in range(first, min(first + shard_size, len(good)))]
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


def _write_index(out: Path, data: Path, spec: CacheSpec, rows, good: list[Record], sizes, n_shards: int, shard_size: int,
                 comps: Any, bad: list[int], records: list[Record], seconds: float) -> None:  # fmt: skip
    from safetensors import safe_open

    shards = []
    cond_keys: set[str] = set()
    for k in range(n_shards):
        path = out / shard_name(k)
        if not _shard_done(path, spec.digest):
            raise UserError(
                f"{path}: missing or incomplete after the build; rerun the same command to finish it"
            )
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            if k == 0:
                cond_keys = {key.split("/cond/", 1)[1] for key in f.keys() if "/cond/" in key}  # noqa: SIM118 (not a dict)
        shards.append({"file": path.name, "rank": int(meta["rank"]), "first": int(meta["first"]),
                       "count": int(meta["count"]), "bytes": path.stat().st_size})  # fmt: skip
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
        ],  # fmt: skip
        "shards": shards,
        "skipped_unreadable": [records[i].path.name for i in bad],
        "data_files": rows,
        "build_seconds": seconds,  # rank 0's last build session, model loading included
    }
    _write_json_atomic(out / INDEX_NAME, index)


# ---------------------------------------------------------------------------------------------------
# Training from a cache


@dataclass
class CacheIndex:
    folder: Path
    spec: CacheSpec
    raw: dict[str, Any]

    @property
    def sizes(self) -> list[tuple[int, int]]:
        return [tuple(s["size"]) for s in self.raw["samples"]]  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.raw["samples"])


def open_cache(
    cache_dir: Path,
    model: str,
    data: Path,
    resolution: int | None,
    buckets: bool,
    dtype: str,
    random_flip: bool,
    max_sequence_length: int | None = None,
) -> CacheIndex:
    """The cache's index, after checking it was made for this run; a mismatch is one UserError naming what
    differs. Reads config files only: nothing here loads a model."""
    cache_dir = Path(cache_dir)
    index_path = cache_dir / INDEX_NAME
    if not index_path.is_file():
        partial = (
            " (its build did not finish: rerun the same `sdzero cache` command)"
            if (cache_dir / BUILD_NAME).is_file()
            else ""
        )
        raise UserError(f"--cache-dir {cache_dir}: no {INDEX_NAME}{partial}; build one with `sdzero cache --model "
                        f"{model} --data {data} --out {cache_dir}`")  # fmt: skip
    raw = json.loads(index_path.read_text())
    if raw.get("format") != CACHE_FORMAT:
        raise UserError(
            f"--cache-dir {cache_dir}: cache format {raw.get('format')} is not {CACHE_FORMAT}; rebuild it"
        )
    cached = _spec_from(raw["spec"])
    want, _, rows = run_spec(model, data, resolution, buckets, cached.flip, dtype, max_sequence_length)
    diff = differences(cached, want, raw["data_files"], rows)
    if random_flip and cached.flip != "both":
        diff.append("--random-flip needs both orientations, the cache has one (--flip none)")
    if diff:
        rebuild = f"sdzero cache --model {model} --data {data} --out NEW_DIR" + (
            " --buckets" if buckets else ""
        )
        raise UserError(
            f"--cache-dir {cache_dir} does not match this run: {'; '.join(diff)} (cache vs run). Rebuild it "
            f"(`{rebuild}` with the run's --resolution/--dtype/--flip) or train without --cache-dir"
        )
    return CacheIndex(cache_dir, cached, raw)


class CachedSamples(Dataset):
    """Items shaped like `CaptionedImages`' but with posterior mean/std and text embeddings instead of
    pixels and tokens. The per-sample generator makes the same draws in the same order (flip, then
    `draw_noise`), so a sample's noise, timestep and posterior draw equal those of online encoding."""

    def __init__(self, cache: CacheIndex, spec: SampleSpec) -> None:
        self.cache, self.spec = cache, spec
        self._open: dict[int, Any] = {}  # per process (each DataLoader worker opens its own handles)

    def __len__(self) -> int:
        return len(self.cache)

    def _shard(self, k: int) -> Any:
        if k not in self._open:
            from safetensors import safe_open

            self._open[k] = safe_open(str(self.cache.folder / shard_name(k)), framework="pt")
        return self._open[k]

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        index, epoch = key
        rng = sample_generator(self.spec.seed, epoch, index)
        flip = self.spec.random_flip and rng.random() < 0.5
        shard = self._shard(self.cache.raw["samples"][index]["shard"])
        view = f"{index}/flip/" if flip else f"{index}/"
        mean, std = shard.get_tensor(view + "mean"), shard.get_tensor(view + "std")
        drawn = draw_noise(rng, self.spec, tuple(mean.shape))
        cond = {f"cond.{k}": shard.get_tensor(f"{index}/cond/{k}") for k in self.cache.raw["cond_keys"]}
        return {
            "latent_mean": mean,
            "latent_std": std,
            **cond,
            **drawn,
            "index": torch.tensor(index, dtype=torch.long),
            "original_size": shard.get_tensor(f"{index}/original_size"),
            "crop_top_left": shard.get_tensor(f"{index}/crop_top_left"),
            "target_size": shard.get_tensor(f"{index}/target_size"),
        }


def launcher_command(cache_args: list[str], num_gpus: int | None, hostfile: Path | None) -> list[str]:
    """`deepspeed ... --module sdzero.cli cache ARGS`: every rank (on every host) builds its share."""
    from sdzero.launch import deepspeed_executable, free_port

    cmd = [deepspeed_executable()]
    if hostfile is not None:
        if not Path(hostfile).is_file():
            raise UserError(f"--hostfile {hostfile}: no such file")
        cmd += ["--hostfile", str(hostfile)]
    if num_gpus is not None:
        cmd += ["--num_gpus", str(num_gpus)]
    # --no_local_rank: the ranks read RANK/LOCAL_RANK from the environment, as the trainer does.
    return [*cmd, "--master_port", str(free_port()), "--no_local_rank", "--module", "sdzero.cli", "cache",
            *cache_args]  # fmt: skip
