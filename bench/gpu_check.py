"""The GPU-only paths the CPU CI cannot prove, checked on one CUDA GPU in one short run.

1. The tiny default model on synthetic data (as `sdzero demo` builds them) trained through the real
   entry (`deepspeed --num_gpus 1 sdzero/train.py`, NCCL) under ds_configs zero2_fp16 (real dynamic loss
   scaling: skipped steps and loss scale reported), zero3_bf16 and zero1_bf16. Each must exit 0 with
   finite losses that fall (mean of the last 5 steps below the first 5). zero2_fp16 is also cut at half
   way with a checkpoint and continued with `--resume auto`; the continued steps are compared with the
   uninterrupted run's.
2. Memory: `sdzero profile`'s trial machinery on a UNet of Stable Diffusion 1.5's size (its published
   UNet/VAE config, random weights; a CLIP-L-sized text encoder over the tiny tokenizer's vocabulary)
   at 512 px (64x64 latents), ZeRO-2 bf16, micro-batch 1, 2 and 4. The advisor's memory model
   (advisor.model.memory, as `sdzero advise` fits it) is fitted on the trials and its predicted per-rank
   peak compared with the CUDA allocator's measured peak (torch.cuda.max_memory_allocated), both in
   sample (fitted on every trial) and held out (micro-batch 4 predicted from 1 and 2). Samples/s too.
3. `pytest tests/unit` with CUDA visible, if time is left.

The DeepSpeed JSONs are the shipped ones with `"torch_adam": true` in the optimizer params (torch's AdamW
instead of DeepSpeed's JIT-compiled FusedAdam, which would take minutes of nvcc); `--fused-adam` keeps
them exactly as shipped. Everything else is as shipped.

    python bench/gpu_check.py --out results/ [--work /tmp/gpu_check] [--budget-s 380]

Without CUDA it refuses with exit code 2. `--cpu-rehearsal` runs the same code paths on the CPU (gloo,
a small stand-in for the SD 1.5-sized UNet, fp16 through the tests' accelerator patch) to check the script
itself before spending GPU time. Results: `<out>/gpu_check.json` and `<out>/gpu_check.md`; run logs and
trials.csv beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sdzero.constants import GIB

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gpu_run_helpers import (  # noqa: E402  (bench/ is this script's folder, first on sys.path)
    Clock,
    environment,
    launch,
    log_tail,
    run_env,
    say,
    summarize_metrics,
    write_config,
)

TINY_CONFIGS = ("zero2_fp16", "zero3_bf16", "zero1_bf16")
RESUME_CONFIG = "zero2_fp16"
MEMORY_MICRO_BATCHES = (1, 2, 4)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the results (small files only)")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_check"), help="models, data, runs")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per tiny-model run")
    p.add_argument("--budget-s", type=float, default=380.0, help="stop starting new phases past this")
    p.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=list(MEMORY_MICRO_BATCHES),
        help="memory phase's micro-batches (at least 2; the largest is held out given 3 or more)",
    )
    p.add_argument("--fused-adam", action="store_true", help="keep DeepSpeed's FusedAdam (JIT build)")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument("--cpu-rehearsal", action="store_true", help="run the same paths on the CPU (no figures)")
    return p.parse_args()


# --------------------------------------------------------------------------------------------------
# 1. tiny model, three configs, checkpoint + resume


def tiny_phase(a: argparse.Namespace, clock: Clock, results: dict[str, Any], logs: list[Path]) -> None:
    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    work = a.work / "tiny"
    model, data = work / "model", work / "data"
    if not (model / "model_index.json").exists():
        write_tiny_model(model)
    if not (data / "metadata.jsonl").exists():
        write_synthetic_dataset(data, images=256)
    base = ["--model", str(model), "--data", str(data), "--lr", "3e-4", "--num-workers", "2"]
    runs: dict[str, Any] = results.setdefault("tiny_runs", {})

    def train(name: str, config: str, output: Path, steps: int, extra: list[str]) -> dict[str, Any]:
        if clock.left() < 30:
            runs[name] = {"skipped": f"budget: {clock.left():.0f} s left"}
            return runs[name]
        cfg = write_config(config, work / "configs" / f"{config}.json", a.fused_adam)
        log = a.work / "logs" / f"{name}.log"
        logs.append(log)
        say(f"tiny {name}: {config}, {steps} steps")
        code, wall = launch(
            [
                "--deepspeed_config",
                str(cfg),
                *base,
                "--output-dir",
                str(output),
                "--max-steps",
                str(steps),
                *extra,
            ],
            log,
            run_env(a.cpu_rehearsal, "fp16" in config),
            min(150.0, clock.left()),
        )
        info = {
            "config": config,
            "exit_code": code,
            "wall_s": round(wall, 1),
            **summarize_metrics(output / "metrics.jsonl"),
        }
        if code != 0:
            info["log_tail"] = log_tail(log)
        runs[name] = info
        say(
            f"  exit {code} in {wall:.1f} s; loss {info.get('loss_first', float('nan')):.4f} -> "
            f"{info.get('loss_last', float('nan')):.4f}; skipped {info.get('skipped_steps', '-')}"
        )
        return info

    for config in TINY_CONFIGS:
        train(config, config, work / "runs" / config, a.steps, [])

    # checkpoint at half way, then `--resume auto` in the same folder
    half = a.steps // 2
    cut = work / "runs" / f"{RESUME_CONFIG}-cut"
    first = train(f"{RESUME_CONFIG}-cut", RESUME_CONFIG, cut, half, ["--checkpoint-every", str(half)])
    if first.get("exit_code") != 0:
        return
    rest = train(f"{RESUME_CONFIG}-resumed", RESUME_CONFIG, cut, a.steps, ["--resume", "auto"])
    full = runs.get(RESUME_CONFIG, {})
    if rest.get("exit_code") == 0 and full.get("losses"):
        ref = full["losses"][half:]
        got = rest.get("losses", [])
        n = min(len(ref), len(got))
        diffs = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(ref[:n], got[:n], strict=True)]
        resumed = {
            "resumed_first_step": rest.get("first_step"),
            "expected_first_step": half + 1,
            "compared_steps": n,
            "max_rel_loss_diff_vs_uninterrupted": max(diffs) if diffs else None,
            "mean_rel_loss_diff_vs_uninterrupted": statistics.fmean(diffs) if diffs else None,
        }
        if "loss_scales" in full and "loss_scales" in rest and "loss_scales" in first:
            resumed["loss_scale_at_cut"] = first["loss_scales"][-1]
            resumed["loss_scale_first_resumed"] = rest["loss_scales"][0]
            resumed["loss_scale_uninterrupted_same_step"] = full["loss_scales"][half]
            resumed["skipped_steps_resumed_total"] = rest.get("skipped_steps")
            resumed["skipped_steps_uninterrupted_total"] = full.get("skipped_steps")
        results["resume"] = resumed
        say(f"  resume: {resumed}")


# --------------------------------------------------------------------------------------------------
# 2. memory model against the CUDA allocator, SD 1.5-sized UNet


def write_sd15_sized_model(out: Path, small: bool) -> Path:
    """SD 1.5's UNet and VAE configs with random weights; a CLIP-L-sized text encoder (12 layers, 768
    wide, 77 positions) over the tiny tokenizer's vocabulary. `small`: a scaled-down stand-in (rehearsal)."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from sdzero.atomic import new_dir
    from sdzero.models.tiny import _ddpm_settings, build_tokenizer

    torch.manual_seed(0)
    tokenizer = build_tokenizer(max_length=77)
    width, layers = (64, 2) if small else (768, 12)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=4 * width,
            projection_dim=width,
            num_hidden_layers=layers,
            num_attention_heads=layers,
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    vae_blocks = (16, 32, 32, 32) if small else (128, 256, 512, 512)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=vae_blocks,
        layers_per_block=2,
        latent_channels=4,
        norm_num_groups=8 if small else 32,
        sample_size=512,
        scaling_factor=0.18215,
    )
    unet_blocks = (32, 64, 64, 64) if small else (320, 640, 1280, 1280)
    unet = UNet2DConditionModel(
        sample_size=8 if small else 64,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=unet_blocks,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=width,
        attention_head_dim=8,
        norm_num_groups=8 if small else 32,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDPMScheduler(**_ddpm_settings(), clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    with new_dir(out) as tmp:
        pipe.save_pretrained(tmp, safe_serialization=True)
    return out


def memory_phase(
    a: argparse.Namespace, clock: Clock, results: dict[str, Any], logs: list[Path]
) -> Path | None:
    import pandas as pd

    from advisor.measure.grid import GridRequest
    from advisor.measure.profile import run_profile
    from advisor.model.memory import ZeroSettings, fit_memory_model, trained_numels
    from sdzero.models.tiny import write_synthetic_dataset

    work = a.work / "sd15"
    model, data = work / "model", work / "data"
    mem: dict[str, Any] = results.setdefault("memory", {})
    t0 = time.monotonic()
    if not (model / "model_index.json").exists():
        say("memory: writing the SD 1.5-sized pipeline (random weights)")
        write_sd15_sized_model(model, small=a.cpu_rehearsal)
    if not (data / "metadata.jsonl").exists():
        write_synthetic_dataset(data, images=64, size=64)
    mem["model_build_s"] = round(time.monotonic() - t0, 1)
    numels = trained_numels(model)
    mem["unet_params"] = int(sum(numels))
    resolution = 64 if a.cpu_rehearsal else 512
    mem["resolution"] = resolution
    base = write_config("zero2_bf16", work / "configs" / "zero2_bf16.json", a.fused_adam)
    out = work / "profile"
    per_trial = 60.0 if not a.cpu_rehearsal else 150.0
    batches = sorted(set(a.micro_batches))
    while batches and clock.left() < per_trial * len(batches) + 10:
        batches.pop()  # the largest first: the smaller ones are the fit, the largest (given 3+) the held-out check
    if len(batches) < 2:
        mem["skipped"] = f"budget: {clock.left():.0f} s left"
        return None
    say(
        f"memory: sdzero profile, ZeRO-2 bf16, micro-batches {batches}, {resolution} px, "
        f"{mem['unet_params']:,} UNet parameters"
    )
    os.environ["PYTHONPATH"] = run_env(a.cpu_rehearsal, False)["PYTHONPATH"]
    result = run_profile(
        model=model,
        data=data,
        out_dir=out,
        grid=GridRequest(
            stages=(2,), precisions=("bf16",), micro_batches=tuple(batches), ranks_per_node=(1,)
        ),
        base_config=base,
        steps=3,
        warmup_steps=2,
        trial_timeout_s=per_trial + 30,
        stall_timeout_s=60,
        train_args=["--resolution", str(resolution), "--num-workers", "4"],
        log=say,
    )
    table = result.table
    for trial_dir in sorted((out / "trials").glob("*")):
        logs.append(trial_dir / "log.txt")
    ok = table[table["status"] == "ok"].copy()
    mem["trials"] = [
        {
            k: (None if pd.isna(row[k]) else row[k].item() if hasattr(row[k], "item") else row[k])
            for k in (
                "trial_id",
                "status",
                "reason",
                "micro_batch",
                "samples_per_s",
                "step_time_median_s",
                "params_bytes",
                "grads_bytes",
                "master_bytes",
                "optimizer_bytes",
                "model_state_bytes",
                "bucket_bytes",
                "frozen_bytes",
                "activation_bytes",
                "device_peak_bytes",
                "cuda_peak_bytes",
                "peak_rss_bytes",
                "wall_s",
            )
        }
        for _, row in table.iterrows()
    ]
    if len(ok) < 2:
        mem["error"] = "fewer than 2 ok trials: no fit"
        return result.csv_path
    zero = ZeroSettings.from_config(json.loads(base.read_text()))

    def compare(fit_rows: pd.DataFrame, row: pd.Series, held_out: bool) -> dict[str, Any]:
        model_fit = fit_memory_model(fit_rows, numels, zero)
        parts = model_fit.per_rank_bytes(2, "bf16", int(row["micro_batch"]), "none", int(row["world_size"]))
        measured = float(row["device_peak_bytes"])
        return {
            "micro_batch": int(row["micro_batch"]),
            "held_out": held_out,
            "fitted_on_micro_batches": sorted(int(m) for m in fit_rows["micro_batch"]),
            "predicted_bytes": parts["allocated"],  # the allocator's peak, as measured (no context, NCCL)
            "predicted_parts_bytes": {
                k: parts[k]
                for k in (
                    "model_states",
                    "buckets",
                    "frozen",
                    "activations",
                    "fwd_bwd",
                    "step",
                    "step_transient",
                )
            },
            "measured_cuda_peak_bytes": measured,
            "error_pct": 100.0 * (parts["allocated"] / measured - 1.0),
            "predicted_device_total_bytes": parts["total"],
            "model_states_measured_bytes": float(row["model_state_bytes"]),
            "activations_measured_bytes": float(row["activation_bytes"]),
            "notes": model_fit.notes,
        }

    rows = [compare(ok, row, False) for _, row in ok.iterrows()]
    largest = ok["micro_batch"].max()
    rest = ok[ok["micro_batch"] < largest]
    if len(rest) >= 2:
        rows.append(compare(rest, ok[ok["micro_batch"] == largest].iloc[0], True))
    mem["comparison"] = rows
    for r in rows:
        say(
            f"  mb {r['micro_batch']} {'held-out' if r['held_out'] else 'in-sample'}: predicted "
            f"{r['predicted_bytes'] / GIB:.3f} GiB, measured {r['measured_cuda_peak_bytes'] / GIB:.3f} GiB, "
            f"error {r['error_pct']:+.1f}%"
        )
    return result.csv_path


# --------------------------------------------------------------------------------------------------
# 3. unit tests with CUDA visible


def pytest_phase(a: argparse.Namespace, clock: Clock, results: dict[str, Any], out: Path) -> None:
    if clock.left() < 45:
        results["pytest"] = {"skipped": f"budget: {clock.left():.0f} s left"}
        return
    say("pytest tests/unit")
    log = out / "pytest.txt"
    cmd = [sys.executable, "-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider"]
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=run_env(a.cpu_rehearsal, False),
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=clock.left() - 5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = 124
    last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    results["pytest"] = {"exit_code": code, "summary": last[-1] if last else ""}
    say(f"  pytest exit {code}: {results['pytest']['summary']}")


# --------------------------------------------------------------------------------------------------


def verdicts(results: dict[str, Any]) -> list[str]:
    problems = []
    for name, run in results.get("tiny_runs", {}).items():
        if "skipped" in run:
            problems.append(f"{name}: skipped ({run['skipped']})")
        elif run.get("exit_code") != 0:
            problems.append(f"{name}: exit code {run.get('exit_code')}")
        elif not name.endswith(("-cut", "-resumed")) and not run.get("loss_falls"):
            problems.append(f"{name}: loss did not fall or is not finite")
    resume = results.get("resume")
    if resume and resume.get("resumed_first_step") != resume.get("expected_first_step"):
        problems.append(f"resume started at step {resume.get('resumed_first_step')}")
    if results.get("pytest", {}).get("exit_code") not in (None, 0):
        problems.append("pytest tests/unit failed")
    return problems


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# gpu_check {results['date']}", "", f"device: {results['environment'].get('gpu', 'cpu')}", ""]
    lines += [
        "| run | exit | steps | loss first -> last | mean first 5 -> last 5 | skipped (fp16) | "
        "loss scale first -> last | samples/s (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.get("tiny_runs", {}).items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped | | | | | | |")
            continue

        def f(key: str, fmt: str = ".4f", r: dict[str, Any] = r) -> str:
            return "-" if r.get(key) is None else format(r[key], fmt)

        lines.append(
            f"| {name} | {r['exit_code']} | {r.get('steps', 0)} | {f('loss_first')} -> "
            f"{f('loss_last')} | {f('loss_first5_mean')} -> {f('loss_last5_mean')} | "
            f"{r.get('skipped_steps', '-')} | {f('loss_scale_first', 'g')} -> {f('loss_scale_last', 'g')} "
            f"| {f('samples_per_s_median', '.1f')} |"
        )
    if results.get("resume"):
        lines += ["", f"resume: {json.dumps(results['resume'])}"]
    mem = results.get("memory", {})
    if mem.get("comparison"):
        lines += [
            "",
            f"memory, ZeRO-2 bf16, {mem['unet_params']:,} UNet parameters, {mem['resolution']} px:",
            "",
            "| micro-batch | fit | predicted GiB | measured CUDA peak GiB | error | samples/s |",
            "|---|---|---|---|---|---|",
        ]
        rate = {t["micro_batch"]: t["samples_per_s"] for t in mem["trials"]}
        for r in mem["comparison"]:
            lines.append(
                f"| {r['micro_batch']} | {'held out' if r['held_out'] else 'in sample'} | "
                f"{r['predicted_bytes'] / GIB:.3f} | {r['measured_cuda_peak_bytes'] / GIB:.3f} | "
                f"{r['error_pct']:+.1f}% | {rate.get(r['micro_batch']) or 0:.2f} |"
            )
    elif mem:
        lines += ["", f"memory: {json.dumps({k: v for k, v in mem.items() if k != 'trials'})}"]
    if results.get("pytest"):
        lines += ["", f"pytest tests/unit: {json.dumps(results['pytest'])}"]
    lines += ["", "problems: " + ("; ".join(results["problems"]) or "none"), ""]
    return "\n".join(lines)


def main() -> int:
    a = parse()
    import torch

    if not torch.cuda.is_available() and not a.cpu_rehearsal:
        print(
            "gpu_check: no CUDA device visible to torch; run this on a CUDA machine "
            "(--cpu-rehearsal checks the script itself on a CPU)",
            file=sys.stderr,
        )
        return 2
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")  # nothing is downloaded; offline machines must not wait on the hub
    clock = Clock(a.budget_s)
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(a.cpu_rehearsal),
        "settings": {"steps": a.steps, "torch_adam": not a.fused_adam, "budget_s": a.budget_s},
    }
    logs: list[Path] = []
    csv_path = None

    def save() -> None:
        results["elapsed_s"] = round(clock.elapsed(), 1)
        results["problems"] = verdicts(results)
        (a.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        (a.out / "gpu_check.md").write_text(markdown(results))

    phases = [] if a.skip_tiny else [("tiny", lambda: tiny_phase(a, clock, results, logs))]
    if not a.skip_memory:
        phases.append(("memory", lambda: memory_phase(a, clock, results, logs)))
    if not a.skip_pytest:
        phases.append(("pytest", lambda: pytest_phase(a, clock, results, a.out)))
    for name, phase in phases:
        try:
            value = phase()
            if name == "memory":
                csv_path = value
        except Exception as exc:  # one broken phase must not cost the others' figures
            import traceback

            results.setdefault("phase_errors", {})[name] = traceback.format_exc()[-3000:]
            say(f"phase {name} failed: {exc!r}")
        save()
    if csv_path and Path(csv_path).exists():
        shutil.copy(csv_path, a.out / "trials.csv")
    with (a.out / "run_logs.txt").open("w") as f:
        for log in logs:
            f.write(f"==== {log}\n{log_tail(log, 60)}\n\n")
    save()
    print((a.out / "gpu_check.md").read_text())
    return 0 if not results["problems"] and not results.get("phase_errors") else 1


if __name__ == "__main__":
    sys.exit(main())
