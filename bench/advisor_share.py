"""How much of `sdzero advise` measures? Its wall time's share spent in measured steps, and configs per minute.

For each model, `sdzero advise --max-nodes 32` runs as a user runs it, timed from start to exit; then,
from its own files:

- **measured share**: the seconds its trainer processes spent in measured steps (every `step_times_s` the
  profiles under <out>/profile/trials/ record: a trial's after its warm-up, or a launch's timed steps)
  over the command's wall time. The rest starts and stops processes, loads models, builds engines, warms
  up, benchmarks the collectives and fits;
- **configs per minute**: the distinct configs it measured (ok rows of trials.csv, a repeat counted
  once) per minute of wall time.

- **within its budget**: the budget the run announced (its "budget:" line, the default rule's unless
  --budget-minutes is given) against its wall time;
- **intervals**: the 95% half-widths of the configs it measured, at its own node count (predictions.csv).

Models: `default`, the embedded default (no --model); `rehearsal`, bench/rehearsal_model.py's SD 1.x UNet
of 135M parameters at 32x32 latents. `--before COMMIT` runs the same on that commit's code too (a git
worktree under --work), side by side in this run.

`--grid` then measures the rehearsal's whole grid in the same bench (every ZeRO stage x micro-batch at
the advise run's global batch, each at the accumulation that reaches it, through `sdzero profile`'s
interleaved launches) and compares the advise run's pick with the grid's fastest config: their ratio, and
whether the difference lies within the two measurements' 95% half-widths in quadrature.

    flock /tmp/sdzero-heavy.lock python bench/advisor_share.py --work W [--models default,rehearsal]
        [--before 058e46f] [--budget-minutes N] [--grid]

Each run's terminal answer is kept verbatim in <work>/<code>-<model>.txt; results in <work>/share.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PYTHON = REPO / ".venv" / "bin" / "python"


def source_tree(work: Path, commit: str | None) -> Path:
    """This checkout, or a worktree of `commit` under `work` (made once)."""
    if commit is None:
        return REPO
    tree = work / f"src-{commit}"
    if not tree.is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True)
    return tree


def run_advise(tree: Path, out: Path, model_args: list[str], budget: float | None) -> tuple[float, str]:
    """`sdzero advise --max-nodes 32` of `tree`'s code; (wall seconds, its terminal output)."""
    cmd = [str(PYTHON), "-c", "from advisor.cli import main; main()", "advise", "--max-nodes", "32"]
    cmd += ["--out", str(out), *model_args]
    if budget:
        cmd += ["--budget-minutes", f"{budget:g}"]
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"advise failed ({out}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall, done.stdout + done.stderr


def measured_seconds(out: Path) -> float:
    """Seconds in measured steps: every step time the run's profiles record."""
    total = 0.0
    for path in (out / "profile" / "trials").rglob("profile.json"):
        profile = json.loads(path.read_text())
        configs = profile["configs"].values() if "configs" in profile else [profile]
        total += sum(sum(c.get("step_times_s") or []) for c in configs)
    return total


def trials_seconds(out: Path) -> float:
    """The same from trials.csv alone: each row's measured steps x its median step time (every row, ok or
    raced out, that measured steps; the accumulation checks included)."""
    table = pd.read_csv(out / "profile" / "trials.csv")
    steps = pd.to_numeric(table["measured_steps"], errors="coerce").fillna(0)
    median = pd.to_numeric(table["step_time_median_s"], errors="coerce").fillna(0)
    return float((steps * median).sum())


def configs_measured(out: Path) -> int:
    table = pd.read_csv(out / "profile" / "trials.csv")
    return int(table.loc[table["status"] == "ok", "trial_id"].nunique())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--models", default="default,rehearsal")
    parser.add_argument("--before", default=None, help="a commit to run side by side (e.g. 058e46f)")
    parser.add_argument(
        "--budget-minutes", type=float, default=None, help="the rehearsal's, this code's run only"
    )
    parser.add_argument("--grid", action="store_true", help="the rehearsal's full grid, after its advise run")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    results_path = work / "share.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results["cpu"] = cpu_name()
    codes = [("after", None)] + ([("before", args.before)] if args.before else [])
    for model in args.models.split(","):
        model_args: list[str] = []
        budget = None
        if model == "rehearsal":
            sys.path.insert(0, str(REPO / "bench"))
            from rehearsal_model import write_rehearsal

            folder, data, params = write_rehearsal(work / "rehearsal")
            model_args = ["--model", str(folder), "--data", str(data)]
            budget = args.budget_minutes
            results["rehearsal_params"] = params
        for code, commit in codes:
            key = f"{code}-{model}"
            if key in results:
                continue
            out = work / key
            # --budget-minutes is this code's: the earlier code runs at its own default budget
            wall, terminal = run_advise(
                source_tree(work, commit), out, model_args, budget if commit is None else None
            )
            (work / f"{key}.txt").write_text(terminal)
            measured = measured_seconds(out)
            from_trials = trials_seconds(out)
            configs = configs_measured(out)
            results[key] = {
                "wall_s": wall,
                "measured_s": measured,
                "measured_share": measured / wall,
                "trials_steps_s": from_trials,
                "trials_share": from_trials / wall,
                "phases": phase_seconds(out),
                "configs": configs,
                "configs_per_minute": configs / (wall / 60),
                "answer": next((line for line in terminal.splitlines() if line.startswith("answer:")), ""),
                "budget_s": announced_budget_s(out),
                "measured_halfwidths": measured_halfwidths(out),
            }
            results_path.write_text(json.dumps(results, indent=1))
            show(key, results[key])
        if model == "rehearsal" and args.grid and "grid-rehearsal" not in results:
            results["grid-rehearsal"] = grid_check(
                work / "after-rehearsal", model_args, work / "grid-rehearsal"
            )
            results_path.write_text(json.dumps(results, indent=1))
    print(table(results))
    if "grid-rehearsal" in results:
        print(grid_lines(results["grid-rehearsal"]))


def phase_seconds(out: Path) -> dict[str, float]:
    """Where the wall time went: the launches' walls, start-ups, steps and timed steps (launches.json);
    the rest of the wall is outside the launches (the collectives benchmark, the fit, the report); the
    span of the comm/ folder's file times bounds the benchmark from below."""
    from advisor.measure.launch import LAUNCHES_FILE, read_launches

    path = next((p for p in (out / "profile" / LAUNCHES_FILE, out / LAUNCHES_FILE) if p.is_file()), None)
    records = read_launches(path) if path is not None else []
    comm = [p.stat().st_mtime for p in (out / "comm").rglob("*") if p.is_file()]
    return {
        "launches": len(records),
        "launch_wall_s": sum(r.wall_s or 0.0 for r in records),
        "startup_s": sum(r.startup_s or 0.0 for r in records),
        "steps_s": sum(r.steps_s or 0.0 for r in records),
        "timed_s": sum(r.timed_s or 0.0 for r in records),
        "comm_files_span_s": (max(comm) - min(comm)) if len(comm) > 1 else 0.0,
    }


def announced_budget_s(out: Path) -> float | None:
    """The budget the run announced in its "budget:" line (recommendation.json's search log)."""
    rec = json.loads((out / "recommendation.json").read_text())
    for line in rec.get("search_log", []):
        if line.startswith("budget: "):
            return float(line.split()[1]) * 60
    return None


def measured_halfwidths(out: Path) -> list[float]:
    """The relative 95% half-widths of the step time of every config the run measured, at the node count
    it measured them on (one node)."""
    table = pd.read_csv(out / "predictions.csv")
    rows = table[(table["interval_source"] == "measured") & (table["node_count"] == 1)]
    half = (rows["step_time_s_hi"] - rows["step_time_s_lo"]) / 2 / rows["step_time_s"]
    return sorted(float(h) for h in half)


def batch_shapes(global_batch: int, ranks: int, micro_batches: tuple[int, ...]) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs that reach `global_batch` on `ranks` ranks exactly."""
    shapes = []
    for mb in micro_batches:
        accum, rest = divmod(global_batch, mb * ranks)
        if accum >= 1 and rest == 0:
            shapes.append((mb, accum))
    return shapes


def grid_check(advise_dir: Path, model_args: list[str], work: Path) -> dict:
    """Measure every config the advise run chose among at its batch shape; its pick against the fastest."""
    from advisor.measure.grid import GridRequest
    from advisor.measure.profile import run_profile
    from advisor.stages.request import CPU_GRID
    from sdzero.cluster.launch_command import shipped_config

    rec = json.loads((advise_dir / "recommendation.json").read_text())
    ranks = int(rec["gpus_per_node"])
    model, data = Path(model_args[1]), Path(model_args[3])
    started = time.monotonic()
    rows = []
    for mb, accum in batch_shapes(int(rec["global_batch"]), ranks, CPU_GRID.micro_batches):
        grid = GridRequest(
            stages=CPU_GRID.stages,
            precisions=CPU_GRID.precisions,
            micro_batches=(mb,),
            ranks_per_node=(ranks,),
            grad_accums=(accum,),
        )
        result = run_profile(
            model, data, work / f"mb{mb}-ga{accum}", grid=grid, base_config=shipped_config("zero2_bf16.json")
        )
        rows.append(result.table[result.table["status"] == "ok"])
    grid_table = pd.concat(rows, ignore_index=True)
    grid_table["config_id"] = grid_table["trial_id"].str.replace(r"-r\d+$", "", regex=True)
    grid_table["rate"] = grid_table["global_batch"] / grid_table["step_time_s"]
    grid_table["half"] = (grid_table["step_s_hi"] - grid_table["step_s_lo"]) / 2 / grid_table["step_time_s"]
    best = grid_table.loc[grid_table["rate"].idxmax()]
    pick = grid_table[grid_table["config_id"].str.startswith(str(rec["config_id"]))]
    pick = pick[pick["grad_accum"] == int(rec["grad_accum"])].iloc[0]
    ratio = float(pick["rate"] / best["rate"])
    noise = math.hypot(float(pick["half"]), float(best["half"]))
    return {
        "wall_s": time.monotonic() - started,
        "configs": int(len(grid_table)),
        "pick": str(pick["trial_id"]),
        "best": str(best["trial_id"]),
        "pick_over_best": ratio,
        "noise": noise,
        "within_noise": bool(1 - ratio <= noise),
        "rates": {str(r.trial_id): float(r.rate) for r in grid_table.itertuples()},
    }


def grid_lines(g: dict) -> str:
    return (
        f"grid (rehearsal): {g['configs']} configs in {g['wall_s']:.0f} s; advise's pick {g['pick']} measures "
        f"{g['pick_over_best']:.3f} of the fastest, {g['best']} "
        f"({'within' if g['within_noise'] else 'outside'} the noise of +-{g['noise']:.1%})"
    )


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(
            line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        name = platform.processor()
    return f"{name}, {os.cpu_count()} cores"


def show(key: str, r: dict) -> None:
    print(
        f"{key}: {r['wall_s']:.0f} s wall, {r['measured_s']:.0f} s in measured steps ({r['measured_share']:.0%}; "
        f"trials.csv: {r.get('trials_steps_s', float('nan')):.0f} s, {r.get('trials_share', float('nan')):.0%}), "
        f"phases {r.get('phases')}, "
        f"{r['configs']} configs ({r['configs_per_minute']:.1f} a minute); budget announced "
        f"{(r.get('budget_s') or float('nan')):.0f} s; measured configs' intervals "
        f"+-{max(r.get('measured_halfwidths') or [float('nan')]):.1%} at most",
        flush=True,
    )


def table(results: dict) -> str:
    lines = [
        f"cpu: {results.get('cpu')}",
        "| run | wall | measured steps | share | configs | configs / min |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        if isinstance(r, dict) and "measured_share" in r:
            lines.append(
                f"| {key} | {r['wall_s']:.0f} s | {r['measured_s']:.0f} s | {r['measured_share']:.0%} | "
                f"{r['configs']} | {r['configs_per_minute']:.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
