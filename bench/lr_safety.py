"""Does the LR the advisor recommends train, and does the old uncapped rule diverge? Real trainer runs.

The embedded default (tiny SD-1.5-shaped model, synthetic shapes, ds_configs/zero2_bf16.json: micro-batch 4,
AdamW lr 1e-4, clipping 1.0) is trained for --steps optimizer steps by the trainer (`deepspeed`
launcher, real DeepSpeed engine) under each LR:

- advise, default: the global batch the advisor keeps (the base config's on one node: 4 x 1 x 2 ranks =
  8), with the LR sdzero.config.lr_rule gives there (the base LR: the batch did not change);
- advise, --global-batch B: the LR sdzero.config.lr_rule gives at B from that reference (sqrt rule, capped);
- the same rule uncapped (what the cap takes away);
- the old advisor's rule at B: linear from the same reference, uncapped (the issue's 64x at B = 512).

For each: the mean loss over the first and the last 10 steps, the largest loss, and whether it is
finite. "Falls" means last-10 mean < first-10 mean. Warm-up is off in every run: the peak LR from step
1 is the harder test (sdzero.config.lr_rule recommends a warm-up on top).

    flock /tmp/sdzero-heavy.lock python bench/lr_safety.py [--batch 512] [--steps 60] [--only advise,old]

At --batch 512 a run takes about 4 minutes on 2 CPU cores (3.6 s per step): split with --only to keep each
hold of the shared lock short.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sdzero.cluster.launch_command import deepspeed_command  # noqa: E402
from sdzero.config.lr_rule import DEFAULT_LR_SCALING, base_lr_of, choose_lr, reference_batch  # noqa: E402

ADVISOR_RANKS_PER_NODE = 2
"""`sdzero advise` on a CPU runs its trials with 2 ranks: its target node, and so its reference batch."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=512, help="the --global-batch a user asks for")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ranks", type=int, default=1, help="ranks per run (the global batch is the same)")
    p.add_argument("--micro-batch", type=int, default=64, help="per rank, for the large batch")
    p.add_argument("--config", type=Path, default=REPO / "ds_configs" / "zero2_bf16.json")
    p.add_argument("--work", type=Path, default=None, help="folder for model, data and runs (default: temp)")
    p.add_argument("--only", default="", help="comma-separated run names (prefixes) to run, e.g. advise,old")
    return p.parse_args()


def run(
    work: Path,
    name: str,
    base: dict,
    batch: int,
    lr: float,
    args: argparse.Namespace,
    model: Path,
    data: Path,
) -> dict:
    micro = min(args.micro_batch, batch // args.ranks)
    accum = batch // (micro * args.ranks)
    if micro * accum * args.ranks != batch:
        raise SystemExit(f"global batch {batch} is not micro {micro} x accumulation x {args.ranks} ranks")
    config = {**base, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum}
    config.pop("train_batch_size", None)
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "ds.json").write_text(json.dumps(config))
    train_args = [
        "--deepspeed_config",
        str(out / "ds.json"),
        "--model",
        str(model),
        "--data",
        str(data),
        "--output-dir",
        str(out / "run"),
        "--max-steps",
        str(args.steps),
        "--lr",
        repr(lr),
        "--lr-scaling",
        "none",
        "--num-workers",
        "1",
        "--seed",
        "0",
    ]
    cmd = deepspeed_command(train_args, num_gpus=args.ranks)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=os.environ.copy())
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the trainer failed:\n{proc.stderr[-3000:]}")
    losses = [
        json.loads(line)["loss"]
        for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    first, last = losses[:10], losses[-10:]
    finite = all(math.isfinite(x) for x in losses)
    row = {
        "run": name,
        "global_batch": batch,
        "lr": lr,
        "steps": len(losses),
        "first10": sum(first) / len(first),
        "last10": sum(last) / len(last),
        "max": max(losses),
        "finite": finite,
    }
    row["falls"] = finite and row["last10"] < row["first10"]
    return row


def main() -> None:
    args = parse()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions"))
    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    base = json.loads(args.config.read_text())
    reference = reference_batch(base, ADVISOR_RANKS_PER_NODE)
    base_lr = base_lr_of(base)
    rule = DEFAULT_LR_SCALING
    capped = choose_lr(base_lr, args.batch, reference, rule)
    uncapped = choose_lr(base_lr, args.batch, reference, rule, max_factor=math.inf)
    old = base_lr * args.batch / reference  # the old advisor: linear, no cap
    cases = [
        ("advise-default", reference, choose_lr(base_lr, reference, reference, rule).lr),
        (f"advise-batch{args.batch}", args.batch, capped.lr),
        (f"{rule}-uncapped-batch{args.batch}", args.batch, uncapped.lr),
        (f"old-linear-batch{args.batch}", args.batch, old),
    ]
    wanted = [w for w in args.only.split(",") if w]
    cases = [c for c in cases if not wanted or any(c[0].startswith(w) for w in wanted)]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        model = write_tiny_model(work / "model") if not (work / "model").exists() else work / "model"
        data = work / "data"
        if not (data / "metadata.jsonl").exists():
            write_synthetic_dataset(data, images=max(args.batch, 64), size=40)
        rows = []
        for name, batch, lr in cases:
            row = run(work, name, base, batch, lr, args, model, data)
            rows.append(row)
            print(
                f"{name:28s} batch {batch:4d} lr {lr:.3g}: loss first 10 {row['first10']:.4f}, last 10 "
                f"{row['last10']:.4f}, max {row['max']:.4f}, {'falls' if row['falls'] else 'DOES NOT FALL'}"
                + ("" if row["finite"] else " (non-finite)"),
                flush=True,
            )
    print(
        json.dumps(
            {
                "reference_batch": reference,
                "rule": rule,
                "capped_factor": capped.factor,
                "uncapped_factor": uncapped.factor,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
