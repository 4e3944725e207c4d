"""Loading a diffusers pipeline's parts: the trained network, and the frozen VAE and text encoders.

What each family loads (classes, folders, tokenizers) is on its `Family` (sdzero.models.families); the parts once
loaded (`Components`) live beside the families; this module does the loading.

Every part is loaded with `from_pretrained(model, subfolder=...)`, the path a hub id or a local folder
takes alike. Nothing here runs under `deepspeed.zero.Init`: frozen parts created inside it would be
partitioned by ZeRO-3 and fail with size-0 weights (diffusers#1865), so they stay plain replicated modules.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from sdzero.config.user_file import read_user_bytes
from sdzero.errors import UserError
from sdzero.models.families import DEFAULT_MAX_SEQUENCE_LENGTH, Components
from sdzero.models.families import detect_family as detect_family  # re-exported: its callers import it here
from sdzero.models.step_input import PromptEmbeds

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOAD_ERRORS = (OSError, ValueError, pickle.UnpicklingError, EOFError)
"""What the libraries raise for a part they cannot read: a missing or damaged file, a config they reject,
and a `.bin` whose pickle the weights-only loader refuses (a payload: UnpicklingError, which is neither
of the first two), or a truncated one (EOFError)."""
PART_CONFIGS = {"scheduler": "scheduler_config.json", "vae": "config.json"}
"""The config file of each part a local pipeline folder holds (the network's and text encoders' are config.json)."""


def load_error_line(exc: BaseException) -> str:
    """A library's error as the one line a user needs: its first line, the type when it has none."""
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else ""
    if isinstance(exc, pickle.UnpicklingError):
        return f"a weights file holds a pickle the safe loader refuses ({first[:160]}); nothing in it was run"
    return first or type(exc).__name__


def check_part_configs(model: str, family: Any) -> None:
    """Each part's config file in a local folder holds a JSON object: the libraries assume one, and a list
    (a scheduler config written as `[...]`) was reported as "couldn't connect to huggingface.co"."""
    local = Path(model)
    if not local.is_dir():
        return
    parts = {**PART_CONFIGS, family.subfolder: "config.json"}
    parts.update({name: "config.json" for name in family.text_encoders})
    for folder, name in parts.items():
        path = local / folder / name
        if not os.path.lexists(path):
            continue  # the library says which part is missing, in its words
        flag = f"--model {model}:"
        try:
            raw = json.loads(read_user_bytes(path, flag).decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise UserError(f"{flag} {folder}/{name} is not JSON ({load_error_line(exc)})") from None
        if not isinstance(raw, dict):
            raise UserError(
                f"{flag} {folder}/{name} holds a JSON {type(raw).__name__}, not an object; write the part's "
                "config as the library saves it (a JSON object)"
            )


def check_network_fits(model: str, family: Any) -> None:
    """The trained network's config, built on the meta device (no memory): its parameters in fp32 must fit
    this machine's memory, or a config with enormous channel counts would be allocated until the kernel
    kills the run."""
    import psutil

    if not Path(model).is_dir():
        return  # a hub id: its config is fetched by from_pretrained, and a hub model is a real one
    cls = family.network_class()
    try:
        config = cls.load_config(model, subfolder=family.subfolder)
        with torch.device("meta"):
            network = cls.from_config(config)
    except LOAD_ERRORS + (TypeError, KeyError, RuntimeError, AssertionError) as exc:
        raise UserError(
            f"--model {model}: {family.subfolder}/config.json does not build a {cls.__name__} "
            f"({load_error_line(exc)})"
        ) from None
    fp32_bytes = 4 * sum(p.numel() for p in network.parameters())
    memory = psutil.virtual_memory().total
    if fp32_bytes > memory:
        raise UserError(
            f"--model {model}: {family.subfolder}/config.json asks for {fp32_bytes / 4:.3g} parameters "
            f"({fp32_bytes / 2**30:.1f} GiB in fp32), more than this machine's {memory / 2**30:.1f} GiB of "
            "memory; check its channel counts (block_out_channels, ...)"
        )


def frozen_dtypes(compute: str) -> tuple[torch.dtype, torch.dtype]:
    """(text encoder, VAE) dtypes. The VAE stays fp32 under fp16: SD VAEs overflow to NaN in fp16
    (diffusers#4424); bf16 has fp32's range, so it is safe there."""
    dtype = DTYPES[compute]
    return dtype, (torch.float32 if compute == "fp16" else dtype)


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
    check_part_configs(model, family)
    check_network_fits(model, family)
    text_dtype, vae_dtype = frozen_dtypes(compute)
    parts: dict[str, Any] = {}
    try:
        parts.update(family.load_tokenizers(model))
        if frozen:
            parts.update(
                {k: _freeze(m, device) for k, m in family.load_text_encoders(model, text_dtype).items()}
            )
            parts["vae"] = _freeze(_load_vae(model, vae_dtype), device)
            vae_config = dict(parts["vae"].config)
        else:
            vae_config = dict(AutoencoderKL.load_config(model, subfolder="vae"))
        noise_scheduler = family.load_scheduler(model)
        sampler_class = type(noise_scheduler).load_config(model, subfolder="scheduler").get("_class_name", "")
        network = family.load_network(model)
    except LOAD_ERRORS as exc:
        raise UserError(f"--model {model}: a pipeline part failed to load: {load_error_line(exc)}") from None
    network.train()
    scale = 2 ** (len(vae_config["block_out_channels"]) - 1)
    return Components(
        family=family,
        network=network,
        vae=parts.pop("vae", None),
        noise_scheduler=noise_scheduler,
        vae_scale_factor=scale,
        native_resolution=int(network.config.sample_size) * scale,
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
        for name, module in comps.family.load_text_encoders(comps.model, text_dtype).items():
            setattr(comps, name, _freeze(module, device))
        comps.vae = _freeze(_load_vae(comps.model, vae_dtype), device)
    except LOAD_ERRORS as exc:
        raise UserError(
            f"--model {comps.model}: a frozen pipeline part failed to load: {load_error_line(exc)}"
        ) from None
    return comps


def sampling_scheduler(comps: Components) -> Any:
    """A fresh scheduler for sampling: the pipeline's own class, built from the training schedule's config
    (so a v-prediction run samples as v-prediction). Fresh, because `set_timesteps` rewrites a scheduler's
    schedule and the training objective reads the training one."""
    import diffusers

    cls = getattr(diffusers, comps.sampler_class, None) or type(comps.noise_scheduler)
    return cls.from_config(comps.noise_scheduler.config)


def resolve_prediction_type(comps: Components, requested: str | None) -> str:
    """The training target (Family.resolve_prediction_type): "flow_matching" for SD3; for the DDPM
    families `requested` or the scheduler's own, recorded in the scheduler so exports carry it."""
    return comps.family.resolve_prediction_type(comps.noise_scheduler, requested)


def tokenize(comps: Components, text: str) -> tuple[torch.Tensor, ...]:
    """Every token tensor the family's text encoders take, for one caption (Family.tokenize)."""
    return comps.family.tokenize(comps, text)


def encode_prompts(comps: Components, token_ids: tuple[torch.Tensor, ...]) -> PromptEmbeds:
    """The text conditioning of a micro-batch's token ids (Family.encode_prompts)."""
    return comps.family.encode_prompts(comps, token_ids)
