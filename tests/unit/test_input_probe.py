"""The input pipeline measured (sdzero.data.input_probe): one worker's items/s over the run's own dataset,
and the storage's bytes/s and files/s with several readers, over loose files and shard members alike."""

from __future__ import annotations

import pytest
import torch

from sdzero.data.images import CaptionedImages, SampleSpec, read_metadata
from sdzero.data.input_probe import measure_input, measure_storage, measure_worker
from sdzero.data.shard_writer import write_shards
from sdzero.data.shards import read_records
from sdzero.models.tiny import write_synthetic_dataset


@pytest.fixture(scope="module")
def loose(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("probe") / "shapes", images=12, size=24)


class Counting(CaptionedImages):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0

    def __getitem__(self, key):
        self.calls += 1
        return super().__getitem__(key)


def dataset_of(records):
    spec = SampleSpec(resolution=16, latent_shape=(4, 2, 2), num_train_timesteps=10, seed=0)
    return Counting(records, spec, lambda text: (torch.zeros(2, dtype=torch.long),))


def test_one_worker_is_timed_over_the_datasets_own_items(loose):
    dataset = dataset_of(read_metadata(loose))
    measured = measure_worker(dataset, seed=0, seconds=0.0)
    assert measured["samples"] == 4 and dataset.calls == 5  # one uncounted first item, then the minimum
    assert measured["samples_per_s"] == pytest.approx(4 / measured["seconds"])
    everything = measure_worker(dataset_of(read_metadata(loose)), seed=0, seconds=60.0)
    assert everything["samples"] == 11  # stops at the epoch's end: every item but the uncounted one


@pytest.mark.parametrize("sharded", [False, True])
def test_the_storage_is_read_by_several_readers_byte_for_byte(loose, tmp_path, sharded):
    if sharded:
        write_shards(loose, tmp_path / "s", max_count=5)
        records = read_records(tmp_path / "s")
    else:
        records = read_metadata(loose)
    sizes = [p.stat().st_size for p in sorted(loose.glob("*.png"))]
    measured = measure_storage(records, readers=3, seconds=60.0)
    assert measured["files"] == 12 and measured["readers"] == 3
    assert measured["bytes_per_file"] == pytest.approx(sum(sizes) / 12)
    assert measured["bytes_per_s"] == pytest.approx(sum(sizes) / measured["seconds"])
    assert measure_storage([], readers=2) is None


def test_the_section_names_the_readers_a_node_runs(loose):
    section = measure_input(dataset_of(read_metadata(loose)), 0, workers_per_rank=2, local_ranks=4)
    assert section["kind"] == "images" and section["storage"]["readers"] == 8
    assert (section["workers_per_rank"], section["local_ranks"]) == (2, 4) and section["cpu_count"] >= 1
