"""Is the advisor calibrated on models it never saw? (2 ranks on the CPU, tiny models, the default budget)

For each model and round:
1. the whole 1-node grid (ZeRO 1-3 x bf16 x micro-batch 1, 2, 4, 8), measured with `sdzero profile`'s
   launches (one per ZeRO stage, its micro-batches interleaved): the ground truth's first pass;
2. `sdzero advise --max-nodes 1` at its default budget (5 minutes on a CPU), as a user would run it;
3. the same grid again: the ground truth's second pass.

The two passes surround the advise run in time. Every launch of every run times the same fixed product
(its tie, advisor.measure.launch): each grid config is put by it on the machine speed of the advise run's
first launch. A config's ground truth is the geometric mean of its two passes, its interval their
intervals and their disagreement combined. The truth is then put on the advise run's machine by the
median ratio over the configs both measured (as rounds of the earlier protocol, one grid pass, were).

Then, from the advise run's own files (trials, validation.csv, launches.json) and its own code
(advisor.model.prediction_error.fit_models, advisor.model.uncertainty), each grid config is predicted at
the ground truth's batch shape with its 95% interval, and:

- **error**: step-time MAPE on the grid configs the advise run did not measure;
- **noise floor**: the advise run's (the halves of its launches) and the ground truth's: the two passes'
  repeat spread over every config after the ties' correction (one measurement's noise between runs minutes
  apart, which is also what each of the advise run's single trials carries against the truth);
- **between runs**: the mean |ratio / scale - 1| of the advise run's trials to the truth over the configs
  both measured: what a model with no error of its own would show as its error here;
- **coverage**: the share of grid configs whose measured step lies in its predicted interval; and, since
  the ground truth is a measurement too, the share whose prediction and measurement differ by less than
  their two 95% half-widths in quadrature;
- **pick vs best**: the advisor's pick among the grid's configs (advisor.decide.ties.pick_config
  on those predictions: the recommendation's rule) against the grid's measured best: their ratio, and
  whether the difference is within the two measurements' noise.

Goal (#28): error <= max(10%, 1.5 x noise floor), coverage >= 90%, the pick within noise of the best,
every round, every model. Models: the embedded default (SD 1.5-shaped tiny), a wider and deeper SD 1.5
UNet, and the SDXL-shaped tiny (two text encoders, pooled `text_time` embedding).

    python bench/advisor_accuracy.py [--work DIR] [--models default,wide,sdxl] [--rounds 2] [--no-avx512]

`--no-avx512` runs everything as on a host without AVX-512 (bf16 emulated, several times slower): torch's
kernels are kept at AVX2 (NO_AVX512_ENV, inherited by every trial's ranks), which on this AMD EPYC makes
a tiny UNet's bf16 step about 6x slower and its fp32 step no slower; the CPU line says so.

Results accumulate in <work>/accuracy.json (a rerun with the same --work skips finished rounds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
NO_AVX512_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""ATen's vectorised ops and oneDNN's matmuls and convolutions kept at AVX2 (sdzero.telemetry.environment)."""


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


def _ties(folder: Path) -> dict[str, float]:
    """A run's launches' ties (launches.json): the median of its fixed product's time, by launch folder."""
    from advisor.measure.launch import LAUNCHES_FILE, read_launches

    for path in (folder / LAUNCHES_FILE, folder / "profile" / LAUNCHES_FILE):
        records = read_launches(path)
        if records:
            return {r.folder: r.tie_s for r in records if r.tie_s}
    return {}


def _shape(row) -> tuple:
    """A config at one accumulation (the advise run's checks add some)."""
    return (*_key(row), int(row["grad_accum"]))


def joint_truth(
    advise_dir: Path, passes: list[tuple[Path, pd.DataFrame]]
) -> tuple[pd.DataFrame, dict] | None:
    """The grid's passes on the advise run's machine speed, one row per config, and how they agree.

    Every launch of every run timed the same fixed product (its tie, advisor.measure.launch): a grid
    config's raw step divided by its launch's tie over the advise run's first launch's tie is the config
    on the machine the advise run put its own trials on. None when a run has no ties or a pass is missing
    (the bench falls back to the median ratio)."""
    from advisor.stats import MEAN_ABS_TO_SIGMA, pooled_log_spread

    advise_ties = _ties(advise_dir)
    ties = [_ties(folder) for folder, _ in passes]
    if len(passes) < 2 or not advise_ties or not all(ties):
        return None
    base = next(iter(advise_ties.values()))  # the advise run's first launch: its rows' own machine speed
    measured: dict[tuple, list[tuple[float, float, float]]] = {}
    first: dict[tuple, pd.Series] = {}
    for (_, table), run_ties in zip(passes, ties, strict=True):
        for _, row in table[table["status"] == "ok"].iterrows():
            factor = run_ties.get(str(row["trial_dir"]), base) / base
            raw = (float(row["step_s_raw"]), float(row["step_s_raw_lo"]), float(row["step_s_raw_hi"]))
            measured.setdefault(_shape(row), []).append(tuple(x / factor for x in raw))
            first.setdefault(_shape(row), row)
    rows = []
    for shape, steps in measured.items():
        logs = [math.log(step) for step, _, _ in steps]
        centre = math.exp(float(np.mean(logs)))
        own = math.hypot(*((hi - lo) / 2 / step for step, lo, hi in steps)) / len(steps)
        disagreement = (max(logs) - min(logs)) / 2  # each pass's distance from their centre (two passes)
        half = math.hypot(own, disagreement)
        row = first[shape].copy()
        row["truth_s"], row["step_s_lo"], row["step_s_hi"] = centre, centre * (1 - half), centre * (1 + half)
        row["passes_s"] = [step for step, _, _ in steps]
        rows.append(row)
    sigma, dof = pooled_log_spread([[step for step, _, _ in steps] for steps in measured.values()])
    every_tie = [t / base for run in ties for t in run.values()] + [t / base for t in advise_ties.values()]
    agreement = {
        "grid_noise_floor": None if sigma is None else sigma / MEAN_ABS_TO_SIGMA,
        "grid_noise_dof": dof,
        "pass_ratios": [s[1][0] / s[0][0] for s in measured.values() if len(s) > 1],
        "ties": len(every_tie),
        "tie_range": [min(every_tie), max(every_tie)],
    }
    return pd.DataFrame(rows).reset_index(drop=True), agreement


def evaluate(advise_dir: Path, model: Path, passes: list[tuple[Path, pd.DataFrame]], rec: dict) -> dict:
    """Predict every grid config from the advise run's own files, and judge the predictions."""
    from advisor.decide.ties import is_tie, pick_config
    from advisor.measure.grid import load_base_config
    from advisor.measure.trial_table import read_trials
    from advisor.model.memory import ZeroSettings, trained_numels
    from advisor.model.network import build_network
    from advisor.model.prediction_error import fit_models, trial_predictions
    from advisor.model.step_time import measured_step_s
    from advisor.model.uncertainty import add_intervals, estimate_spread
    from sdzero.cluster.launch_command import shipped_config

    trials = read_trials(advise_dir / "profile" / "trials.csv")
    trials = trials[trials["status"] == "ok"]
    validation = pd.read_csv(advise_dir / "validation.csv")
    net, _ = build_network(advise_dir / "comm" / "comm_fit.json", 2)
    numels = trained_numels(str(model))
    zero = ZeroSettings.from_config(load_base_config(shipped_config("zero2_bf16.json")))
    models = fit_models(trials, numels, zero, net)
    floor, dof = _noise_floor(advise_dir)
    spread = estimate_spread(trials, validation, floor, 0.0, True, noise_dof=dof)

    advise_steps = dict(zip((_shape(r) for _, r in trials.iterrows()), measured_step_s(trials), strict=True))
    joint = joint_truth(advise_dir, passes)
    if joint is not None:  # both passes at the advise run's first launch's machine speed, by their ties
        truth, agreement = joint
        method = "launch ties, median ratio"
    else:  # one pass, as its launches put it
        grid_dir, grid = passes[0]
        truth = grid[grid["status"] == "ok"].copy()
        truth["truth_s"] = measured_step_s(truth).to_numpy()
        floor_g, dof_g = _noise_floor(grid_dir)
        agreement = {"grid_noise_floor": floor_g, "grid_noise_dof": dof_g}
        method = "median ratio"
    # Onto the advise run's machine: the median ratio over every config both measured (the scale printed
    # is how far the ties alone would have been off).
    shared = [
        advise_steps[_shape(r)] / float(r["truth_s"])
        for _, r in truth.iterrows()
        if _shape(r) in advise_steps
    ]
    scale = float(np.median(shared)) if shared else 1.0
    truth["truth_s"] *= scale
    ratios = shared  # their spread about the scale: how well two runs agree on the same configs
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
    if rec.get("usable_memory_bytes"):  # the advise run's device memory, as its own tie rule weighed it
        table["usable_bytes"] = float(rec["usable_memory_bytes"])
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
    # Where advise measured every grid config (one launch per stage), the error is its figures' over all
    # of them: the fit's, which the printed figures are, against the truth.
    held = float(error[unmeasured].mean()) if unmeasured.any() else float(error.mean())
    grid_floor = agreement["grid_noise_floor"]
    goal = max(0.10, 1.5 * max(floor or 0.0, grid_floor or 0.0))  # either run's noise is in the error
    between = float(np.mean([abs(r / scale - 1) for r in ratios])) if ratios else None
    table["inside"] = inside
    table["error"] = error
    # How informative the intervals are, beside how often they hold: their mean 95% half-width
    half = (table["step_time_s_hi"] - table["step_time_s_lo"]) / 2 / table["step_time_s"]
    return {
        "halfwidth_unmeasured": float(half[unmeasured].mean()) if unmeasured.any() else math.nan,
        "halfwidth_measured": float(half[~unmeasured].mean()) if (~unmeasured).any() else math.nan,
        "trials_run": int(len(trials)),
        "grid": int(len(table)),
        "held_out_error": held,
        "error_basis": "unmeasured configs" if unmeasured.any() else "every config (advise measured all)",
        "advise_check_error": (rec.get("error") or {}).get("step_time_mape"),
        "error_all": float(error.mean()),
        "noise_floor": floor,
        "noise_dof": dof,
        **agreement,
        "scale_method": method,
        "between_runs": between,
        "coverage": float(inside.mean()),
        "coverage_with_truth_noise": float(consistent.mean()),
        "cross_run_ratios": [float(r) for r in ratios],
        "coverage_unmeasured": float(inside[unmeasured].mean()) if unmeasured.any() else math.nan,
        "scale_to_advise_machine": scale,
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
    p.add_argument(
        "--no-avx512",
        action="store_true",
        help="keep torch below AVX-512 in every run (bf16 emulated), as on a host without it",
    )
    args = p.parse_args()
    if args.no_avx512:
        os.environ.update(NO_AVX512_ENV)  # before torch loads here, and inherited by every launch
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
            grid_model = model or _embedded_model(work)
            # The grid's two passes surround the advise run (one grid pass first, the advise run, the
            # second pass); rounds of the earlier protocol have one pass, "grid" only.
            passes: list[tuple[Path, pd.DataFrame]] = []
            names = ["grid", "advise", "grid-after"]
            if args.reevaluate and not (folder / "grid-after").is_dir():
                names = ["grid", "advise"]
            rec: dict = {}
            for name in names:
                if name == "advise":
                    rec = run_advise(model, data, folder / "advise")
                elif args.reevaluate:  # the finished grid's last attempt of each trial, nothing run
                    from advisor.measure.trial_table import read_trials

                    table = read_trials(folder / name / "trials.csv")
                    passes.append((folder / name, table.drop_duplicates("trial_id", keep="last")))
                else:
                    passes.append((folder / name, run_grid(grid_model, data, folder / name)))
            results[key] = evaluate(folder / "advise", grid_model, passes, rec)
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
        f"{_widths(r)}pick {r['pick']} / best {r['grid_best']} = {r['pick_over_best']:.3f}"
        f" ({'within' if r['pick_within_noise'] else 'outside'} noise); trials {r['trials_run']}/{r['grid']}; "
        f"runs' speed ratio {r['scale_to_advise_machine']:.3f} by {r.get('scale_method', 'median ratio')} "
        f"({min(r.get('cross_run_ratios') or [1]):.2f}-{max(r.get('cross_run_ratios') or [1]):.2f} over shared "
        f"configs{_between(r)})",
        flush=True,
    )


def _widths(r: dict) -> str:
    """The intervals' mean half-widths (unmeasured / measured configs), where the round recorded them."""
    if "halfwidth_unmeasured" not in r:
        return ""
    return (
        f"intervals +-{r['halfwidth_unmeasured']:.0%} unmeasured / +-{r['halfwidth_measured']:.0%} measured, "
    )


def _between(r: dict) -> str:
    """The mean disagreement of the two runs on the configs both measured, where the round has it."""
    return f"; {r['between_runs']:.1%} apart" if r.get("between_runs") is not None else ""


def summary_table(results: dict) -> str:
    lines = [
        f"cpu: {results.get('cpu')}",
        "| model | round | held-out error | goal | noise floor (advise / grid) | coverage (with truth's interval) "
        "| interval half-width (unmeasured / measured) | pick / best | within noise | trials "
        "| runs' ratio (spread; mean apart) | goals met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        if "/" not in key:
            continue
        kind, rnd = key.split("/")
        lines.append(
            f"| {kind} | {rnd.removeprefix('round')} | {r['held_out_error']:.1%} | {r['error_goal']:.0%} | "
            f"{(r['noise_floor'] or 0):.1%} / {(r['grid_noise_floor'] or 0):.1%} | {r['coverage']:.0%} "
            f"({r.get('coverage_with_truth_noise', float('nan')):.0%}) | "
            f"{r.get('halfwidth_unmeasured', float('nan')):.0%} / {r.get('halfwidth_measured', float('nan')):.0%} | "
            f"{r['pick']} / {r['grid_best']} = {r['pick_over_best']:.3f} | {r['pick_within_noise']} | "
            f"{r['trials_run']}/{r['grid']} | {r['scale_to_advise_machine']:.2f} "
            f"({min(r.get('cross_run_ratios') or [1]):.2f}-{max(r.get('cross_run_ratios') or [1]):.2f}"
            f"{_between(r)}) | {r['goals_met']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
