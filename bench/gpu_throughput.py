"""sdzero's training throughput on one CUDA GPU, against the diffusers text-to-image example's loop pattern,
with each GPU switch on and off, and the model FLOPs utilization (MFU) against the device's bf16 peak.

Network: Stable Diffusion 1.5's UNet config (random weights, 860 M parameters) at 512 px (64x64 latents),
micro-batch 8, bf16 compute, AdamW (torch's, lr 1e-5, gradient clipping at 1.0), one GPU. Both loops train
from pre-made latents and text embeddings, as from a latent cache (sdzero --cache-dir), so the figure is the
trained network's and not the frozen VAE's.

Rows (each a fresh UNet, warm-up steps, then timed steps between two device synchronizes):
- example: the loop pattern of diffusers' examples/text_to_image/train_text_to_image.py, written here: fp32
  weights under torch.autocast(bf16), noise and timesteps, add_noise, UNet, MSE, backward, clip at 1.0,
  AdamW step, zero_grad, and the example's per-step `gather(loss).mean().item()` (a sync per step).
- sdzero: `Trainer.train` on a one-rank DeepSpeed engine, ZeRO-2 bf16 (ds_configs/zero2_bf16.json with
  sdzero's own fused AdamW), default switches; then one switch changed per row (--sync-timing, --no-tf32,
  --channels-last, --attention flash|efficient|math, --compile) and the best pair (channels-last + compile).

MFU = model FLOPs per sample x samples/s / peak. FLOPs per sample: torch.utils.flop_counter.FlopCounterMode
over one forward and backward of the UNet at batch 1 in bf16 (matmuls, convolutions and attention, the ops
it counts; norms and pointwise ops are not counted, as is usual for MFU). Peak: dense bf16 tensor-core
FLOP/s from the vendor's datasheet for the device name (PEAK_BF16_TFLOPS), or --peak-tflops.

    python bench/gpu_throughput.py --out results/gpu_throughput [--batch 8] [--steps 10] [--budget-s 360]

Without CUDA it refuses with exit code 2. `--cpu-rehearsal` runs the same code on the CPU with a small
UNet at 64 px, to check the script before spending GPU time (its figures mean nothing). Results:
<out>/gpu_throughput.json and <out>/gpu_throughput.md. docs/gpu.md says how to run it and read it.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "A10G": 70.0,
}
"""Dense bf16 tensor-core TFLOP/s by device-name fragment (NVIDIA datasheets; first match wins)."""

VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("defaults", {}),
    ("sync-timing", {"sync_timing": True}),
    ("no-tf32", {"tf32": False}),
    ("channels-last", {"channels_last": True}),
    ("attention-flash", {"attention": "flash"}),
    ("attention-efficient", {"attention": "efficient"}),
    ("attention-math", {"attention": "math"}),
    ("compile", {"compile": True}),
    ("channels-last+compile", {"channels_last": True, "compile": True}),
]
"""sdzero rows: a name (the run options it changes from the defaults, without dashes) and those options."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_throughput.json/.md")
    p.add_argument("--batch", type=int, default=8, help="micro-batch (samples per step)")
    p.add_argument("--resolution", type=int, default=512, help="pixels (latents are 1/8 of it)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per row")
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per row (allocations, cuDNN, compile)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="rows that would start after this many seconds are skipped",
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, TFLOP/s")
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="rows to leave out, by name (e.g. compile channels-last+compile)",
    )
    p.add_argument(
        "--cpu-rehearsal", action="store_true", help="small UNet on the CPU: checks the script only"
    )
    return p.parse_args()


def unet_config(small: bool) -> dict[str, Any]:
    """SD 1.5's UNet (runwayml/stable-diffusion-v1-5 unet/config.json), or a small stand-in."""
    return {
        "sample_size": 64,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 1 if small else 2,
        "block_out_channels": (32, 64, 64, 64) if small else (320, 640, 1280, 1280),
        "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        "cross_attention_dim": 64 if small else 768,
        "attention_head_dim": 8,
        "norm_num_groups": 32,
    }


def peak_flops(name: str, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    for fragment, tflops in PEAK_BF16_TFLOPS.items():
        if fragment in name:
            return tflops * 1e12
    return None


def premade_batch(g: Any, batch: int, side: int, text_width: int, device: Any) -> Any:
    """One cached-input micro-batch (a StepInput as sdzero.data.cache makes): posterior mean/std, its eps,
    text states, noise, t; drawn from `g` in that order."""
    import torch

    from sdzero.models.step_input import LatentPosterior, PromptEmbeds, StepInput

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=g).to(device)

    mean, std = randn(batch, 4, side, side), 0.1 * randn(batch, 4, side, side).abs()
    eps, noise, text = randn(batch, 4, side, side), randn(batch, 4, side, side), randn(batch, 77, text_width)
    timestep = torch.randint(0, 1000, (batch,), generator=g).to(device)
    # SDXL's size/crop inputs, which SD ignores: the trained size in pixels (the VAE downsamples by 8).
    size = torch.tensor([[8 * side, 8 * side]] * batch, device=device)
    return StepInput(
        noise=noise,
        latent_eps=eps,
        timestep=timestep,
        index=torch.arange(batch, device=device),
        original_size=size,
        crop_top_left=torch.zeros_like(size),
        target_size=size,
        posterior=LatentPosterior(mean, std),
        prompt_embeds=PromptEmbeds(text),
    )


def premade_batches(n: int, batch: int, side: int, text_width: int, device: Any) -> list[Any]:
    """`n` cached-input micro-batches (StepInputs), the same ones on every run (a seeded generator)."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [premade_batch(g, batch, side, text_width, device) for _ in range(n)]


class Premade:
    """What the Trainer draws batches from (as bench/trainer_overhead.py's)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches, self.i, self.epoch, self.batches_in_epoch = batches, 0, 0, 0
        self.samples_in_epoch = 0  # the data position a checkpoint records (sdzero.data.feed.Batches)

    def next(self) -> Any:
        self.i += 1
        return self.batches[self.i % len(self.batches)]

    def check_late(self) -> int:
        return 0  # no images read, none failing late


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def flops_per_sample(base_unet: Any, side: int, text_width: int, device: Any) -> float:
    """Forward + backward FLOPs of the UNet for one sample, counted by FlopCounterMode in bf16."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    unet = copy.deepcopy(base_unet).to(device)
    x = torch.randn(1, 4, side, side, device=device)
    text = torch.randn(1, 77, text_width, device=device)
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(device.type, dtype=torch.bfloat16):
        unet(x, torch.tensor([500], device=device), text).sample.float().pow(2).mean().backward()
    del unet
    return float(counter.get_total_flops())


def example_rate(a: argparse.Namespace, base_unet: Any, batches: list, scheduler: Any, device: Any) -> float:
    """samples/s of the diffusers example's loop pattern (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from sdzero.training.fast_paths import apply_backend_flags

    # TF32 on, as sdzero's default, for a like-for-like row
    apply_backend_flags(SimpleNamespace(tf32=True), device.type)
    unet = copy.deepcopy(base_unet).to(device).train()
    params = [p for p in unet.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, **fused)
    feed = Premade(batches)
    scale = 0.18215

    def step() -> None:
        b = feed.next()
        latents = (b.posterior.mean + b.posterior.std * b.latent_eps) * scale
        noisy = scheduler.add_noise(latents, b.noise, b.timestep)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = unet(noisy, b.timestep, b.prompt_embeds.encoder_hidden_states).sample
        loss = F.mse_loss(pred.float(), b.noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach().repeat(a.batch).mean())  # the example's per-step loss read-back (.item())

    for _ in range(a.warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync(device)
    return a.batch * a.steps / (time.perf_counter() - start)  # the UNet and optimizer go with this frame


def ds_config(a: argparse.Namespace, dest: Path) -> Path:
    """The shipped ZeRO-2 bf16 JSON at this micro-batch, without its optimizer section: sdzero then builds
    torch's fused AdamW (DeepSpeed's FusedAdam would first JIT-build with nvcc, minutes of the budget).
    `a.deepspeed_adam` keeps the section: DeepSpeed's FusedAdam where nvcc matches torch's CUDA
    (sdzero.training.adam_kernel)."""
    raw = json.loads((REPO / "ds_configs" / "zero2_bf16.json").read_text())
    if not getattr(a, "deepspeed_adam", False):
        raw.pop("optimizer", None)
    raw["train_micro_batch_size_per_gpu"] = a.batch
    dest.write_text(json.dumps(raw, indent=2) + "\n")
    return dest


def sdzero_rate(
    a: argparse.Namespace, options: dict[str, Any], base_unet: Any, batches: list, scheduler: Any, device: Any
) -> tuple[float, dict[str, Any]]:
    """samples/s of sdzero's own Trainer with these run options, and what it really used."""
    import torch

    from sdzero.config.train_config import TrainConfig, load_ds_config
    from sdzero.models.families import Components
    from sdzero.models.loading import DTYPES
    from sdzero.telemetry.phase_timers import timing_mode
    from sdzero.training.engine import init_engine
    from sdzero.training.fast_paths import apply_backend_flags, check_attention, speed_report
    from sdzero.training.trainer import Trainer
    from sdzero.training.trainer_parts import DataSide, ModelSide, RunSettings

    work = a.out / "work"
    (work / "data").mkdir(parents=True, exist_ok=True)
    ds = load_ds_config(ds_config(a, work / "ds_config.json"), 1)
    cfg = TrainConfig(
        deepspeed_config=ds.path,
        model="bench/sd15-sized-unet",
        data=work / "data",
        output_dir=work / "run",
        max_steps=a.warmup,
        lr=1e-5,
        resolution=a.resolution,
        **options,
    )
    apply_backend_flags(cfg, device.type)
    comps = Components(
        family="sd",
        network=copy.deepcopy(base_unet),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        noise_scheduler=scheduler,
        vae_scale_factor=8,
        native_resolution=a.resolution,
        latent_scaling_factor=0.18215,
    )
    engine, _ = init_engine(cfg, ds, comps)
    try:
        attention = check_attention(cfg, engine.module, DTYPES[ds.dtype], device)
        used = speed_report(cfg, engine, timing_mode(device, cfg.sync_timing), attention)
        # Built from parts: this in-memory UNet has no pipeline folder or dataset to set a run up from, and
        # nothing is due around the step (no EMA, checkpoint, validation or stop vote): no callbacks.
        trainer = Trainer(
            RunSettings(cfg, ds, device), ModelSide(comps, engine, "epsilon"), DataSide(Premade(batches))
        )
        trainer.train()  # warm-up: --max-steps is a.warmup
        sync(device)
        start = time.perf_counter()
        trainer.train(until=trainer.state.step + a.steps)
        sync(device)
        return a.batch * a.steps / (time.perf_counter() - start), used
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, comps
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def start_one_rank(device_type: str) -> None:
    """A one-rank process group in this process (NCCL on CUDA, gloo on the CPU), as DeepSpeed expects."""
    from sdzero.cluster.launch_command import free_port
    from sdzero.process.distributed import start_distributed

    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
    ):
        os.environ.setdefault(key, value)
    start_distributed(backend="nccl" if device_type == "cuda" else "gloo", set_device=device_type == "cuda")


def rows_to_markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# sdzero GPU throughput: {results['device']}",
        "",
        f"{results['settings']}; {results['flops_per_sample'] / 1e9:.1f} GFLOP per sample (forward + backward, "
        f"FlopCounterMode); peak {results['peak_tflops'] or 'unknown'} TFLOP/s bf16 dense.",
        "",
        "| row | samples/s | vs example | MFU | attention kernel | optimizer | note |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    example = next((r["samples_per_s"] for r in results["rows"] if r["row"] == "example"), None)
    for r in results["rows"]:
        rate = r.get("samples_per_s")
        ratio = f"{rate / example:.3f}" if rate and example else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
        used = r.get("used", {})
        kernel = ", ".join(f"{k}: {v}" for k, v in used.get("attention_kernel_by_head_size", {}).items())
        lines.append(
            f"| {r['row']} | {f'{rate:.2f}' if rate else ''} | {ratio} | {mfu} | {kernel} | "
            f"{used.get('optimizer', '')} | {r.get('error', '')} |"
        )
    return "\n".join(lines) + "\n"


def sd15_scheduler():
    """Stable Diffusion 1.5's training noise schedule (its scheduler_config.json), for every row."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
    )


def main() -> int:
    a = parse()
    import torch

    if not torch.cuda.is_available() and not a.cpu_rehearsal:
        print(
            "gpu_throughput: no CUDA device visible to torch; run this on a CUDA machine "
            "(--cpu-rehearsal checks the script itself on a CPU)",
            file=sys.stderr,
        )
        return 2
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")  # nothing is downloaded; offline machines must not wait on the hub
    from diffusers import UNet2DConditionModel

    began = time.monotonic()
    device = torch.device("cuda" if not a.cpu_rehearsal else "cpu")
    start_one_rank(device.type)  # on CUDA, device 0 (LOCAL_RANK 0) becomes the current device
    a.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = unet_config(small=a.cpu_rehearsal)
    base_unet = UNet2DConditionModel(**config)
    side, width = a.resolution // 8, config["cross_attention_dim"]
    scheduler = sd15_scheduler()
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU rehearsal"
    peak = peak_flops(name, a.peak_tflops)
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "versions": {m: __import__(m).__version__ for m in ("torch", "deepspeed", "diffusers")},
        "settings": f"UNet {sum(p.numel() for p in base_unet.parameters()) / 1e6:.1f} M params, "
        f"{a.resolution} px, micro-batch {a.batch}, bf16, {a.steps} timed steps after {a.warmup}",
        "flops_per_sample": flops_per_sample(base_unet, side, width, device),
        "peak_tflops": peak / 1e12 if peak else None,
        "rows": [],
    }
    batches = premade_batches(4, a.batch, side, width, device)
    skip = set(a.skip) | ({"compile", "channels-last+compile"} if a.cpu_rehearsal else set())
    rows = [("example", None), *VARIANTS]
    for row, options in rows:
        if row in skip:
            continue
        entry: dict[str, Any] = {"row": row}
        if time.monotonic() - began > a.budget_s:
            entry["error"] = "skipped: --budget-s spent"
        else:
            try:
                if options is None:
                    entry["samples_per_s"] = example_rate(a, base_unet, batches, scheduler, device)
                else:
                    entry["samples_per_s"], entry["used"] = sdzero_rate(
                        a, options, base_unet, batches, scheduler, device
                    )
                if peak:
                    entry["mfu"] = results["flops_per_sample"] * entry["samples_per_s"] / peak
            except Exception as exc:  # one failing switch must not cost the other rows
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        results["rows"].append(entry)
        print(f"gpu_throughput: {entry}", file=sys.stderr, flush=True)
        (a.out / "gpu_throughput.json").write_text(json.dumps(results, indent=2) + "\n")
    (a.out / "gpu_throughput.md").write_text(rows_to_markdown(results))
    print(rows_to_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
