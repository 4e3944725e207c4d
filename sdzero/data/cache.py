"""On-disk latent and text-embedding caches: encode once with the frozen VAE and text encoders, then train
without loading them.

Layout of a cache folder (no pickle anywhere):

    build.json                  what the cache is being built for (written first; a resume must match it)
    shard-00000.safetensors     the samples of positions [first, first + count): per sample the VAE
    shard-00001.safetensors     posterior mean and std (and those of the mirrored image with --flip both),
    ...                         every text embedding the family's `encode_prompts` returns, and SDXL's
                                original_size / crop_top_left / target_size
    cache.json                  the index: what made it, every sample's file name, shard and size, every
                                shard's byte count and sha256; written last, so its presence means the
                                build is complete

The posterior mean and std are stored, not one latent sample, so that every epoch still draws its own
posterior sample from the sample's `latent_eps`, exactly as online encoding does. Shards are written
under a temporary name and renamed: a killed build leaves only complete shards, and rerunning the same
command skips them. The index is trusted only as far as it is proven: a run checks every shard's size
against it, and its sha256 too when the whole cache is at most FULL_CHECK_MAX_BYTES (`shard_problems`).
This module holds what both sides share and the training side; the build is in
sdzero.data.cache_build.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from sdzero.config.data_source import data_root, is_shard_source, shard_paths
from sdzero.config.user_file import read_user_bytes
from sdzero.data.buckets import bucket_sizes
from sdzero.data.images import (
    Record,
    SampleSpec,
    draw_noise,
    sample_generator,
)
from sdzero.data.shards import read_records
from sdzero.errors import UserError
from sdzero.models.families import FAMILIES, detect_family
from sdzero.models.step_input import LatentPosterior, PromptEmbeds, StepInput

log = logging.getLogger("sdzero.data.cache")

CACHE_FORMAT = 1
INDEX_NAME = "cache.json"
BUILD_NAME = "build.json"
FLIP_POLICIES = ("none", "both")
# The trained networks' folders (unet, transformer), not part of the cache's fingerprint: the cache never
# uses them. Registry order; run_identity.model_fingerprint hashes them in this order.
TRAINED_NETS = tuple(dict.fromkeys(family.subfolder for family in FAMILIES))
SKIPPED_PARTS = (*TRAINED_NETS, "scheduler")
FULL_CHECK_MAX_BYTES = 1 << 30
"""Caches up to this size have every shard's sha256 checked when a run opens them: one sequential read of
the cache per rank before training. Above it a run checks sizes only (a stat per shard: this catches
truncation, not a flipped byte), and rerunning `sdzero cache` on the folder checks every sha256."""


# ---------------------------------------------------------------------------------------------------
# What made a cache


def _model_file(model: str, relpath: str) -> Path:
    local = Path(model) / relpath
    if Path(model).is_dir():
        return local
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(model, relpath))


def _read_json(model: str, relpath: str) -> dict[str, Any]:
    """A config file of the model as a JSON object, or one UserError (a list, bytes that are not UTF-8 or
    broken JSON would otherwise surface as an AttributeError or UnicodeDecodeError traceback)."""
    try:
        raw = json.loads(read_user_bytes(_model_file(model, relpath), f"--model {model}:").decode("utf-8"))
    except (
        OSError,
        ValueError,
        RecursionError,
    ) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise UserError(
            f"--model {model}: cannot read {relpath} ({first}); pass a diffusers pipeline folder"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(
            f"--model {model}: {relpath} is a JSON {type(raw).__name__}, not an object; pass a diffusers "
            "pipeline folder (for example one written by `sdzero tiny-model`)"
        )
    return raw


def check_model_index(model: str) -> None:
    """A local model folder's model_index.json is a JSON object (what every reader of it assumes)."""
    if Path(model).is_dir():
        _read_json(model, "model_index.json")


@dataclass(frozen=True)
class NetGeometry:
    """What the cache and buckets need to know about the model, read from its config files alone."""

    native_resolution: int
    vae_scale_factor: int
    granularity: int
    """Sides of a training image must be multiples of this: VAE downsampling x the net's own (UNet levels or
    transformer patch)."""
    max_side: int | None = None
    """Longest side in pixels the net accepts (SD3: its position-embedding grid), None: no limit."""


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
    grid = net_cfg.get("pos_embed_max_size")  # in patches; SD3's transformer refuses larger latents
    max_side = int(grid) * vae_factor * net_factor if grid else None
    return NetGeometry(
        int(net_cfg["sample_size"]) * vae_factor, vae_factor, vae_factor * net_factor, max_side
    )


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
    """[file name, size, mtime_ns] of every listed image and of the metadata file itself; of every shard
    for tar shards (a shard's captions are in the fingerprint's captions)."""
    if is_shard_source(data):
        root = data_root(data)
        return [
            [p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns]
            for p in shard_paths(data)
        ]
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


def rows_fingerprint(rows: list[list[Any]], records: list[Record]) -> str:
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

    COMPARED = (
        "family",
        "model_fingerprint",
        "resolution",
        "buckets",
        "dtype",
        "data_fingerprint",
        "text_tokens",
        "crop",
    )

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
    check_model_index(model)  # before detect_family, which assumes an object
    family = detect_family(model)
    geometry = net_geometry(model)
    res = resolution or geometry.native_resolution
    sizes = (
        [list(s) for s in bucket_sizes(res, geometry.granularity, max_side=geometry.max_side)]
        if buckets
        else None
    )
    records = read_records(data)
    rows = data_files(Path(data), records)
    spec = CacheSpec(
        family=family.name,
        model_fingerprint=model_fingerprint(model),
        resolution=res,
        buckets=sizes,
        flip=flip,
        dtype=dtype,
        data_fingerprint=rows_fingerprint(rows, records),
        text_tokens=family.text_tokens(max_sequence_length),
        model=str(model),
        data=str(Path(data).resolve()),
    )
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
        parts = [
            f"{len(x)} {what} (e.g. {', '.join(x[:3])})"
            for x, what in ((changed, "changed"), (added, "added"), (removed, "removed"))
            if x
        ]
        out.append(f"data {cache.data} vs {run.data}: " + ("; ".join(parts) or "captions differ"))
    return out


def spec_from(obj: dict[str, Any]) -> CacheSpec:
    names = {f.name for f in fields(CacheSpec)}
    return CacheSpec(**{k: v for k, v in obj.items() if k in names})


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def shard_problems(folder: Path, raw: dict[str, Any], full: bool) -> list[str]:
    """One phrase per shard of the index that is not what the build committed: missing, another size
    (truncated or appended to), or, with `full`, content that does not match its recorded sha256. An index
    written before sha256 sums were recorded gets the size check only."""
    problems = []
    for k, entry in enumerate(raw["shards"]):
        path = Path(folder) / shard_name(k)
        try:
            size = path.stat().st_size
            if size != entry["bytes"]:
                problems.append(f"{path} has {size} bytes, {INDEX_NAME} says {entry['bytes']} (truncated?)")
            elif full and "sha256" in entry and file_sha256(path) != entry["sha256"]:
                problems.append(f"{path} does not match its sha256 in {INDEX_NAME} (corrupted)")
        except FileNotFoundError:
            problems.append(f"{path} is missing")
    return problems


def cache_bytes(raw: dict[str, Any]) -> int:
    return sum(int(entry["bytes"]) for entry in raw["shards"])


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


def read_index(index_path: Path) -> dict[str, Any]:
    """The parsed cache.json, or one UserError saying it is damaged and how to get a good one."""
    rebuild = f"rebuild the cache (`sdzero cache ... --out {index_path.parent}` into a new folder)"
    try:
        raw = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{index_path} is damaged ({exc}); {rebuild}") from None
    if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise UserError(f"{index_path}: cache format {found} is not {CACHE_FORMAT}; {rebuild}")
    lists = all(isinstance(raw.get(k), list) for k in ("samples", "data_files", "shards"))
    if not isinstance(raw.get("spec"), dict) or not lists:
        raise UserError(f"{index_path} is damaged (spec, samples, shards or data_files missing); {rebuild}")
    try:
        spec_from(raw["spec"])
        for sample in raw["samples"]:
            [int(x) for x in sample["size"]]
    except (TypeError, KeyError, ValueError) as exc:
        raise UserError(f"{index_path} is damaged (a malformed entry: {exc!r}); {rebuild}") from None
    wrong = _bad_shard_entry(raw)
    if wrong:
        raise UserError(f"{index_path} is damaged ({wrong}); {rebuild}")
    return raw


def read_build_record(out: Path) -> dict[str, Any] | None:
    """The build.json of an interrupted build in `out` (None when there is none), checked to be what
    `sdzero cache` writes: a JSON object with a spec object and a data_files list. Anything else is one
    line, where json.loads and a KeyError once printed tracebacks."""
    path = Path(out) / BUILD_NAME
    if not os.path.lexists(path):
        return None
    fix = f"remove {path} (or the whole folder) and rerun `sdzero cache`"
    try:
        raw = json.loads(read_user_bytes(path, "--out").decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{path} is not JSON written by `sdzero cache` ({str(exc)[:120]}); {fix}") from None
    if not (
        isinstance(raw, dict)
        and isinstance(raw.get("spec"), dict)
        and isinstance(raw.get("data_files"), list)
    ):
        raise UserError(f"{path} is damaged (not an object with spec and data_files); {fix}")
    try:
        spec_from(raw["spec"])
    except (TypeError, KeyError, ValueError) as exc:
        raise UserError(f"{path} is damaged (a malformed spec: {exc!r}); {fix}") from None
    return raw


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad_shard_entry(raw: dict[str, Any]) -> str | None:
    """What is wrong with the index's shard list or a sample's shard number, as a phrase; None if nothing.
    Checked here so that a hand-edited index fails before launch, not as an IndexError in a worker."""
    for k, entry in enumerate(raw["shards"]):
        if (
            not isinstance(entry, dict)
            or entry.get("file") != shard_name(k)
            or not _is_count(entry.get("bytes"))
        ):
            return f"shard entry {k} is not {{'file': {shard_name(k)!r}, 'bytes': <count>, ...}}"
        if "sha256" in entry and not (isinstance(entry["sha256"], str) and len(entry["sha256"]) == 64):
            return f"shard entry {k} has a malformed sha256"
    n = len(raw["shards"])
    for i, sample in enumerate(raw["samples"]):
        shard = sample.get("shard")
        if not _is_count(shard) or shard >= n:
            return f"sample {i} names shard {shard!r}; the index lists {n} shard(s)"
    return None


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
        raise UserError(
            f"--cache-dir {cache_dir}: no {INDEX_NAME}{partial}; build one with `sdzero cache --model "
            f"{model} --data {data} --out {cache_dir}`"
        )
    raw = read_index(index_path)
    cached = spec_from(raw["spec"])
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
    problems = shard_problems(cache_dir, raw, full=cache_bytes(raw) <= FULL_CHECK_MAX_BYTES)
    if problems:
        more = f" (and {len(problems) - 1} more damaged shard(s))" if len(problems) > 1 else ""
        raise UserError(
            f"--cache-dir {cache_dir}: {problems[0]}{more}; rerun the `sdzero cache ... --out {cache_dir}` "
            "command that built it (same options): it checks every shard and rebuilds the damaged ones"
        )
    return CacheIndex(cache_dir, cached, raw)


class CachedSamples(Dataset):
    """Cached StepInputs: like `CaptionedImages`' but with the posterior mean/std and text embeddings in
    place of pixels and tokens. The per-sample generator makes the same draws in the same order (flip, then
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

    def __getitem__(self, key: tuple[int, int]) -> StepInput:
        """One sample (no batch dimension); the DataLoader joins them with StepInput.collate."""
        index, epoch = key
        rng = sample_generator(self.spec.seed, epoch, index)
        flip = self.spec.random_flip and rng.random() < 0.5
        shard = self._shard(self.cache.raw["samples"][index]["shard"])
        view = f"{index}/flip/" if flip else f"{index}/"
        mean, std = shard.get_tensor(view + "mean"), shard.get_tensor(view + "std")
        drawn = draw_noise(rng, self.spec, tuple(mean.shape))
        # The embeddings under the names the build stored (PromptEmbeds' field names: cache_build).
        cond = {k: shard.get_tensor(f"{index}/cond/{k}") for k in self.cache.raw["cond_keys"]}
        return StepInput(
            noise=drawn.noise,
            latent_eps=drawn.latent_eps,
            timestep=drawn.timestep,
            flow_u=drawn.flow_u,
            index=torch.tensor(index, dtype=torch.long),
            original_size=shard.get_tensor(f"{index}/original_size"),
            crop_top_left=shard.get_tensor(f"{index}/crop_top_left"),
            target_size=shard.get_tensor(f"{index}/target_size"),
            posterior=LatentPosterior(mean, std),
            prompt_embeds=PromptEmbeds(**cond),
        )
