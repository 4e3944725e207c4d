"""Is the advisor calibrated on models it never saw? (2 ranks on the CPU, tiny models, the default budget)

For each model and round:
1. `sdzero advise --max-nodes 1` at its default budget (5 minutes on a CPU), as a user would run it;
2. the whole 1-node grid (ZeRO 1-3 x bf16 x micro-batch 1, 2, 4, 8) measured with `sdzero profile`'s
   runner, bracketed by its own reference config, as the ground truth;
the two in alternating order between rounds, so neither always runs in the slower minutes.

Each run corrects its trials to its own reference's first bracket (advisor.measure.drift); the two are
put on one machine speed by the median ratio over the configs both measured (printed with its spread:
how well two runs of the same configs agree on this machine).
Then, from the advise run's own files (trials, validation.csv, drift.json) and its own code
(advisor.model.prediction_error.fit_models, advisor.model.uncertainty), each grid config is predicted at
the ground truth's batch shape with its 95% interval, and:

- **error**: step-time MAPE on the grid configs the advise run did not measure;
- **noise floor**: the advise run's (drift.json) and the ground truth's;
- **coverage**: the share of grid configs whose measured step lies in its predicted interval; and, since
  the ground truth is a measurement too, the share whose prediction and measurement differ by less than
  their two 95% half-widths in quadrature;
- **pick vs best**: the advisor's pick among the grid's configs (advisor.model.uncertainty.pick_config
  on those predictions: the recommendation's rule) against the grid's measured best: their ratio, and
  whether the difference is within the two measurements' noise.

Goal (#28): error <= max(10%, 1.5 x noise floor), coverage >= 90%, the pick within noise of the best,
every round, every model. Models: the embedded default (SD 1.5-shaped tiny), a wider and deeper SD 1.5
UNet, and the SDXL-shaped tiny (two text encoders, pooled `text_time` embedding).

    python bench/advisor_accuracy.py [--work DIR] [--models default,wide,sdxl] [--rounds 2]

Results accumulate in <work>/accuracy.json (a rerun with the same --work skips finished rounds).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODELS = ("default", "wide", "sdxl")


def write_model(kind: str, where: Path) -> Path:
    """A tiny model of the given shape in diffusers format (the advise and grid runs load it as any)."""
    from sdzero.models.tiny import write_tiny_model

    out = where / f"model-{kind}"
    if (out / "model_index.json").is_file():
        return out
    if kind == "sdxl":
        return write_tiny_model(out, "sdxl")
    write_tiny_model(out, "sd15")
    if kind == "wide":  # the same pipeline with a UNet 1.5x as wide and twice as deep per block
        import torch
        from diffusers import UNet2DConditionModel

        config = json.loads((out / "unet" / "config.json").read_text())
        config |= {"block_out_channels": [48, 96], "layers_per_block": 2}
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        torch.manual_seed(1)
        UNet2DConditionModel(**config).save_pretrained(out / "unet", safe_serialization=True)
    return out


def run_advise(model: Path | None, data: Path, out: Path) -> dict:
    """`sdzero advise` as a user runs it; returns recommendation.json."""
    if (out / "recommendation.json").is_file():
        return json.loads((out / "recommendation.json").read_text())
    cmd = [str(REPO / ".venv" / "bin" / "sdzero"), "advise", "--max-nodes", "1", "--out", str(out)]
    if model is not None:
        cmd += ["--model", str(model), "--data", str(data)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"advise failed ({out}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"  advise: {time.monotonic() - started:.0f} s", flush=True)
    return json.loads((out / "recommendation.json").read_text())


def run_grid(model: Path, data: Path, out: Path) -> pd.DataFrame:
    from advisor.measure.grid import GridRequest
    from advisor.measure.profile import run_profile
    from sdzero.cluster.launch_command import shipped_config

    grid = GridRequest(
        stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1, 2, 4, 8), ranks_per_node=(2,)
    )
    started = time.monotonic()
    result = run_profile(
        model,
        data,
        out,
        grid=grid,
        base_config=shipped_config("zero2_bf16.json"),
        steps=10,
        warmup_steps=2,
        train_args=["--num-workers", "1"],
    )
    print(f"  grid: {time.monotonic() - started:.0f} s", flush=True)
    return result.table


def _noise_floor(folder: Path) -> tuple[float | None, int]:
    """The run's noise floor and its degrees of freedom, as the advisor computes them."""
    from advisor.model.uncertainty import run_noise_floor

    return run_noise_floor(folder)


def _key(row) -> tuple[int, str, int, str]:
    from advisor.model.uncertainty import config_key

    return config_key(row)


def evaluate(advise_dir: Path, model: Path, grid_dir: Path, grid: pd.DataFrame, rec: dict) -> dict:
    """Predict every grid config from the advise run's own files, and judge the predictions."""
    from advisor.measure.duel import read_duels
    from advisor.measure.grid import load_base_config
    from advisor.measure.trial_table import read_trials
    from advisor.model.memory import ZeroSettings, trained_numels
    from advisor.model.network import build_network
    from advisor.model.prediction_error import fit_models, trial_predictions
    from advisor.model.step_time import measured_step_s
    from advisor.model.uncertainty import add_intervals, estimate_spread, is_tie, pick_config
    from sdzero.cluster.launch_command import shipped_config

    trials = read_trials(advise_dir / "profile" / "trials.csv")
    trials = trials[trials["status"] == "ok"]
    validation = pd.read_csv(advise_dir / "validation.csv")
    net, _ = build_network(advise_dir / "comm" / "comm_fit.json", 2)
    numels = trained_numels(str(model))
    zero = ZeroSettings.from_config(load_base_config(shipped_config("zero2_bf16.json")))
    models = fit_models(trials, numels, zero, net)
    floor, dof = _noise_floor(advise_dir)
    spread = estimate_spread(
        trials, validation, floor, 0.0, True, noise_dof=dof, duels=read_duels(advise_dir / "duel.json")
    )

    truth = grid[grid["status"] == "ok"].copy()
    truth["truth_s"] = measured_step_s(truth).to_numpy()

    # One machine speed for both runs: each run is corrected to its own reference's first bracket, so the
    # two differ by a common factor; it is the median ratio over every config both runs measured (one
    # shared config would carry its own measurement's noise into every figure). Their spread says how
    # well the two runs agree at all.
    def shape(row: pd.Series) -> tuple:  # a config at one accumulation: the advise run's checks add some
        return (*_key(row), int(row["grad_accum"]))

    advise_steps = dict(zip((shape(r) for _, r in trials.iterrows()), measured_step_s(trials), strict=True))
    ratios = [
        advise_steps[shape(r)] / float(r["truth_s"]) for _, r in truth.iterrows() if shape(r) in advise_steps
    ]
    scale = float(np.median(ratios)) if ratios else 1.0
    truth["truth_s"] *= scale
    measured_keys = {_key(r) for _, r in trials.iterrows()}
    rows = []
    for _, row in truth.iterrows():
        predicted = trial_predictions(models, row, net)
        batch = int(row["micro_batch"]) * int(row["grad_accum"]) * int(row["world_size"])
        rows.append(
            {
                "config_id": f"z{int(row['zero_stage'])}-bf16-mb{int(row['micro_batch'])}",
                "zero_stage": int(row["zero_stage"]),
                "dtype": "bf16",
                "precision": "bf16",
                "micro_batch": int(row["micro_batch"]),
                "offload": "none",
                "global_batch": batch,
                "step_time_s": predicted["step_time_s"],
                "samples_per_s": batch / predicted["step_time_s"],
                "exposed_inter_s": 0.0,
                "mem_per_rank_bytes": predicted["mem_per_rank_bytes"],
                "feasible": True,
                "truth_s": float(row["truth_s"]),
                "truth_rate": batch / float(row["truth_s"]),
                "truth_lo": float(row["step_s_lo"]) * scale,
                "truth_hi": float(row["step_s_hi"]) * scale,
                "measured_by_advise": _key(row) in measured_keys,
            }
        )
    table = add_intervals(pd.DataFrame(rows), spread)
    inside = (table["truth_s"] >= table["step_time_s_lo"]) & (table["truth_s"] <= table["step_time_s_hi"])
    # The ground truth is a measurement too: consistent when prediction and truth differ by less than
    # their two 95% half-widths in quadrature.
    pred_half = (table["step_time_s_hi"] - table["step_time_s_lo"]) / 2 / table["step_time_s"]
    truth_rel = (table["truth_hi"] - table["truth_lo"]) / 2 / table["truth_s"]
    consistent = (table["step_time_s"] / table["truth_s"]).map(math.log).abs() <= np.hypot(
        pred_half, truth_rel
    )
    error = (table["step_time_s"] / table["truth_s"] - 1).abs()
    unmeasured = ~table["measured_by_advise"].astype(bool)
    pick = pick_config(table).row
    best = table.loc[table["truth_rate"].idxmax()]
    mine = table[table["config_id"] == pick["config_id"]].iloc[0]
    # "within noise": the two measured rates' difference inside its 95% interval (their own intervals)
    truth_half = lambda r: (r["truth_hi"] - r["truth_lo"]) / 2 / r["truth_s"]  # noqa: E731
    within = bool(
        is_tie(
            pd.Series({"samples_per_s": mine["truth_rate"], "compare_halfwidth": truth_half(mine)}),
            pd.Series({"samples_per_s": best["truth_rate"], "compare_halfwidth": truth_half(best)}),
        )
    )
    held = float(error[unmeasured].mean()) if unmeasured.any() else math.nan
    grid_floor, grid_dof = _noise_floor(grid_dir)
    goal = max(0.10, 1.5 * max(floor or 0.0, grid_floor or 0.0))  # either run's noise is in the error
    table["inside"] = inside
    table["error"] = error
    return {
        "trials_run": int(len(trials)),
        "grid": int(len(table)),
        "held_out_error": held,
        "error_all": float(error.mean()),
        "noise_floor": floor,
        "noise_dof": dof,
        "grid_noise_floor": grid_floor,
        "grid_noise_dof": grid_dof,
        "coverage": float(inside.mean()),
        "coverage_with_truth_noise": float(consistent.mean()),
        "cross_run_ratios": [float(r) for r in ratios],
        "coverage_unmeasured": float(inside[unmeasured].mean()) if unmeasured.any() else math.nan,
        "scale_to_advise_machine": scale,
        "duels": [d.line() for d in read_duels(advise_dir / "duel.json")],
        "pick": str(pick["config_id"]),
        "advise_recommended": str(rec.get("config_id")),
        "grid_best": str(best["config_id"]),
        "pick_over_best": float(mine["truth_rate"] / best["truth_rate"]),
        "pick_within_noise": within,
        "error_goal": goal,
        "goals_met": bool(held <= goal and inside.mean() >= 0.9 and within),
        "table": table[
            [
                "config_id",
                "measured_by_advise",
                "step_time_s",
                "step_time_s_lo",
                "step_time_s_hi",
                "truth_s",
                "error",
                "inside",
            ]
        ].to_dict("records"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--reevaluate", action="store_true", help="judge finished rounds again from their folders (no runs)"
    )
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="advisor_accuracy_"))
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "accuracy.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    from sdzero.telemetry.environment import cpu_kind

    results["cpu"] = cpu_kind()
    print(f"work: {work}\ncpu: {results['cpu']}", flush=True)
    from sdzero.models.tiny import write_synthetic_dataset

    data = work / "data"
    if not (data / "metadata.jsonl").is_file():
        write_synthetic_dataset(data, images=64, size=40)
    for r in range(1, args.rounds + 1):
        for kind in args.models.split(","):
            key = f"{kind}/round{r}"
            if key in results and not args.reevaluate:
                continue
            if args.reevaluate and key not in results:
                continue
            print(f"{key}:", flush=True)
            folder = work / kind / f"round{r}"
            folder.mkdir(parents=True, exist_ok=True)
            model = None if kind == "default" else write_model(kind, work)
            steps = [("advise", None), ("grid", None)]
            if r % 2 == 0:
                steps.reverse()  # alternate which run takes the earlier minutes
            rec: dict = {}
            grid = pd.DataFrame()
            grid_model = model or _embedded_model(work)
            for name, _ in steps:
                if name == "advise":
                    rec = run_advise(model, data, folder / "advise")
                elif args.reevaluate:  # the finished grid's last attempt of each trial, nothing run
                    from advisor.measure.trial_table import read_trials

                    grid = read_trials(folder / "grid" / "trials.csv").drop_duplicates(
                        "trial_id", keep="last"
                    )
                else:
                    grid = run_grid(grid_model, data, folder / "grid")
            results[key] = evaluate(folder / "advise", grid_model, folder / "grid", grid, rec)
            results_path.write_text(json.dumps(results, indent=1, default=float))
            show(key, results[key])
    print(summary_table(results))


def _embedded_model(work: Path) -> Path:
    """The embedded default's model, written here the way `sdzero advise` writes it (the same seed)."""
    from sdzero.models.tiny import write_tiny_model

    out = work / "model-default"
    return out if (out / "model_index.json").is_file() else write_tiny_model(out, "sd15")


def show(key: str, r: dict) -> None:
    print(
        f"  {key}: held-out error {r['held_out_error']:.1%} (goal <= {r['error_goal']:.0%}; noise floor "
        f"{(r['noise_floor'] or 0):.1%}, grid's {(r['grid_noise_floor'] or 0):.1%}), coverage {r['coverage']:.0%} "
        f"({r.get('coverage_with_truth_noise', float('nan')):.0%} with the truth's own interval), "
        f"pick {r['pick']} / best {r['grid_best']} = {r['pick_over_best']:.3f}"
        f" ({'within' if r['pick_within_noise'] else 'outside'} noise); trials {r['trials_run']}/{r['grid']}; "
        f"runs' speed ratio {r['scale_to_advise_machine']:.3f} "
        f"({min(r.get('cross_run_ratios') or [1]):.2f}-{max(r.get('cross_run_ratios') or [1]):.2f} over shared configs)",
        flush=True,
    )


def summary_table(results: dict) -> str:
    lines = [
        f"cpu: {results.get('cpu')}",
        "| model | round | held-out error | goal | noise floor (advise / grid) | coverage (with truth's interval) "
        "| pick / best | within noise | trials | runs' ratio (spread) | goals met |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        if "/" not in key:
            continue
        kind, rnd = key.split("/")
        lines.append(
            f"| {kind} | {rnd.removeprefix('round')} | {r['held_out_error']:.1%} | {r['error_goal']:.0%} | "
            f"{(r['noise_floor'] or 0):.1%} / {(r['grid_noise_floor'] or 0):.1%} | {r['coverage']:.0%} "
            f"({r.get('coverage_with_truth_noise', float('nan')):.0%}) | "
            f"{r['pick']} / {r['grid_best']} = {r['pick_over_best']:.3f} | {r['pick_within_noise']} | "
            f"{r['trials_run']}/{r['grid']} | {r['scale_to_advise_machine']:.2f} "
            f"({min(r.get('cross_run_ratios') or [1]):.2f}-{max(r.get('cross_run_ratios') or [1]):.2f}) | "
            f"{r['goals_met']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
