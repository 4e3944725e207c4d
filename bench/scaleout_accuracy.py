"""How well does the advisor predict a 2-host run from 1-host trials plus a link probe?

On a namespace cluster (tests/cluster: 2 "hosts" x 1 rank, sshd in each, root needed) with the links
rate-limited by `tc tbf` to each rate below and delayed by 1 ms each way (tests/cluster/delayline.py: this
kernel has no netem), for ZeRO-2 and ZeRO-3 (bf16, the shipped base config):

1. a 1-host trial with 2 local ranks (the same world size as the 2-host run), just before the 2-host run,
2. `sdzero comm` on this machine (intra) and across the two hosts (inter, the shaped link),
3. the advisor's time model fitted on the 1-host trial predicts the step time at 2 nodes x 1 rank over
   the measured inter link,
4. the same config runs on the 2 hosts through the hostfile; its median step time is the measurement.

Run it alone (it needs both cores): `flock /tmp/sdzero-cpu.lock python
bench/scaleout_accuracy.py`. Writes <work>/scaleout.csv and prints the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster lives with the tests

from cluster import Cluster  # noqa: E402

from advisor.measure.grid import TrialSpec, load_base_config  # noqa: E402
from advisor.measure.profile import trial_settings  # noqa: E402
from advisor.model.scaleout import check_config, probe_links, rows_table  # noqa: E402
from sdzero.hosts import prepare_hosts  # noqa: E402
from sdzero.launch import shipped_config  # noqa: E402
from sdzero.tiny import write_synthetic_dataset, write_tiny_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["200mbit", "1gbit"], help="tc tbf rates of the host links")
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay of each host link (0: none)")
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="measured steps per trial (after 1 warm-up step)")
    p.add_argument("--comm-budget-s", type=float, default=10.0, help="per link probe")
    p.add_argument("--rounds", type=int, default=1, help="repeat every case this many times (new probes too)")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one)")
    args = p.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="sdzero-scaleout-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # the launchers read .deepspeed_env from here
    model = work / "model"
    data = work / "data"
    if not (model / "model_index.json").exists():
        write_tiny_model(model)
    if not (data / "metadata.jsonl").exists():
        write_synthetic_dataset(data, images=64, size=40)
    base = load_base_config(shipped_config("zero2_bf16.json"))
    started = time.monotonic()
    rows = []
    with Cluster(hosts=2, slots=1) as cluster:
        cluster.write_hostfile(cluster.hostfile)
        _, master, interface, env_file, merge = prepare_hosts(cluster.hostfile, workdir=work)
        # The "hosts" share this machine's cores. A rank alone on its namespace host would size torch's
        # thread pool to all of them (as it should on a real host), and the two would thrash each other:
        # give each rank its share, as the 1-host trial's two ranks get.
        threads = max(1, len(os.sched_getaffinity(0)) // 2)
        with env_file.open("a") as f:
            f.write(f"OMP_NUM_THREADS={threads}\n")
        print(
            f"cluster {cluster.tag}: {master} + 1 host over {interface}; {env_file}: added {sorted(merge.added)}"
        )
        local = trial_settings(model, data, args.steps, 1, 900.0, 300.0, None, None, ("--num-workers", "1"))
        remote = trial_settings(model, data, args.steps, 1, 900.0, 300.0, None, cluster.hostfile,
                                ("--num-workers", "1"))  # fmt: skip
        for round_ in range(1, args.rounds + 1):
            for rate in args.rates:
                cluster.shape(rate, delay_ms=args.delay_ms or None)
                here = work / f"round{round_}" / rate
                fit = probe_links(here / "comm", cluster.hostfile, 2, args.comm_budget_s, log=print)
                for stage in args.stages:
                    spec = TrialSpec(stage, "bf16", args.micro_batch, "none", 2)
                    # The 1-host trial runs again next to each 2-host run: on shared cores the same config's
                    # step moves by several percent over minutes, which a trial reused across rates would
                    # add to the error.
                    row, _ = check_config(spec, base, local, remote, fit, 2, 1, here)
                    rows.append((round_, rate, row))
                    print(f"round {round_} {rate} {row.config}: predicted {row.predicted_step_s:.3f} s, "
                          f"measured {row.measured_step_s:.3f} s ({row.error:+.1%})", flush=True)  # fmt: skip
    table = rows_table([r for *_, r in rows]).assign(
        round=[n for n, *_ in rows], rate=[rate for _, rate, _ in rows], delay_ms=args.delay_ms
    )
    table.to_csv(work / "scaleout.csv", index=False)
    print()
    print("| round | link (rate, one-way delay) | config | inter busbw measured | 1-host step | predicted 2-host "
          "| measured 2-host | error |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for _, r in table.iterrows():
        print(f"| {r['round']} | {r['rate']}, {r['delay_ms']:g} ms | {r['config']} | {r['inter_busbw_gbit_s']:.3f} "
              f"Gbit/s | {r['one_host_step_s']:.3f} s | {r['predicted_step_s']:.3f} s | {r['measured_step_s']:.3f} s "
              f"| {r['error']:+.1%} |")  # fmt: skip
    if args.rounds > 1:
        print("\n| link | config | median error | largest |error| |\n|---|---|---|---|")
        for (rate, config), case in table.groupby(["rate", "config"], sort=False):
            print(f"| {rate}, {args.delay_ms:g} ms | {config} | {case['error'].median():+.1%} "
                  f"| {case['error'].abs().max():.1%} |")  # fmt: skip
    print(f"\n{len(table)} cases in {time.monotonic() - started:.0f} s; table in {work / 'scaleout.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
