"""How good is the advisor's model, and how few trials does it need? (2 ranks on the CPU, tiny model)

1. Run the full grid of `sdzero advise` on a CPU (ZeRO 1-3 x bf16 x micro-batch 1, 2, 4, 8) with
   `sdzero profile`, and the collectives benchmark.
2. Replay the advisor's own search over that table: the seeds, then each trial the model picks, exactly as
   `sdzero advise` would, but answered from the measured grid (same machine, same run).
3. Fit on the chosen subset and print:
   (a) step-time MAPE on the grid points it did not measure (goal <= 10 %, aim 5 %),
   (b) activation-memory error on them (goal <= 5 %),
   (c) trials run / full grid (goal <= 1/3),
   (d) the recommended config's measured samples/s / the grid's best (goal >= 0.97), at the measured
       node count (1 node, 2 ranks: where both can be measured).

    python bench/advisor_accuracy.py [--work DIR] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="folder for everything (reuses a finished grid and its link fit)",
    )
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="advisor_accuracy_"))

    from advisor.advise import CPU_GRID, default_inputs
    from advisor.measure.collectives_launch import run_comm
    from advisor.measure.grid import load_base_config, plan_grid
    from advisor.measure.profile import run_profile
    from advisor.model.memory import ZeroSettings, trained_numels
    from advisor.model.network import build_network
    from advisor.model.predict import Candidate, predict_table
    from advisor.model.prediction_error import fit_models, trial_predictions
    from advisor.model.recommend import recommend
    from advisor.model.search import run_search
    from advisor.model.step_time import measured_step_s
    from sdzero.cluster.launch_command import shipped_config

    model, data = default_inputs(work, None, None)
    base_path = shipped_config("zero2_bf16.json")
    grid = CPU_GRID.__class__(**{**CPU_GRID.__dict__, "ranks_per_node": (2,)})
    full = run_profile(
        model,
        data,
        work / "full",
        grid=grid,
        base_config=base_path,
        steps=args.steps,
        warmup_steps=1,
        train_args=["--num-workers", "1"],
        log=print,
    ).table
    fit_path = work / "comm" / "comm_fit.json"
    if not fit_path.is_file():  # a rerun on the same --work compares models on the very same measurements
        fit_path = run_comm(
            work / "comm", num_ranks=2, backends=("torch",), max_bytes=16 * 2**20, budget_s=15.0
        ).fit_path
    net, _ = build_network(fit_path, 2)
    numels = trained_numels(model)
    zero = ZeroSettings.from_config(load_base_config(base_path))
    plan = plan_grid(grid, {"bf16": True, "fp16": False})
    table = full.set_index("trial_id")
    measured: list[str] = []

    def replay(specs):
        measured.extend(s.trial_id for s in specs if s.trial_id not in measured and s.trial_id in table.index)
        return table.loc[measured].reset_index()

    search = run_search(plan, replay, numels, zero, net, net, 1, 1e12, None, budget_s=1e9)
    subset = search.trials
    models = fit_models(subset, numels, zero, net)
    unmeasured = full[~full["trial_id"].isin(subset["trial_id"]) & (full["status"] == "ok")]
    step_err, act_err = [], []
    for _, row in unmeasured.iterrows():
        predicted = trial_predictions(models, row, net)
        measured_step = float(measured_step_s(row.to_frame().T).iloc[0])
        step_err.append(abs(predicted["step_time_s"] / measured_step - 1))
        act_err.append(abs(predicted["activation_bytes"] / row["activation_bytes"] - 1))
    ok = full[full["status"] == "ok"]
    cands = [Candidate(int(r.zero_stage), str(r.precision), int(r.micro_batch)) for r in ok.itertuples()]
    predictions = predict_table(cands, [1], models.memory, models.timing, net, 1e12, None)
    best, *_ = recommend(predictions, load_base_config(base_path), 1e12, "linear", 8)
    chosen = ok[ok["trial_id"].str.startswith(str(best["config_id"]))]["samples_per_s"].iloc[0]
    summary = {
        "step_time_mape_unmeasured": float(np.mean(step_err)) if step_err else None,
        "activation_error_unmeasured_mean": float(np.mean(act_err)) if act_err else None,
        "activation_error_unmeasured_max": float(np.max(act_err)) if act_err else None,
        "trials_run": len(subset),
        "full_grid": plan.max_trials,
        "chosen": str(best["config_id"]),
        "chosen_measured_samples_per_s": float(chosen),
        "grid_best": str(ok.loc[ok["samples_per_s"].idxmax(), "trial_id"]),
        "grid_best_samples_per_s": float(ok["samples_per_s"].max()),
        "chosen_over_best": float(chosen / ok["samples_per_s"].max()),
        "search_log": search.log,
    }
    pd.set_option("display.width", 200)
    print(full[["trial_id", "status", "samples_per_s", "step_time_s", "comm_s", "activation_bytes"]])
    print(json.dumps(summary, indent=2))
    print(
        f"(a) step-time MAPE on unmeasured configs: {summary['step_time_mape_unmeasured']:.1%} (goal <= 10%)"
    )
    print(
        f"(b) activation-memory error on unmeasured: mean {summary['activation_error_unmeasured_mean']:.2%}, "
        f"max {summary['activation_error_unmeasured_max']:.2%} (goal <= 5%)"
    )
    print(f"(c) trials run / full grid: {len(subset)}/{plan.max_trials} (goal <= 1/3)")
    print(
        f"(d) chosen {summary['chosen']} measured / grid best: {summary['chosen_over_best']:.3f} (goal >= 0.97)"
    )


if __name__ == "__main__":
    main()
