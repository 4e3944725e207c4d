"""Exports load as-is: every component of an exported pipeline in one dtype, so that a bare
`DiffusionPipeline.from_pretrained(out)` generates (a bf16 UNet beside fp32 encoders failed at the first
matmul), for each family. The ZeRO-3 bf16 checkpoint -> `sdzero export` path is in tests/dist/test_checkpoint.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdzero.checkpoint.export import write_pipeline
from sdzero.models.loading import load_components
from sdzero.models.tiny import TINY_FAMILIES, write_tiny_model


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export_models")
    return {f: write_tiny_model(root / f, family=f) for f in TINY_FAMILIES}


def saved_dtypes(out: Path) -> set[torch.dtype]:
    return {t.dtype for f in out.rglob("*.safetensors") for t in load_file(f).values()}


def generate(pipe) -> torch.Tensor:
    extra = {"max_sequence_length": 8} if "transformer" in pipe.components else {}
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np", **extra)
    return torch.as_tensor(image.images[0])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_export_of_a_bf16_run_loads_with_no_arguments_and_generates(family, family_models, tmp_path):
    from diffusers import DiffusionPipeline

    # What a bf16 run holds: frozen parts loaded in bf16, the trained net's gathered 16-bit weights.
    comps = load_components(str(family_models[family]), "bf16", "cpu")
    state = {k: v.to(torch.bfloat16) for k, v in comps.network.state_dict().items()}
    out = write_pipeline(tmp_path / "pipe", state, comps, extra_unets={"unet_ema": state})
    assert saved_dtypes(out) == {torch.float32}
    pipe = DiffusionPipeline.from_pretrained(out)
    image = generate(pipe)
    assert image.shape == (32, 32, 3) and torch.isfinite(image).all() and image.std() > 0
    # The frozen parts come from the model's fp32 originals, not from the run's bf16-rounded copies.
    original = load_file(next((family_models[family] / "text_encoder").glob("*.safetensors")))
    exported = load_file(next((out / "text_encoder").glob("*.safetensors")))
    assert all(torch.equal(original[k], exported[k]) for k in original)


def test_a_bf16_export_is_bf16_throughout_and_loads_with_torch_dtype(family_models, tmp_path):
    from diffusers import DiffusionPipeline

    comps = load_components(str(family_models["sd15"]), "fp32", "cpu")
    out = write_pipeline(tmp_path / "pipe", comps.network.state_dict(), comps, torch.bfloat16)
    assert saved_dtypes(out) == {torch.bfloat16}
    pipe = DiffusionPipeline.from_pretrained(out, dtype=torch.bfloat16)
    assert generate(pipe).shape == (32, 32, 3)
