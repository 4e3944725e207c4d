"""The input pipeline measured (sdzero.data.input_probe): one worker's items/s over the run's own dataset,
and the storage's bytes/s and files/s with several readers, over loose files and shard members alike."""

from __future__ import annotations

import time

import pytest
import torch

from sdzero.data.images import CaptionedImages, SampleSpec, read_metadata
from sdzero.data.input_probe import measure_input, measure_storage, measure_worker
from sdzero.data.shard_writer import write_shards
from sdzero.data.shards import read_records
from sdzero.models.step_input import StepInput
from sdzero.models.tiny import write_synthetic_dataset


@pytest.fixture(scope="module")
def loose(tmp_path_factory):
    return write_synthetic_dataset(tmp_path_factory.mktemp("probe") / "shapes", images=12, size=24)


def dataset_of(records):
    spec = SampleSpec(resolution=16, latent_shape=(4, 2, 2), num_train_timesteps=10, seed=0)
    return CaptionedImages(records, spec, lambda text: (torch.zeros(2, dtype=torch.long),))


def test_one_worker_process_delivers_the_runs_own_batches(loose):
    measured = measure_worker(dataset_of(read_metadata(loose)), 0, 2, StepInput.collate, seconds=0.0)
    # 12 images in batches of 2: the first uncounted, then the rest of the epoch (under the minimum)
    assert measured["batch_size"] == 2 and measured["samples"] == 10
    assert measured["samples_per_s"] > 0


class Sleepy:
    """Items of 20 ms, but one of 300 ms (another process took the core for it)."""

    def __len__(self):
        return 10

    def __getitem__(self, key):
        time.sleep(0.3 if key[0] == 2 else 0.02)
        return key[0]


def test_a_batch_slowed_by_another_process_does_not_set_the_rate():
    measured = measure_worker(Sleepy(), seed=0, collate=list, seconds=0.0)
    assert measured["samples"] == 6
    assert 30 < measured["samples_per_s"] <= 50  # 1 / 20 ms, not the mean with the 300 ms item


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
    section = measure_input(dataset_of(read_metadata(loose)), 0, 2, 4, collate=StepInput.collate)
    assert section["kind"] == "images" and section["storage"]["readers"] == 8
    assert (section["workers_per_rank"], section["local_ranks"]) == (2, 4) and section["cpu_count"] >= 1


def test_a_data_set_of_one_batch_still_gives_a_rate(loose):
    measured = measure_worker(dataset_of(read_metadata(loose)), 0, 12, StepInput.collate, seconds=0.0)
    assert measured["samples"] == 0 and measured["samples_per_s"] > 0
