"""The real-size rehearsal's model: an SD 1.x UNet of over 100M parameters, built from its config.

SD 1.5's block structure (three cross-attention down blocks and a plain one, two layers each, the
mirror on the way up, 8 attention heads) at 128/256/512/512 channels instead of 320/640/1280/1280, in
the embedded default's pipeline (its tiny VAE and text encoder: only the UNet is trained), at 32x32
latents (64 px images through the tiny VAE's 1/2). On 2 CPU cores one advise launch of it takes over
a minute: start-up, and steps of seconds, as a large model's launch is on a GPU node.

    python bench/rehearsal_model.py OUT     # writes OUT/model and OUT/data (256 images), prints the size
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SD15_SHAPE = {
    "down_block_types": [
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    "layers_per_block": 2,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
}
"""SD 1.5's UNet block structure (runwayml/stable-diffusion-v1-5 unet/config.json)."""
WIDTHS = [128, 256, 512, 512]
"""SD 1.5's channels (320, 640, 1280, 1280) at 0.4x."""
LATENT_SIDE = 32
IMAGES = 256


def write_rehearsal(out: Path) -> tuple[Path, Path, int]:
    """(model folder, data folder, trained parameters): the embedded pipeline with the rehearsal UNet."""
    import torch
    from diffusers import UNet2DConditionModel

    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    model, data = out / "model", out / "data"
    if not (model / "model_index.json").is_file():
        write_tiny_model(model, "sd15")
        config = json.loads((model / "unet" / "config.json").read_text())
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        config |= SD15_SHAPE | {"block_out_channels": WIDTHS, "sample_size": LATENT_SIDE}
        torch.manual_seed(0)
        UNet2DConditionModel(**config).save_pretrained(model / "unet", safe_serialization=True)
    if not (data / "metadata.jsonl").is_file():
        write_synthetic_dataset(data, IMAGES, size=2 * LATENT_SIDE)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    return model, data, sum(p.numel() for p in unet.parameters())


if __name__ == "__main__":
    folder, images, params = write_rehearsal(Path(sys.argv[1]))
    print(f"{folder}: UNet of {params / 1e6:.0f}M parameters; data {images}")
