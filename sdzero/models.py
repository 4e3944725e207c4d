"""Loading a diffusers pipeline's parts: the trained UNet, and the frozen VAE and text encoder.

Every part is loaded with `from_pretrained(model, subfolder=...)`, the path a hub id or a local folder
takes alike. Nothing here runs under `deepspeed.zero.Init`: frozen parts created inside it would be
partitioned by ZeRO-3 and fail with size-0 weights (diffusers#1865), so they stay plain replicated modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdzero.errors import UserError

# model_index.json `_class_name` -> family the trainer knows how to train.
PIPELINE_FAMILIES = {
    "StableDiffusionPipeline": "sd",
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def read_model_index(model: str) -> dict[str, Any]:
    local = Path(model)
    if local.is_dir():
        path = local / "model_index.json"
    else:
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(model, "model_index.json"))
        except Exception as exc:  # hub errors come in many classes; the message is what matters
            raise UserError(
                f"--model {model}: not a local folder and not reachable on the hub ({type(exc).__name__}); "
                "pass a diffusers pipeline folder, or check the hub id and network / HF_HUB_OFFLINE"
            ) from exc
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"--model {model}: unreadable model_index.json ({exc})") from exc


def detect_family(model: str) -> str:
    """The family comes from the pipeline folder itself, so users never have to state it twice."""
    class_name = read_model_index(model).get("_class_name", "")
    family = PIPELINE_FAMILIES.get(class_name)
    if family is None:
        known = ", ".join(PIPELINE_FAMILIES)
        raise UserError(
            f"--model {model}: pipeline class {class_name!r} is not supported yet (supported: {known})"
        )
    return family


@dataclass
class Components:
    family: str
    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: Any
    noise_scheduler: Any
    vae_scale_factor: int
    native_resolution: int

    @property
    def latent_channels(self) -> int:
        return int(self.unet.config.in_channels)


def frozen_dtypes(compute: str) -> tuple[torch.dtype, torch.dtype]:
    """(text encoder, VAE) dtypes. The VAE stays fp32 under fp16: SD VAEs overflow to NaN in fp16
    (diffusers#4424); bf16 has fp32's range, so it is safe there."""
    dtype = DTYPES[compute]
    return dtype, (torch.float32 if compute == "fp16" else dtype)


def load_components(model: str, compute: str, device: torch.device | str) -> Components:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    family = detect_family(model)
    try:
        tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
        text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder")
        # torch_dtype at load time lets diffusers keep the modules it knows must stay fp32 in fp32.
        vae = AutoencoderKL.from_pretrained(model, subfolder="vae", torch_dtype=frozen_dtypes(compute)[1])
        noise_scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
        # The trained net is loaded in fp32; DeepSpeed casts it and keeps fp32 master weights itself.
        unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {model}: a pipeline part failed to load: {exc}") from exc

    text_dtype, vae_dtype = frozen_dtypes(compute)
    for frozen, dtype in ((text_encoder, text_dtype), (vae, vae_dtype)):
        frozen.requires_grad_(False)
        frozen.eval()
        frozen.to(device=device, dtype=dtype)
    unet.train()
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    return Components(
        family=family,
        unet=unet,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        noise_scheduler=noise_scheduler,
        vae_scale_factor=scale,
        native_resolution=int(unet.config.sample_size) * scale,
    )


@torch.no_grad()
def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Sample the VAE posterior with the per-sample `eps` (not the global RNG) so runs are reproducible."""
    posterior = vae.encode(pixels.to(vae.dtype)).latent_dist
    latents = posterior.mean + posterior.std * eps.to(posterior.mean.dtype)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((latents - shift) * vae.config.scaling_factor).float()


@torch.no_grad()
def encode_text(text_encoder: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return text_encoder(input_ids)[0]


def tokenize(comps: Components, text: str) -> dict[str, torch.Tensor]:
    """Every token tensor the family's text encoders take, for one caption (keys become batch keys)."""
    tok = comps.tokenizer
    ids = tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
    return {"input_ids": torch.tensor(ids, dtype=torch.long)}


@torch.no_grad()
def encode_prompts(comps: Components, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text conditioning of a micro-batch, by name (what a latent/text-embedding cache stores):
    `encoder_hidden_states` for every family, plus pooled embeddings for the families that take them."""
    return {"encoder_hidden_states": encode_text(comps.text_encoder, batch["input_ids"])}
