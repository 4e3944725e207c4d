"""What a launch costs before and after its training steps, and what each of three savings is worth.

A 2-rank launch of the tiny model for 2 steps spends ~1 s training and the rest starting and stopping;
the test suite pays that ~90 times and `sdzero advise` once per trial. Three savings, each measured side by
side with what it replaces, alternated round by round so that a change in machine load hits both:

1. **launcher**: the whole run through `deepspeed --num_gpus 2` (runner + per-node launcher) against
   `sdzero.cluster.launch_command.one_host_command` (the per-node launcher alone, which is all the runner starts on one
   host); both runs are the same trainer, steps and data, so the difference is the runner;
2. **cpu info**: py-cpuinfo's `get_cpu_info`, which DeepSpeed's CPU op builder calls twice per JIT-loaded
   op, asked twice as it is, and twice behind `sdzero.process.distributed.ask_cpu_info_once`;
3. **exit**: a process that imports what a rank imports (torch, DeepSpeed, a diffusers UNet) and returns,
   with and without `sdzero.process.exit.freeze_heap_for_exit`: seconds from its last line to its end.

    python bench/launch_overhead.py [--rounds 3]

Run it alone (2 cores: any other job moves every figure). The CPU model and whether it has AVX-512 are
printed with the figures, since bf16 and import times differ several-fold between such machines.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sdzero.cluster.launch_command import deepspeed_command, one_host_command  # noqa: E402
from sdzero.telemetry.environment import cpu_kind  # noqa: E402

EXIT_PROBE = """
import sys, time
import torch, deepspeed
from diffusers import UNet2DConditionModel
if sys.argv[1] == "freeze":
    from sdzero.process.exit import freeze_heap_for_exit
    freeze_heap_for_exit()
print(repr(time.time()), flush=True)
"""

CPUINFO_PROBE = """
import sys, time
if sys.argv[1] == "once":
    from sdzero.process.distributed import ask_cpu_info_once
    ask_cpu_info_once()
import cpuinfo
start = time.perf_counter()
for _ in range(2):  # DeepSpeed's cpu_arch() and simd_width() for one JIT load
    cpuinfo.get_cpu_info()
print(repr(time.perf_counter() - start), flush=True)
"""


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    return p.parse_args()


def timed(cmd: list[str]) -> float:
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    if done.returncode != 0:
        raise SystemExit(
            f"failed ({done.returncode}): {' '.join(cmd[:6])} ...\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return time.monotonic() - start


def exit_seconds(mode: str) -> float:
    proc = subprocess.Popen(
        [sys.executable, "-c", EXIT_PROBE, mode], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # DeepSpeed's start-up warning comes first, on stdout
        if line.strip().replace(".", "", 1).isdigit():
            last_line = float(line)
            break
    else:
        raise SystemExit(f"exit probe ({mode}) printed no time")
    proc.wait(timeout=120)
    return time.time() - last_line


def cpuinfo_seconds(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", CPUINFO_PROBE, mode], capture_output=True, text=True, cwd=REPO, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> int:
    a = parse()
    with tempfile.TemporaryDirectory(prefix="sdzero-launch-") as tmp:
        work = Path(tmp)
        sdzero = [sys.executable, "-m", "sdzero.cli"]
        subprocess.run([*sdzero, "tiny-model", str(work / "model")], check=True, capture_output=True)
        subprocess.run(
            [*sdzero, "synth-data", str(work / "data"), "--images", "32"], check=True, capture_output=True
        )

        def train_args(name: str) -> list[str]:
            return [
                "--deepspeed_config", str(REPO / "ds_configs" / "zero2_bf16.json"),
                "--model", str(work / "model"), "--data", str(work / "data"),
                "--output-dir", str(work / name), "--max-steps", str(a.steps), "--num-workers", "1",
            ]  # fmt: skip

        figures: dict[str, list[float]] = {
            k: [] for k in ("runner", "one_host", "ask", "once", "plain", "freeze")
        }
        for r in range(a.rounds):
            figures["runner"].append(timed(deepspeed_command(train_args(f"runner{r}"), num_gpus=2)))
            figures["one_host"].append(timed(one_host_command(train_args(f"one{r}"), 2)))
            figures["ask"].append(cpuinfo_seconds("ask"))
            figures["once"].append(cpuinfo_seconds("once"))
            figures["plain"].append(exit_seconds("plain"))
            figures["freeze"].append(exit_seconds("freeze"))
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in figures.items()))

    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"\n{cpu_kind()}; {a.rounds} rounds, medians:")
    print(
        f"- launcher: 2-rank {a.steps}-step run {med['runner']:.1f} s through `deepspeed`, "
        f"{med['one_host']:.1f} s through one_host_command: {med['runner'] - med['one_host']:.1f} s less "
        f"(ratio {med['one_host'] / med['runner']:.2f})"
    )
    print(
        f"- cpu info for one JIT load: {med['ask']:.2f} s asked twice, {med['once']:.2f} s asked once: "
        f"{med['ask'] - med['once']:.2f} s less per rank"
    )
    print(
        f"- exit after the rank's imports: {med['plain']:.2f} s, {med['freeze']:.2f} s with the heap frozen: "
        f"{med['plain'] - med['freeze']:.2f} s less per rank"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
