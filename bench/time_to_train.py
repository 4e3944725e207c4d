"""The time to train, checked: train the embedded default for a fixed number of samples with the config
`sdzero advise` recommends, on this machine, and compare the measured wall time (start-up included) with
the predicted one.

    flock /tmp/sdzero-heavy.lock python bench/time_to_train.py ADVISE_OUT [--samples 2560]

ADVISE_OUT is the --out of an `sdzero advise` run on the embedded default (its trials and link probes).
The prediction is a replan of it (advisor.stages.replan, nothing measured) for one node of this machine and the
same --samples; the run is that replan's recommended_ds_config.json and launch command, through the
`deepspeed` launcher, its wall time from start to exit. Prints both and their ratio, with the kind of CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def predicted(advise_out: Path, samples: int, plan_out: Path) -> dict:
    """The replan's answer for 1 node and `samples` samples."""
    from advisor.stages.advise import AdviseRequest, run_advise

    request = AdviseRequest(max_nodes=1, nodes=1, out_dir=plan_out, replan=advise_out, samples=samples)
    return run_advise(request).recommendation


def measured(rec: dict, run_dir: Path) -> float:
    """Wall seconds of the recommended launch, max steps set to the predicted optimizer steps."""
    words = shlex.split(rec["launch_command"].split("  # ")[0])
    steps = int(rec["time_to_train"]["optimizer_steps"])
    words = [
        str(run_dir) if w.endswith("/run") and words[i - 1] == "--output-dir" else w
        for i, w in enumerate(words)
    ]
    words += ["--max-steps", str(steps), "--num-workers", "1"]
    words[0] = str(Path(sys.executable).parent / "deepspeed")
    started = time.monotonic()
    proc = subprocess.run(words, capture_output=True, text=True)
    wall = time.monotonic() - started
    (run_dir.parent / "bench_run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}); see {run_dir.parent / 'bench_run.log'}")
    return wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("advise_out", type=Path)
    p.add_argument("--samples", type=int, default=2560, help="samples to train (default 10 steps of 256)")
    p.add_argument("--work", type=Path, default=Path("/tmp/sdzero-time-to-train"))
    args = p.parse_args()
    from sdzero.telemetry.environment import cpu_kind

    rec = predicted(args.advise_out.resolve(), args.samples, args.work / "plan")
    t = rec["time_to_train"]
    wall = measured(rec, args.work / "run")
    error = t["seconds"] / wall - 1
    interval = t.get("seconds_interval")  # the prediction's 95% interval (advisor.model.uncertainty)
    print(
        json.dumps(
            {
                "cpu": cpu_kind(),
                "config": rec["config_id"],
                "micro_batch": rec["micro_batch"],
                "grad_accum": rec["grad_accum"],
                "ranks": rec["gpus_per_node"],
                "samples": t["samples"],
                "optimizer_steps": t["optimizer_steps"],
                "predicted_s": round(t["seconds"], 1),
                "predicted_interval_s": [round(v, 1) for v in interval] if interval else None,
                "measured_inside_interval": bool(interval[0] <= wall <= interval[1]) if interval else None,
                "predicted_startup_s": round(t["startup_s"], 1),
                "measured_s": round(wall, 1),
                "predicted_over_measured": round(t["seconds"] / wall, 3),
                "error": round(error, 3),
                "held_out_step_time_error": rec["error"].get("step_time_mape"),
                "noise_floor": rec.get("noise_floor"),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
