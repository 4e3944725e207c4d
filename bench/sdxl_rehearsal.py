"""Does `sdzero advise` pick right when the fastest config needs gradient checkpointing? (SDXL structure)

The model: SDXL's UNet block structure (a plain down block, then two cross-attention down blocks with 1, 2
and 10 transformer layers, two layers per block, the mirror on the way up, linear projections, the
`text_time` addition embedding of the pooled prompt and six size/crop numbers), built from diffusers'
UNet2DConditionModel config at reduced width (32/64/128 channels instead of 320/640/1280, 32-channel
heads), in the SDXL-shaped tiny pipeline (its two text encoders and VAE: only the UNet is trained), at
32x32 latents (64 px images through the tiny VAE's 1/2).

Phases (each resumable; run each under the heavy lock, they fit its few-minutes rule one by one):

1. `grid-1`, `grid-2`, `grid-3`: the whole 1-node grid of one ZeRO stage (bf16, micro-batch 1, 2, 4, 8,
   each with and without gradient checkpointing, accumulation 1), one `sdzero profile` launch each;
2. `cap`: the device memory cap: from the grid's measured per-rank peaks, the cap (its usable part, the
   advisor's default headroom of 10% left free) under which the fastest config that fits needs gradient
   checkpointing, clearly (`choose_cap`): the case where SDXL at 1024 px does not fit a GPU at a useful
   micro-batch without checkpointing or offload, at this machine's scale;
3. `advise`: `sdzero advise --max-nodes 1 --checkpointing both --device-memory-gib CAP` as a user runs it,
   timed from start to exit;
4. `host`: `sdzero advise --replan` of that run with `--host-memory-gib` declared between the host RAM the
   pick needs and the most any config needs (predictions.csv `host_bytes_per_node`; where the pick needs
   the most, between the least and the pick's): the configs over it must be refused with their reason;
5. `report`: advise's pick against the grid's fastest config that fits the cap (per-sample rate at the
   pick's micro-batch and checkpointing, measured by the grid), whether their difference lies within the
   two measurements' 95% half-widths in quadrature, advise's wall time over the grid's, and whether the
   answer names checkpointing where the grid says it is needed;
6. `coverage`: `sdzero advise --replan` of the advise run with this checkout's model (nothing measured
   again), and its intervals for the configs the run did not measure against the grid's steps (as
   `report` does for the run itself), each with its width (upper over lower bound).

    flock /tmp/sdzero-heavy.lock .venv/bin/python bench/sdxl_rehearsal.py --work W --phase grid-1
    ... --phase grid-2, grid-3, advise (its --budget-minutes), host, report

Results accumulate in <work>/sdxl.json; the advise run's terminal answer is kept in <work>/advise.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
SDXL_SHAPE = {
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "layers_per_block": 2,
    "transformer_layers_per_block": [1, 2, 10],
    "use_linear_projection": True,
    "norm_num_groups": 32,
}
"""SDXL base's UNet block structure (stabilityai/stable-diffusion-xl-base-1.0 unet/config.json)."""
WIDTHS = [32, 64, 128]
"""SDXL's channels (320, 640, 1280) at 0.1x."""
HEADS = [1, 2, 4]
"""32 channels per head at every level (SDXL: 64-channel heads, 5/10/20 of them)."""
LATENT_SIDE = 32
IMAGES = 128
HEADROOM = 0.1
"""advise's default --headroom: the cap's usable part is (1 - HEADROOM) of it."""
GLOBAL_BATCH = 8
"""advise's global batch (the shipped config's micro-batch 4 on 2 ranks), given explicitly."""
RANKS = 2
MICRO_BATCHES = (1, 2, 4)
"""The micro-batches that reach GLOBAL_BATCH on RANKS ranks (8 would need half an accumulation step)."""


def in_reach(micro_batch: int) -> bool:
    return GLOBAL_BATCH % (RANKS * micro_batch) == 0


def write_sdxl_rehearsal(out: Path) -> tuple[Path, Path, int]:
    """(model folder, data folder, trained parameters): the SDXL-shaped tiny pipeline, its UNet SDXL's."""
    import torch
    from diffusers import UNet2DConditionModel

    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    model, data = out / "model", out / "data"
    if not (model / "model_index.json").is_file():
        write_tiny_model(model, "sdxl")
        config = json.loads((model / "unet" / "config.json").read_text())
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        config |= SDXL_SHAPE | {
            "block_out_channels": WIDTHS,
            "attention_head_dim": HEADS,
            "sample_size": LATENT_SIDE,
        }
        torch.manual_seed(0)
        UNet2DConditionModel(**config).save_pretrained(model / "unet", safe_serialization=True)
    if not (data / "metadata.jsonl").is_file():
        write_synthetic_dataset(data, IMAGES, size=2 * LATENT_SIDE)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    return model, data, sum(p.numel() for p in unet.parameters())


def run_grid_stage(model: Path, data: Path, out: Path, stage: int) -> dict:
    """One ZeRO stage's whole ladder, with and without checkpointing, in one launch."""
    from advisor.measure.grid import GridRequest
    from advisor.measure.profile import run_profile
    from sdzero.cluster.launch_command import shipped_config

    grid = GridRequest(
        stages=(stage,),
        precisions=("bf16",),
        micro_batches=MICRO_BATCHES,
        ranks_per_node=(RANKS,),
        grad_accums=(1,),
        checkpointing=(False, True),
    )
    started = time.monotonic()
    result = run_profile(model, data, out, grid=grid, base_config=shipped_config("zero2_bf16.json"))
    call_s = time.monotonic() - started
    rows = result.table[result.table["status"] == "ok"]
    return {
        "wall_s": launches_wall_s(out),
        "call_s": call_s,
        "rows": [grid_row(r) for _, r in rows.iterrows()],
    }


def launches_wall_s(out: Path) -> float:
    """The grid's launches' walls (launches.json: a contended launch counted, whether or not its relaunch
    finished): what the grid cost, also where a rerun of the phase found its configs measured."""
    from advisor.measure.launch import LAUNCHES_FILE, read_launches

    return sum(r.wall_s or 0.0 for r in read_launches(out / LAUNCHES_FILE))


def grid_row(r: pd.Series) -> dict:
    step = float(r["step_time_s"])
    return {
        "id": str(r["trial_id"]),
        "stage": int(r["zero_stage"]),
        "micro_batch": int(r["micro_batch"]),
        "gc": "gc" in str(r["trial_id"]).split("-"),
        "rate": float(r["global_batch"]) / step,
        "half": (float(r["step_s_hi"]) - float(r["step_s_lo"])) / 2 / step,
        "peak": float(r["device_peak_bytes"]),
    }


def choose_cap(rows: list[dict]) -> dict:
    """The usable cap under which the fastest fitting config uses checkpointing, clearly.

    Candidates sit (geometrically) midway in each gap between two adjacent measured peaks; a candidate
    counts where the fastest config that fits is checkpointed and leads the fastest plain one that fits
    (if any) by more than their two half-widths in quadrature. Of those, the widest gap: the peaks are
    computed, not sampled, but the advisor predicts the configs it does not measure."""
    rows = [r for r in rows if in_reach(r["micro_batch"])]
    peaks = sorted({r["peak"] for r in rows})
    best: dict | None = None
    for low, high in zip(peaks, peaks[1:], strict=False):
        usable = math.sqrt(low * high)
        fitting = [r for r in rows if r["peak"] <= usable]
        top = max(fitting, key=lambda r: r["rate"])
        plain = [r for r in fitting if not r["gc"]]
        rival = max(plain, key=lambda r: r["rate"]) if plain else None
        clear = rival is None or top["rate"] / rival["rate"] - 1 > math.hypot(top["half"], rival["half"])
        if top["gc"] and clear and (best is None or high / low > best["margin"]):
            best = {
                "usable_bytes": usable,
                "margin": high / low,
                "fastest_fitting": top["id"],
                "fastest_plain_fitting": None if rival is None else rival["id"],
            }
    if best is None:
        raise SystemExit("no cap makes a checkpointed config clearly the fastest that fits: widen the grid")
    best["device_memory_gib"] = best["usable_bytes"] / (1 - HEADROOM) / 2**30
    return best


def run_advise(out: Path, model: Path, data: Path, cap_gib: float, budget: float | None) -> tuple[float, str]:
    from advisor_share import run_advise as share_run_advise

    args = ["--model", str(model), "--data", str(data), "--checkpointing", "both"]
    args += ["--device-memory-gib", f"{cap_gib:.6f}", "--global-batch", str(GLOBAL_BATCH)]
    wall, terminal = share_run_advise(REPO, out, args, budget)
    return wall, terminal


def host_check(advise_dir: Path, out: Path, cap_gib: float) -> dict:
    """Replan with a declared host RAM between two configs' needs: who is refused, and why."""
    preds = pd.read_csv(advise_dir / "predictions.csv")
    rec = json.loads((advise_dir / "recommendation.json").read_text())
    one = preds[preds["node_count"] == 1]
    needs = pd.to_numeric(one["host_bytes_per_node"], errors="coerce").dropna()
    pick_need = float(one.loc[one["config_id"] == rec["config_id"], "host_bytes_per_node"].max())
    most, least = float(needs.max()), float(needs[needs > 0].min())
    # Between the pick's need and the most (the pick stays), or, where the pick needs the most, between
    # the least and the pick's (the pick itself is refused and the answer moves).
    low, high = (pick_need, most) if most > pick_need else (least, pick_need)
    declared = math.sqrt(low * high) / 2**30
    cmd = [str(REPO / ".venv" / "bin" / "sdzero"), "advise", "--replan", str(advise_dir), "--out", str(out)]
    cmd += ["--host-memory-gib", f"{declared:.6f}", "--device-memory-gib", f"{cap_gib:.6f}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if done.returncode != 0:
        raise SystemExit(f"replan failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    replan = pd.read_csv(out / "predictions.csv")
    replan = replan[replan["node_count"] == 1]
    refused = replan[~replan["host_fits"].astype(bool)]
    again = json.loads((out / "recommendation.json").read_text())
    return {
        "declared_gib": declared,
        "pick_need_gib": pick_need / 2**30,
        "most_gib": most / 2**30,
        "least_gib": least / 2**30,
        "refused": sorted(set(refused["config_id"])),
        "reasons": sorted(set(refused["host_reason"].astype(str)))[:2],
        "pick_after": str(again["config_id"]),
        "answer": next((x for x in done.stdout.splitlines() if x.startswith("answer:")), ""),
    }


def replan_coverage(results: dict, out: Path) -> dict:
    """The advise run replanned with this checkout's model (its intervals recomputed, nothing measured),
    against the grid as `coverage` judges the run itself."""
    cmd = [str(REPO / ".venv" / "bin" / "sdzero"), "advise", "--replan", results["advise"]["out"]]
    cmd += ["--out", str(out), "--device-memory-gib", f"{results['cap']['device_memory_gib']:.6f}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    if done.returncode != 0:
        raise SystemExit(f"replan failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [r for s in (1, 2, 3) for r in results[f"grid-{s}"]["rows"]]
    result = coverage(out, [r for r in rows if in_reach(r["micro_batch"])])
    result["answer"] = next((x for x in done.stdout.splitlines() if x.startswith("answer:")), "")
    return result


def report(results: dict) -> dict:
    """advise's pick against the grid's fastest fitting config, and the wall times."""
    rows = [r for s in (1, 2, 3) for r in results[f"grid-{s}"]["rows"]]
    rows = [r for r in rows if in_reach(r["micro_batch"])]
    usable = results["cap"]["usable_bytes"]
    fitting = [r for r in rows if r["peak"] <= usable]
    best = max(fitting, key=lambda r: r["rate"])
    rec = json.loads((Path(results["advise"]["out"]) / "recommendation.json").read_text())
    # The grid is one node's: advise's choice at one node (its scaling table's row; the answer's node count
    # follows the efficiency rule).
    one = next(r for r in rec["scaling_table"] if int(r["node_count"]) == 1)
    config = str(one["config_id"]).split("-")
    stage, gc = int(config[0][1:]), "gc" in config
    matches = [
        r for r in rows if (r["stage"], r["micro_batch"], r["gc"]) == (stage, int(one["micro_batch"]), gc)
    ]
    pick = matches[0] if matches else None
    grid_wall = sum(results[f"grid-{s}"]["wall_s"] for s in (1, 2, 3))
    out = {
        "best": best["id"],
        "best_needs_gc": best["gc"],
        "pick": str(one["config_id"]),
        "pick_grad_accum": int(one["grad_accum"]),
        "answer_config": f"{rec['node_count']} nodes, {rec['config_id']}",
        "pick_names_gc": gc,
        "grid_wall_s": grid_wall,
        "advise_wall_s": results["advise"]["wall_s"],
        "wall_ratio": results["advise"]["wall_s"] / grid_wall,
    }
    if pick is not None:
        out["pick_fits_grid_peak"] = pick["peak"] <= usable
        out["pick_over_best"] = pick["rate"] / best["rate"]
        out["noise"] = math.hypot(pick["half"], best["half"])
        out["within_noise"] = 1 - out["pick_over_best"] <= out["noise"]
    out["coverage"] = coverage(Path(results["advise"]["out"]), rows)
    return out


def coverage(advise_dir: Path, rows: list[dict]) -> dict:
    """Do advise's intervals for the configs it did not measure cover the grid's measurements?

    At one node and accumulation 1 (the batch shape the grid measured: micro-batch 4 here), each config
    advise predicted without measuring it (its interval from borrowed costs) against the grid's step; the
    grid ran minutes earlier, so its steps are first put on the advise run's machine speed by the median
    ratio over the configs both measured (as bench/advisor_accuracy.py does)."""
    preds = pd.read_csv(advise_dir / "predictions.csv")
    preds = preds[(preds["node_count"] == 1) & (preds["grad_accum"] == 1)]
    grid = {(r["stage"], r["micro_batch"], r["gc"]): RANKS * r["micro_batch"] / r["rate"] for r in rows}
    pairs = []
    for _, p in preds.iterrows():
        key = (int(p["zero_stage"]), int(p["micro_batch"]), bool(p["checkpointing"]))
        if key in grid and str(p["offload"]) == "none":
            pairs.append((p, grid[key]))
    measured = [float(p["step_time_s"]) / g for p, g in pairs if p["interval_source"] == "measured"]
    scale = float(pd.Series(measured).median()) if measured else 1.0
    configs = []
    for p, g in pairs:
        if p["interval_source"] == "measured":
            continue
        truth = g * scale
        lo, hi = float(p["step_time_s_lo"]), float(p["step_time_s_hi"])
        configs.append(
            {
                "config": str(p["config_id"]),
                "source": str(p["interval_source"]),
                "predicted_s": float(p["step_time_s"]),
                "interval": [lo, hi],
                "measured_s": truth,
                "covered": lo <= truth <= hi,
                "width": hi / lo,
            }
        )
    return {"scale": scale, "scale_from": len(measured), "configs": configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument(
        "--phase",
        required=True,
        choices=["grid-1", "grid-2", "grid-3", "cap", "advise", "host", "report", "coverage"],
    )
    parser.add_argument("--budget-minutes", type=float, default=None)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    path = work / "sdxl.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    from advisor_share import cpu_name

    results["cpu"] = cpu_name()
    model, data, params = write_sdxl_rehearsal(work / "sdxl")
    results["params"] = params
    phase = args.phase
    if phase.startswith("grid-"):
        results[phase] = run_grid_stage(model, data, work / phase, int(phase[-1]))
    elif phase == "cap":
        results["cap"] = choose_cap([r for s in (1, 2, 3) for r in results[f"grid-{s}"]["rows"]])
    elif phase == "advise":
        out = work / "advise"
        wall, terminal = run_advise(
            out, model, data, results["cap"]["device_memory_gib"], args.budget_minutes
        )
        (work / "advise.txt").write_text(terminal)
        answer = next((x for x in terminal.splitlines() if x.startswith("answer:")), "")
        results["advise"] = {"out": str(out), "wall_s": wall, "answer": answer}
    elif phase == "host":
        results["host"] = host_check(work / "advise", work / "host", results["cap"]["device_memory_gib"])
    elif phase == "coverage":
        results["coverage"] = replan_coverage(results, work / "replan")
    else:
        results["report"] = report(results)
    path.write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if not k.startswith("grid-")}, indent=1))
    if phase.startswith("grid-"):
        for r in results[phase]["rows"]:
            print(
                f"  {r['id']}: {r['rate']:.2f} samples/s +-{r['half']:.1%}, peak {r['peak'] / 2**20:.1f} MiB"
            )


if __name__ == "__main__":
    main()
