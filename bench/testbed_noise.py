"""How steady is this machine's own speed? The error floor of predicting one run from another.

The scale-out bench (scaleout_accuracy.py) predicts a multi-host run from a 1-host trial made a minute or
two before it. Both are compute-bound on these CPUs, so if the machine itself computes faster in one
minute than in the next (a virtual machine whose physical cores are shared with other tenants), a model
with no error at all still misses by that drift. This bench measures the drift with nothing of ours
running: one fixed single-thread torch workload (matrix products and tanh, the UNet's kind of work) for
`--seconds`, timed in blocks of ~0.1 s. Consecutive blocks make "steps" of the same work (~`--step-s`,
a tiny-model step on these cores), and consecutive steps "trials" judged as the advisor judges one: by
their median step. It reports

- the steps' median time and coefficient of variation (cv),
- for trials of 5-20 steps: the cv of the trials' median steps and the slowest over the fastest,
- for every pair of trials `--gap-min`..`--gap-max` seconds apart (a 1-host trial and the hosts' run it
  predicts), |one's median step / the other's - 1|: its median, 90th percentile and largest. That is the
  error a perfect model would show on this machine for the same work.

Run it alone (`flock /tmp/sdzero-heavy.lock python bench/testbed_noise.py`): any other job on the two
cores moves the figures, which is exactly what it must not measure. `--procs N` runs N such workloads at
once (as a trial's ranks do) and pools their trials; `--json` keeps the block times and `--from-json`
reads them again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sdzero.telemetry.environment import cpu_kind  # noqa: E402

TRIAL_STEPS = (5, 10, 20)
"""Measured steps per trial compared (the scale-out bench measures 10)."""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=180.0, help="how long each workload runs")
    p.add_argument("--procs", type=int, default=1, help="workloads at once (each one thread)")
    p.add_argument("--gap-min", type=float, default=30.0, help="least gap between two compared trials (s)")
    p.add_argument("--gap-max", type=float, default=150.0, help="largest gap between two compared trials (s)")
    p.add_argument("--step-s", type=float, default=0.6, help="work per step, in seconds at median speed")
    p.add_argument("--json", type=Path, default=None, help="write every block's (start, seconds) here")
    p.add_argument("--from-json", type=Path, default=None, help="analyse blocks written by --json, run none")
    p.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)  # one workload, JSON out
    return p.parse_args()


def workload(seconds: float) -> list[tuple[float, float]]:
    """(start on the monotonic clock, seconds) of every block of fixed work run for `seconds`."""
    import torch  # only the workers need it

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    for _ in range(100):  # warm the allocator and caches before timing
        a = torch.tanh(a @ a.T / 256)
    blocks, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        for _ in range(300):
            a = torch.tanh(a @ a.T / 256)
        blocks.append((start, time.monotonic() - start))
    return blocks


def cpu_ticks() -> list[int]:
    """The machine's CPU time counters (/proc/stat's `cpu` line: user, nice, system, idle, iowait, irq,
    softirq, steal, ...); empty where there is none."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return []


def steal_share(before: list[int], after: list[int]) -> float | None:
    """Of the machine's CPU time between two readings, the share the hypervisor gave to others (steal):
    the part of a slowdown it would account for."""
    if len(before) < 8 or len(after) < 8:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    return spent[7] / sum(spent[:8]) if sum(spent[:8]) else None


def steps(blocks: np.ndarray, step_s: float) -> np.ndarray:
    """(start, seconds) of steps of equal work: runs of n consecutive blocks, n making ~step_s at the
    blocks' median speed."""
    n = max(1, round(step_s / float(np.median(blocks[:, 1]))))
    whole = len(blocks) // n * n
    return np.column_stack([blocks[:whole:n, 0], blocks[:whole, 1].reshape(-1, n).sum(axis=1)])


def trials(series: np.ndarray, steps_per_trial: int) -> tuple[np.ndarray, np.ndarray]:
    """(start, median step) of consecutive, non-overlapping trials of `steps_per_trial` steps."""
    whole = len(series) // steps_per_trial * steps_per_trial
    if not whole:
        return np.empty(0), np.empty(0)
    grouped = series[:whole].reshape(-1, steps_per_trial, 2)
    return grouped[:, 0, 0], np.median(grouped[:, :, 1], axis=1)


def pair_errors(starts: np.ndarray, values: np.ndarray, gap_min: float, gap_max: float) -> np.ndarray:
    """|later / earlier - 1| for every pair of trials whose starts are gap_min..gap_max seconds apart."""
    later, earlier = np.triu_indices(len(values), k=1)[::-1]  # every pair once, in time order
    gap = starts[later] - starts[earlier]
    apart = (gap >= gap_min) & (gap <= gap_max)
    return np.abs(values[later[apart]] / values[earlier[apart]] - 1)


def run_workloads(procs: int, seconds: float) -> list[np.ndarray] | None:
    """`procs` workloads at once, each in its own process; their blocks (None if one failed)."""
    ticks = cpu_ticks()
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(seconds)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(procs)
    ]
    outputs = [w.communicate()[0] for w in workers]
    if any(w.returncode for w in workers):
        return None
    steal = steal_share(ticks, cpu_ticks())
    print(f"steal: {'unknown' if steal is None else f'{steal:.2%} of the CPU time'} over the run")
    return [np.array(json.loads(out)) for out in outputs]


def report(series: list[np.ndarray], gap_min: float, gap_max: float) -> None:
    """The steps' spread and, per trial length, how far trials gap_min..gap_max seconds apart differ."""
    times = np.concatenate([s[:, 1] for s in series])
    seconds = max(s[-1, 0] - s[0, 0] for s in series)
    print(f"{cpu_kind()}; {len(series)} workload(s) x {seconds:.0f} s, {len(times)} steps")
    print(f"step: median {np.median(times):.3f} s, cv {times.std() / times.mean():.1%}")
    print(
        f"\n| steps per trial | trials | cv of median steps | slowest / fastest | pairs {gap_min:g}-{gap_max:g} s "
        "apart | median | 90th pct | largest |\n|---|---|---|---|---|---|---|---|"
    )
    for n in TRIAL_STEPS:
        cut = [trials(s, n) for s in series]
        medians = np.concatenate([m for _, m in cut])
        errors = np.concatenate([pair_errors(start, m, gap_min, gap_max) for start, m in cut])
        if len(medians) < 2:
            continue
        quantiles = (
            f"{np.median(errors):.1%} | {np.percentile(errors, 90):.1%} | {errors.max():.1%}"
            if len(errors)
            else "- | - | -"
        )
        print(
            f"| {n} | {len(medians)} | {medians.std() / medians.mean():.1%} | {medians.max() / medians.min():.2f} "
            f"| {len(errors)} | {quantiles} |"
        )


def main() -> int:
    a = parse()
    if a.worker is not None:
        print(json.dumps(workload(a.worker)))
        return 0
    if a.from_json:
        series = [np.array(s) for s in json.loads(a.from_json.read_text())]
    else:
        series = run_workloads(a.procs, a.seconds)
        if series is None:
            print("a workload failed (its error is above)", file=sys.stderr)
            return 1
    if a.json:
        a.json.write_text(json.dumps([s.tolist() for s in series]))
    report([steps(s, a.step_s) for s in series], a.gap_min, a.gap_max)
    return 0


if __name__ == "__main__":
    sys.exit(main())
