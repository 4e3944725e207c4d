"""Training from a latent/text cache against encoding online, alternated in one run.

One DeepSpeed engine, two real input pipelines through the trainer's own code (a `Trainer` set up from
the options, its batches swapped per block; `data_feed.build_data` for the cached side): online (images decoded, VAE and text encoders run every micro-step) and cached
(`sdzero cache` shards read back; no encoder runs). Blocks alternate (online, cached, online, ...) so drift
in machine load hits both alike; the ratio of median samples/s is the figure. The cache build itself
(`sdzero cache --num-gpus RANKS`) is timed first.

    python bench/cache_speedup.py [--family sd3] [--ranks 2] [--rounds 4] [--steps 6]
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

REPO = Path(__file__).resolve().parents[1]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="sd3", help="tiny model family: sd15, sdxl or sd3")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4, help="alternated pairs of blocks")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per block")
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--num-workers", type=int, default=1, help="data-loader workers per rank, both sides")
    p.add_argument("--config", type=Path, default=REPO / "ds_configs" / "zero2_bf16.json")
    p.add_argument(
        "--work", type=Path, default=None, help="folder for model/data/cache (default: a temp dir)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build-wall-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args()


def dtype_of(config: Path) -> str:
    raw = json.loads(config.read_text())
    return (
        "bf16"
        if raw.get("bf16", {}).get("enabled")
        else "fp16"
        if raw.get("fp16", {}).get("enabled")
        else "fp32"
    )


def launch(args: argparse.Namespace) -> int:
    from sdzero.cluster.launch_command import deepspeed_command
    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    work = args.work or Path(tempfile.mkdtemp(prefix="sdzero-cache-bench-"))
    model, data, cache = work / f"model-{args.family}", work / "data", work / f"cache-{args.family}"
    if not (model / "model_index.json").exists():
        write_tiny_model(model, family=args.family)
    if not (data / "metadata.jsonl").exists():
        write_synthetic_dataset(data, images=args.images)
    build = [
        sys.executable,
        "-m",
        "sdzero.cli",
        "cache",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(cache),
        "--dtype",
        dtype_of(args.config),
        "--num-gpus",
        str(args.ranks),
    ]
    start = time.perf_counter()
    code = subprocess.call(build)
    build_wall_s = time.perf_counter() - start
    if code != 0:
        return code
    worker_args = [
        "--worker",
        "--family",
        args.family,
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--num-workers",
        str(args.num_workers),
        "--config",
        str(args.config),
        "--work",
        str(work),
        "--build-wall-s",
        f"{build_wall_s:.3f}",
    ]
    cmd = deepspeed_command(worker_args, num_gpus=args.ranks, entry=[__file__])
    return subprocess.call(cmd)


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    from sdzero.config.train_config import TrainConfig
    from sdzero.data.cache import open_cache
    from sdzero.data.feed import Batches, build_data
    from sdzero.training.trainer import Trainer

    model, data, cache_dir = (
        args.work / f"model-{args.family}",
        args.work / "data",
        args.work / f"cache-{args.family}",
    )
    common = dict(
        deepspeed_config=args.config,
        model=str(model),
        data=data,
        output_dir=args.work / "bench_run",
        max_steps=args.steps,
        num_workers=args.num_workers,
    )
    # The online side is the trainer as set up from its options (the frozen parts loaded); the cached side
    # trains the same engine from the cache's batches, which never touch the frozen parts.
    trainer = Trainer.setup(TrainConfig(**common))
    ds, comps, rank, world = trainer.ds, trainer.comps, trainer.rank, trainer.world
    cached_cfg = TrainConfig(**common, cache_dir=cache_dir)
    cache = open_cache(cache_dir, str(model), data, None, False, ds.dtype, False)
    _, cached_sampler, cached_loader, _ = build_data(cached_cfg, ds, comps, rank, world, cache)
    sides = {"online": trainer.batches, "cached": Batches(cached_loader, cached_sampler)}

    def block(side: str) -> None:
        trainer.batches = sides[side]
        trainer.train(until=trainer.state.step + args.steps)

    block("online")  # warm-up: allocations, JIT, loader workers of both sides
    block("cached")
    samples = ds.global_batch * args.steps
    rates: dict[str, list[float]] = {"online": [], "cached": []}
    for _ in range(args.rounds):
        rates["online"].append(samples / timed(lambda: block("online")))
        rates["cached"].append(samples / timed(lambda: block("cached")))
    for batches in sides.values():
        batches.close()  # loader workers ignore SIGTERM: stopped now, not left for the exit to wait on
    if rank == 0:
        report(args, ds, rates, cache)


def report(args, ds, rates: dict[str, list[float]], cache) -> None:
    online, cached = statistics.median(rates["online"]), statistics.median(rates["cached"])
    shard_bytes = sum(s["bytes"] for s in cache.raw["shards"])
    result = {
        "family": args.family,
        "config": args.config.name,
        "ranks": ds.world_size,
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "global_batch": ds.global_batch,
        "online_samples_per_s": rates["online"],
        "cached_samples_per_s": rates["cached"],
        "speedup_cached_over_online": cached / online,
        "cache_samples": len(cache),
        "cache_bytes": shard_bytes,
        "cache_build_wall_s": args.build_wall_s,
        "cache_build_in_process_s": cache.raw.get("build_seconds"),
    }
    print(json.dumps(result, indent=2))
    print(
        f"\ncached / online samples/s (median of {args.rounds} alternated blocks of {args.steps} steps, tiny "
        f"{args.family}): {cached:.2f} / {online:.2f} = {cached / online:.2f}x"
    )
    print(
        f"cache build: {len(cache)} samples, {shard_bytes / 1e6:.1f} MB, {args.build_wall_s:.1f} s wall with "
        f"{ds.world_size} ranks ({cache.raw.get('build_seconds', 0):.1f} s inside rank 0, model load included)"
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
