"""The embedded default: a tiny Stable Diffusion pipeline and a synthetic captioned image set.

Both are written to disk in the formats real users have (a diffusers pipeline folder; an image folder
with `metadata.jsonl`), so the trainer reads them through exactly the code a real checkpoint takes.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from sdzero.atomic import new_dir
from sdzero.errors import UserError

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


def build_t5_tokenizer():
    """A T5 tokenizer built locally (a Unigram model, as SentencePiece's): one piece per caption word and
    per printable character, so any caption tokenizes."""
    from transformers import T5Tokenizer

    words = sorted(set(COLOURS) | set(SHAPES) | set(SIZES) | set(FILLER))
    # T5's layout: <pad>=0, </s>=1, <unk>=2, then pieces; whole words score above single characters.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in words]
    pieces += [(chr(c), -5.0) for c in range(ord("!"), ord("~") + 1)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _clip_text_config(tokenizer, hidden: int, projection: int | None = None):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        **({"projection_dim": projection} if projection else {}),
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _tiny_vae(**overrides):
    from diffusers import AutoencoderKL

    # Two VAE blocks: latents are 1/2 of the image side (real SD: 1/8), so 32 px images give 16x16 latents.
    settings = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    return AutoencoderKL(**{**settings, **overrides})


def _ddpm_settings() -> dict:
    return dict(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
    )


def _tiny_sd15():
    from diffusers import DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    # Creation order fixes the random weights for a seed: tokenizer, text encoder, VAE, UNet.
    tokenizer = build_tokenizer()
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, 32))
    vae = _tiny_vae()
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
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDPMScheduler(**_ddpm_settings(), clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _tiny_sdxl():
    """SDXL's layout: CLIP-L-like and CLIP-G-like encoders (the second with a projection, whose pooled
    output feeds the UNet's `text_time` embedding beside the six size/crop numbers), as in SDXL base."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    tokenizer = build_tokenizer()
    text_encoder = CLIPTextModel(_clip_text_config(tokenizer, 16))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(tokenizer, 32, projection=24))
    time_embed_dim = 8
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16 + 32,  # penultimate hidden states of both encoders, concatenated
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_embed_dim,
        projection_class_embeddings_input_dim=6 * time_embed_dim + 24,  # 6 time ids + pooled (proj 24)
        norm_num_groups=8,
    )
    return StableDiffusionXLPipeline(
        vae=_tiny_vae(),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=build_tokenizer(),
        unet=unet,
        scheduler=EulerDiscreteScheduler(**_ddpm_settings(), timestep_spacing="leading"),
        add_watermarker=False,
    )


def _tiny_sd3():
    """SD3's layout: two CLIP encoders with projections (pooled outputs concatenated) and a T5 encoder,
    an MMDiT transformer, a 16-bit-safe VAE with a shift factor, and the flow-matching scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer, tokenizer_3 = build_tokenizer(), build_t5_tokenizer()
    text_encoder = CLIPTextModelWithProjection(_clip_text_config(tokenizer, 16, projection=16))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config(tokenizer, 32, projection=32))
    t5_dim = 64  # >= the CLIP hidden sizes together (48): SD3 zero-pads the CLIP states up to T5's width
    text_encoder_3 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_3),
            d_model=t5_dim,
            d_kv=16,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer_3.pad_token_id,
            eos_token_id=tokenizer_3.eos_token_id,
        )
    )
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=t5_dim,
        caption_projection_dim=64,  # = heads x head dim, as in SD3
        pooled_projection_dim=16 + 32,  # both CLIP projections, concatenated
        pos_embed_max_size=32,
    )
    # SD3's VAE has no quant convs and a shift factor; the tiny one keeps both traits.
    vae = _tiny_vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.06, scaling_factor=1.5)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        # SD3 shifts its schedule towards noise more at higher resolutions (the paper's resolution-dependent
        # shift; 3.0 for the 1024 px models); the 32 px tiny model uses none.
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=build_tokenizer(),
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


TINY_BUILDERS = {"sd15": _tiny_sd15, "sdxl": _tiny_sdxl, "sd3": _tiny_sd3}
TINY_FAMILIES = tuple(TINY_BUILDERS)
"""`tiny-model --family` names: one pipeline per registered family (sdzero.models.families); sd15's is detected
as family `sd` (SD 1.x/2.x)."""


def write_tiny_model(out: Path, family: str = "sd15", seed: int = 0) -> Path:
    """Write a complete diffusers pipeline folder with small random weights; returns `out`."""
    if family not in TINY_BUILDERS:
        raise UserError(f"unknown --family {family!r}; choose one of: {', '.join(TINY_FAMILIES)}")
    import torch

    torch.manual_seed(seed)
    pipe = TINY_BUILDERS[family]()
    with new_dir(Path(out)) as tmp:
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
    with new_dir(Path(out)) as tmp, open(tmp / "metadata.jsonl", "w") as meta:
        for i in range(images):
            side = int(size + rng.integers(0, size // 4 + 1))
            caption, img = _caption_and_image(rng, side)
            name = f"{i:06d}.png"
            img.save(tmp / name)
            meta.write(json.dumps({"file_name": name, "text": caption}) + "\n")
    return Path(out)
