"""Loading a diffusers pipeline's parts: the trained network, and the frozen VAE and text encoders.

Families: SD 1.x/2.x (`sd`), SDXL (`sdxl`: two CLIP encoders, pooled embedding, size/crop conditioning) and
SD3 (`sd3`: MMDiT transformer trained by flow matching; CLIP-L, CLIP-G and T5).

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
    "StableDiffusionXLPipeline": "sdxl",
    "StableDiffusion3Pipeline": "sd3",
}
# Where each family keeps its trained network inside the pipeline folder.
TRAINED_SUBFOLDER = {"sd": "unet", "sdxl": "unet", "sd3": "transformer"}
# The frozen text encoders, by their pipeline folder (and attribute) names, in the order the family uses.
TEXT_ENCODERS = {
    "sd": ("text_encoder",),
    "sdxl": ("text_encoder", "text_encoder_2"),
    "sd3": ("text_encoder", "text_encoder_2", "text_encoder_3"),
}
DEFAULT_MAX_SEQUENCE_LENGTH = 77
"""T5 tokens per caption for SD3 when --max-sequence-length is not given (diffusers' SD3 training default)."""

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
    """A pipeline's parts as the trainer uses them.

    `unet` is the trained network whatever the family: the UNet2DConditionModel of SD 1.x/2.x and SDXL, the
    SD3Transformer2DModel (MMDiT) of SD3. One name lets checkpoints, EMA, profiling, export and the advisor
    treat every family alike; `trained_subfolder` says where it lives in the pipeline folder.

    The frozen parts (`vae`, `text_encoder*`) are None when loaded with `frozen=False` (training from a
    latent/text cache); the latent geometry and scaling then come from the VAE's config alone.
    """

    family: str
    unet: torch.nn.Module
    vae: torch.nn.Module | None
    text_encoder: torch.nn.Module | None
    tokenizer: Any
    noise_scheduler: Any
    vae_scale_factor: int
    native_resolution: int
    latent_scaling_factor: float = 1.0
    latent_shift_factor: float = 0.0
    text_encoder_2: torch.nn.Module | None = None
    text_encoder_3: torch.nn.Module | None = None
    tokenizer_2: Any = None
    tokenizer_3: Any = None
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    """T5 tokens per caption (SD3 only)."""
    sampler_class: str = ""
    """The scheduler class the pipeline folder names (e.g. EulerDiscreteScheduler for SDXL): exports and
    validation sample with it; training reads the same noise schedule through `noise_scheduler`."""
    model: str = ""
    """Where the parts came from: `ensure_frozen` loads missing frozen parts from here."""
    compute: str = "fp32"

    @property
    def latent_channels(self) -> int:
        return int(self.unet.config.in_channels)

    @property
    def trained_subfolder(self) -> str:
        return TRAINED_SUBFOLDER[self.family]

    @property
    def frozen_loaded(self) -> bool:
        return self.vae is not None and all(getattr(self, n) is not None for n in TEXT_ENCODERS[self.family])

    def frozen_modules(self) -> tuple[torch.nn.Module, ...]:
        """The loaded frozen modules (VAE and text encoders), replicated on every rank."""
        names = ("vae", *TEXT_ENCODERS[self.family])
        return tuple(m for m in (getattr(self, n) for n in names) if m is not None)


def frozen_dtypes(compute: str) -> tuple[torch.dtype, torch.dtype]:
    """(text encoder, VAE) dtypes. The VAE stays fp32 under fp16: SD VAEs overflow to NaN in fp16
    (diffusers#4424); bf16 has fp32's range, so it is safe there."""
    dtype = DTYPES[compute]
    return dtype, (torch.float32 if compute == "fp16" else dtype)


def trained_network_class(family: str) -> Any:
    """The diffusers class of the family's trained network (its folder: TRAINED_SUBFOLDER[family])."""
    from diffusers import SD3Transformer2DModel, UNet2DConditionModel

    return SD3Transformer2DModel if family == "sd3" else UNet2DConditionModel


def _load_trained(model: str, family: str) -> torch.nn.Module:
    cls = trained_network_class(family)
    # The trained net is loaded in fp32; DeepSpeed casts it and keeps fp32 master weights itself.
    return cls.from_pretrained(model, subfolder=TRAINED_SUBFOLDER[family])


def _load_scheduler(model: str, family: str) -> Any:
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    # SDXL ships an Euler sampler config; training reads the same betas through DDPM, as diffusers does.
    cls = FlowMatchEulerDiscreteScheduler if family == "sd3" else DDPMScheduler
    return cls.from_pretrained(model, subfolder="scheduler")


def _load_tokenizers(model: str, family: str) -> dict[str, Any]:
    from transformers import CLIPTokenizer, T5TokenizerFast

    names = [n.replace("text_encoder", "tokenizer") for n in TEXT_ENCODERS[family]]
    return {
        name: (T5TokenizerFast if name == "tokenizer_3" else CLIPTokenizer).from_pretrained(
            model, subfolder=name
        )
        for name in names
    }


def _load_text_encoders(model: str, family: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    classes = {
        "sd": (CLIPTextModel,),
        "sdxl": (CLIPTextModel, CLIPTextModelWithProjection),
        "sd3": (CLIPTextModelWithProjection, CLIPTextModelWithProjection, T5EncoderModel),
    }[family]
    # torch_dtype at load time: T5 keeps the modules it knows overflow in fp16 (`wo`) in fp32.
    return {
        name: cls.from_pretrained(model, subfolder=name, torch_dtype=dtype)
        for name, cls in zip(TEXT_ENCODERS[family], classes, strict=True)
    }


def _load_vae(model: str, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    # torch_dtype at load time lets diffusers keep the modules it knows must stay fp32 in fp32.
    return AutoencoderKL.from_pretrained(model, subfolder="vae", torch_dtype=dtype)


def _freeze(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    module.requires_grad_(False)
    module.eval()
    return module.to(device=device)


def load_components(
    model: str,
    compute: str,
    device: torch.device | str,
    frozen: bool = True,
    max_sequence_length: int | None = None,
) -> Components:
    """The family's parts. `frozen=False` skips the VAE and text encoders (a run that trains from a
    latent/text cache never needs them); the VAE's config still gives the latent geometry and scaling."""
    from diffusers import AutoencoderKL

    family = detect_family(model)
    text_dtype, vae_dtype = frozen_dtypes(compute)
    parts: dict[str, Any] = {}
    try:
        parts.update(_load_tokenizers(model, family))
        if frozen:
            parts.update(
                {k: _freeze(m, device) for k, m in _load_text_encoders(model, family, text_dtype).items()}
            )
            parts["vae"] = _freeze(_load_vae(model, vae_dtype), device)
            vae_config = dict(parts["vae"].config)
        else:
            vae_config = dict(AutoencoderKL.load_config(model, subfolder="vae"))
        noise_scheduler = _load_scheduler(model, family)
        sampler_class = type(noise_scheduler).load_config(model, subfolder="scheduler").get("_class_name", "")
        unet = _load_trained(model, family)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {model}: a pipeline part failed to load: {exc}") from exc
    unet.train()
    scale = 2 ** (len(vae_config["block_out_channels"]) - 1)
    return Components(
        family=family,
        unet=unet,
        vae=parts.pop("vae", None),
        noise_scheduler=noise_scheduler,
        vae_scale_factor=scale,
        native_resolution=int(unet.config.sample_size) * scale,
        latent_scaling_factor=float(vae_config.get("scaling_factor") or 1.0),
        latent_shift_factor=float(vae_config.get("shift_factor") or 0.0),
        max_sequence_length=max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH,
        sampler_class=sampler_class,
        model=model,
        compute=compute,
        text_encoder=parts.pop("text_encoder", None),
        **parts,
    )


def ensure_frozen(comps: Components, device: torch.device | str) -> Components:
    """Load the VAE and text encoders into `comps` if it was loaded without them (a cache run that
    samples validation images or exports a pipeline). Replicated, never under zero.Init, as at start-up."""
    if comps.frozen_loaded:
        return comps
    text_dtype, vae_dtype = frozen_dtypes(comps.compute)
    try:
        for name, module in _load_text_encoders(comps.model, comps.family, text_dtype).items():
            setattr(comps, name, _freeze(module, device))
        comps.vae = _freeze(_load_vae(comps.model, vae_dtype), device)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {comps.model}: a frozen pipeline part failed to load: {exc}") from exc
    return comps


def sampling_scheduler(comps: Components) -> Any:
    """A fresh scheduler for sampling: the pipeline's own class, built from the training schedule's config
    (so a v-prediction run samples as v-prediction). Fresh, because `set_timesteps` rewrites a scheduler's
    schedule and the training objective reads the training one."""
    import diffusers

    cls = getattr(diffusers, comps.sampler_class, None) or type(comps.noise_scheduler)
    return cls.from_config(comps.noise_scheduler.config)


def resolve_prediction_type(comps: Components, requested: str | None) -> str:
    """The training target. SD3 trains by flow matching (its scheduler has no prediction_type); the
    DDPM families take `requested` or the scheduler's own, recorded in the scheduler so exports carry it."""
    if comps.family == "sd3":
        return "flow_matching"
    prediction_type = requested or comps.noise_scheduler.config.prediction_type
    comps.noise_scheduler.register_to_config(prediction_type=prediction_type)
    return prediction_type


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


def _ids(tokenizer: Any, text: str, max_length: int) -> torch.Tensor:
    ids = tokenizer(text, padding="max_length", max_length=max_length, truncation=True).input_ids
    return torch.tensor(ids, dtype=torch.long)


def tokenize(comps: Components, text: str) -> dict[str, torch.Tensor]:
    """Every token tensor the family's text encoders take, for one caption (keys become batch keys):
    `input_ids` (CLIP-L), `input_ids_2` (CLIP-G: SDXL, SD3), `input_ids_3` (T5: SD3)."""
    out = {"input_ids": _ids(comps.tokenizer, text, comps.tokenizer.model_max_length)}
    if comps.tokenizer_2 is not None:
        out["input_ids_2"] = _ids(comps.tokenizer_2, text, comps.tokenizer_2.model_max_length)
    if comps.tokenizer_3 is not None:
        out["input_ids_3"] = _ids(comps.tokenizer_3, text, comps.max_sequence_length)
    return out


def _clip_states(encoder: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(penultimate hidden states, projected pooled embedding or None): what SDXL and SD3 condition on."""
    out = encoder(ids, output_hidden_states=True)
    return out.hidden_states[-2], getattr(out, "text_embeds", None)


@torch.no_grad()
def encode_prompts(comps: Components, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text conditioning of a micro-batch, by name (what a latent/text-embedding cache stores):
    `encoder_hidden_states` for every family, plus `pooled_prompt_embeds` for SDXL and SD3."""
    if not comps.frozen_loaded:
        raise RuntimeError(
            "encode_prompts needs the text encoders; load_components(frozen=False) skipped them"
        )
    if comps.family == "sd":
        return {"encoder_hidden_states": encode_text(comps.text_encoder, batch["input_ids"])}
    states_1, pooled_1 = _clip_states(comps.text_encoder, batch["input_ids"])
    states_2, pooled_2 = _clip_states(comps.text_encoder_2, batch["input_ids_2"])
    clip = torch.cat([states_1, states_2], dim=-1)
    if comps.family == "sdxl":
        # SDXL pools from its second encoder only (the first is a plain CLIPTextModel).
        return {"encoder_hidden_states": clip, "pooled_prompt_embeds": pooled_2}
    t5 = comps.text_encoder_3(batch["input_ids_3"])[0]
    # SD3 zero-pads the CLIP states to T5's width and joins the two token sequences.
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return {
        "encoder_hidden_states": torch.cat([clip, t5.to(clip.dtype)], dim=-2),
        "pooled_prompt_embeds": torch.cat([pooled_1, pooled_2], dim=-1),
    }
