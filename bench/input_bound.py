"""An input-bound case on this machine: advise's predicted samples/s against `sdzero train`'s measured
samples/s with the same loader workers; the same from a latent cache, where the bound moves to compute;
loose files against tar shards.

Large JPEGs at the tiny model's small training resolution, one loader worker per rank: decoding a
multi-megapixel JPEG takes far longer than the tiny network's step, so the input binds. Each case is
`sdzero advise --max-nodes 1` (its trials also measure one loader worker and the storage:
sdzero.data.input_probe) and then `sdzero train` with the recommended DeepSpeed JSON and the same
workers. The measured rate is the median of the run's per-step samples/s after its first steps.

    flock /tmp/sdzero-heavy.lock python bench/input_bound.py --work /tmp/ib --case loose
    flock /tmp/sdzero-heavy.lock python bench/input_bound.py --work /tmp/ib --case shards
    flock /tmp/sdzero-heavy.lock python bench/input_bound.py --work /tmp/ib --case cache
    python bench/input_bound.py --work /tmp/ib --table      # the three cases side by side

Each case writes WORK/<case>/result.json; --table prints the cases found. Cases run one at a time (each
under the heavy lock, a few minutes), so that no two share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CASES = ("loose", "shards", "cache")
SKIP_STEPS = 4
"""First steps of a run left out of its rate: the workers' first batches and the process's first seconds."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="folder for model, data, runs (kept: reused)")
    p.add_argument("--case", choices=CASES)
    p.add_argument("--table", action="store_true", help="print the cases' table from WORK")
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--side", type=int, default=2400, help="JPEG side in pixels")
    p.add_argument("--workers", type=int, default=1, help="loader workers per rank (trials and run)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=16, help="optimizer steps of the measured run")
    p.add_argument("--budget-minutes", type=float, default=2.0, help="advise's budget per case")
    return p.parse_args()


def write_jpegs(folder: Path, images: int, side: int) -> Path:
    """Smooth colour fields with noise: large files that decode slowly, each with a caption."""
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    lines = []
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    for i in range(images):
        base = np.stack(
            [
                ramp[None, :].repeat(side, 0),
                ramp[:, None].repeat(side, 1),
                np.full((side, side), 40.0 * (i % 6)),
            ],
            -1,
        )
        pixels = np.clip(base + rng.normal(0, 24, (side, side, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:04d}.jpg", quality=92)
        lines.append(json.dumps({"file_name": f"{i:04d}.jpg", "text": f"a gradient number {i % 6}"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def prepare(args: argparse.Namespace) -> tuple[Path, Path, str]:
    """(tiny model, loose JPEG folder, shard pattern), written once into WORK."""
    from sdzero.data.shard_writer import write_shards
    from sdzero.models.tiny import write_tiny_model

    work = args.work
    model, data, shards = work / "model", work / "jpegs", work / "shards"
    if not model.exists():
        write_tiny_model(model)
    if not data.exists():
        write_jpegs(data, args.images, args.side)
    if not shards.exists():
        summary = write_shards(data, shards, max_count=16)
        assert summary.samples == args.images
    count = len(list(shards.glob("*.tar")))
    return model, data, f"{shards}/{{000000..{count - 1:06d}}}.tar"


def build_cache(model: Path, data: Path, out: Path) -> None:
    if (out / "cache.json").exists():
        return
    cmd = [sys.executable, "-m", "sdzero.cli", "cache", "--model", str(model), "--data", str(data)]
    cmd += ["--out", str(out), "--dtype", "bf16"]  # the shipped zero2_bf16.json's precision
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def advise(model: Path, data: str, out: Path, train_args: list[str], minutes: float) -> dict[str, Any]:
    """advise's answer for one node of this machine: the row, the verdict and the recommended JSON."""
    from advisor.stages.advise import AdviseRequest, run_advise

    request = AdviseRequest(
        max_nodes=1,
        model=str(model),
        data=Path(data),
        out_dir=out,
        budget_minutes=minutes,
        train_args=tuple(train_args),
    )
    rec = run_advise(request).recommendation
    row = next(r for r in rec["scaling_table"] if r["node_count"] == 1)
    return {"row": row, "verdict": rec["verdict"], "ds_config": str(out / "recommended_ds_config.json")}


def train(
    model: Path, data: str, ds_config: str, out: Path, train_args: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """`sdzero train`'s own launch (DeepSpeed's per-node launcher) and its measured samples/s."""
    from sdzero.cluster.launch_command import one_host_command
    from sdzero.telemetry.metrics import read_metrics

    words = ["--deepspeed_config", ds_config, "--model", str(model), "--data", data]
    words += [
        "--output-dir",
        str(out),
        "--max-steps",
        str(args.steps),
        "--checkpoint-every",
        "0",
        *train_args,
    ]
    proc = subprocess.run(one_host_command(words, args.ranks), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"train failed:\n{proc.stderr[-3000:]}")
    rows = read_metrics(out / "metrics.jsonl")[SKIP_STEPS:]
    rates = [float(r["samples_per_s"]) for r in rows]
    waits = [float(r.get("data_s") or 0.0) / float(r["step_time_s"]) for r in rows]
    return {
        "samples_per_s": statistics.median(rates),
        "steps": len(rates),
        "wait_share": statistics.median(waits),
    }


def run_case(args: argparse.Namespace) -> None:
    model, data, pattern = prepare(args)
    case_dir = args.work / args.case
    workers = ["--num-workers", str(args.workers)]
    extra: list[str] = []
    source = pattern if args.case == "shards" else str(data)
    if args.case == "cache":
        build_cache(model, data, args.work / "latents")
        extra = ["--cache-dir", str(args.work / "latents")]
    load = [os.getloadavg()[0]]  # the machine is shared: its 1-minute load before and after each part
    answer = advise(model, source, case_dir / "advise", workers + extra, args.budget_minutes)
    load.append(os.getloadavg()[0])
    measured = train(model, source, answer["ds_config"], case_dir / "train", workers + extra, args)
    load.append(os.getloadavg()[0])
    row = answer["row"]
    result = {
        "case": args.case,
        "predicted_samples_per_s": row["samples_per_s"],
        "training_samples_per_s": row.get("training_samples_per_s"),
        "input_samples_per_s": row.get("input_samples_per_s"),
        "input_link": row.get("input_link"),
        "input_bound": bool(row.get("input_bound")),
        "measured": measured,
        "config": row["config_id"],
        "verdict": answer["verdict"],
        "cpu": cpu_model(),
        "workers_per_rank": args.workers,
        "ranks": args.ranks,
        "load_1min": load,
    }
    (case_dir / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(work: Path) -> str:
    lines = [
        "| case | config | predicted samples/s | measured samples/s | error | binds | loader wait in the run | load (advise, train) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        path = work / case / "result.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        measured = r["measured"]["samples_per_s"]
        error = r["predicted_samples_per_s"] / measured - 1
        binds = f"input ({r['input_link']})" if r["input_bound"] else "compute"
        lines.append(
            f"| {case} | {r['config']} | {r['predicted_samples_per_s']:.3g} | {measured:.3g} | {error:+.1%} | "
            f"{binds} | {r['measured']['wait_share']:.0%} | {_load(r)} |"
        )
    return "\n".join(lines)


def _load(result: dict[str, Any]) -> str:
    load = result.get("load_1min") or []
    return f"{load[1]:.1f}, {load[2]:.1f}" if len(load) == 3 else "-"


def main() -> None:
    args = parse()
    os.environ.setdefault("SDZERO_LISTING_DIR", str(args.work / "listings"))
    if args.table:
        print(table(args.work))
        for case in CASES:
            path = args.work / case / "result.json"
            if path.exists():
                print(f"\n{case} verdict: {json.loads(path.read_text())['verdict']}")
        return
    if args.case is None:
        raise SystemExit("give --case (one of loose, shards, cache) or --table")
    run_case(args)


if __name__ == "__main__":
    main()
