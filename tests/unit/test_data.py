"""Metadata parsing, unreadable-image detection, per-sample determinism and the distributed sampler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from step_input_fakes import tensors_of

from sdzero.data.images import (
    CaptionedImages,
    EpochSampler,
    LateFailures,
    Record,
    SampleSpec,
    check_bad_fraction,
    find_unreadable,
    read_metadata,
)
from sdzero.errors import UserError


def make_folder(tmp_path: Path, n: int = 6) -> Path:
    folder = tmp_path / "imgs"
    folder.mkdir()
    rows = []
    for i in range(n):
        Image.new("RGB", (40 + i, 32), (10 * i, 100, 200)).save(folder / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "text": f"image {i}"})
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def corrupt(folder: Path) -> dict[str, str]:
    """Zero-byte, truncated, not-an-image and missing files, the ways real datasets go bad."""
    (folder / "0.png").write_bytes(b"")
    data = (folder / "1.png").read_bytes()
    (folder / "1.png").write_bytes(data[: len(data) // 2])
    (folder / "2.png").write_bytes(b"this is not a png at all")
    (folder / "3.png").unlink()
    return {"0.png": "zero-byte", "1.png": "truncated", "2.png": "garbage", "3.png": "missing"}


def test_metadata_formats(tmp_path):
    folder = make_folder(tmp_path)
    jsonl = read_metadata(folder)
    assert [r.text for r in jsonl] == [f"image {i}" for i in range(6)]
    (folder / "metadata.jsonl").unlink()
    (folder / "metadata.csv").write_text("file_name,text\n0.png,a red circle\n1.png,\n")
    assert [r.text for r in read_metadata(folder)] == ["a red circle", ""]


def test_metadata_errors(tmp_path):
    with pytest.raises(UserError, match="metadata.jsonl"):
        read_metadata(tmp_path)
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "caption": "x"}) + "\n")
    with pytest.raises(UserError, match="missing column"):
        read_metadata(tmp_path)
    (tmp_path / "metadata.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1: not valid JSON"):
        read_metadata(tmp_path)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_unreadable_images_are_found_by_shards(tmp_path, world):
    folder = make_folder(tmp_path)
    corrupt(folder)
    records = read_metadata(folder)
    bad = sorted(i for rank in range(world) for i in find_unreadable(records, rank, world))
    assert bad == [0, 1, 2, 3]


def test_mostly_bad_data_is_fatal_with_a_reason(tmp_path):
    check_bad_fraction(10, 5, 0.5, tmp_path)  # half is still allowed at 0.5
    with pytest.raises(UserError, match="6 of 10 images are unreadable"):
        check_bad_fraction(10, 6, 0.5, tmp_path)


def spec(**kw) -> SampleSpec:
    return SampleSpec(resolution=32, latent_shape=(4, 16, 16), num_train_timesteps=1000, seed=7, **kw)


def tokens(text: str) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([len(text)]),)


def test_samples_are_a_function_of_seed_epoch_and_index(tmp_path):
    folder = make_folder(tmp_path)
    ds = CaptionedImages(read_metadata(folder), spec(random_flip=True, random_crop=True), tokens)
    a, b = ds[(3, 0)], ds[(3, 0)]
    assert len(tensors_of(a)) == 10  # pixels, tokens, the draws, the indices and the sizes
    for key, value in tensors_of(a).items():
        assert torch.equal(value, tensors_of(b)[key]), key
    other_epoch = ds[(3, 1)]
    assert not torch.equal(a.noise, other_epoch.noise)
    assert a.pixel_values.shape == (3, 32, 32)
    assert a.noise.shape == a.latent_eps.shape == (4, 16, 16)
    assert float(a.pixel_values.min()) >= -1.0 and float(a.pixel_values.max()) <= 1.0
    assert 0 <= int(a.timestep) < 1000


def test_noise_offset_shifts_channel_means(tmp_path):
    folder = make_folder(tmp_path)
    records = read_metadata(folder)
    plain = CaptionedImages(records, spec(), tokens)[(0, 0)].noise
    offset = CaptionedImages(records, spec(noise_offset=0.5), tokens)[(0, 0)].noise
    delta = offset - plain
    # The same per-channel constant everywhere within a channel, differing between channels.
    assert torch.allclose(delta, delta[:, :1, :1].expand_as(delta))
    assert delta[:, 0, 0].abs().max() > 0


def test_image_that_breaks_after_the_check_is_skipped_not_swapped(tmp_path):
    folder = make_folder(tmp_path)
    records = read_metadata(folder)
    by_number = lambda text: (torch.tensor([int(text.split()[-1])]),)  # noqa: E731
    ds = CaptionedImages(records, spec(), by_number)
    expected = ds[(2, 0)]
    (folder / "1.png").write_bytes(b"")
    item = ds[(1, 0)]
    assert ds.late_failures == 1
    # Record 2 served whole: its caption with its image and its own noise, never image 2 under caption 1.
    assert int(item.index) == 2 and int(item.token_ids[0][0]) == 2
    assert all(
        torch.equal(getattr(item, k), getattr(expected, k)) for k in ("pixel_values", "noise", "timestep")
    )
    ds[(1, 1)]
    assert ds.late_failures == 1  # counted once, and not reopened on every later epoch


def test_file_names_must_stay_inside_the_data_folder(tmp_path):
    outside = tmp_path / "secret.png"
    Image.new("RGB", (8, 8)).save(outside)
    for k, name in enumerate((str(outside), "../secret.png", "sub/../../secret.png", "link.png")):
        (tmp_path / f"case{k}").mkdir()
        folder = make_folder(tmp_path / f"case{k}", n=1)
        (folder / "link.png").symlink_to(outside)
        (folder / "metadata.jsonl").write_text(json.dumps({"file_name": name, "text": "x"}) + "\n")
        with pytest.raises(UserError) as err:
            read_metadata(folder)
        message = str(err.value)
        assert f"row 1: file_name {name!r} points outside --data" in message and "\n" not in message
    (tmp_path / "ok").mkdir()
    inner = make_folder(tmp_path / "ok", n=1)
    (inner / "sub").mkdir()
    (inner / "sub" / "alias.png").symlink_to(inner / "0.png")  # a link that stays inside is fine
    (inner / "metadata.jsonl").write_text(json.dumps({"file_name": "sub/alias.png", "text": "x"}) + "\n")
    assert read_metadata(inner)[0].path == inner / "sub" / "alias.png"


def test_pixel_limit_is_its_own_setting(tmp_path, monkeypatch):
    import sdzero.data.images as data

    folder = make_folder(tmp_path, n=2)
    Image.new("RGB", (200, 100)).save(folder / "1.png")
    monkeypatch.setattr(data, "_max_image_pixels", data.DEFAULT_MAX_IMAGE_PIXELS)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    assert find_unreadable(read_metadata(folder), 0, 1) == []
    data.set_max_image_pixels(10_000)  # 200 x 100 = 20000 pixels: refused from the header
    assert find_unreadable(read_metadata(folder), 0, 1) == [1]
    assert Image.MAX_IMAGE_PIXELS == 10_000
    with pytest.raises(UserError, match="--max-image-pixels 0"):
        data.set_max_image_pixels(0)


def test_epoch_sampler_partitions_and_resumes():
    n, world = 21, 2
    samplers = [EpochSampler(n, rank, world, seed=3) for rank in range(world)]
    for s in samplers:
        s.set_epoch(4)
    shards = [list(s) for s in samplers]
    indices = [i for shard in shards for i, _ in shard]
    assert len(indices) == len(set(indices)) == 20  # drop_last: every rank gets 10, none repeats
    assert all(epoch == 4 for shard in shards for _, epoch in shard)
    samplers[0].set_epoch(4, start=12)  # 12 samples taken by the 2 ranks: 6 each
    assert list(samplers[0]) == shards[0][6:]
    samplers[0].set_epoch(5)
    assert list(samplers[0]) != shards[0]


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_epoch_sampler_resumed_on_another_world_size_neither_repeats_nor_skips(before, after):
    """The data position is in samples of the epoch's one global order: a run stopped after k samples on
    `before` ranks and continued on `after` ranks takes each sample of the epoch once, in that order."""
    n, seed, epoch = 23, 7, 2
    order = EpochSampler(n, 0, 1, seed=seed)
    order.set_epoch(epoch)
    full = [i for i, _ in order]  # the global order, as one rank sees it

    def take(world: int, start: int, count: int) -> list[int]:
        """`count` samples per rank from `start`, interleaved in global order (as a step takes them)."""
        per_rank = []
        for rank in range(world):
            s = EpochSampler(n, rank, world, seed=seed)
            s.set_epoch(epoch, start=start)
            per_rank.append([i for i, _ in s][:count])
        taken = min(len(p) for p in per_rank)  # drop_last: every rank the same number
        assert taken == max(len(p) for p in per_rank)
        return [per_rank[r][j] for j in range(taken) for r in range(world)]

    first = take(before, 0, 3)  # 3 micro-batches of 1 on every rank
    rest = take(after, len(first), 100)
    seen = first + rest
    assert len(seen) == len(set(seen))  # no sample twice
    assert seen == full[: len(seen)]  # none skipped: a prefix of the global order
    # Only what the batch shape cannot use is left out: the cut to a multiple of the world size, and the
    # remainder after the resume point.
    assert len(seen) >= n - 2 * (max(before, after) - 1)


def test_records_keep_paths_relative_to_the_folder(tmp_path):
    folder = make_folder(tmp_path, n=1)
    assert read_metadata(folder) == [Record(folder / "0.png", "image 0")]
    assert np.asarray(Image.open(read_metadata(folder)[0].path)).shape == (32, 40, 3)


def test_late_failures_in_dataloader_workers_count_toward_max_bad_fraction(tmp_path, process_group):
    """Images that break after the start-up check, met by two DataLoader workers (each keeps its own
    count, which never reaches the rank): the rank counts each once, from the batches, and at the epoch's
    end the run stops in one line once they exceed --max-bad-fraction."""
    from torch.utils.data import DataLoader

    from sdzero.data.feed import Batches
    from sdzero.models.step_input import StepInput

    folder = make_folder(tmp_path, n=12)
    records = read_metadata(folder)
    for i in (3, 4, 9):  # readable at the start-up check, broken by the time a worker opens them
        (folder / f"{i}.png").write_bytes(b"")

    def epoch(max_bad_fraction: float) -> tuple[Batches, LateFailures]:
        sampler = EpochSampler(len(records), 0, 1, seed=1)
        loader = DataLoader(
            CaptionedImages(records, spec(), tokens),
            batch_size=2,
            sampler=sampler,
            num_workers=2,
            collate_fn=StepInput.collate,  # as build_data's loader
        )
        late = LateFailures(len(records), 1, max_bad_fraction, folder)  # 1 more failed at start-up
        batches = Batches(loader, sampler, late=late)
        for _ in range(6):  # the whole epoch: 12 records, 2 per micro-batch
            batches.next()
        return batches, late

    batches, late = epoch(0.5)
    assert late.mine == {3, 4, 9}  # counted once each, whichever worker met them (and however often)
    assert batches.check_late() == 3
    with pytest.raises(UserError) as err:
        batches, _ = epoch(0.3)  # (1 + 3) / 13 > 30%
        batches.next()  # the next epoch starts: every rank checks together at the boundary
    message = str(err.value)
    assert "4 of 13 images are unreadable (3 of them failed during training" in message
    assert "--max-bad-fraction" in message and "\n" not in message


def test_bucket_sampler_resumed_on_another_world_size_with_the_same_global_batch():
    """--buckets: 2 ranks x micro 2 x accumulation 1, stopped after 3 steps, continued on 1 rank x micro 2
    x accumulation 2 (the same global batch of 4): every step trains on the samples the uninterrupted
    2-rank run would have, none repeated or skipped."""
    from sdzero.data.buckets import BucketBatchSampler

    bucket_of = [i % 3 for i in range(40)]

    def steps(micro: int, accum: int, world: int, start: int) -> list[set[int]]:
        per_rank = []
        for rank in range(world):
            s = BucketBatchSampler(bucket_of, 3, micro, accum, rank, world, seed=3)
            s.set_epoch(1, start=start)
            per_rank.append([[i for i, _ in batch] for batch in s])
        n_steps = len(per_rank[0]) // accum
        return [
            {i for r in per_rank for batch in r[k * accum : (k + 1) * accum] for i in batch}
            for k in range(n_steps)
        ]

    uninterrupted = steps(2, 1, 2, 0)
    resumed = steps(2, 1, 2, 0)[:3] + steps(2, 2, 1, start=3 * 4)
    assert resumed == uninterrupted and len(uninterrupted) > 4
    with pytest.raises(UserError, match="not a whole number"):
        steps(4, 1, 1, start=6)  # inside a micro-batch round: another global batch's position
