"""The embedded default: a tiny Stable Diffusion pipeline and a synthetic captioned image set.

Both are written to disk in the formats real users have (a diffusers pipeline folder; an image folder
with `metadata.jsonl`), so the trainer reads them through exactly the code a real checkpoint takes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from sdzero.errors import UserError

FAMILIES = ("sd15",)

# Words of the synthetic captions; the tokenizer gets one whole-word token for each of them.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 215, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
SIZES = ("small", "large")
FILLER = ("a", "on", "background", "in", "the", "middle")


@contextmanager
def atomic_dir(out: Path) -> Iterator[Path]:
    """Build a folder next to `out` and move it into place only when complete.

    An existing non-empty `out` is refused rather than overwritten: nothing the user had is lost.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} already exists and is not empty; choose a new folder or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _byte_level_chars() -> list[str]:
    """The printable characters of GPT-2/CLIP byte-level BPE (bytes mapped to visible unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def build_tokenizer(max_length: int = 16):
    """A CLIP tokenizer built locally: byte-level characters plus whole-word merges for the caption words."""
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    for ch in _byte_level_chars():
        for tok in (ch, ch + "</w>"):
            vocab.setdefault(tok, len(vocab))
    merges: list[str] = []  # "left right" lines, as in merges.txt
    words = sorted(set(COLOURS) | set(SHAPES) | set(SIZES) | set(FILLER))
    for word in words:
        # Merge left to right: "r e" -> "re", "re d</w>" -> "red</w>"; every step is a vocabulary entry.
        left = word[0]
        for i, ch in enumerate(word[1:], start=1):
            right = ch + ("</w>" if i == len(word) - 1 else "")
            merged = left + right
            if f"{left} {right}" not in merges:
                merges.append(f"{left} {right}")
            vocab.setdefault(merged, len(vocab))
            left = merged
    # Through files, as a downloaded tokenizer arrives: the same loading path in every transformers version.
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.json").write_text(json.dumps(vocab))
        (Path(tmp) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        return CLIPTokenizer.from_pretrained(tmp, model_max_length=max_length)


def write_tiny_model(out: Path, family: str = "sd15", seed: int = 0) -> Path:
    """Write a complete diffusers pipeline folder with small random weights; returns `out`."""
    if family not in FAMILIES:
        raise UserError(f"unknown --family {family!r}; choose one of: {', '.join(FAMILIES)}")
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=tokenizer.model_max_length,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    # Two VAE blocks: latents are 1/2 of the image side (real SD: 1/8), so 32 px images give 16x16 latents.
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        clip_sample=False,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    with atomic_dir(Path(out)) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
    return Path(out)


def _caption_and_image(rng: np.random.Generator, size: int) -> tuple[str, Image.Image]:
    colour_names = list(COLOURS)
    fg, bg = rng.choice(len(colour_names), size=2, replace=False)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    scale = SIZES[int(rng.integers(len(SIZES)))]
    img = Image.new("RGB", (size, size), COLOURS[colour_names[bg]])
    draw = ImageDraw.Draw(img)
    radius = size * (0.18 if scale == "small" else 0.38)
    c = size / 2
    if shape == "circle":
        draw.ellipse([c - radius, c - radius, c + radius, c + radius], fill=COLOURS[colour_names[fg]])
    elif shape == "square":
        draw.rectangle([c - radius, c - radius, c + radius, c + radius], fill=COLOURS[colour_names[fg]])
    else:
        h = radius * math.sqrt(3)
        pts = [(c, c - radius), (c - h / 2 * 1.15, c + radius * 0.8), (c + h / 2 * 1.15, c + radius * 0.8)]
        draw.polygon(pts, fill=COLOURS[colour_names[fg]])
    caption = f"a {scale} {colour_names[fg]} {shape} on a {colour_names[bg]} background"
    return caption, img


def write_synthetic_dataset(out: Path, images: int, size: int = 48, seed: int = 0) -> Path:
    """Coloured shapes on plain backgrounds, each described by its caption; `metadata.jsonl` lists them.

    Sizes vary a little around `size` so the trainer's resize and crop are exercised.
    """
    if images < 1:
        raise UserError(f"--images must be at least 1, got {images}")
    if size < 8:
        raise UserError(f"--size must be at least 8 pixels, got {size}")
    rng = np.random.default_rng(seed)
    with atomic_dir(Path(out)) as tmp, open(tmp / "metadata.jsonl", "w") as meta:
        for i in range(images):
            side = int(size + rng.integers(0, size // 4 + 1))
            caption, img = _caption_and_image(rng, side)
            name = f"{i:06d}.png"
            img.save(tmp / name)
            meta.write(json.dumps({"file_name": name, "text": caption}) + "\n")
    return Path(out)
