"""SDXL and SD3 end to end: ZeRO-3 training on 2 ranks, validation sampling, export, and the pipelines.

One launch per family (module-scoped) serves every assertion about it: the loss falls, validation images
were written at ZeRO-3, the `--export-final` folder and a `sdzero export` of the saved checkpoint both load
in the family's diffusers pipeline and produce an image.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from launch import CONFIGS, check_ok, metrics, run_trainer

pytestmark = pytest.mark.dist

STEPS = {"sdxl": 12, "sd3": 20}
PIPELINES = {"sdxl": "StableDiffusionXLPipeline", "sd3": "StableDiffusion3Pipeline"}
# Per family: steps, LR and options. The tiny nets start far from their targets' scale (random output
# layers) and a few AdamW steps remove a systematic error larger than the step-to-step spread of the loss
# (each step draws new images, noise and timesteps). SDXL's UNet (~1M parameters) learns epsilon fast: the
# last five of 12 steps averaged 0.43x the first three. SD3's velocity target (noise - x) has a larger
# irreducible part and the transformer is small (~290k), so it gets a higher LR and 20 steps: in four
# simulated data orders the mean of the last five steps was 0.68-0.77x that of the first three (0.76x in
# this test's own run); the bound asserted for both is 0.85x.
OPTIONS = {
    "sdxl": ("--lr", "2e-3"),
    "sd3": ("--lr", "1e-2", "--max-sequence-length", "8", "--weighting-scheme", "logit_normal"),
}


@pytest.fixture(scope="module")
def family_runs(synth_data, tmp_path_factory):
    """family -> (model folder, run folder, launch output), launched once per family on first use."""
    from sdzero.models.tiny import write_tiny_model

    runs: dict[str, tuple[Path, Path, str]] = {}

    def get(family: str) -> tuple[Path, Path, str]:
        if family not in runs:
            work = tmp_path_factory.mktemp(family)
            model = write_tiny_model(work / "model", family=family)
            proc = run_trainer(
                CONFIGS / "zero3_bf16.json",
                model,
                synth_data,
                work / "run",
                *OPTIONS[family],
                "--export-final",
                "--checkpoint-every",
                str(STEPS[family]),
                "--validation-prompts",
                "a red circle",
                "--validation-inference-steps",
                "2",
                "--profile-out",
                str(work / "profile.json"),
                steps=STEPS[family],
            )
            check_ok(proc)
            runs[family] = (model, work / "run", proc.stdout + proc.stderr)
        return runs[family]

    return get


def _image(pipe, **extra) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np", **extra).images[
        0
    ]


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_zero3_training_loss_falls(family, family_runs):
    _, run, _ = family_runs(family)
    rows = metrics(run)
    assert len(rows) == STEPS[family] and all(r["zero_stage"] == 3 and r["dtype"] == "bf16" for r in rows)
    losses = [r["loss"] for r in rows]
    assert all(np.isfinite(losses)), losses
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    assert last < 0.85 * first, losses
    # Validation sampled at ZeRO-3 with every rank in the gathers; rank 0 wrote the image.
    images = list((run / "validation").rglob("*.png"))
    assert len(images) == 1, images


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_export_loads_in_the_family_pipeline(family, family_runs, tmp_path):
    import diffusers
    import torch
    from safetensors.torch import load_file

    from sdzero.checkpoint.export import export_checkpoint
    from sdzero.models.families import detect_family

    model, run, _ = family_runs(family)
    sub = detect_family(str(model)).subfolder
    cls = getattr(diffusers, PIPELINES[family])
    extra = {"max_sequence_length": 8} if family == "sd3" else {}
    final = run / "final"
    assert json.loads((final / "model_index.json").read_text())["_class_name"] == PIPELINES[family]
    # Loaded as users load a bf16 export: with torch_dtype (by default diffusers would build the network
    # in fp32 while transformers keeps the encoders' stored bf16, and SDXL's pooled embedding would clash).
    image = _image(cls.from_pretrained(final, torch_dtype=torch.bfloat16), **extra)
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()

    result = export_checkpoint(run, tmp_path / "exported")
    assert result.step == STEPS[family]
    pipe = cls.from_pretrained(tmp_path / "exported", torch_dtype=torch.bfloat16)
    assert type(pipe.scheduler).__name__ == type(cls.from_pretrained(model).scheduler).__name__
    image = _image(pipe, **extra)
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()
    # Both routes hold the trained weights: the same as each other (bf16 vs fp32 consolidation), not the
    # initial ones.
    weights = f"{sub}/diffusion_pytorch_model.safetensors"
    from_final, exported = load_file(final / weights), load_file(tmp_path / "exported" / weights)
    initial = load_file(model / weights)
    assert from_final.keys() == exported.keys() == initial.keys()
    moved = [k for k in initial if not torch.equal(initial[k].float(), exported[k].float())]
    assert len(moved) > len(initial) // 2
    for k in exported:
        torch.testing.assert_close(from_final[k].float(), exported[k].float(), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("family", ["sdxl", "sd3"])
def test_profile_counts_the_family_network_and_every_frozen_part(family, family_runs):
    """`sdzero profile` measures what the trainer trains: the UNet or the SD3 transformer, and all of the
    family's frozen modules (two or three text encoders and the VAE)."""
    from sdzero.models.loading import load_components
    from sdzero.telemetry.memory import module_bytes

    model, run, _ = family_runs(family)
    profile = json.loads((run.parent / "profile.json").read_text())
    comps = load_components(str(model), "bf16", "cpu")
    assert profile["trained_params"] == sum(p.numel() for p in comps.network.parameters())
    assert len(comps.frozen_modules()) == {"sdxl": 3, "sd3": 4}[family]
    for rank in profile["ranks"]:
        assert rank["frozen_bytes"] == module_bytes(*comps.frozen_modules())
        assert rank["activation_bytes"] > 0 and rank["activation_tensors"] > 0
