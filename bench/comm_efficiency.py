"""Large-message all-reduce bus bandwidth on a rate-limited link, as a fraction of the shaped rate.

Two namespace "hosts" (tests/cluster; root needed), one rank each, their links limited by `tc tbf` to each
rate below. `sdzero comm` measures all-reduce with torch.distributed (gloo) and with MPI (mpi4py over Open
MPI's TCP transport); the figure is the bus bandwidth (nccl-tests' definition, algbw x 2(n-1)/n) at the
largest message size reached, divided by the shaped rate. The physical limit is 1.0: a ring all-reduce
moves busbw through each link, which tbf caps at the rate.

Run it alone: `flock /tmp/sdzero-cpu.lock python bench/comm_efficiency.py`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from sdzero.constants import MIB

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the namespace cluster lives with the tests

from cluster import Cluster  # noqa: E402

from advisor.measure.collectives_launch import run_comm  # noqa: E402
from sdzero.cluster.hostfile import prepare_hosts  # noqa: E402

UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits_s(rate: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if not match:
        raise SystemExit(f"rate {rate!r}: use a tc rate such as 200mbit or 1gbit")
    return float(match.group(1)) * UNITS[match.group(2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", nargs="+", default=["200mbit", "1gbit"])
    p.add_argument("--max-mib", type=int, default=64, help="largest message, MiB")
    p.add_argument("--budget-s", type=float, default=40.0, help="measuring time per rate, both backends")
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="sdzero-commeff-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.chdir(work)  # the deepspeed launcher reads .deepspeed_env from here
    results = []
    with Cluster(hosts=2, slots=1) as cluster:
        cluster.write_hostfile(cluster.hostfile)
        prepare_hosts(cluster.hostfile, workdir=work)
        subnet = f"{cluster.subnet}.0/24"
        # Open MPI's daemons and TCP transport on the cluster's subnet only (see the multi-node notes).
        mpirun_args = ("--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet)
        for rate in args.rates:
            cluster.shape(rate)
            result = run_comm(
                work / rate,
                num_ranks=1,
                hostfile=cluster.hostfile,
                backends=("torch", "mpi"),
                max_bytes=args.max_mib * MIB,
                budget_s=args.budget_s,
                mpirun_args=mpirun_args,
                log=print,
            )
            table = result.table
            table = table[(table["collective"] == "all_reduce") & (table["link_level"] == "inter")]
            for library, rows in table.groupby("library"):
                largest = rows.loc[rows["size_bytes"].idxmax()]
                busbw_bits = float(largest["busbw_gbps"]) * 1e9 * 8
                results.append(
                    (
                        rate,
                        library,
                        int(largest["size_bytes"]),
                        busbw_bits,
                        busbw_bits / rate_bits_s(rate),
                        bool(largest["correct"]),
                    )
                )
    print()
    print("| shaped rate | library | largest all-reduce | bus bandwidth | fraction of rate | correct |")
    print("|---|---|---|---|---|---|")
    for rate, library, size, busbw, fraction, correct in results:
        print(
            f"| {rate} | {library} | {size / MIB:.0f} MiB | {busbw / 1e6:.1f} Mbit/s | {fraction:.3f} | {correct} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
