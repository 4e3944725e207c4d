"""What bench/gpu_check.py's phases share: the time budget, log lines, the environment record, the run
environment and configs, one trainer launch, and what its metrics file says."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()


def say(message: str) -> None:
    print(f"[gpu_check {datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def environment(rehearsal: bool) -> dict[str, Any]:
    import torch

    from sdzero.telemetry.environment import environment_snapshot

    info: dict[str, Any] = {
        "rehearsal_on_cpu": rehearsal,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for name in ("deepspeed", "diffusers", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # reported, not fatal: the runs will say more
            info[name] = f"import failed: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = int(props.total_memory)
        info["gpus"] = torch.cuda.device_count()
    try:
        info["snapshot"] = environment_snapshot()
    except Exception as exc:
        info["snapshot"] = f"failed: {exc}"
    return info


def run_env(rehearsal: bool, fp16: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [str(REPO)]
    if rehearsal and fp16:  # DeepSpeed's CPU accelerator refuses fp16 without the tests' patch
        env["SDZERO_TEST_FP16_ON_CPU"] = "1"
        paths.insert(0, str(REPO / "tests" / "support"))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def write_config(name: str, dest: Path, fused_adam: bool) -> Path:
    raw = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    if not fused_adam:
        raw.setdefault("optimizer", {}).setdefault("params", {})["torch_adam"] = True
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(raw, indent=2) + "\n")
    return dest


def launch(args: list[str], log: Path, env: dict[str, str], timeout_s: float) -> tuple[int, float]:
    """One trainer run under `deepspeed --num_gpus 1`; (exit code, wall seconds). 124: killed at timeout."""
    from sdzero.cluster.launch_command import deepspeed_command

    cmd = deepspeed_command(args, num_gpus=1)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = 124
    return code, time.monotonic() - started


def log_tail(log: Path, lines: int = 25) -> str:
    if not log.exists():
        return ""
    text = log.read_text(errors="replace")
    clean = [line.rsplit("\r", 1)[-1].rstrip() for line in text.splitlines()]
    return "\n".join([line for line in clean if line][-lines:])


def summarize_metrics(path: Path) -> dict[str, Any]:
    from sdzero.telemetry.metrics import read_metrics

    if not path.exists():
        return {"steps": 0}
    rows = read_metrics(path)
    if not rows:
        return {"steps": 0}
    losses = [float(r["loss"]) for r in rows]
    head, tail = losses[:5], losses[-5:]
    rates = [float(r["samples_per_s"]) for r in rows[1:]] or [float(rows[0]["samples_per_s"])]
    out: dict[str, Any] = {
        "steps": len(rows),
        "first_step": int(rows[0]["step"]),
        "last_step": int(rows[-1]["step"]),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_first5_mean": statistics.fmean(head),
        "loss_last5_mean": statistics.fmean(tail),
        "all_finite": all(math.isfinite(x) for x in losses),
        "samples_per_s_median": statistics.median(rates),
        "step_time_median_s": statistics.median(float(r["step_time_s"]) for r in rows[1:] or rows),
        "peak_mem_bytes": max(int(r["peak_mem_bytes"]) for r in rows),
        "losses": [round(x, 6) for x in losses],
    }
    out["loss_falls"] = out["all_finite"] and out["loss_last5_mean"] < out["loss_first5_mean"]
    if rows[0].get("loss_scale") is not None:
        scales = [float(r["loss_scale"]) for r in rows]
        out.update(
            loss_scale_first=scales[0],
            loss_scale_last=scales[-1],
            loss_scale_min=min(scales),
            skipped_steps=int(rows[-1]["skipped_steps"] or 0),
            loss_scales=scales,
        )
    return out
