"""Tar shards as --data (img2dataset's layout): the index, the remembered index, damaged members, and the
sampling properties over real DataLoader worker processes: 2 ranks x 2 workers see every sample once per
epoch, a resume mid-epoch continues exactly at the same world size, and at another one loses or repeats
nothing."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from typer.testing import CliRunner

from sdzero.config.data_source import data_root, is_shard_source, shard_paths
from sdzero.data import shards
from sdzero.data.feed import Batches
from sdzero.data.images import CaptionedImages, EpochSampler, SampleSpec, read_metadata
from sdzero.data.listing import check_images
from sdzero.data.shard_writer import write_shards
from sdzero.data.shards import read_records
from sdzero.errors import UserError
from sdzero.models.step_input import StepInput
from sdzero.models.tiny import write_synthetic_dataset

N_IMAGES = 30


class OneRank:
    """The listing's collectives for a single process."""

    rank, world = 0, 1

    def broadcast(self, obj):
        return obj

    def gather(self, obj):
        return [obj]


@pytest.fixture(scope="module")
def loose(tmp_path_factory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("loose") / "shapes", images=N_IMAGES, size=24)


@pytest.fixture(scope="module")
def shard_dir(loose, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded") / "shards"
    summary = write_shards(loose, out, max_count=8)
    assert (summary.samples, summary.shards) == (N_IMAGES, 4)
    return out


def png_bytes(color: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 16), color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_damaged_shard(path: Path) -> None:
    """A shard with two good samples, an undecodable image, an image without caption, and a caption
    without image (img2dataset's layout, written with webdataset's own TarWriter)."""
    from webdataset import TarWriter

    with TarWriter(str(path)) as sink:
        sink.write({"__key__": "good0", "png": png_bytes((255, 0, 0)), "txt": b"a red square"})
        sink.write({"__key__": "good1", "png": png_bytes((0, 0, 255)), "json": b'{"caption": "blue"}'})
        sink.write({"__key__": "broken", "jpg": b"\xff\xd8 not a jpeg", "txt": b"broken"})
        sink.write({"__key__": "nocaption", "png": png_bytes((0, 255, 0))})
        sink.write({"__key__": "noimage", "txt": b"lonely caption"})


def test_shards_hold_the_folders_samples_by_pattern_and_by_folder(loose, shard_dir):
    pattern = f"{shard_dir}/{{000000..000003}}.tar"
    assert is_shard_source(pattern) and is_shard_source(shard_dir) and not is_shard_source(loose)
    by_pattern, by_folder = read_records(pattern), read_records(shard_dir)
    assert [r.text for r in by_pattern] == [r.text for r in read_metadata(loose)]
    assert [(r.path, r.member) for r in by_pattern] == [(r.path, r.member) for r in by_folder]
    assert data_root(pattern) == shard_dir.absolute()
    # every member's bytes are the loose image's bytes, read at the indexed offset
    for shard_record, loose_record in zip(by_pattern, read_metadata(loose), strict=True):
        assert shard_record.image_source().getvalue() == loose_record.path.read_bytes()
        assert shard_record.problem is None


def test_a_missing_shard_or_bad_pattern_is_one_line(shard_dir, tmp_path):
    with pytest.raises(UserError, match=r"6 of 10 shards do not exist \(first: .*000004\.tar\)"):
        shard_paths(f"{shard_dir}/{{000000..000009}}.tar")
    (tmp_path / "x.tar").write_bytes(b"not a tar at all" * 64)
    with pytest.raises(UserError, match="cannot be read as a tar file"):
        read_records(tmp_path / "x.tar")


def test_the_index_is_remembered_until_a_shard_changes(loose, tmp_path, monkeypatch):
    out = tmp_path / "s"
    write_shards(loose, out, max_count=16)
    first = read_records(out)
    calls: list[Path] = []
    real = shards.index_shard
    monkeypatch.setattr(shards, "index_shard", lambda p: calls.append(p) or real(p))
    assert read_records(out) == first and calls == []
    changed = out / "000001.tar"
    changed.write_bytes(changed.read_bytes())  # same bytes, new mtime: read again, alone
    os.utime(changed, ns=(1, 1))
    assert read_records(out) == first and calls == [changed.absolute()]


def test_damaged_members_are_skipped_and_counted(tmp_path):
    shard = tmp_path / "damaged.tar"
    write_damaged_shard(shard)
    records = read_records(shard)
    assert [r.member[0] for r in records] == ["good0", "good1", "broken", "nocaption", "noimage"]
    assert records[1].text == "blue"
    checked = check_images(records, shard, OneRank(), max_bad_fraction=0.9)
    assert checked.bad == [2, 3, 4]
    assert checked.sizes[:2] == [(16, 20), (16, 20)]
    with pytest.raises(UserError, match="3 of 5 images are unreadable"):
        check_images(records, shard, OneRank(), max_bad_fraction=0.5)


def dataset_over(data: Path | str) -> CaptionedImages:
    spec = SampleSpec(resolution=16, latent_shape=(4, 2, 2), num_train_timesteps=10, seed=3)
    return CaptionedImages(read_records(data), spec, lambda text: (torch.zeros(2, dtype=torch.long),))


def loader_for(
    dataset: CaptionedImages, rank: int, world: int, micro: int = 2
) -> tuple[DataLoader, EpochSampler]:
    sampler = EpochSampler(len(dataset), rank, world, seed=7)
    loader = DataLoader(
        dataset,
        batch_size=micro,
        sampler=sampler,
        drop_last=True,
        num_workers=2,
        collate_fn=StepInput.collate,
    )
    return loader, sampler


def take(batches: Batches, steps: int) -> list[int]:
    return [i for _ in range(steps) for i in batches.next().index.tolist()]


def test_two_ranks_by_two_workers_see_every_sample_once_per_epoch(shard_dir):
    dataset = dataset_over(shard_dir)
    for epoch in (0, 1):
        seen: list[int] = []
        orders = []
        for rank in (0, 1):
            loader, sampler = loader_for(dataset, rank, 2, micro=3)
            sampler.set_epoch(epoch)
            orders.append(sampler.global_order())
            seen += [i for batch in loader for i in batch.index.tolist()]
        assert sorted(seen) == list(range(N_IMAGES)), epoch  # 30 = 2 ranks x 3 micro x 5 steps
        assert orders[0] == orders[1]
    loader, sampler = loader_for(dataset, 0, 2)
    sampler.set_epoch(0)
    first = sampler.global_order()
    sampler.set_epoch(1)
    assert sampler.global_order() != first  # the order follows (seed, epoch)


def test_resume_mid_epoch_is_exact_at_the_same_world_size_and_elastic_at_another(shard_dir):
    dataset = dataset_over(shard_dir)
    whole = {r: take(Batches(*loader_for(dataset, r, 2)), 7) for r in (0, 1)}
    assert sorted(whole[0] + whole[1]) == sorted(set(whole[0] + whole[1]))
    # interrupted after 3 steps (samples_in_epoch = 3 steps x 2 micro x 2 ranks), resumed on 2 ranks
    for r in (0, 1):
        loader, sampler = loader_for(dataset, r, 2)
        assert take(Batches(loader, sampler, samples_in_epoch=12), 4) == whole[r][6:]
    # resumed on 3 ranks instead: every sample not yet seen, once, and none of those seen
    before = {i for r in (0, 1) for i in whole[r][:6]}
    after: list[int] = []
    for r in (0, 1, 2):
        loader, sampler = loader_for(dataset, r, 3)
        batches = Batches(loader, sampler, samples_in_epoch=12)
        after += take(batches, len(sampler) // 2)
    assert not before & set(after) and len(after) == len(set(after))
    assert len(before) + len(after) == N_IMAGES  # 12 seen + 18 = 3 ranks x 2 micro x 3 steps: none lost


def test_a_member_that_breaks_after_the_check_is_skipped_in_the_worker(tmp_path):
    shard = tmp_path / "s.tar"
    write_damaged_shard(shard)
    records = read_records(shard)[:2]
    spec = SampleSpec(resolution=16, latent_shape=(4, 2, 2), num_train_timesteps=10, seed=3)
    dataset = CaptionedImages(records, spec, lambda text: (torch.zeros(2, dtype=torch.long),))
    broken = records[0].__class__(records[0].path, "x", ("good0", records[0].member[1] + 3, 40))
    dataset.records = [broken, records[1]]
    item = dataset[(0, 0)]
    assert int(item.index) == 1 and int(item.requested) == 0 and dataset.late_failures == 1


def test_sdzero_shard_command_writes_shards_and_refuses_an_existing_folder(loose, tmp_path):
    from advisor.cli import app

    out = tmp_path / "made"
    done = CliRunner().invoke(app, ["shard", str(loose), str(out), "--max-count", "10"])
    assert done.exit_code == 0, done.output
    assert "wrote 30 samples in 3 shards" in done.output
    assert sorted(p.name for p in out.iterdir()) == ["000000.tar", "000001.tar", "000002.tar"]
    with tarfile.open(out / "000000.tar") as tar:
        names = sorted(tar.getnames())[:3]
        meta = json.load(tar.extractfile("000000000.json"))
    assert names == ["000000000.json", "000000000.png", "000000000.txt"]
    assert meta == {"caption": read_records(out)[0].text, "file_name": read_metadata(loose)[0].path.name}
    again = CliRunner().invoke(app, ["shard", str(loose), str(out)])
    assert again.exit_code == 2 and "already exists" in again.output


def test_the_shared_storage_check_fingerprints_shards_without_reading_them(loose, tmp_path):
    from sdzero.cluster.shared_storage import listing_fingerprint

    out = tmp_path / "s"
    write_shards(loose, out, max_count=16)
    pattern = f"{out}/{{000000..000001}}.tar"
    assert listing_fingerprint(pattern) == listing_fingerprint(out)  # the same shards, either way named
    before = listing_fingerprint(pattern)
    with open(out / "000001.tar", "ab") as f:
        f.write(b"\0" * 512)  # a node with a different copy of a shard
    assert listing_fingerprint(pattern) != before
