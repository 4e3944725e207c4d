"""Captioned image folders: metadata, a sharded check for unreadable files, and per-sample determinism.

Every random choice for a sample (crop, flip, noise, timestep, SD3's flow draw) comes from a generator
seeded by (seed, epoch, sample index). A sample therefore gets the same noise whatever the world size,
micro-batch, ZeRO stage, worker count or resume point, which is what makes runs comparable and resumes
exact. The worker only produces tensors (a sample's `StepInput`, joined into micro-batches by
`StepInput.collate`); the family encodes them and forms the loss (sdzero.models.families).
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset, DistributedSampler, Sampler

from sdzero.config.user_file import check_regular_file
from sdzero.errors import AgreedError, UserError
from sdzero.models.objectives import FlowSettings
from sdzero.models.step_input import StepInput

log = logging.getLogger("sdzero.data.images")

METADATA_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
IMAGE_ERRORS = (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError, SyntaxError)
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
"""Larger images are refused as unreadable before they are decoded (a decompression bomb: a small PNG
that inflates to gigabytes). Set with --max-image-pixels; PIL's own guard is set to the same figure."""
_max_image_pixels = DEFAULT_MAX_IMAGE_PIXELS


def set_max_image_pixels(pixels: int) -> None:
    """The limit `open_rgb` enforces in this process and in DataLoader workers forked after this call."""
    global _max_image_pixels
    if pixels < 1:
        raise UserError(f"--max-image-pixels {pixels}: must be at least 1 (width x height)")
    _max_image_pixels = int(pixels)


def max_image_pixels() -> int:
    """The pixel limit in force in this process (--max-image-pixels)."""
    return _max_image_pixels


_open_shards: dict[tuple[int, str], int] = {}
"""Descriptors of the shards this process has read, keyed by (pid, path): a DataLoader worker forked with
its parent's table opens its own (pread needs no shared offset, but a forked descriptor is the parent's)."""


def read_member(path: Path, offset: int, size: int) -> bytes:
    """One member's bytes: a single positioned read from a descriptor kept open per process."""
    key = (os.getpid(), str(path))
    fd = _open_shards.get(key)
    if fd is None:
        fd = _open_shards[key] = os.open(path, os.O_RDONLY)
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise OSError(f"{path}: member at byte {offset} cut short ({len(data)} of {size} bytes)")
    return data


@dataclass(frozen=True)
class Record:
    path: Path
    """The image file, or the tar shard that holds the image (`member`)."""
    text: str
    member: tuple[str, int, int] | None = None
    """(sample key, byte offset, size) of the image inside the shard `path`; None for a loose file."""
    problem: str | None = None
    """Why a shard's sample cannot be trained on (no image or no caption member), found when indexing."""

    def image_source(self) -> Path | io.BytesIO:
        """What PIL opens: the file, or the member's bytes (one positioned read of the shard)."""
        if self.member is None:
            return self.path
        return io.BytesIO(read_member(self.path, self.member[1], self.member[2]))

    def size_bytes(self) -> int:
        return self.path.stat().st_size if self.member is None else self.member[2]

    def name_in(self, root: Path) -> str:
        """The record's name relative to the data root: `dir/a.jpg`, or `shard.tar#key` for a member."""
        name = self.path.relative_to(root).as_posix()
        return name if self.member is None else f"{name}#{self.member[0]}"

    @property
    def label(self) -> str:
        """How a log line names the image."""
        return str(self.path) if self.member is None else f"{self.path}#{self.member[0]}"


def read_metadata(folder: Path) -> list[Record]:
    """Records from the folder's metadata file; `file_name` is relative to the folder."""
    folder = Path(folder)
    for name in METADATA_NAMES:
        meta = folder / name
        if os.path.lexists(meta):
            # a FIFO, a device node or a link to one is named as what it is, never "no metadata file"
            check_regular_file(meta, "--data")
            break
    else:
        raise UserError(
            f"--data {folder}: no {' / '.join(METADATA_NAMES)}; write one line per image with "
            '"file_name" and "text" (see `sdzero synth-data` for an example)'
        )
    try:
        if meta.suffix == ".jsonl":
            table = read_jsonl(meta)
        elif meta.suffix == ".csv":
            table = pd.read_csv(meta, dtype=str, keep_default_na=False)
        else:
            table = pd.read_parquet(meta)
    except (ValueError, OSError, ImportError) as exc:
        raise UserError(f"{meta}: cannot be parsed ({exc}); fix or regenerate the metadata file") from exc
    missing = {"file_name", "text"} - set(table.columns)
    if missing:
        raise UserError(
            f"{meta}: missing column(s) {', '.join(sorted(missing))}; each row needs file_name and text"
        )
    if table.empty:
        raise UserError(f"{meta}: lists no images")
    return [
        Record(inside(folder, meta, row, str(f)), "" if pd.isna(t) else str(t))
        for row, (f, t) in enumerate(zip(table.file_name, table.text, strict=True), start=1)
    ]


def read_jsonl(meta: Path) -> pd.DataFrame:
    """The JSONL metadata as a table, each line checked to be one JSON object: pandas reports a line that
    is an array or a number only as "dictionary update sequence element #0 has length 5", with no line."""
    rows = []
    with open(meta, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"{meta} line {number}: not valid JSON ({exc.msg}); fix or remove that line"
                ) from None
            if not isinstance(row, dict):
                raise UserError(
                    f"{meta} line {number}: a JSON {type(row).__name__}, not an object; each line must be "
                    '{"file_name": ..., "text": ...}'
                )
            rows.append(row)
    return pd.DataFrame.from_records(rows) if rows else pd.DataFrame(columns=["file_name", "text"])


def inside(folder: Path, meta: Path, row: int, name: str) -> Path:
    """`folder/name`, refused unless it stays inside `folder` once symlinks are followed: a metadata file
    from elsewhere must not make the trainer (or a cache build) read /etc/passwd or another user's files."""
    if "\0" in name:  # no file has one; the path calls below would raise a ValueError traceback
        raise UserError(f"{meta} row {row}: file_name {name!r} holds a NUL character; fix that row")
    path = folder / name
    if Path(name).is_absolute() or not path.resolve().is_relative_to(folder.resolve()):
        raise UserError(
            f"{meta} row {row}: file_name {name!r} points outside --data {folder}; file names must be "
            "relative paths inside the data folder (no absolute paths, '..' or links out)"
        )
    return path


def open_rgb(path: Path | io.BytesIO) -> Image.Image:
    """Decode fully (truncated files fail here, not later in a worker) and convert to RGB; an image over
    the pixel limit is refused from its header, before anything is decoded."""
    Image.MAX_IMAGE_PIXELS = _max_image_pixels  # PIL's own check at open (it errors at twice the figure)
    with Image.open(path) as img:
        if img.width * img.height > _max_image_pixels:
            raise Image.DecompressionBombError(
                f"{img.width}x{img.height} pixels, over --max-image-pixels {_max_image_pixels}"
            )
        img.load()
        return img.convert("RGB")


def find_unreadable(records: list[Record], rank: int, world_size: int) -> list[int]:
    """Indices, among this rank's share (i % world == rank), of images that cannot be decoded: a full
    decode of each, every call. Start-up uses the remembered header check (sdzero.data.listing) instead."""
    bad = []
    for i in range(rank, len(records), world_size):
        try:
            if records[i].problem:
                raise OSError(records[i].problem)
            if records[i].size_bytes() == 0:
                raise OSError("zero-byte file")
            open_rgb(records[i].image_source())
        except IMAGE_ERRORS as exc:
            bad.append(i)
            warn_unreadable(len(bad), records[i].label, exc)
    warn_unlisted(len(bad))
    return bad


LISTED_UNREADABLE = 20
"""Unreadable images named one line each at start-up; the rest are a count (a million missing files once
printed a million lines before the one that said what to do)."""


def warn_unreadable(bad_so_far: int, path: Path | str, reason: object) -> None:
    """The warning for the `bad_so_far`-th unreadable image (1-based): the first LISTED_UNREADABLE by name."""
    if bad_so_far <= LISTED_UNREADABLE:
        log.warning("skipping unreadable image %s: %s", path, reason)


def warn_unlisted(n_bad: int) -> None:
    if n_bad > LISTED_UNREADABLE:
        log.warning(
            "... and %d more unreadable images, not listed (%d in all)", n_bad - LISTED_UNREADABLE, n_bad
        )


def check_bad_fraction(n_total: int, n_bad: int, max_bad_fraction: float, folder: Path) -> None:
    if n_bad and n_bad / n_total > max_bad_fraction:
        raise UserError(
            f"--data {folder}: {n_bad} of {n_total} images are unreadable (more than {max_bad_fraction:.0%}); "
            "check the folder (or raise --max-bad-fraction)"
        )


def sample_generator(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index])))


def resize_and_crop(
    img: Image.Image, size: int | tuple[int, int], rng: np.random.Generator, random_crop: bool
) -> tuple[Image.Image, tuple[int, int]]:
    """Resize to cover `size` (a square side, or (height, width) for an aspect-ratio bucket), then crop
    it out; also return the crop's (top, left), which SDXL's micro-conditioning takes as an input."""
    out_h, out_w = (size, size) if isinstance(size, int) else size
    w, h = img.size
    scale = max(out_w / w, out_h / h)
    new_w, new_h = max(out_w, round(w * scale)), max(out_h, round(h * scale))
    img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    if random_crop:
        left = int(rng.integers(0, new_w - out_w + 1))
        top = int(rng.integers(0, new_h - out_h + 1))
    else:
        left, top = (new_w - out_w) // 2, (new_h - out_h) // 2
    return img.crop((left, top, left + out_w, top + out_h)), (top, left)


@dataclass(frozen=True)
class SampleSpec:
    """What each sample needs besides its image: shapes and the noise recipe."""

    resolution: int
    latent_shape: tuple[int, int, int]
    num_train_timesteps: int
    seed: int
    random_flip: bool = False
    random_crop: bool = False
    noise_offset: float = 0.0
    flow: FlowSettings | None = None
    """SD3: each sample also draws `flow_u`, its place on the flow-matching schedule (the family says
    whether: Family.flow_settings)."""

    def latent_shape_for(self, size_hw: tuple[int, int]) -> tuple[int, int, int]:
        """The latent shape of a sample trained at (height, width) pixels (an aspect-ratio bucket)."""
        channels, side = self.latent_shape[0], self.latent_shape[1]
        return channels, size_hw[0] * side // self.resolution, size_hw[1] * side // self.resolution


def flow_u(flow: FlowSettings, generator: torch.Generator) -> float:
    """One sample's draw from the timestep density of `flow.weighting_scheme` (diffusers' own sampler),
    in [0, 1]; the sample's generator makes it a function of (seed, epoch, index). The objective maps it
    to a timestep and sigma (objectives.flow_timesteps)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        weighting_scheme=flow.weighting_scheme,
        batch_size=1,
        logit_mean=flow.logit_mean,
        logit_std=flow.logit_std,
        mode_scale=flow.mode_scale,
        generator=generator,
    )
    return float(u[0])


@dataclass(frozen=True)
class SampleDraws:
    """One sample's randomness besides its crop and flip (the StepInput fields of the same names)."""

    noise: torch.Tensor
    latent_eps: torch.Tensor
    timestep: torch.Tensor
    flow_u: torch.Tensor | None = None


def draw_noise(rng: np.random.Generator, spec: SampleSpec, latent_shape: tuple[int, int, int]) -> SampleDraws:
    """A sample's diffusion noise, VAE posterior draw and timestep, after its crop and flip draws.

    Online encoding and a latent cache both call this with the same generator state, so a sample gets
    the same noise either way (the cache equality test rests on it).
    """
    noise = rng.standard_normal(latent_shape, dtype=np.float32)
    if spec.noise_offset:
        # Offset noise (Guttenberg 2023): a per-channel constant lets the model shift mean brightness.
        offset = rng.standard_normal((latent_shape[0], 1, 1), dtype=np.float32)
        noise = noise + spec.noise_offset * offset
    latent_eps = rng.standard_normal(latent_shape, dtype=np.float32)  # VAE posterior sample
    timestep = int(rng.integers(0, spec.num_train_timesteps))
    u = None
    if spec.flow is not None:
        generator = torch.Generator().manual_seed(int(rng.integers(0, 2**63 - 1)))
        u = torch.tensor(flow_u(spec.flow, generator), dtype=torch.float32)
    return SampleDraws(
        noise=torch.from_numpy(noise),
        latent_eps=torch.from_numpy(latent_eps),
        timestep=torch.tensor(timestep, dtype=torch.long),
        flow_u=u,
    )


class CaptionedImages(Dataset):
    """Items are keyed by (sample index, epoch) so the per-sample randomness is reproducible."""

    def __init__(
        self,
        records: list[Record],
        spec: SampleSpec,
        tokenize: Callable[[str], tuple[torch.Tensor, ...]],
        sizes: list[tuple[int, int]] | None = None,
    ):
        # `tokenize` returns every token tensor the family's text encoders take, in encoder order.
        # `sizes`: each record's (height, width) aspect-ratio bucket; None trains every sample square.
        self.records = records
        self.spec = spec
        self.tokenize = tokenize
        self.sizes = sizes
        self.failed: set[int] = set()  # records found unreadable after the start-up check (see _load)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: tuple[int, int]) -> StepInput:
        """One sample (no batch dimension); the DataLoader joins them with StepInput.collate."""
        requested, epoch = key
        index, img = self._load(requested)
        rng = sample_generator(self.spec.seed, epoch, index)
        original_hw = (img.height, img.width)
        size_hw = self.sizes[index] if self.sizes else (self.spec.resolution, self.spec.resolution)
        img, crop_top_left = resize_and_crop(img, size_hw, rng, self.spec.random_crop)
        if self.spec.random_flip and rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)
        drawn = draw_noise(rng, self.spec, self.spec.latent_shape_for(size_hw))
        return StepInput(
            noise=drawn.noise,
            latent_eps=drawn.latent_eps,
            timestep=drawn.timestep,
            flow_u=drawn.flow_u,
            index=torch.tensor(index, dtype=torch.long),
            # What the sampler asked for: where it differs from `index`, the records between were found
            # unreadable in a DataLoader worker, whose own count never reaches the rank (LateFailures).
            requested=torch.tensor(requested, dtype=torch.long),
            # SDXL's size/crop micro-conditioning (add_time_ids); other families ignore them.
            original_size=torch.tensor(original_hw, dtype=torch.long),
            crop_top_left=torch.tensor(crop_top_left, dtype=torch.long),
            target_size=torch.tensor(size_hw, dtype=torch.long),
            pixel_values=pixels.contiguous(),
            token_ids=self.tokenize(self.records[index].text),
        )

    def _load(self, index: int) -> tuple[int, Image.Image]:
        """(the index of the sample served, its image). Files that passed the up-front check can still
        vanish or change on a shared filesystem: such a sample is skipped as the check would have skipped
        it, and the next readable record is served whole (its own image, caption, size and randomness;
        never another record's image under this caption), rather than kill a multi-node job over a file.
        """
        for attempt in range(len(self.records)):
            i = (index + attempt) % len(self.records)
            if i in self.failed:
                continue
            try:
                return i, open_rgb(self.records[i].image_source())
            except IMAGE_ERRORS as exc:
                self.failed.add(i)
                log.warning(
                    "skipping image %s: unreadable since the start-up check (%s); %d skipped so far in "
                    "this process",
                    self.records[i].label,
                    exc,
                    len(self.failed),
                )
        raise UserError("no readable image left in the dataset")

    @property
    def late_failures(self) -> int:
        """Images skipped after the start-up check, in this process (a worker's count stays there)."""
        return len(self.failed)


def skipped_for(requested: int, served: int, n: int) -> list[int]:
    """Records skipped to serve `served` for `requested`: the cyclic range between them (see _load)."""
    return [(requested + k) % n for k in range((served - requested) % n)]


class LateFailures:
    """Images that passed the start-up check but failed later, counted over every DataLoader worker of
    this rank (from each batch's requested/served indices: a worker's own count stays in the worker) and
    then over all ranks at `check`, a collective that every rank reaches at the same micro-batch (an epoch's
    end, the run's end). The run stops there with one line once the start-up and late failures together
    exceed --max-bad-fraction, as the start-up check alone would have stopped it."""

    def __init__(self, n_readable: int, n_bad_at_start: int, max_bad_fraction: float, folder: Path) -> None:
        self.n_readable, self.n_bad_at_start = n_readable, n_bad_at_start
        self.max_bad_fraction, self.folder = max_bad_fraction, folder
        self.mine: set[int] = set()
        self.all: set[int] = set()

    def note(self, batch: StepInput) -> None:
        if batch.cached or batch.requested is None:  # a cache's images were all decoded when it was built
            return
        pairs = zip(batch.requested.tolist(), batch.index.tolist(), strict=True)
        for requested, served in pairs:
            if requested != served:
                self.mine.update(skipped_for(requested, served, self.n_readable))

    def check(self) -> int:
        """Gather every rank's late failures; stop (UserError, on every rank alike) over the limit. A
        collective. Returns how many distinct images failed late on all ranks so far."""
        import torch.distributed as dist

        shares: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, sorted(self.mine))
        new = {i for share in shares for i in share} - self.all
        if new:
            self.all |= new
            log.warning("%d images failed after the start-up check so far (all ranks)", len(self.all))
        n_total = self.n_readable + self.n_bad_at_start
        n_bad = self.n_bad_at_start + len(self.all)
        if n_bad / n_total > self.max_bad_fraction:  # the same gathered figures on every rank
            raise AgreedError(
                f"--data {self.folder}: {n_bad} of {n_total} images are unreadable ({len(self.all)} of them "
                f"failed during training, after the start-up check; more than {self.max_bad_fraction:.0%}); "
                "check the folder (or raise --max-bad-fraction)"
            )
        return len(self.all)


class EpochSampler(Sampler):
    """`DistributedSampler`'s order, yielding (index, epoch) keys, that can start mid-epoch at a position
    counted in samples taken by all ranks together, so that a resume on another world size continues the
    same global order with no sample repeated or skipped.

    The epoch's global order is the seeded permutation DistributedSampler draws (identical for every world
    size), cut to a multiple of the world size (drop_last: every rank gets the same number of samples, so
    no rank waits on a collective forever). Rank r takes every world-th sample of what is left after
    `start`; with `start` 0 that is exactly DistributedSampler(drop_last=True).
    """

    def __init__(self, n: int, rank: int, world_size: int, seed: int, shuffle: bool = True):
        self.order_of = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        self.n, self.rank, self.world_size = n, rank, world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """`start`: samples of this epoch all ranks have already taken (a resume's data position)."""
        usable = self.n // self.world_size * self.world_size
        if not 0 <= start <= self.n:
            raise UserError(
                f"the checkpoint's data position ({start} samples into epoch {epoch}) is outside this "
                f"dataset of {self.n} samples; was the data changed?"
            )
        self.epoch, self.start = epoch, min(start, usable)
        self.order_of.set_epoch(epoch)

    def global_order(self) -> list[int]:
        """The epoch's sample order over all ranks (what the ranks take between them, in turn)."""
        return list(self.order_of)[: self.n // self.world_size * self.world_size]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        rest = self.global_order()[self.start :]
        usable = len(rest) // self.world_size * self.world_size
        for index in rest[self.rank : usable : self.world_size]:
            yield index, self.epoch

    def __len__(self) -> int:
        return (self.n // self.world_size * self.world_size - self.start) // self.world_size
