"""sdzero's steady-state throughput against a bare DeepSpeed loop, alternated in one run.

Both loops drive the same engine (same model, same DeepSpeed JSON) over the same pre-made micro-batches,
so the only difference is what sdzero's Trainer (built by `Trainer.setup`, as a run builds it) adds per
step: phase timers, the per-step loss/memory all-gather, its callbacks, metrics.jsonl, the progress bar.
Each round times one block of each, bare first in even rounds and sdzero first in odd ones, so drift in
machine load hits both sides alike and neither is always the one after. The figure is the median of the
rounds' own ratios (sdzero / bare samples/s, each from two blocks run back to back) with its bootstrap 95%
interval: on a shared CPU one block of 8 steps moves by 10-20%, so a ratio of a few rounds moves by
several percent between identical runs, and the interval says how far this run pins it (#24: a 0.93 read
as a regression was that). The ratio of the two sides' median rates is printed too. Goal: >= 0.98.

On a CPU a device sync is free, so this cannot see what the loop's GPU syncs would cost: that is what
bench/gpu_throughput.py measures, and tests/unit/test_gpu_speed.py proves the loop takes none per phase.

It also measures the data loader alone (samples/s it can feed per rank, with the trainer's worker count)
against what training consumes per rank.

    python bench/trainer_overhead.py [--ranks 2] [--rounds 12] [--steps 8] [--config ds_configs/zero2_bf16.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sdzero.models.step_input import StepInput

REPO = Path(__file__).resolve().parents[1]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per block")
    p.add_argument("--config", type=Path, default=REPO / "ds_configs" / "zero2_bf16.json")
    p.add_argument("--work", type=Path, default=None, help="folder for model/data (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> int:
    from sdzero.cluster.launch_command import deepspeed_command
    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    work = args.work or Path(tempfile.mkdtemp(prefix="sdzero-bench-"))
    if not (work / "model" / "model_index.json").exists():
        write_tiny_model(work / "model")
    if not (work / "data" / "metadata.jsonl").exists():
        write_synthetic_dataset(work / "data", images=128)
    worker_args = [
        "--worker",
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--config",
        str(args.config),
        "--work",
        str(work),
    ]
    cmd = deepspeed_command(worker_args, num_gpus=args.ranks, entry=[__file__])
    return subprocess.call(cmd)


class Premade:
    """Cycles through micro-batches made once up front, so neither loop pays for data loading."""

    def __init__(self, batches: list[StepInput]) -> None:
        self.batches, self.i, self.epoch, self.batches_in_epoch = batches, 0, 0, 0
        self.samples_in_epoch = 0  # the data position a checkpoint records (sdzero.data.feed.Batches)

    def next(self) -> StepInput:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch

    def check_late(self) -> int:
        return 0  # no images read, none failing late


def bare_block(engine, comps, batches: Premade, steps: int, accum: int, device) -> None:
    """The loop every DeepSpeed tutorial writes: encode, noise, forward, MSE, backward, step."""
    from sdzero.models.encoding import encode_latents, encode_text

    for _ in range(steps):
        for _ in range(accum):
            b = batches.next().to(device)
            latents = encode_latents(comps.vae, b.pixel_values, b.latent_eps)
            text = encode_text(comps.text_encoder, b.token_ids[0])
            noisy = comps.noise_scheduler.add_noise(latents, b.noise, b.timestep)
            dtype = next(engine.module.parameters()).dtype
            pred = engine(noisy.to(dtype), b.timestep, text.to(dtype), return_dict=False)[0]
            loss = F.mse_loss(pred.float(), b.noise.float())
            engine.backward(loss)
            engine.step()


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def loader_rate(loader, sampler, n_batches: int) -> float:
    sampler.set_epoch(1000)
    it = iter(loader)
    next(it)  # worker start-up is a one-off, not throughput
    start = time.perf_counter()
    seen = 0
    for _ in range(n_batches):
        try:
            seen += len(next(it))  # samples in the micro-batch
        except StopIteration:
            break
    return seen / (time.perf_counter() - start)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from sdzero.config.train_config import TrainConfig
    from sdzero.telemetry.metrics import MetricsWriter
    from sdzero.training.trainer import Trainer

    out = args.work / "bench_run"
    cfg = TrainConfig(
        deepspeed_config=args.config,
        model=str(args.work / "model"),
        data=args.work / "data",
        output_dir=out,
        max_steps=args.steps,
        num_workers=2,
    )
    # The trainer's own set-up (distributed start, model, data, engine); no checkpoints, EMA or validation,
    # so what is left of the callbacks per step is the preemption vote.
    trainer = Trainer.setup(cfg)
    ds, engine, comps, rank, world = trainer.ds, trainer.engine, trainer.comps, trainer.rank, trainer.world
    loader, sampler = trainer.batches.loader, trainer.batches.sampler
    feed = loader_rate(loader, sampler, n_batches=12)
    sampler.set_epoch(0)
    premade = Premade([b for _, b in zip(range(4 * ds.grad_accum), iter(loader), strict=False)])
    loaded, trainer.batches = trainer.batches, premade
    loaded.close()  # its loader workers ignore SIGTERM: stopped now, not left for the exit to wait on

    def sdzero_block() -> None:
        # train() closes its writer at the end, as a run does; each block opens one (appending).
        trainer.writer = MetricsWriter(out / "metrics.jsonl") if rank == 0 else None
        trainer.train(until=trainer.state.step + args.steps)

    def bare() -> None:
        bare_block(engine, comps, premade, args.steps, ds.grad_accum, trainer.device)

    bare()  # warm-up: first steps allocate, JIT and fill caches
    samples = ds.global_batch * args.steps
    rates: dict[str, list[float]] = {"bare": [], "sdzero": []}
    for i in range(args.rounds):
        order = (("bare", bare), ("sdzero", sdzero_block))
        for name, block in order if i % 2 == 0 else order[::-1]:
            rates[name].append(samples / timed(block))
    feeds = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(feeds, torch.tensor([feed], dtype=torch.float64))
    if rank == 0:
        report(args, ds, rates, [float(f) for f in feeds])


def report(args, ds, rates: dict[str, list[float]], feeds: list[float]) -> None:
    from sdzero.telemetry.step_interval import median_interval

    bare, ours = statistics.median(rates["bare"]), statistics.median(rates["sdzero"])
    paired = median_interval([z / b for z, b in zip(rates["sdzero"], rates["bare"], strict=True)])
    consume = ours / ds.world_size
    result = {
        "config": str(args.config.name),
        "ranks": ds.world_size,
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "bare_samples_per_s": rates["bare"],
        "sdzero_samples_per_s": rates["sdzero"],
        "overhead_ratio": ours / bare,
        "round_ratio_median": paired.median_s,
        "round_ratio_95": [paired.lo_s, paired.hi_s],
        "loader_samples_per_s_per_rank": min(feeds),
        "training_consumes_per_rank": consume,
        "loader_headroom": min(feeds) / consume,
    }
    print(json.dumps(result, indent=2))
    print(
        f"\nsdzero / bare DeepSpeed samples/s, median of {args.rounds} rounds' ratios: "
        f"{paired.median_s:.3f} (95% interval {paired.lo_s:.3f}-{paired.hi_s:.3f})  (goal >= 0.98)"
    )
    print(f"ratio of the medians: {ours:.2f} / {bare:.2f} = {ours / bare:.3f} samples/s")
    print(
        f"data loader feeds {min(feeds):.1f} samples/s per rank; training consumes {consume:.1f} "
        f"per rank: headroom x{min(feeds) / consume:.1f}"
    )


def main() -> int:
    args = parse()
    if not args.worker:
        return launch(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
