"""Validation sampling: images from the current weights, at every ZeRO stage, without hangs.

Under ZeRO-3 each forward pass gathers the partitioned parameters with collectives; if rank 0 alone ran
the pipeline it would wait forever for the others (SimpleTuner#759). So every rank runs the same
pipeline calls with the same prompts, seeds and step counts, in lockstep, and rank 0 alone writes the
images. At ZeRO-0/1/2 the other ranks' passes are redundant work, kept so that one code path serves all.

The sampler's randomness comes from explicit generators and the global RNG is forked around it, so a
validation pass changes nothing about training (exact resume holds with or without it).
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("sdzero.validation")


def slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit] or "prompt"


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
        """Sample every prompt; all ranks must call this (ZeRO-3 gathers inside each UNet forward)."""
        from diffusers import DDIMScheduler

        from sdzero.export import build_pipeline

        start = time.perf_counter()
        unet = engine.module  # the trained network: a UNet, or SD3's transformer
        # SD/SDXL sample with DDIM from the training betas; SD3 with a fresh copy of its flow-matching
        # scheduler (the training objective reads the unshifted-by-set_timesteps training schedule).
        scheduler = None if comps.family == "sd3" else DDIMScheduler.from_config(comps.noise_scheduler.config)
        pipe = build_pipeline(comps, unet, scheduler)  # loads the frozen parts if a cache run skipped them
        extra = {"max_sequence_length": comps.max_sequence_length} if comps.family == "sd3" else {}
        pipe.set_progress_bar_config(disable=True)
        folder = self.out / f"step_{step:08d}"
        written: list[Path] = []
        unet.eval()
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
                        path = folder / f"{i:02d}_{slug(prompt)}.png"
                        image.save(path)
                        written.append(path)
        finally:
            unet.train()
        if rank == 0:
            (folder / "prompts.json").write_text(json.dumps(self.prompts, indent=1) + "\n")
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
