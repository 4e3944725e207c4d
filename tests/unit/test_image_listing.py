"""The image listing (issue 43): start-up checks images from their headers, once, and remembers them by
(path, size, mtime); `--buckets` takes sizes from that check rather than reading every header on every
rank; `sdzero cache` decodes in DataLoader workers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from sdzero.data import listing
from sdzero.data.images import read_metadata


@pytest.fixture(autouse=True)
def listing_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SDZERO_LISTING_DIR", str(tmp_path / "listings"))


@pytest.fixture
def pil_reads(monkeypatch):
    """Counts image files opened and images decoded, in this process."""
    seen = {"open": 0, "decode": 0}
    real_open, real_load = Image.open, Image.Image.load

    def counted_open(*a, **k):
        seen["open"] += 1
        return real_open(*a, **k)

    def counted_load(self, *a, **k):
        if getattr(self, "im", None) is None:  # a real decode, not an already-loaded image's no-op
            seen["decode"] += 1
        return real_load(self, *a, **k)

    monkeypatch.setattr(Image, "open", counted_open)
    monkeypatch.setattr(Image.Image, "load", counted_load)
    return seen


def make_folder(tmp_path: Path, n: int = 8) -> Path:
    folder = tmp_path / "imgs"
    folder.mkdir()
    rows = []
    for i in range(n):
        Image.new("RGB", (40 + 8 * i, 32), (10 * i, 100, 200)).save(folder / f"{i}.png")
        rows.append({"file_name": f"{i}.png", "text": f"image {i}"})
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder


def options(folder: Path, model: str = "unused", buckets: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        data=folder,
        model=model,
        max_image_pixels=8192 * 8192,
        max_bad_fraction=0.5,
        resolution=32,
        seed=1,
        random_flip=False,
        random_crop=False,
        noise_offset=0.0,
        buckets=buckets,
        num_workers=0,
    )


COMPS = SimpleNamespace(
    native_resolution=32,
    vae_scale_factor=8,
    latent_channels=4,
    noise_scheduler=SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000)),
    family=SimpleNamespace(flow_settings=lambda cfg: None),
)
DS = SimpleNamespace(micro_batch=2, grad_accum=1)


def start(cfg: SimpleNamespace):
    from sdzero.data.feed import build_data

    return build_data(cfg, DS, COMPS, 0, 1)


def test_start_up_reads_headers_once_and_a_restart_reads_no_image(tmp_path, pil_reads, process_group):
    folder = make_folder(tmp_path)
    (folder / "3.png").write_bytes(b"not an image")
    dataset, _, _, n_bad = start(options(folder))
    assert (len(dataset), n_bad) == (7, 1)
    assert pil_reads == {"open": 8, "decode": 0}  # each header once, no pixels decoded
    dataset, _, _, n_bad = start(options(folder))  # the next start: nothing changed
    assert (len(dataset), n_bad) == (7, 1)
    assert pil_reads == {"open": 8, "decode": 0}
    # a changed file (another size or mtime) is read again, and only it
    Image.new("RGB", (64, 32)).save(folder / "3.png")
    os.utime(folder / "3.png", ns=(1, 1))
    dataset, _, _, n_bad = start(options(folder))
    assert (len(dataset), n_bad) == (8, 0)
    assert pil_reads["open"] == 9


def test_a_truncated_png_is_caught_from_its_checksums_without_a_decode(tmp_path, pil_reads):
    folder = make_folder(tmp_path, n=2)
    data = (folder / "1.png").read_bytes()
    (folder / "1.png").write_bytes(data[: len(data) // 2])
    one = SimpleNamespace(rank=0, world=1, broadcast=lambda obj: obj, gather=lambda obj: [obj])
    checked = listing.check_images(read_metadata(folder), folder, one, 0.5)
    assert checked.bad == [1] and checked.sizes == [(32, 40), None]
    assert pil_reads["decode"] == 0


def test_the_ranks_share_the_header_reads_and_all_get_every_size(tmp_path, pil_reads):
    """Two ranks (threads, with the collectives played by a barrier): each reads its own half, and both
    end with the sizes of all eight images (what --buckets assigns from)."""
    import threading

    folder = make_folder(tmp_path)
    records = read_metadata(folder)
    barrier, shares, results = threading.Barrier(2), [None, None], [None, None]

    class Rank:
        def __init__(self, rank: int) -> None:
            self.rank, self.world = rank, 2

        def broadcast(self, obj):
            return {}

        def gather(self, obj):
            shares[self.rank] = obj
            barrier.wait()
            return list(shares)

    def run(rank: int) -> None:
        results[rank] = listing.check_images(records, folder, Rank(rank), 0.5)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [count for _, count in shares] == [4, 4] and pil_reads["open"] == 8  # each header read once
    for checked in results:
        assert checked.sizes == [(32, 40 + 8 * i) for i in range(8)]


def test_buckets_take_the_checks_sizes_and_read_no_header_again(
    tmp_path, tiny_model, pil_reads, process_group
):
    folder = make_folder(tmp_path)
    start(options(folder, str(tiny_model), buckets=True))
    assert pil_reads["open"] == 8  # the check's header reads; none for the buckets
    _, sampler, _, _ = start(options(folder, str(tiny_model), buckets=True))
    assert pil_reads["open"] == 8
    assert sum(len(b) for b in sampler.micro_batches(0)) > 0


def test_a_cache_build_decodes_in_dataloader_workers(tmp_path, monkeypatch, tiny_model):
    """`sdzero cache` feeds the encoders from worker processes: every image is opened outside the rank's
    own process."""
    import torch

    from sdzero.data import cache_build
    from sdzero.models.loading import load_components

    folder = make_folder(tmp_path, n=6)
    pids = tmp_path / "pids"
    real = cache_build.open_rgb

    def recording_open(path):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(path)

    monkeypatch.setattr(cache_build, "open_rgb", recording_open)
    comps = load_components(str(tiny_model), "fp32", torch.device("cpu"))
    items = [(p, r, (32, 32)) for p, r in enumerate(read_metadata(folder))]
    tensors = cache_build._encode_shard(comps, items, "none", 2, torch.device("cpu"))  # default workers
    assert {k.split("/")[0] for k in tensors} == {str(p) for p in range(6)}
    opened_in = [int(line) for line in pids.read_text().split()]
    assert len(opened_in) == 6 and os.getpid() not in opened_in
