"""Model families as objects: everything that differs between SD 1.x/2.x, SDXL and SD3, registered once.

A `Family` knows its pipeline (the `_class_name` in model_index.json, used for export and validation), its
trained network (class, folder and pipeline attribute: a UNet for SD and SDXL, SD3's MMDiT transformer),
its text encoders and tokenizers (how a caption is tokenized and encoded into the conditioning the network
takes), its training scheduler, its objective (DDPM epsilon/v-prediction with Min-SNR, or SD3's flow
matching: what each sample draws and how the loss is formed; the math is in sdzero.models.objectives) and the
options only it accepts. `detect_family(model)` reads the pipeline folder and returns the registered object;
code elsewhere asks it (`comps.family.encode_prompts(...)`, `family.subfolder`) instead of comparing names.

`name` ("sd", "sdxl", "sd3") is what manifests and cache specs record. A Family compares equal to its name
string and hashes like it, so tables keyed by name (manifests, cache specs) find it. Code asks the
object; a test (tests/unit/test_family_registry.py) refuses name comparisons outside this module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from sdzero.config.user_file import read_user_bytes
from sdzero.errors import UserError
from sdzero.models.objectives import FlowSettings, LossInputs, Objective, ddpm_loss, flow_matching_loss
from sdzero.models.step_input import PromptEmbeds, StepInput

if TYPE_CHECKING:
    from sdzero.config.train_config import TrainConfig

DEFAULT_MAX_SEQUENCE_LENGTH = 77
"""T5 tokens per caption for SD3 when --max-sequence-length is not given (diffusers' SD3 training default)."""

TEXT_SLOTS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""The pipelines' names for their text encoders, in order; tokenizer `k` pairs with encoder `k`."""


def flow_flags(cfg: TrainConfig) -> list[str]:
    """The flow-matching (SD3) flags this run sets."""
    flags = {
        "--weighting-scheme": cfg.weighting_scheme is not None,
        "--logit-mean": cfg.logit_mean is not None,
        "--logit-std": cfg.logit_std is not None,
        "--mode-scale": cfg.mode_scale is not None,
        "--precondition-outputs": cfg.precondition_outputs,
        "--max-sequence-length": cfg.max_sequence_length is not None,
    }
    return [flag for flag, is_set in flags.items() if is_set]


def ddpm_flags(cfg: TrainConfig) -> list[str]:
    """The DDPM (SD, SDXL) objective flags this run sets."""
    flags = {
        "--prediction-type": cfg.prediction_type is not None,
        "--snr-gamma": cfg.snr_gamma is not None,
        "--noise-offset": cfg.noise_offset > 0,
    }
    return [flag for flag, is_set in flags.items() if is_set]


def _ids(tokenizer: Any, text: str, max_length: int) -> torch.Tensor:
    ids = tokenizer(text, padding="max_length", max_length=max_length, truncation=True).input_ids
    return torch.tensor(ids, dtype=torch.long)


def _clip_states(encoder: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(penultimate hidden states, projected pooled embedding or None): what SDXL and SD3 condition on."""
    out = encoder(ids, output_hidden_states=True)
    return out.hidden_states[-2], getattr(out, "text_embeds", None)


class Family:
    """One model family. Subclasses set the class attributes and override what their family does
    differently; one instance of each is registered (`FAMILIES`)."""

    name: ClassVar[str]
    pipeline_class_name: ClassVar[str]
    """model_index.json's `_class_name`: how the family is recognised, and the pipeline exports build."""
    network_class_name: ClassVar[str]
    """The diffusers class of the trained network."""
    network_attr: ClassVar[str] = "unet"
    """The trained network's pipeline attribute, which is also its folder in a pipeline folder."""
    text_encoder_classes: ClassVar[tuple[str, ...]]
    """transformers classes of the frozen text encoders, in pipeline order (TEXT_SLOTS)."""
    tokenizer_classes: ClassVar[tuple[str, ...]]
    scheduler_class_name: ClassVar[str]
    """The scheduler training reads the noise schedule through (not necessarily the pipeline's sampler)."""
    pipeline_options: ClassVar[dict[str, Any]] = {}
    """Further pipeline constructor arguments for export and validation."""
    lora_targets: ClassVar[tuple[str, ...]] = ("to_k", "to_q", "to_v", "to_out.0")
    """Modules that get LoRA adapters by default (--lora-rank): the UNet attention projections of diffusers'
    train_text_to_image_lora / train_dreambooth_lora scripts."""

    # -- identity: equal to (and hashed like) the name, so `comps.family == "sd3"` keeps working meanwhile

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Family):
            return other.name == self.name
        if isinstance(other, str):
            return other == self.name
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"<family {self.name}: {self.pipeline_class_name}>"

    def __reduce__(self) -> tuple[Callable[[str], Family], tuple[str]]:
        return family_named, (self.name,)  # unpickles (e.g. in a spawned worker) to the registered object

    # -- parts

    @property
    def subfolder(self) -> str:
        """Where the pipeline folder keeps the trained network."""
        return self.network_attr

    @property
    def text_encoders(self) -> tuple[str, ...]:
        """The frozen text encoders' pipeline attribute (and folder) names."""
        return TEXT_SLOTS[: len(self.text_encoder_classes)]

    @property
    def tokenizers(self) -> tuple[str, ...]:
        return tuple(name.replace("text_encoder", "tokenizer") for name in self.text_encoders)

    def network_class(self) -> Any:
        import diffusers

        return getattr(diffusers, self.network_class_name)

    def pipeline_class(self) -> Any:
        import diffusers

        return getattr(diffusers, self.pipeline_class_name)

    def scheduler_class(self) -> Any:
        import diffusers

        return getattr(diffusers, self.scheduler_class_name)

    def load_network(self, model: str) -> torch.nn.Module:
        # The trained net is loaded in fp32; DeepSpeed casts it and keeps fp32 master weights itself.
        return self.network_class().from_pretrained(model, subfolder=self.subfolder)

    def load_scheduler(self, model: str) -> Any:
        return self.scheduler_class().from_pretrained(model, subfolder="scheduler")

    def load_tokenizers(self, model: str) -> dict[str, Any]:
        import transformers

        return {
            name: getattr(transformers, cls).from_pretrained(model, subfolder=name)
            for name, cls in zip(self.tokenizers, self.tokenizer_classes, strict=True)
        }

    def load_text_encoders(self, model: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
        import transformers

        # torch_dtype at load time: T5 keeps the modules it knows overflow in fp16 (`wo`) in fp32.
        return {
            name: getattr(transformers, cls).from_pretrained(model, subfolder=name, torch_dtype=dtype)
            for name, cls in zip(self.text_encoders, self.text_encoder_classes, strict=True)
        }

    # -- text: captions -> token ids (in the data worker) -> conditioning (on the device)

    def token_length(self, comps: Components, slot: int) -> int:
        """Tokens per caption for text encoder `slot`: the CLIP tokenizers' own length."""
        return int(getattr(comps, self.tokenizers[slot]).model_max_length)

    def tokenize(self, comps: Components, text: str) -> tuple[torch.Tensor, ...]:
        """Every token tensor the family's text encoders take, for one caption, in encoder order (a
        StepInput's `token_ids`): CLIP-L, then CLIP-G (SDXL, SD3), then T5 (SD3)."""
        return tuple(
            _ids(getattr(comps, name), text, self.token_length(comps, slot))
            for slot, name in enumerate(self.tokenizers)
        )

    @torch.no_grad()
    def encode_prompts(self, comps: Components, token_ids: tuple[torch.Tensor, ...]) -> PromptEmbeds:
        """The text conditioning of a micro-batch's token ids (what a latent/text-embedding cache stores):
        `encoder_hidden_states` for every family, plus `pooled_prompt_embeds` for SDXL and SD3."""
        if not comps.frozen_loaded:
            raise RuntimeError(
                "encode_prompts needs the text encoders; load_components(frozen=False) skipped them"
            )
        return self._encode(comps, token_ids)

    def _encode(self, comps: Components, token_ids: tuple[torch.Tensor, ...]) -> PromptEmbeds:
        raise NotImplementedError

    def text_tokens(self, max_sequence_length: int | None) -> int | None:
        """The T5 sequence length a text cache is built for; None for families without T5."""
        return None

    # -- objective

    def flow_settings(self, cfg: TrainConfig) -> FlowSettings | None:
        """What each sample draws besides noise and a DDPM timestep: SD3's flow-matching settings
        (its samples draw `flow_u`), None for the DDPM families."""
        return None

    def resolve_prediction_type(self, scheduler: Any, requested: str | None) -> str:
        """The training target: `requested` or the scheduler's own, recorded in the scheduler so that
        exports carry it."""
        prediction_type = requested or scheduler.config.prediction_type
        scheduler.register_to_config(prediction_type=prediction_type)
        return prediction_type

    def objective(self, cfg: TrainConfig, scheduler: Any) -> Objective:
        """The run's objective, resolved once (the prediction type is recorded in `scheduler`)."""
        return Objective(
            self.resolve_prediction_type(scheduler, cfg.prediction_type), snr_gamma=cfg.snr_gamma
        )

    def added_inputs(self, cond: PromptEmbeds, step: StepInput, dtype: torch.dtype) -> dict[str, Any]:
        """Network inputs besides (noisy latents, timesteps, text states): none for SD 1.x/2.x."""
        return {}

    def loss(self, inputs: LossInputs, objective: Objective) -> torch.Tensor:
        """One micro-batch's loss: noise the latents with the samples' own noise and timesteps, predict,
        compare. `inputs.cond` is the text conditioning (`encode_prompts`, or a cache); `inputs.step` carries
        the per-sample randomness and SDXL's size/crop inputs."""
        added = self.added_inputs(inputs.cond, inputs.step, inputs.model_dtype)
        return ddpm_loss(inputs, objective, added)

    # -- options

    def check_options(self, cfg: TrainConfig) -> None:
        """Refuse options that only another family's objective understands (checked once the model's
        family is known, before any process group exists)."""
        flags = flow_flags(cfg)
        if flags:
            raise UserError(
                f"{', '.join(flags)}: SD3 (flow matching) options, but --model {cfg.model} is a {self.name} "
                "pipeline; drop them or train an SD3 model"
            )

    def identity_options(self, cfg: TrainConfig) -> dict[str, Any]:
        """The family's own options that shape the trajectory, keyed by flag (a resume must keep them)."""
        return {}

    # -- sampling (validation) and export

    def validation_scheduler(self, comps: Components) -> Any:
        """The scheduler validation samples with, None for the pipeline's own (see export.build_pipeline):
        SD and SDXL sample with DDIM from the training betas."""
        from diffusers import DDIMScheduler

        return DDIMScheduler.from_config(comps.noise_scheduler.config)

    def sampling_options(self, comps: Components) -> dict[str, Any]:
        """Further arguments of the pipeline's `__call__`."""
        return {}

    def build_pipeline(self, comps: Components, network: torch.nn.Module, scheduler: Any) -> Any:
        """The family's diffusers pipeline around `network` and the frozen parts of `comps`."""
        parts = {name: getattr(comps, name) for name in (*self.text_encoders, *self.tokenizers)}
        return self.pipeline_class()(
            vae=comps.vae,
            **parts,
            **{self.network_attr: network},
            scheduler=scheduler,
            **self.pipeline_options,
        )


FAMILIES: tuple[Family, ...] = ()
_BY_NAME: dict[str, Family] = {}
_BY_PIPELINE: dict[str, Family] = {}


def register(cls: type[Family]) -> type[Family]:
    """Register the family (one instance); its name and pipeline class must be new."""
    global FAMILIES
    family = cls()
    if family.name in _BY_NAME or family.pipeline_class_name in _BY_PIPELINE:
        raise ValueError(f"family {family.name} ({family.pipeline_class_name}) is registered twice")
    _BY_NAME[family.name] = _BY_PIPELINE[family.pipeline_class_name] = family
    FAMILIES = (*FAMILIES, family)
    return cls


@register
class StableDiffusion(Family):
    """SD 1.x/2.x: one CLIP text encoder, a UNet, DDPM epsilon or v-prediction."""

    name = "sd"
    pipeline_class_name = "StableDiffusionPipeline"
    network_class_name = "UNet2DConditionModel"
    text_encoder_classes = ("CLIPTextModel",)
    tokenizer_classes = ("CLIPTokenizer",)
    scheduler_class_name = "DDPMScheduler"
    pipeline_options = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}

    def _encode(self, comps: Components, token_ids: tuple[torch.Tensor, ...]) -> PromptEmbeds:
        return PromptEmbeds(comps.text_encoder(token_ids[0])[0])


@register
class StableDiffusionXL(Family):
    """SDXL: two CLIP encoders, their pooled embedding and size/crop micro-conditioning (add_time_ids)."""

    name = "sdxl"
    pipeline_class_name = "StableDiffusionXLPipeline"
    network_class_name = "UNet2DConditionModel"
    text_encoder_classes = ("CLIPTextModel", "CLIPTextModelWithProjection")
    tokenizer_classes = ("CLIPTokenizer", "CLIPTokenizer")
    # SDXL ships an Euler sampler config; training reads the same betas through DDPM, as diffusers does.
    scheduler_class_name = "DDPMScheduler"
    pipeline_options = {"add_watermarker": False}

    def _encode(self, comps: Components, token_ids: tuple[torch.Tensor, ...]) -> PromptEmbeds:
        states_1, _ = _clip_states(comps.text_encoder, token_ids[0])
        states_2, pooled_2 = _clip_states(comps.text_encoder_2, token_ids[1])
        # SDXL pools from its second encoder only (the first is a plain CLIPTextModel).
        return PromptEmbeds(torch.cat([states_1, states_2], dim=-1), pooled_prompt_embeds=pooled_2)

    def added_inputs(self, cond: PromptEmbeds, step: StepInput, dtype: torch.dtype) -> dict[str, Any]:
        """SDXL's micro-conditioning: the pooled text embedding and six numbers per sample, (original
        height, width, crop top, left, target height, width), which the UNet embeds like timesteps."""
        if cond.pooled_prompt_embeds is None:
            raise ValueError("SDXL conditions on a pooled prompt embedding; this conditioning has none")
        time_ids = torch.cat([step.original_size, step.crop_top_left, step.target_size], dim=1)
        added = {"text_embeds": cond.pooled_prompt_embeds.to(dtype), "time_ids": time_ids.to(dtype)}
        return {"added_cond_kwargs": added}


@register
class StableDiffusion3(Family):
    """SD3: an MMDiT transformer trained by flow matching; CLIP-L, CLIP-G and T5."""

    name = "sd3"
    pipeline_class_name = "StableDiffusion3Pipeline"
    network_class_name = "SD3Transformer2DModel"
    network_attr = "transformer"
    text_encoder_classes = ("CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel")
    tokenizer_classes = ("CLIPTokenizer", "CLIPTokenizer", "T5TokenizerFast")
    scheduler_class_name = "FlowMatchEulerDiscreteScheduler"
    # diffusers' train_dreambooth_lora_sd3 defaults: both streams' attention projections of the MMDiT.
    lora_targets = (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    )

    def token_length(self, comps: Components, slot: int) -> int:
        return comps.max_sequence_length if slot == 2 else super().token_length(comps, slot)  # T5: the option

    def _encode(self, comps: Components, token_ids: tuple[torch.Tensor, ...]) -> PromptEmbeds:
        states_1, pooled_1 = _clip_states(comps.text_encoder, token_ids[0])
        states_2, pooled_2 = _clip_states(comps.text_encoder_2, token_ids[1])
        clip = torch.cat([states_1, states_2], dim=-1)
        t5 = comps.text_encoder_3(token_ids[2])[0]
        # SD3 zero-pads the CLIP states to T5's width and joins the two token sequences.
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return PromptEmbeds(
            torch.cat([clip, t5.to(clip.dtype)], dim=-2),
            pooled_prompt_embeds=torch.cat([pooled_1, pooled_2], dim=-1),
        )

    def text_tokens(self, max_sequence_length: int | None) -> int | None:
        return max_sequence_length or DEFAULT_MAX_SEQUENCE_LENGTH

    def flow_settings(self, cfg: TrainConfig) -> FlowSettings | None:
        return FlowSettings.from_config(cfg)

    def resolve_prediction_type(self, scheduler: Any, requested: str | None) -> str:
        return "flow_matching"  # its scheduler has no prediction_type; check_options refuses one

    def objective(self, cfg: TrainConfig, scheduler: Any) -> Objective:
        return Objective("flow_matching", flow=FlowSettings.from_config(cfg))

    def loss(self, inputs: LossInputs, objective: Objective) -> torch.Tensor:
        if objective.flow is None:
            raise ValueError("SD3 trains by flow matching: pass its FlowSettings")
        return flow_matching_loss(inputs, objective.flow)

    def check_options(self, cfg: TrainConfig) -> None:
        flags = ddpm_flags(cfg)
        if flags:
            raise UserError(
                f"{', '.join(flags)}: DDPM options, but --model {cfg.model} is SD3, trained by flow matching; "
                "use --weighting-scheme (and --logit-mean/--logit-std/--mode-scale) instead"
            )

    def identity_options(self, cfg: TrainConfig) -> dict[str, Any]:
        from dataclasses import asdict

        settings: dict[str, Any] = {
            f"--{k.replace('_', '-')}": v for k, v in asdict(FlowSettings.from_config(cfg)).items()
        }
        settings["--max-sequence-length"] = cfg.max_sequence_length
        return settings

    def validation_scheduler(self, comps: Components) -> Any:
        # A fresh copy of its flow-matching sampler (build_pipeline's default): the training objective reads
        # the schedule as it was before any set_timesteps.
        return None

    def sampling_options(self, comps: Components) -> dict[str, Any]:
        return {"max_sequence_length": comps.max_sequence_length}


# ---------------------------------------------------------------------------------------------------
# Looking families up


def family_named(name: str) -> Family:
    """The registered family called `name` (as manifests and cache specs record it)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(_BY_NAME)})") from None


def as_family(family: Family | str) -> Family:
    """`family` itself, or the registered family of that name."""
    return family if isinstance(family, Family) else family_named(family)


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
        index = json.loads(read_user_bytes(path, f"--model {model}:").decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise UserError(f"--model {model}: unreadable model_index.json ({exc})") from None
    if not isinstance(index, dict):  # a list or a number would fail later as an AttributeError
        raise UserError(
            f"--model {model}: model_index.json holds a JSON {type(index).__name__}, not an object; "
            "pass a diffusers pipeline folder (its model_index.json names the pipeline class)"
        )
    return index


def detect_family(model: str) -> Family:
    """The family comes from the pipeline folder itself, so users never have to state it twice."""
    class_name = read_model_index(model).get("_class_name", "")
    if not isinstance(class_name, str):  # a list or an object is unhashable: a TypeError traceback once
        raise UserError(
            f"--model {model}: model_index.json's _class_name must be a pipeline class name (a string), got "
            f"{json.dumps(class_name)[:80]}"
        )
    family = _BY_PIPELINE.get(class_name)
    if family is None:
        known = ", ".join(_BY_PIPELINE)
        raise UserError(
            f"--model {model}: pipeline class {class_name!r} is not supported yet (supported: {known})"
        )
    return family


@dataclass
class Components:
    """A pipeline's parts as the trainer uses them.

    `network` is the trained network: the UNet2DConditionModel of SD 1.x/2.x and SDXL, the
    SD3Transformer2DModel (MMDiT) of SD3; `family` says which, and everything else that differs (a
    family's name is accepted too and looked up). The frozen parts (`vae`, `text_encoder*`) are None when
    loaded with `frozen=False` (training from a latent/text cache); the latent geometry and scaling then
    come from the VAE's config alone.
    """

    family: Family
    network: torch.nn.Module
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

    def __post_init__(self) -> None:
        self.family = as_family(self.family)

    @property
    def latent_channels(self) -> int:
        return int(self.network.config.in_channels)

    @property
    def trained_subfolder(self) -> str:
        return self.family.subfolder

    @property
    def frozen_loaded(self) -> bool:
        return self.vae is not None and all(getattr(self, n) is not None for n in self.family.text_encoders)

    def frozen_modules(self) -> tuple[torch.nn.Module, ...]:
        """The loaded frozen modules (VAE and text encoders), replicated on every rank."""
        names = ("vae", *self.family.text_encoders)
        return tuple(m for m in (getattr(self, n) for n in names) if m is not None)
