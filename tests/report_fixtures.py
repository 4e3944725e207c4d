"""Synthetic inputs for the report tests: fixtures of the data contract, NOT measurements.

Every number below is made up to exercise the report (shapes, edge cases, hostile strings). The files
follow the formats the real writers use: metrics.jsonl as the Trainer writes it, checkpoint manifests
through sdzero.checkpoint.checkpointer.Manifest, comm.csv with advisor.measure.collectives_rank' columns and comm_fit.json through
advisor.model.alphabeta's own fit; predictions.csv, recommendation.json and validation.csv as advisor/report/build.py's
docstring defines them for the performance model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

HOSTILE = "<script>alert(1)</script>"
"""A string that would run if it reached the page unescaped."""
HOSTILE_ATTR = '"><img src=x onerror=alert(2)>'
"""One that would break out of an attribute value."""
HOSTILE_DIR = "run<img src=x onerror=alert(3)>"
"""A run folder name (no slash, so a legal file name) that would be a tag if unescaped."""
GIB = 2**30
MIB = 2**20


# -------------------------------------------------------------------------------------------- training


def metrics_record(step: int, ranks: int = 2, fp16: bool = True, skipped: int = 0) -> dict[str, Any]:
    """One metrics.jsonl line with every field the Trainer writes (synthetic values)."""
    phases = {"data_s": 0.01, "encode_s": 0.02, "forward_s": 0.05, "backward_s": 0.12, "optimizer_s": 0.03}
    step_time = sum(phases.values()) + 0.01 + (0.5 if step == 1 else 0.0)  # step 1: warm-up
    peak = 600 * MIB + 2 * MIB * min(step, 5)
    return {
        "step": step,
        "epoch": (step - 1) // 8,
        "loss": 1.2 * math.exp(-step / 6) + 0.05 * (step % 3),
        "lr": 1e-4,
        "samples_per_s": 8 * ranks / step_time,
        "step_time_s": step_time,
        **phases,
        "world_size": ranks,
        "zero_stage": 2,
        "dtype": "fp16" if fp16 else "bf16",
        "micro_batch": 4,
        "grad_accum": 1,
        "loss_scale": 2.0 ** max(16 - skipped, 10) if fp16 else None,
        "skipped_steps": skipped if fp16 else None,
        "peak_mem_bytes": peak + (ranks - 1) * MIB,
        "peak_mem_bytes_per_rank": [peak + r * MIB for r in range(ranks)],
    }


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_training_run(
    folder: Path,
    steps: int = 12,
    ranks: int = 2,
    fp16: bool = True,
    resumed_at: int | None = 5,
    checkpoints: tuple[int, ...] = (8, 12),
    validation_steps: tuple[int, ...] = (),
) -> Path:
    """A run folder: metrics (with an earlier segment when `resumed_at`), configs, checkpoint manifests,
    and validation images at `validation_steps` (see write_validation)."""
    from sdzero.checkpoint.checkpointer import Manifest, step_tag

    folder.mkdir(parents=True, exist_ok=True)
    skipped = lambda s: min(s - 1, 2) if fp16 else 0  # noqa: E731 (two overflows at the start, as fp16 does)
    if resumed_at:
        # the first attempt ran to step resumed_at + 1 and was killed; the resume restarts at resumed_at
        write_lines(
            folder / "metrics.1.jsonl",
            [metrics_record(s, ranks, fp16, skipped(s)) for s in range(1, resumed_at + 2)],
        )
    first = resumed_at or 1
    write_lines(
        folder / "metrics.jsonl",
        [metrics_record(s, ranks, fp16, skipped(s)) for s in range(first, steps + 1)],
    )
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": fp16, "loss_scale": 0},
        "comment": HOSTILE,
    }
    (folder / "ds_config.json").write_text(json.dumps(ds, indent=2))
    run = {
        "model": f"/models/{HOSTILE}",
        "output_dir": str(folder),
        "validation_prompts": [HOSTILE, HOSTILE_ATTR],
        "max_steps": steps,
        "seed": 0,
        "zero_stage": 2,
        "dtype": "fp16" if fp16 else "bf16",
    }
    (folder / "run_config.json").write_text(json.dumps(run, indent=2))
    for step in validation_steps:
        write_validation(folder, step, run["validation_prompts"])
    root = folder / "checkpoints"
    for serial, step in enumerate(checkpoints, start=1):
        manifest = Manifest(
            tag=step_tag(step),
            step=step,
            serial=serial,
            zero_stage=2,
            dtype="fp16",
            world_size=ranks,
            seed=0,
            model=HOSTILE,
            prediction_type="epsilon",
            ema=False,
            files={"mp_rank_00_model_states.pt": {"bytes": 3 * MIB, "sha256": "0" * 64}},
            created_unix_s=1.7e9 + step,
        )
        (root / manifest.tag).mkdir(parents=True)
        (root / manifest.tag / "manifest.json").write_text(manifest.to_json())
    if checkpoints:
        (root / "latest").write_text(step_tag(checkpoints[-1]))
        (root / f".incoming-{step_tag(steps + 4)}").mkdir()  # a save that never committed
    return folder


VALIDATION_PX = 384


def validation_colour(step: int, prompt_index: int) -> tuple[int, int, int]:
    """The flat colour of one synthetic validation image: tells every (step, prompt) cell apart."""
    return (40 + 60 * prompt_index) % 256, (20 * step) % 256, 200 - 30 * prompt_index


def write_validation(folder: Path, step: int, prompts: list[str]) -> list[Path]:
    """What sdzero.training.validation.Validator writes for one step: a PNG per prompt (a flat colour under light
    noise, so it weighs as much as a real sample of VALIDATION_PX) and prompts.json."""
    import numpy as np
    from PIL import Image

    from sdzero.training.validation import PROMPTS_FILE, image_name, step_folder

    out = step_folder(folder / "validation", step)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(step)
    paths = []
    for i, prompt in enumerate(prompts):
        noise = rng.integers(-12, 13, (VALIDATION_PX, VALIDATION_PX, 3))
        pixels = np.clip(np.array(validation_colour(step, i)) + noise, 0, 255).astype(np.uint8)
        paths.append(out / image_name(i, prompt))
        Image.fromarray(pixels).save(paths[-1])
    (out / PROMPTS_FILE).write_text(json.dumps(prompts))
    return paths


# ---------------------------------------------------------------------------------------------- advise


def write_comm(folder: Path) -> None:
    """comm.csv in advisor.measure.collectives_rank' columns and comm_fit.json fitted by advisor.model.alphabeta itself."""
    from advisor.measure.collectives_rank import CSV_COLUMNS
    from advisor.model.alphabeta import busbw_gbps, fit_table, fits_payload
    from sdzero.atomic import write_json_atomic

    links = {"torch": ("gloo", 40e-6, 1 / 3e9), "mpi": ("Open MPI 4.1.4", 15e-6, 1 / 4e9)}
    rows = []
    for backend, (library, alpha, beta) in links.items():
        for k, collective in enumerate(("all_reduce", "reduce_scatter", "all_gather")):
            for power in range(12, 27, 2):  # 4 KiB .. 64 MiB
                size = 2**power
                t = (alpha + size * beta * (2 if collective == "all_reduce" else 1)) * (
                    1 + 0.03 * ((power + k) % 3)
                )
                rows.append(
                    {
                        "backend": backend,
                        "library": library,
                        "collective": collective,
                        "link_level": "intra",
                        "node": "host0",
                        "ranks": 2,
                        "nodes": 1,
                        "size_bytes": size,
                        "count": size // 4,
                        "dtype": "float32",
                        "warmup": 2,
                        "iters": 5,
                        "repeats": 3,
                        "time_s": t,
                        "time_spread": 0.05,
                        "algbw_gbps": size / t / 1e9,
                        "busbw_gbps": busbw_gbps(collective, 2, size, t),
                        "correct": True,
                        "max_abs_error": 0.0,
                        "emulated": False,
                        "note": "",
                    }
                )
    table = pd.DataFrame(rows, columns=list(CSV_COLUMNS))
    table.to_csv(folder / "comm.csv", index=False)
    write_json_atomic(
        folder / "comm_fit.json", fits_payload(fit_table(table), {"host": "host0", "hostfile": HOSTILE})
    )


def write_trials(folder: Path, capacity_bytes: int = 2 * GIB) -> None:
    rows = []
    for stage in (1, 2, 3):
        for dtype in ("bf16", "fp16"):
            for micro in (1, 2, 4, 8, 16):
                peak = (1.2 - 0.25 * stage) * GIB + micro * 90 * MIB
                oom = peak > capacity_bytes
                rows.append(
                    {
                        "trial_id": f"z{stage}-{dtype}-mb{micro}",
                        "status": "oom" if oom else "ok",
                        "zero_stage": stage,
                        "dtype": dtype,
                        "micro_batch": micro,
                        "grad_accum": 1,
                        "offload": "none",
                        "world_size": 2,
                        "nodes": 1,
                        "samples_per_s": None if oom else 2 * micro / (0.1 + 0.02 * micro + 0.03 * stage),
                        "step_time_s": None if oom else 0.1 + 0.02 * micro + 0.03 * stage,
                        "device_peak_bytes": peak,
                        "mem_cap_bytes": capacity_bytes,
                        "reason": "device peak above --mem-cap-gib" if oom else "",
                    }
                )
    rows.append(
        {
            "trial_id": "z3-bf16-offload",
            "status": "crashed",
            "zero_stage": 3,
            "dtype": "bf16",
            "micro_batch": 4,
            "reason": f"RuntimeError: {HOSTILE}",
        }
    )
    rows.append(
        {
            "trial_id": "z3-fp16-hang",
            "status": "timeout",
            "zero_stage": 3,
            "dtype": "fp16",
            "micro_batch": 2,
            "reason": "killed at --trial-timeout 300 s",
        }
    )
    pd.DataFrame(rows).to_csv(folder / "trials.csv", index=False)


def write_model_outputs(folder: Path) -> None:
    """predictions.csv, recommendation.json, recommended_ds_config.json, validation.csv (the contract)."""
    configs = {
        "z2-bf16-mb8": (2, "bf16", 8, 60.0, 0.020),
        "z3-bf16-mb16": (3, "bf16", 16, 55.0, 0.035),
        "z1-fp16-mb4": (1, "fp16", 4, 50.0, 0.015),
        HOSTILE_ATTR: (2, "fp16", 4, 45.0, 0.02),
    }
    rows = []
    for config_id, (stage, dtype, micro, base, comm) in configs.items():
        for nodes in (1, 2, 4, 8, 16, 32):
            compute = 2 * micro / base * 4
            exposed = comm * math.log2(nodes) * (1 + 0.2 * stage)
            step = compute + exposed
            rate = nodes * 8 * micro / step
            rows.append(
                {
                    "node_count": nodes,
                    "config_id": config_id,
                    "zero_stage": stage,
                    "dtype": dtype,
                    "micro_batch": micro,
                    "samples_per_s": rate,
                    "step_time_s": step,
                    "compute_s": compute,
                    "exposed_comm_s": exposed,
                    "mem_per_rank_bytes": (1.5 - 0.3 * stage / nodes) * GIB,
                    "efficiency": compute / step,
                    "feasible": True,
                }
            )
    pd.DataFrame(rows).to_csv(folder / "predictions.csv", index=False)
    runner = {
        "config_id": "z3-bf16-mb16",
        "node_count": 32,
        "samples_per_s": 900.0,
        "step_time_s": 0.9,
        "mem_per_rank_bytes": 1.2 * GIB,
        "why_not": f"communication-bound at 32 nodes {HOSTILE}",
    }
    rec = {
        "config_id": "z2-bf16-mb8",
        "node_count": 32,
        "samples_per_s": 1200.0,
        "step_time_s": 0.85,
        "mem_per_rank_bytes": 1.4 * GIB,
        "global_batch": 2048,
        "grad_accum": 1,
        "lr": 2.0e-4,
        "lr_scaling": "sqrt",
        "launch_command": f"deepspeed --hostfile hosts sdzero/train.py --model {HOSTILE}",
        "error": {"step_time_mape": 0.062, "memory_mape": 0.031},
        "runners_up": [runner],
        "note": HOSTILE,
    }
    (folder / "recommendation.json").write_text(json.dumps(rec, indent=2))
    ds = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000},
    }
    (folder / "recommended_ds_config.json").write_text(json.dumps(ds, indent=2))
    pairs = []
    for i, config_id in enumerate(configs):
        pairs.append(
            {
                "config_id": config_id,
                "quantity": "step_time_s",
                "predicted": 0.5 * (1 + 0.04 * (i - 1)),
                "measured": 0.5 + 0.1 * i,
                "held_out": i % 2 == 0,
                "node_count": 1,
            }
        )
        pairs.append(
            {
                "config_id": config_id,
                "quantity": "mem_per_rank_bytes",
                "predicted": (1 + 0.1 * i) * GIB * 1.03,
                "measured": (1 + 0.1 * i) * GIB,
                "held_out": i % 2 == 1,
                "node_count": 1,
            }
        )
    pd.DataFrame(pairs).to_csv(folder / "validation.csv", index=False)


def write_advise_folder(folder: Path, model: bool = True, comm: bool = True, trials: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if trials:
        write_trials(folder)
    if comm:
        write_comm(folder)
    if model:
        write_model_outputs(folder)
    env = {
        "versions": {"torch": "2.13.0", "deepspeed": "0.19.8"},
        "devices": "2 x CPU (synthetic)",
        "hostfile": HOSTILE_ATTR,
        "network": "loopback",
    }
    (folder / "environment.json").write_text(json.dumps(env, indent=2))
    return folder
