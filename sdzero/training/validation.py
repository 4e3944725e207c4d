"""Validation sampling: images from the current weights, at every ZeRO stage, without hangs.

Under ZeRO-3 each forward pass gathers the partitioned parameters with collectives; if rank 0 alone ran
the pipeline it would wait forever for the others (SimpleTuner#759). So every rank runs the same
pipeline calls with the same prompts, seeds and step counts, in lockstep, and rank 0 alone writes the
images. At ZeRO-0/1/2 the other ranks' passes are redundant work, kept so that one code path serves all.

The sampler's randomness comes from explicit generators and the global RNG is forked around it, so a
validation pass changes nothing about training (exact resume holds with or without it).

Layout (read back by `read_validation`, for the training report): `<output-dir>/validation/step_NNNNNNNN/`
holds `II_<prompt slug>.png` per prompt (II its index) and `prompts.json`, the prompts in that order.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sdzero.atomic import write_text_atomic

log = logging.getLogger("sdzero.training.validation")
PROMPTS_FILE = "prompts.json"
_STEP_FOLDER = re.compile(r"^step_(\d+)$")
_IMAGE = re.compile(r"^(\d+)_(.*)\.png$")


def slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit] or "prompt"


def step_folder(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def image_name(index: int, prompt: str) -> str:
    return f"{index:02d}_{slug(prompt)}.png"


@dataclass(frozen=True)
class ValidationStep:
    step: int
    images: list[tuple[str, Path]]
    """(prompt, image file) in prompt order."""


def read_validation(root: Path) -> list[ValidationStep]:
    """Every step folder under `root` that holds images, oldest first. A prompt comes from prompts.json;
    where that file is missing or damaged (a run killed between image and list), from the file's name."""
    root = Path(root)
    found = []
    for folder in root.iterdir() if root.is_dir() else []:
        match = _STEP_FOLDER.match(folder.name)
        if not match or not folder.is_dir():
            continue
        prompts = _read_prompts(folder / PROMPTS_FILE)
        images = []
        for path in sorted(folder.iterdir()):
            named = _IMAGE.match(path.name)
            if named and path.is_file():
                index = int(named[1])
                images.append((prompts[index] if index < len(prompts) else named[2], path))
        if images:
            found.append(ValidationStep(int(match[1]), images))
    return sorted(found, key=lambda s: s.step)


def _read_prompts(path: Path) -> list[str]:
    try:
        prompts = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    ok = isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)
    return prompts if ok else []


class Validator:
    def __init__(
        self, prompts: list[str], every: int, inference_steps: int, resolution: int, seed: int, out: Path
    ) -> None:
        self.prompts = prompts
        self.every = every
        self.inference_steps = inference_steps
        self.resolution = resolution
        self.seed = seed
        self.out = Path(out)
        self.last_step: int | None = None

    def due(self, step: int, final: bool) -> bool:
        if not self.prompts or step == self.last_step:
            return False
        return final or (self.every > 0 and step % self.every == 0)

    @torch.no_grad()
    def run(self, step: int, engine: Any, comps: Any, rank: int, device: torch.device) -> list[Path]:
        """Sample every prompt; all ranks must call this (ZeRO-3 gathers inside each network forward)."""
        from sdzero.checkpoint.export import build_pipeline

        start = time.perf_counter()
        network = engine.module  # the trained network: a UNet, or SD3's transformer
        # SD/SDXL sample with DDIM from the training betas; SD3 with a fresh copy of its flow-matching
        # scheduler (the training objective reads the unshifted-by-set_timesteps training schedule).
        scheduler = comps.family.validation_scheduler(comps)
        pipe = build_pipeline(comps, network, scheduler)  # loads the frozen parts if a cache run skipped them
        extra = comps.family.sampling_options(comps)
        pipe.set_progress_bar_config(disable=True)
        folder = step_folder(self.out, step)
        written: list[Path] = []
        network.eval()
        try:
            with torch.random.fork_rng(devices=[]):
                for i, prompt in enumerate(self.prompts):
                    generator = torch.Generator("cpu").manual_seed(self.seed + i)
                    latents = pipe(
                        prompt,
                        height=self.resolution,
                        width=self.resolution,
                        num_inference_steps=self.inference_steps,
                        generator=generator,
                        output_type="latent",
                        **extra,
                    ).images
                    image = self._decode(pipe, comps.vae, latents)
                    if rank == 0:
                        folder.mkdir(parents=True, exist_ok=True)
                        path = folder / image_name(i, prompt)
                        image.save(path)
                        written.append(path)
        finally:
            network.train()
        if rank == 0:
            write_text_atomic(folder / PROMPTS_FILE, json.dumps(self.prompts, indent=1) + "\n")
            log.info(
                "validation: %d image(s) in %s (%.1f s)", len(written), folder, time.perf_counter() - start
            )
        self.last_step = step
        return written

    @staticmethod
    def _decode(pipe: Any, vae: Any, latents: torch.Tensor):
        # Decoded here, in the VAE's own dtype: under fp16 the VAE stays fp32 (it overflows in fp16,
        # diffusers#4424) while the pipeline would hand it fp16 latents.
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        scaled = latents.to(vae.dtype) / vae.config.scaling_factor + shift
        image = vae.decode(scaled, return_dict=False)[0]
        return pipe.image_processor.postprocess(image.float(), output_type="pil")[0]
