"""Latent/text caches in one process: interrupted builds resume, items equal online encoding, mismatches
are refused with what differs, and the cached path runs without a VAE or text encoder."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.data.buckets import assign_buckets, bucket_sizes, image_sizes
from sdzero.data.cache import INDEX_NAME, CachedSamples, net_geometry, open_cache, shard_name
from sdzero.data.cache_build import BuildInterrupted, build_cache
from sdzero.data.images import CaptionedImages, SampleSpec, read_metadata
from sdzero.errors import UserError
from sdzero.models.encoding import encode_batch
from sdzero.models.families import Family
from sdzero.models.loading import load_components, tokenize
from sdzero.models.objectives import LossInputs, Objective
from sdzero.models.step_input import StepInput

# Where build_cache encodes: the GPU when there is one. Online encoding in these tests runs there too, so
# cached and online latents come from the same kernels (a GPU-built cache against CPU encoding differed
# by up to 8.7e-5 on an H200).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module", autouse=True)
def strict_fp32():
    """cuDNN convolutions default to TF32 (a 10-bit mantissa) on GPUs; the equality checks here need fp32."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def comps(tiny_model):
    return load_components(str(tiny_model), "fp32", DEVICE)


@pytest.fixture(scope="module")
def flip_cache(tiny_model, synth_data, tmp_path_factory):
    """Both orientations, 64 images in 4 shards of 16."""
    out = tmp_path_factory.mktemp("caches") / "flip"
    build_cache(str(tiny_model), synth_data, out, flip="both", dtype="fp32", shard_size=16, batch_size=8)
    return out


def spec_for(comps, random_flip: bool) -> SampleSpec:
    side = comps.native_resolution // comps.vae_scale_factor
    return SampleSpec(
        comps.native_resolution, (comps.latent_channels, side, side), 1000, seed=5, random_flip=random_flip
    )


def test_interrupted_build_resumes_without_redoing_committed_shards(tiny_model, synth_data, tmp_path):
    out = tmp_path / "cache"
    with pytest.raises(BuildInterrupted):
        build_cache(str(tiny_model), synth_data, out, dtype="fp32", shard_size=16, stop_after_shards=1)
    assert not (out / INDEX_NAME).exists()  # incomplete: a run refuses it
    first = (out / shard_name(0)).stat()
    with pytest.raises(UserError, match="did not finish: rerun the same `sdzero cache` command"):
        open_cache(out, str(tiny_model), synth_data, None, False, "fp32", False)
    # What a kill can leave besides committed shards: a half-written temp file; and a damaged shard.
    (out / f".{shard_name(1)}.tmp-999").write_bytes(b"partial")
    (out / shard_name(2)).write_bytes(b"not a safetensors file")
    result = build_cache(str(tiny_model), synth_data, out, dtype="fp32", shard_size=16)
    assert (result.skipped_here, result.built_here, result.shards, result.samples) == (1, 3, 4, 64)
    assert not (out / f".{shard_name(1)}.tmp-999").exists()  # the killed build's temp file: removed
    again = (out / shard_name(0)).stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not rewritten
    index = json.loads((out / INDEX_NAME).read_text())
    assert [s["count"] for s in index["shards"]] == [16] * 4
    assert [s["file_name"] for s in index["samples"]] == [f"{i:06d}.png" for i in range(64)]
    assert index["cond_keys"] == ["encoder_hidden_states"]
    # A finished cache asked for again is left alone.
    assert build_cache(str(tiny_model), synth_data, out, dtype="fp32", shard_size=16).already_complete


def test_cached_items_equal_online_encoding(comps, tiny_model, synth_data, flip_cache):
    records = read_metadata(synth_data)
    cache = open_cache(flip_cache, str(tiny_model), synth_data, None, False, "fp32", random_flip=True)
    online = CaptionedImages(records, spec_for(comps, True), lambda t: tokenize(comps, t))
    cached = CachedSamples(cache, spec_for(comps, True))
    keys = [(i, epoch) for i in (0, 7, 33, 63) for epoch in (0, 1)]
    a = StepInput.collate([online[k] for k in keys])
    b = StepInput.collate([cached[k] for k in keys])
    assert b.cached and not a.cached
    for name in ("noise", "latent_eps", "timestep", "index", "original_size", "crop_top_left", "target_size"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    latents_a, cond_a = encode_batch(comps, a.to(DEVICE))
    latents_b, cond_b = encode_batch(comps, b.to(DEVICE))
    # Tolerance: the cache encoded 8 images per VAE call, this check 8 others; fp32 convolutions may
    # round differently with the batch composition, nothing more.
    torch.testing.assert_close(latents_b, latents_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        cond_b.encoder_hidden_states, cond_a.encoder_hidden_states, rtol=1e-5, atol=1e-6
    )
    # Both orientations are served: the sample's own first draw decides, as it does online.
    from sdzero.data.images import sample_generator

    flips = [bool(sample_generator(5, e, i).random() < 0.5) for i, e in keys]
    assert set(flips) == {True, False}
    for j, ((i, _), flip) in enumerate(zip(keys, flips, strict=True)):
        stored = cached._shard(cache.raw["samples"][i]["shard"]).get_tensor(
            f"{i}/{'flip/' if flip else ''}mean"
        )
        assert torch.equal(b.posterior.mean[j], stored)


def test_mismatched_cache_is_refused_with_what_differs(tiny_model, synth_data, flip_cache, tmp_path):
    with pytest.raises(UserError, match=r"resolution 32 vs 48"):
        open_cache(flip_cache, str(tiny_model), synth_data, 48, False, "fp32", False)
    with pytest.raises(UserError, match=r"precision fp32 vs bf16"):
        open_cache(flip_cache, str(tiny_model), synth_data, None, False, "bf16", False)
    with pytest.raises(UserError, match=r"no buckets vs buckets \['24x44'"):
        open_cache(flip_cache, str(tiny_model), synth_data, None, True, "fp32", False)
    data = tmp_path / "data"
    shutil.copytree(synth_data, data)  # copy2: same sizes and mtimes, so the same data
    open_cache(flip_cache, str(tiny_model), data, None, False, "fp32", False)
    (data / "000003.png").write_bytes((synth_data / "000004.png").read_bytes())
    with pytest.raises(UserError, match=r"1 changed \(e\.g\. 000003\.png\)"):
        open_cache(flip_cache, str(tiny_model), data, None, False, "fp32", False)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    shutil.rmtree(model / "unet")  # the trained net is not part of what the cache depends on...
    shutil.copytree(tiny_model / "unet", model / "unet")
    open_cache(flip_cache, str(model), synth_data, None, False, "fp32", False)
    config = json.loads((model / "vae" / "config.json").read_text())
    config["scaling_factor"] = 0.5  # ...but the VAE is
    (model / "vae" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"VAE/text encoders differ"):
        open_cache(flip_cache, str(model), synth_data, None, False, "fp32", False)


def test_flip_and_crop_policies(tiny_model, synth_data, tmp_path):
    from sdzero.config.train_config import TrainConfig

    out = tmp_path / "noflip"
    build_cache(str(tiny_model), synth_data, out, dtype="fp32", shard_size=64)
    with pytest.raises(UserError, match=r"--random-flip needs both orientations"):
        open_cache(out, str(tiny_model), synth_data, None, False, "fp32", random_flip=True)
    with pytest.raises(UserError, match="--random-crop cannot be served from --cache-dir"):
        TrainConfig(
            deepspeed_config="x.json",
            model=str(tiny_model),
            data=synth_data,
            output_dir=tmp_path / "r",
            cache_dir=out,
            random_crop=True,
        )


def test_cli_refuses_another_build_into_the_same_folder(tiny_model, synth_data, flip_cache):
    runner = CliRunner()
    args = [
        "cache",
        "--model",
        str(tiny_model),
        "--data",
        str(synth_data),
        "--out",
        str(flip_cache),
        "--dtype",
        "fp32",
    ]
    result = runner.invoke(app, [*args, "--resolution", "48", "--flip", "both"])
    assert result.exit_code == 2, result.output
    assert "holds a cache built with other settings (resolution 32 vs 48)" in result.output
    result = runner.invoke(app, [*args, "--flip", "both"])
    assert result.exit_code == 0 and "already a complete cache of 64 samples" in result.output


def test_bucketed_cache_follows_each_images_bucket(tiny_model, tmp_path):
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    sizes = [(40, 64), (64, 40), (48, 48), (30, 70)]  # (width, height)
    lines = []
    for i, (w, h) in enumerate(sizes):
        Image.new("RGB", (w, h), (40 * i, 90, 200)).save(data / f"{i}.png")
        lines.append(json.dumps({"file_name": f"{i}.png", "text": "a red circle"}))
    (data / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "cache"
    build_cache(str(tiny_model), data, out, buckets=True, dtype="fp32")
    cache = open_cache(out, str(tiny_model), data, None, True, "fp32", False)
    buckets = bucket_sizes(32, net_geometry(str(tiny_model)).granularity)
    expected = [
        buckets[b] for b in assign_buckets(image_sizes([data / f"{i}.png" for i in range(4)]), buckets)
    ]
    assert cache.sizes == expected and len(set(expected)) == 4
    comps = load_components(str(tiny_model), "fp32", "cpu", frozen=False)
    spec = spec_for(comps, False)
    for i, (h, w) in enumerate(expected):
        item = CachedSamples(cache, spec)[(i, 0)]
        assert tuple(item.target_size.tolist()) == (h, w)
        assert (
            item.posterior.mean.shape[1:]
            == item.noise.shape[1:]
            == item.latent_eps.shape[1:]
            == (h // 2, w // 2)
        )


def test_cached_training_path_needs_no_frozen_parts(tiny_model, synth_data, flip_cache, monkeypatch):
    import sdzero.models.loading as models

    def refuse(*args, **kwargs):
        raise AssertionError("a cached run loaded a frozen part")

    monkeypatch.setattr(models, "_load_vae", refuse)
    monkeypatch.setattr(Family, "load_text_encoders", refuse)
    comps = load_components(str(tiny_model), "fp32", "cpu", frozen=False)
    assert comps.vae is None and comps.text_encoder is None and comps.frozen_modules() == ()
    cache = open_cache(flip_cache, str(tiny_model), synth_data, None, False, "fp32", False)
    batch = StepInput.collate([CachedSamples(cache, spec_for(comps, False))[(i, 0)] for i in range(4)])
    latents, cond = encode_batch(comps, batch)
    inputs = LossInputs(comps.network, torch.float32, comps.noise_scheduler, latents, cond, batch)
    loss = comps.family.loss(inputs, Objective("epsilon"))
    assert torch.isfinite(loss) and loss > 0


def test_resume_with_another_shard_size_rebuilds_what_no_longer_fits(tiny_model, synth_data, tmp_path):
    out = tmp_path / "cache"
    with pytest.raises(BuildInterrupted):
        build_cache(str(tiny_model), synth_data, out, dtype="fp32", shard_size=16, stop_after_shards=1)
    result = build_cache(str(tiny_model), synth_data, out, dtype="fp32", shard_size=32)
    assert (result.skipped_here, result.built_here) == (0, 2)  # shard 0 held 16 positions, not 32
    index = json.loads((out / INDEX_NAME).read_text())
    assert [(s["first"], s["count"]) for s in index["shards"]] == [(0, 32), (32, 32)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"format": 1, "spec": {', "is damaged (Expecting"),
        ("[1, 2]", "cache format list is not"),
        ("\xff\xfe", "is damaged"),
        ('{"format": %d, "spec": {}}', "spec, samples, shards or data_files missing"),
        ('{"format": %d, "spec": {}, "samples": [{}], "shards": [], "data_files": []}', "a malformed entry"),
    ],
)
def test_a_corrupt_index_is_one_clear_error(tmp_path, text, expected):
    from sdzero.data.cache import CACHE_FORMAT, INDEX_NAME

    (tmp_path / INDEX_NAME).write_bytes((text % CACHE_FORMAT if "%d" in text else text).encode("latin-1"))
    with pytest.raises(UserError) as err:
        open_cache(tmp_path, "no-model", tmp_path, None, False, "fp32", False)
    message = str(err.value)
    assert expected in message and "rebuild the cache" in message and "\n" not in message


@pytest.mark.parametrize(
    ("shards", "samples", "expected"),
    [
        ([{"file": "../x", "bytes": 1}], [{"shard": 0}], "shard entry 0 is not"),
        ([{"file": "shard-00000.safetensors", "bytes": True}], [{"shard": 0}], "shard entry 0 is not"),
        ([{"file": "shard-00000.safetensors", "bytes": 1, "sha256": 5}], [], "malformed sha256"),
        ([{"file": "shard-00000.safetensors", "bytes": 1}], [{"shard": 1}], "sample 0 names shard 1"),
        ([{"file": "shard-00000.safetensors", "bytes": 1}], [{"shard": "0"}], "sample 0 names shard '0'"),
    ],
)
def test_shard_entries_and_sample_shard_numbers_are_checked_before_launch(shards, samples, expected):
    """A hand-edited index fails as one line before launch, not as an IndexError in a loader worker."""
    from sdzero.data.cache import _bad_shard_entry

    assert expected in _bad_shard_entry({"shards": shards, "samples": samples})
    good = [{"file": "shard-00000.safetensors", "bytes": 1, "sha256": "0" * 64}]
    assert _bad_shard_entry({"shards": good, "samples": [{"shard": 0}]}) is None
