"""`python tests/cluster up|down|list`: a namespace cluster that outlives the command, for trying things by hand.

python tests/cluster up --hosts 2 --slots 1 --rate 1gbit --delay-ms 1   # prints the tag and the hostfile
python tests/cluster up --hosts 4 --cpus-per-host 0.4     # every host limited to 0.4 of a core (cgroup)
python tests/cluster list
python tests/cluster down TAG        # or: down --all (every cluster this tool made)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a folder (`python tests/cluster`): make `cluster` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cluster.netns import STATE_ROOT, Cluster, ClusterUnavailable, list_clusters, teardown  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python tests/cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="create a cluster that stays until `down`")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--slots", type=int, default=1)
    up.add_argument("--rate", default=None, help="tc tbf rate per host link, e.g. 1gbit or 200mbit")
    up.add_argument(
        "--delay-ms", type=float, default=None, help="one-way delay each host adds to what it sends"
    )
    up.add_argument(
        "--cpus-per-host",
        type=float,
        default=None,
        help="CPU quota of each host in cores (cgroup), e.g. 0.4: equal compute per host",
    )
    down = sub.add_parser("down", help="remove a cluster (or all) and end only the processes it started")
    down.add_argument("tag", nargs="?")
    down.add_argument("--all", action="store_true")
    sub.add_parser("list", help="clusters made by this tool")
    args = p.parse_args(argv)
    if args.action == "up":
        try:
            cluster = Cluster(
                hosts=args.hosts, slots=args.slots, persistent=True, cpus_per_host=args.cpus_per_host
            ).up()
        except (ClusterUnavailable, ValueError) as exc:
            print(f"cluster: cannot start here: {exc}", file=sys.stderr)
            return 2
        if args.rate or args.delay_ms:
            cluster.shape(args.rate, delay_ms=args.delay_ms)
        print(f"tag {cluster.tag}; hostfile {cluster.hostfile}; master {cluster.master.address}")
        cluster.write_hostfile(cluster.hostfile)
        return 0
    if args.action == "list":
        for state in list_clusters():
            hosts = ", ".join(f"{h['hostname']}={h['address']}" for h in state["hosts"])
            owner = state["owner_pid"] or "persistent"
            delay = f"{state['delay_ms']:g} ms" if state.get("delay_ms") else "-"
            cpus = f"{state['cpus_per_host']:g}" if state.get("cpus_per_host") else "-"
            print(
                f"{state['tag']}  owner {owner}  rate {state['shaped_rate'] or '-'}  delay {delay}  "
                f"cpus/host {cpus}  {hosts}"
            )
        return 0
    tags = [s["tag"] for s in list_clusters()] if args.all else [args.tag] if args.tag else []
    if not tags:
        print("cluster: name a TAG or pass --all", file=sys.stderr)
        return 2
    for tag in tags:
        if not (STATE_ROOT / tag).exists():
            print(f"cluster: no cluster {tag}", file=sys.stderr)
            return 2
        teardown(STATE_ROOT / tag)
        print(f"removed {tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
