"""What the progress record, the straggler sharing and the link probe cost per step, against the same loop without them.

One launch, one engine, one Trainer built by `Trainer.setup` as a run builds it (stall watch on,
--straggler-every 4). Blocks of steps alternate between two sides, the first side swapped every round so
that drift in machine load hits both alike:

- **with**: every phase stores (step, phase, time) into the rank's shared-memory record, the watcher
  thread beats, publishes the host file and leads every 0.5 s, and every 4th step the ranks all-gather
  their compute times (sdzero.training.straggler) and time a round trip between every pair of hosts
  (sdzero.training.link_probe; here each rank stands for a host of its own, so that on one machine the
  probe has pairs to time: with 2 ranks, one pair over the local transport);
- **without**: no record is open (each phase mark returns at once), the watcher's poll does nothing, and
  neither the straggler callback nor the link probe is called.

The figure is the median of the rounds' own ratios (with / without samples/s) and its bootstrap 95%
interval; within noise means the interval holds 1.0 (or the median is within a percent of it).

    python bench/progress_overhead.py [--ranks 2] [--rounds 12] [--steps 8]
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
STRAGGLER_EVERY = 4


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per block (a multiple of 4)")
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
    worker_args = ["--worker", "--rounds", str(args.rounds), "--steps", str(args.steps)]
    worker_args += ["--config", str(args.config), "--work", str(work)]
    return subprocess.call(deepspeed_command(worker_args, num_gpus=args.ranks, entry=[__file__]))


class Premade:
    """Cycles through micro-batches made once up front: neither side pays for data loading."""

    def __init__(self, batches: list) -> None:
        self.batches, self.i, self.epoch, self.batches_in_epoch, self.samples_in_epoch = batches, 0, 0, 0, 0

    def next(self):
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        return batch

    def check_late(self) -> int:
        return 0


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from sdzero.config.train_config import TrainConfig
    from sdzero.telemetry import progress
    from sdzero.training import run_watch
    from sdzero.training.link_probe import LinkProbeCallback, host_pairs
    from sdzero.training.straggler import StragglerCallback
    from sdzero.training.trainer import EVENTS, Trainer, overrides

    out = args.work / "bench_run"
    cfg = TrainConfig(
        deepspeed_config=args.config,
        model=str(args.work / "model"),
        data=args.work / "data",
        output_dir=out,
        max_steps=args.steps,
        num_workers=2,
        stall_seconds=3600.0,
        straggler_every=STRAGGLER_EVERY,
    )
    trainer = Trainer.setup(cfg)
    ds, rank = trainer.ds, trainer.rank
    loaded = trainer.batches
    premade = Premade([b for _, b in zip(range(4 * ds.grad_accum), iter(loaded.loader), strict=False)])
    trainer.batches = premade
    loaded.close()
    record, watch = progress.current(), run_watch._WATCH
    assert record is not None and watch is not None
    watch_poll = watch.poll

    for probe in (c for c in trainer.callbacks if isinstance(c, LinkProbeCallback)):
        probe.hosts = [f"bench-host{r}" for r in range(dist.get_world_size())]
        probe.pairs = host_pairs(probe.hosts)
    sharing = (StragglerCallback, LinkProbeCallback)

    def handlers(with_straggler: bool) -> dict:
        chosen = [c for c in trainer.callbacks if with_straggler or not isinstance(c, sharing)]
        return {e: [getattr(c, e) for c in chosen if overrides(c, e)] for e in EVENTS}

    sides = {"with": handlers(True), "without": handlers(False)}

    def block(side: str) -> None:
        trainer._handlers = sides[side]
        progress._CURRENT = record if side == "with" else None
        watch.poll = watch_poll if side == "with" else (lambda now: None)  # type: ignore[method-assign]
        trainer.writer = None  # the metrics file is the same on both sides; left out of both
        trainer.train(until=trainer.state.step + args.steps)

    def timed(side: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        block(side)
        dist.barrier()
        return time.perf_counter() - start

    block("with")  # warm-up: allocations, JIT, caches
    samples = ds.global_batch * args.steps
    rates: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(args.rounds):
        for side in ("with", "without") if i % 2 == 0 else ("without", "with"):
            rates[side].append(samples / timed(side))
    progress._CURRENT = record
    if rank == 0:
        report(args, rates)
    run_watch.stop_watch()


def report(args: argparse.Namespace, rates: dict[str, list[float]]) -> None:
    from sdzero.telemetry.environment import cpu_kind
    from sdzero.telemetry.step_interval import median_interval

    paired = median_interval([w / wo for w, wo in zip(rates["with"], rates["without"], strict=True)])
    result = {
        "cpu": cpu_kind(),
        "config": args.config.name,
        "rounds": args.rounds,
        "steps_per_block": args.steps,
        "straggler_every": STRAGGLER_EVERY,
        "with_samples_per_s": rates["with"],
        "without_samples_per_s": rates["without"],
        "round_ratio_median": paired.median_s,
        "round_ratio_95": [paired.lo_s, paired.hi_s],
    }
    print(json.dumps(result, indent=2))
    w, wo = statistics.median(rates["with"]), statistics.median(rates["without"])
    print(
        f"\nwith / without the progress record, straggler sharing and link probe, median of {args.rounds} rounds' "
        f"ratios: {paired.median_s:.3f} (95% interval {paired.lo_s:.3f}-{paired.hi_s:.3f}); medians "
        f"{w:.1f} / {wo:.1f} samples/s"
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
