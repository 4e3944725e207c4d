"""How well does the advisor predict a multi-host run from a 1-host trial plus link probes?

On a namespace cluster (tests/cluster: N "hosts", sshd in each, root needed), every host with the same CPU
quota (`--cpus-per-rank` x ranks per host, a cgroup: tests/cluster/cpushare.py), the links rate-limited by
`tc tbf` to each rate below and delayed by 1 ms each way (tests/cluster/delayline.py: this kernel has no
netem), for each layout (`4x1` = 4 hosts x 1 rank; `2x2` = 2 hosts x 2 ranks, inside and across hosts),
ZeRO stage and gradient accumulation (bf16, the shipped base config):

1. a 1-host trial with hosts x ranks local ranks (the same world size), under the same CPU share per rank
   as the hosts' ranks get,
2. `sdzero comm` on this machine (intra, under that share) and across the hosts, one rank per host (inter,
   the shaped link; once per layout and rate),
3. the advisor's time model fitted on the 1-host trial predicts the step time at hosts x ranks over the
   measured links,
4. the same config runs on the hosts through the hostfile; its median step time is the measurement,
5. (`--bracket`, the default) the 1-host trial runs again after the hosts' runs, and the prediction is made
   from both trials: on a machine shared with other people's jobs the compute of one launch differs from
   the next by more than the model's error (docs/multinode.md), so a drift between the trial and the
   hosts' runs is halved, and the two trials' difference (`one_host_spread`) says how large it was.

Every rank records its own time in collectives per step (sdzero/training/measuring/probe.py), so each case also gives
the transport (the least any rank spent, per step: the rank that waited least) and the wait on top of it
(rank 0's and the most any rank spent) beside the predicted link and wait terms (the second table).

The matrix is large for 2 shared cores: run it in chunks (a few layouts/stages at a time, each under the
heavy-job lock) with the same `--work`; every case is appended to <work>/scaleout.csv as it finishes, with
`--round` as its round label, and `--table-only` prints everything measured so far:

    flock /tmp/sdzero-heavy.lock python bench/scaleout_accuracy.py --work /tmp/so --round 1 \\
        --layouts 4x1 --stages 3 --accums 1 4
    python bench/scaleout_accuracy.py --work /tmp/so --table-only
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RANKSHARE = REPO / "tests" / "cluster" / "rankshare"
sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster lives with the tests

import pandas as pd  # noqa: E402
from cluster import Cluster  # noqa: E402

from advisor.measure.grid import TrialSpec, load_base_config  # noqa: E402
from advisor.measure.profile import trial_settings  # noqa: E402
from advisor.model.network import NCCL  # noqa: E402
from advisor.model.step_time import measured_step_s  # noqa: E402
from advisor.stages.scaleout_check import (  # noqa: E402
    ScaleoutRow,
    check_config,
    flat_ring_step_s,
    merge_fits,
    predict_from_one_host,
    predict_step,
    probe_link,
    rows_table,
    trial_table,
)
from sdzero.atomic import write_text_atomic  # noqa: E402
from sdzero.cluster.hostfile import prepare_hosts  # noqa: E402
from sdzero.cluster.launch_command import shipped_config  # noqa: E402
from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model  # noqa: E402
from sdzero.telemetry.environment import cpu_kind  # noqa: E402


def layout(text: str) -> tuple[int, int]:
    hosts, _, slots = text.partition("x")
    if not (hosts.isdigit() and slots.isdigit() and int(hosts) >= 2 and int(slots) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: a layout is HOSTSxRANKS, e.g. 4x1 or 2x2 (2+ hosts)")
    return int(hosts), int(slots)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", type=layout, default=[(4, 1), (3, 1), (2, 2), (2, 1)])
    p.add_argument("--rates", nargs="+", default=["200mbit", "1gbit"], help="tc tbf rates of the host links")
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay of each host link (0: none)")
    p.add_argument("--stages", nargs="+", type=int, default=[3, 2, 1])
    p.add_argument("--accums", nargs="+", type=int, default=[1, 4], help="gradient accumulation steps")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="measured steps per trial (after 1 warm-up step)")
    p.add_argument(
        "--cpus-per-rank",
        type=float,
        default=0.4,
        help="CPU quota per rank in cores (a host gets ranks x this); 0: no quota",
    )
    p.add_argument(
        "--comm-budget-s",
        type=float,
        default=16.0,
        help="per link probe; 8 s stopped a 4-host sweep at 512 KiB, short of the bandwidth regime",
    )
    p.add_argument(
        "--bracket",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the 1-host trial again after the hosts' runs and predict from both (see above)",
    )
    p.add_argument("--round", type=int, default=1, help="round label of this chunk's cases in scaleout.csv")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--table", default="scaleout.csv", help="the CSV in --work that the cases go to")
    p.add_argument("--table-only", action="store_true", help="print the cases in <work>/<table>")
    p.add_argument(
        "--repredict",
        action="store_true",
        help="predict every case in <work>/<table> again with the current model, from the 1-host trial "
        "and link fits each case saved (the measurements stay); writes <table> with the new predictions",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="the overlap check: every case with ZeRO's overlap_comm on and then off; the table "
        "compares the predicted with the measured difference",
    )
    return p.parse_args()


def main() -> int:
    args = parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="sdzero-scaleout-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    csv = work / args.table
    if args.table_only:
        print_table(pd.read_csv(csv))
        return 0
    if args.repredict:
        table = repredict(pd.read_csv(csv))
        write_text_atomic(csv, table.to_csv(index=False))
        print_table(table)
        return 0
    os.chdir(work)  # the launchers read .deepspeed_env from here
    # Each rank gets its share of a core (cgroup quota): one torch thread, on the hosts (.deepspeed_env
    # below) and in the 1-host trials (inherited from here), or the threads would preempt each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.cpus_per_rank:
        # ... and each rank its own quota, in a host as in the 1-host trial (tests/cluster/rankshare).
        os.environ["SDZERO_RANK_CPUS"] = str(args.cpus_per_rank)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(RANKSHARE), os.environ.get("PYTHONPATH", "")])
    model, data = work / "model", work / "data"
    if not (model / "model_index.json").exists():
        write_tiny_model(model)
    if not (data / "metadata.jsonl").exists():
        write_synthetic_dataset(data, images=64, size=40)
    base = load_base_config(shipped_config("zero2_bf16.json"))
    started = time.monotonic()
    for hosts, slots in args.layouts:
        run_layout(args, work, model, data, base, hosts, slots, csv)
    print_table(pd.read_csv(csv))
    print(f"\nthis chunk: {time.monotonic() - started:.0f} s on {cpu_kind()}; every case so far in {csv}")
    return 0


def run_layout(
    args: argparse.Namespace,
    work: Path,
    model: Path,
    data: Path,
    base: dict,
    hosts: int,
    slots: int,
    csv: Path,
) -> None:
    """Every (stage, accumulation, rate) case of one layout, on one cluster made for it."""
    share = args.cpus_per_rank or None
    here = work / f"round{args.round}" / f"{hosts}x{slots}"
    with Cluster(hosts=hosts, slots=slots, cpus_per_host=share and share * slots) as cluster:
        cluster.write_hostfile(cluster.hostfile)
        one_per_host = cluster.write_hostfile(cluster.state_dir / "hostfile.1", slots=1)
        _, master, interface, env_file, _ = prepare_hosts(cluster.hostfile, workdir=work)
        rank_env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(RANKSHARE)])}
        set_env_lines(env_file, {**rank_env, "SDZERO_RANK_CPUS": str(share)} if share else rank_env)
        print(
            f"cluster {cluster.tag}: {hosts} hosts x {slots} over {interface}, master {master}, "
            f"{share and share * slots or 'no'} cores per host",
            flush=True,
        )

        def local_share():  # the 1-host trials and probes: the same share per rank as the hosts' ranks
            return cluster.local_share(share * hosts * slots, hosts * slots) if share else nullcontext()

        # Probes already in this round's folder (an earlier chunk of the same layout) are used again.
        intra = here / "comm-intra" / "comm_fit.json"
        if not intra.exists():
            with local_share():
                probe_link(intra.parent, hosts * slots, None, args.comm_budget_s, log=print)
        fits = {}
        for rate in args.rates:
            inter = here / f"comm-{rate}" / "comm_fit.json"
            if not inter.exists():
                cluster.shape(rate, delay_ms=args.delay_ms or None)
                probe_link(inter.parent, 1, one_per_host, args.comm_budget_s, log=print)
            fits[rate] = merge_fits([intra, inter], here / f"comm-{rate}" / "merged_fit.json")
        local = trial_settings(model, data, args.steps, 1, 900.0, 300.0, None, None, ("--num-workers", "1"))
        remote = replace(local, hostfile=cluster.hostfile.resolve(), hosts=hosts)
        overlaps = (True, False) if args.overlap else (None,)
        for stage, accum, overlap in itertools.product(args.stages, args.accums, overlaps):
            spec = TrialSpec(stage, "bf16", args.micro_batch, "none", slots, overlap_comm=overlap)
            case_base = {**base, "gradient_accumulation_steps": accum}
            case_dir = here / f"z{stage}-accum{accum}" / ("" if overlap is None else f"overlap{int(overlap)}")
            shutil.rmtree(case_dir, ignore_errors=True)  # a rerun of a case starts clean (no stale profile)
            with local_share():  # one 1-host trial serves both rates: it does not use the link
                one_host = trial_table(
                    replace(spec, ranks_per_node=hosts * slots), local, case_base, case_dir / "1host", nodes=1
                )
            one_host.to_csv(case_dir / "1host.csv", index=False)  # for --repredict
            rows = []
            for rate in args.rates:
                cluster.shape(rate, delay_ms=args.delay_ms or None)
                try:
                    row, _ = check_config(
                        spec,
                        case_base,
                        local,
                        remote,
                        fits[rate],
                        hosts,
                        slots,
                        case_dir / rate,
                        one_host=one_host,
                    )
                except RuntimeError as exc:  # one failed run is reported, the chunk goes on
                    print(
                        f"round {args.round} {hosts}x{slots} {rate} {spec.trial_id} accum {accum}: FAILED "
                        f"{str(exc).splitlines()[0]}",
                        flush=True,
                    )
                    continue
                rows.append((rate, row))
            spread = float("nan")
            if args.bracket and rows:
                try:
                    with local_share():  # the same trial again, after the hosts' runs
                        again = trial_table(
                            replace(spec, ranks_per_node=hosts * slots),
                            local,
                            case_base,
                            case_dir / "1host-after",
                            nodes=1,
                        )
                except (KeyboardInterrupt, RuntimeError):  # a chunk cut short keeps its measured cases
                    for rate, row in rows:
                        append(
                            csv,
                            rows_table(
                                [row],
                                round=args.round,
                                rate=rate,
                                delay_ms=args.delay_ms,
                                cpus_per_rank=args.cpus_per_rank,
                                one_host_csv=str(case_dir / "1host.csv"),
                                fit_json=str(fits[rate]),
                                one_host_spread=float("nan"),
                            ),
                        )
                    raise
                both = pd.concat([one_host, again], ignore_index=True)
                both.to_csv(case_dir / "1host.csv", index=False)  # both trials, for --repredict
                steps = measured_step_s(both)
                spread = float(steps.iloc[1] / steps.iloc[0] - 1)
                rows = [(rate, predicted_again(row, both, fits[rate], hosts, slots)) for rate, row in rows]
            for rate, row in rows:
                append(
                    csv,
                    rows_table(
                        [row],
                        round=args.round,
                        rate=rate,
                        delay_ms=args.delay_ms,
                        cpus_per_rank=args.cpus_per_rank,
                        overlap_comm="" if overlap is None else overlap,
                        one_host_csv=str(case_dir / "1host.csv"),
                        fit_json=str(fits[rate]),
                        one_host_spread=spread,
                    ),
                )
                print(
                    f"round {args.round} {hosts}x{slots} {rate} {row.config}: predicted "
                    f"{row.predicted_step_s:.3f} s, measured {row.measured_step_s:.3f} s "
                    f"({row.error:+.1%}); 1-host trial again: {spread:+.1%}",
                    flush=True,
                )


def predicted_again(
    row: ScaleoutRow, one_host: pd.DataFrame, fit: Path, hosts: int, slots: int
) -> ScaleoutRow:
    """The case's prediction from every 1-host trial given (the one before and the one after its hosts'
    runs); the measured columns stay."""
    prediction, _ = predict_step(one_host, fit, hosts, slots)
    step, comm = prediction.step_time_s, prediction.exposed_comm_s
    return replace(
        row,
        predicted_step_s=step,
        predicted_comm_s=comm,
        predicted_compute_s=step - comm,
        predicted_wait_s=prediction.wait_s,
        one_host_step_s=float(measured_step_s(one_host).mean()),
        one_host_comm_s=float(pd.to_numeric(one_host["comm_s"], errors="coerce").mean()),
        flat_ring_step_s=flat_ring_step_s(one_host, fit, hosts, slots) if slots > 1 else float("nan"),
        hierarchy_step_s=predict_from_one_host(one_host, fit, hosts, slots, NCCL)[0]
        if slots > 1
        else float("nan"),
    )


def repredict(table: pd.DataFrame) -> pd.DataFrame:
    """Every case predicted again by the current model from what it saved (its 1-host trial, its link
    fits); the measured columns are kept. Cases recorded before they saved these are left as they were."""
    table = table.copy()
    for i, r in table.iterrows():
        if not isinstance(r.get("one_host_csv"), str) or not Path(r["one_host_csv"]).is_file():
            continue
        one_host = pd.read_csv(r["one_host_csv"])
        hosts, slots, fit = int(r["hosts"]), int(r["slots"]), Path(r["fit_json"])
        prediction, net = predict_step(one_host, fit, hosts, slots)
        step, comm = prediction.step_time_s, prediction.exposed_comm_s
        table.loc[i, ["predicted_step_s", "predicted_comm_s", "predicted_compute_s", "predicted_wait_s"]] = [
            step,
            comm,
            step - comm,
            prediction.wait_s,
        ]
        table.loc[i, "inter_busbw_gbit_s"] = net.inter.busbw_bytes_s * 8 / 1e9
        if slots > 1:
            table.loc[i, "flat_ring_step_s"] = flat_ring_step_s(one_host, fit, hosts, slots)
            table.loc[i, "hierarchy_step_s"] = predict_from_one_host(one_host, fit, hosts, slots, NCCL)[0]
        table.loc[i, "one_host_step_s"] = float(measured_step_s(one_host).mean())
        table.loc[i, "error"] = step / float(r["measured_step_s"]) - 1
    return table


def set_env_lines(env_file: Path, values: dict[str, str]) -> None:
    """Set these keys in the bench's own .deepspeed_env (its work folder), keeping every other line."""
    lines = [line for line in env_file.read_text().splitlines() if line.split("=", 1)[0] not in values]
    write_text_atomic(env_file, "\n".join([*lines, *(f"{k}={v}" for k, v in values.items())]) + "\n")


def append(csv: Path, rows: pd.DataFrame) -> None:
    """Add finished cases to the table at once (atomically): a chunk cut short keeps what it measured."""
    table = pd.concat([pd.read_csv(csv), rows], ignore_index=True) if csv.exists() else rows
    write_text_atomic(csv, table.to_csv(index=False))


def print_table(table: pd.DataFrame) -> None:
    print(
        "\n| round | hosts x ranks | link | config | inter busbw | 1-host step | predicted (compute + comm) "
        "| measured (comm) | error ± its 95% | of which compute, comm | 1-host trial again |"
        "\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for _, r in table.iterrows():
        # The error split: the measured run's time outside collectives against the predicted compute, and
        # its time in collectives against the predicted exposed communication (the two add up to it).
        measured_compute = r["measured_step_s"] - r["measured_comm_s"]
        from_compute = (r["predicted_compute_s"] - measured_compute) / r["measured_step_s"]
        from_comm = (r["predicted_comm_s"] - r["measured_comm_s"]) / r["measured_step_s"]
        spread = r.get("one_host_spread", float("nan"))
        half = _error_halfwidth(r)
        print(
            f"| {r['round']} | {r['hosts']}x{r['slots']} | {r['rate']}, {r['delay_ms']:g} ms | {r['config']} "
            f"| {r['inter_busbw_gbit_s']:.3f} Gbit/s | {r['one_host_step_s']:.3f} s "
            f"| {r['predicted_step_s']:.3f} s ({r['predicted_compute_s']:.3f} + {r['predicted_comm_s']:.3f}) "
            f"| {r['measured_step_s']:.3f} s ({r['measured_comm_s']:.3f}) | {r['error']:+.1%}"
            + ("" if pd.isna(half) else f" ± {half:.1%}")
            + " "
            f"| {from_compute:+.1%}, {from_comm:+.1%} | {'-' if pd.isna(spread) else f'{spread:+.1%}'} |"
        )
    print_transport(table)
    flat = table[table["slots"] > 1] if "flat_ring_step_s" in table else table.iloc[:0]
    if len(flat):
        print(
            "\n| round | hosts x ranks | link | config | model (gloo: ring bytes across hosts) | hierarchy (NCCL) "
            "| all flat ring | measured |\n|---|---|---|---|---|---|---|---|"
        )
        for _, r in flat.iterrows():
            cells = [
                f"{r[c]:.3f} s ({r[c] / r['measured_step_s'] - 1:+.1%})" if pd.notna(r.get(c)) else "-"
                for c in ("predicted_step_s", "hierarchy_step_s", "flat_ring_step_s")
            ]
            print(
                f"| {r['round']} | {r['hosts']}x{r['slots']} | {r['rate']} | {r['config']} | "
                + " | ".join(cells)
                + f" | {r['measured_step_s']:.3f} s |"
            )
    print(
        "\n| round | cases | within 10% | within their own interval | median |error| | largest |error| "
        "| of which communication: median, within 5% of the step "
        "| 1-host trial again: median |spread|, largest |\n|---|---|---|---|---|---|---|---|"
    )
    for round_, rows in table.groupby("round"):
        size = rows["error"].abs()
        # the communication part of each error (as in the first table's split), in fractions of the step
        comm = ((rows["predicted_comm_s"] - rows["measured_comm_s"]) / rows["measured_step_s"]).abs()
        halves = rows.apply(_error_halfwidth, axis=1)
        inside = (size <= halves).sum() if halves.notna().any() else "-"
        print(
            f"| {round_} | {len(rows)} | {(size <= 0.10).sum()} | {inside} | {size.median():.1%} | {size.max():.1%} "
            f"| {comm.median():.1%}, {(comm <= 0.05).sum()} of {comm.notna().sum()} | {repeat_spread(rows)} |"
        )
    print_overlap(table)


def _error_halfwidth(r: pd.Series) -> float:
    """A case's error interval (advisor.stages.scaleout_check.ScaleoutRow.error_halfwidth) from its CSV row:
    rows recorded before the intervals have none."""
    parts = [r.get("measured_halfwidth"), r.get("one_host_halfwidth")]
    spread = r.get("one_host_spread")
    parts.append(abs(spread) / 2 if spread is not None and pd.notna(spread) else None)
    known = [float(p) for p in parts if p is not None and pd.notna(p)]
    return math.hypot(*known) if known else float("nan")


def repeat_spread(rows: pd.DataFrame) -> str:
    """How far a case's 1-host trial moved when run again after the hosts' runs, over a round's cases:
    the same config on the same machine minutes apart, so the error floor of any prediction from one
    trial here (bench/testbed_noise.py measures the machine's own drift)."""
    if "one_host_spread" not in rows:
        return "-"
    # both rates of a case share its pair of 1-host trials: count each pair once
    spread = rows.drop_duplicates(["hosts", "slots", "config"])["one_host_spread"].abs().dropna()
    return f"{spread.median():.1%}, {spread.max():.1%}" if len(spread) else "-"


def print_transport(table: pd.DataFrame) -> None:
    """Cases that recorded every rank's time in collectives: the rank that spent least (its time is the
    closest to the transport alone: it waited least for the others) against the predicted link time, and
    the wait on top of it (rank 0's and the most any rank spent)."""
    if "measured_comm_min_s" not in table:
        return
    rows = table[table["measured_comm_min_s"].notna()]
    if not len(rows):
        return
    print(
        "\n| round | hosts x ranks | link | config | predicted link + wait | transport (least rank) "
        "| wait: rank 0, most rank |\n|---|---|---|---|---|---|---|"
    )
    for _, r in rows.iterrows():
        least, wait = r["measured_comm_min_s"], r.get("predicted_wait_s", float("nan"))
        print(
            f"| {r['round']} | {r['hosts']}x{r['slots']} | {r['rate']} | {r['config']} "
            f"| {r['predicted_comm_s'] - wait:.3f} + {wait:.3f} s | {least:.3f} s "
            f"| {r['measured_comm_s'] - least:.3f} s, {r['measured_comm_max_s'] - least:.3f} s |"
        )


def print_overlap(table: pd.DataFrame) -> None:
    """Cases measured with overlap_comm on and off: predicted vs measured difference (off - on)."""
    if "overlap_comm" not in table:
        return
    flag = table["overlap_comm"].astype(str).str.lower()
    pairs = table[flag.isin(["true", "false"])].assign(on=flag == "true")
    keys = ["round", "hosts", "slots", "rate", "config"]
    lines = []
    for key, rows in pairs.groupby(keys):
        if rows["on"].nunique() != 2:
            continue
        on, off = rows[rows["on"]].iloc[-1], rows[~rows["on"]].iloc[-1]
        predicted = off["predicted_step_s"] - on["predicted_step_s"]
        measured = off["measured_step_s"] - on["measured_step_s"]
        error = predicted / measured - 1 if measured else float("nan")
        lines.append(
            f"| {key[0]} | {key[1]}x{key[2]} | {key[3]} | {key[4]} | {predicted * 1e3:+.1f} ms "
            f"| {measured * 1e3:+.1f} ms | {error:+.1%} |"
        )
    if lines:
        print("\n| round | hosts x ranks | link | config | predicted off - on | measured off - on | error |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
