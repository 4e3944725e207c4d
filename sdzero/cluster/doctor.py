"""`sdzero doctor [--hostfile H]`: before an expensive job, do the nodes agree and can they work together?

Per node (over ssh, as the pdsh launcher reaches them; without a hostfile, the nodes of the Slurm
allocation it runs in, else this machine only): the
accelerators (model, count, memory) or the CPU, driver/CUDA/NCCL versions, Python/torch/DeepSpeed/
diffusers versions, free disk in --output-dir. Across nodes: that the versions agree, that every node sees
the same --data fingerprint and reads the tokens the others wrote in --output-dir (sdzero/cluster/shared_storage.py: the
same check the trainer makes at start), and an all-reduce bandwidth probe per node pair (gloo over TCP:
the link, not NVLink), the slowest pair named. One table, one verdict line, exit 1 on a blocker. With
--data, every node also reads a sample of it at the same time (sdzero.cluster.data_reads).

The node side runs as `python -m sdzero.cluster.doctor node|tokens|probe ...`, printing one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sdzero.cluster.shared_storage import TOKEN_DIR, listing_fingerprint, unseen_tokens, write_token
from sdzero.constants import GIB
from sdzero.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
AGREE_KEYS = ("python", "torch", "deepspeed", "diffusers", "transformers", "cuda", "nccl", "driver")
"""Versions every node must share: a mismatch changes numerics, collectives or checkpoint formats."""
MIN_FREE_DISK_BYTES = 10 << 30
"""Below this a checkpoint save of even a small model risks a full disk mid-write."""
SLOW_PAIR_FRACTION = 0.5
"""A pair slower than this fraction of the median pair is named: one bad link paces every collective."""


def node_facts(output_dir: Path, data: Path | None, token_dir: Path | None) -> dict[str, Any]:
    """This node's hardware, versions and storage view; writes this node's token when asked."""
    from sdzero.telemetry.environment import environment_snapshot

    snap = environment_snapshot()
    versions = {
        k: snap["versions"].get(k) for k in ("python", "torch", "deepspeed", "diffusers", "transformers")
    }
    versions.update(_gpu_stack_versions())
    existing = next(
        p for p in [Path(output_dir).absolute(), *Path(output_dir).absolute().parents] if p.exists()
    )
    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        "accelerators": snap["accelerators"],
        "cpu": snap["cpu"],
        "cpu_count": snap["cpu_count"],
        "versions": versions,
        "free_disk_bytes": shutil.disk_usage(existing).free,
        "data_fingerprint": listing_fingerprint(data) if data is not None and Path(data).is_dir() else None,
    }
    if token_dir is not None:
        write_token(token_dir, facts["host"])
    return facts


def _gpu_stack_versions() -> dict[str, str | None]:
    import torch

    found: dict[str, str | None] = {"cuda": torch.version.cuda, "nccl": None, "driver": None}
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version()
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()
            found["driver"] = out[0] if out else None
    return found


def probe_allreduce(rank: int, master: str, port: int, size_mib: float, rounds: int) -> float:
    """Algorithm bandwidth (bytes / time, Gbit/s) of an all-reduce between two processes, best of rounds."""
    import torch
    import torch.distributed as dist

    # A peer that never comes must not hold this one for torch's default 30 minutes.
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        tensor = torch.ones(int(size_mib * (1 << 20)) // 4, dtype=torch.float32)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        best_s = float("inf")
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            best_s = min(best_s, time.perf_counter() - start)
        return tensor.numel() * 4 * 8 / best_s / 1e9
    finally:
        dist.destroy_process_group()


@dataclass
class Findings:
    blockers: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def assess(
    facts: list[dict[str, Any]], unseen: dict[str, list[str]], pairs_gbps: dict[tuple[str, str], float]
) -> Findings:
    """Blockers and warnings from the nodes' facts, which tokens each could not read, and the pair probes."""
    found = Findings()
    for key in AGREE_KEYS:
        values = {f["host"]: f["versions"].get(key) for f in facts}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"{h}: {v}" for h, v in values.items())
            found.blockers.append(f"{key} versions differ ({listing})")
    gpus = {f["host"]: (len(f["accelerators"]), {a["name"] for a in f["accelerators"]}) for f in facts}
    if len({(n, tuple(sorted(names))) for n, names in gpus.values()}) > 1:
        listing = ", ".join(
            f"{h}: {n} x {'/'.join(sorted(names)) or 'CPU'}" for h, (n, names) in gpus.items()
        )
        found.blockers.append(f"nodes have different accelerators ({listing})")
    prints = {f["host"]: f["data_fingerprint"] for f in facts}
    if len(set(prints.values())) > 1:
        reference = facts[0]["host"]
        odd = [h for h, p in prints.items() if p != prints[reference]]
        found.blockers.append(f"--data differs on {', '.join(odd)} from {reference} (files or metadata)")
    hosts = [f["host"] for f in facts]
    apart = storage_outliers(hosts, unseen)
    if apart:
        shared = [h for h in hosts if h not in apart]
        detail = "; ".join(_token_detail(h, shared, unseen) for h in apart)
        found.blockers.append(
            f"--output-dir on {', '.join(apart)} is not the same folder as on {', '.join(shared)} "
            f"(a private or different mount): {detail}"
        )
    for f in facts:
        if f["free_disk_bytes"] < MIN_FREE_DISK_BYTES:
            found.warnings.append(f"{f['host']}: {f['free_disk_bytes'] / GIB:.1f} GiB free in --output-dir")
    found.warnings.extend(link_warnings(pairs_gbps))
    return found


def storage_outliers(hosts: list[str], unseen: dict[str, list[str]]) -> list[str]:
    """The nodes outside the largest group that reads each other's tokens (ties: the first node's group).

    Naming every node that missed a token would name them all when one node has a private folder (the
    others cannot read its token either); the group that agrees is the shared mount, the rest are not on it.
    """
    views = {h: frozenset(x for x in hosts if x not in unseen.get(h, [])) for h in hosts}
    groups: dict[frozenset[str], list[str]] = {}
    for h in hosts:
        groups.setdefault(views[h], []).append(h)
    shared = max(groups.values(), key=len)  # max keeps the first of equals: the first node's group
    return [h for h in hosts if h not in shared]


def _token_detail(host: str, shared: list[str], unseen: dict[str, list[str]]) -> str:
    parts = [f"{host} cannot read the tokens of {', '.join(unseen[host])}"] if unseen.get(host) else []
    blind = [h for h in shared if host in unseen.get(h, [])]
    parts += [f"{', '.join(blind)} cannot read {host}'s"] if blind else []
    return " and ".join(parts) or f"{host} sees other tokens than {', '.join(shared)}"


def link_warnings(pairs_gbps: dict[tuple[str, str], float]) -> list[str]:
    """A node whose every pair is slow (its NIC, cable or switch port), else the slowest pair.

    Each node's best pair is its own link's speed when the others are healthy; a node whose best is under
    half the median node's best is named, and with it every pair it is in is explained. With two nodes no
    node can be told from its peer: only the pair exists.
    """
    if len(pairs_gbps) < 2:
        return []
    hosts = sorted({h for pair in pairs_gbps for h in pair})
    best = {h: max(g for pair, g in pairs_gbps.items() if h in pair) for h in hosts}
    typical = sorted(best.values())[len(best) // 2]
    found = [
        f"slow node {h}: its fastest pair reaches {best[h]:.2f} Gbit/s, under half a typical node's "
        f"({typical:.2f} Gbit/s); every collective it joins runs at that pace (check its NIC, cable, port)"
        for h in hosts
        if best[h] < SLOW_PAIR_FRACTION * typical
    ]
    if found:
        return found
    ordered = sorted(pairs_gbps.values())
    median = ordered[len(ordered) // 2]
    slow = min(pairs_gbps, key=lambda p: pairs_gbps[p])
    if pairs_gbps[slow] < SLOW_PAIR_FRACTION * median:
        return [
            f"slowest link {slow[0]} <-> {slow[1]}: {pairs_gbps[slow]:.2f} Gbit/s, under half the median "
            f"pair ({median:.2f} Gbit/s); every collective runs at its pace"
        ]
    return []


def _remote(
    host: str | None,
    args: list[str],
    env: dict[str, str] | None = None,
    timeout_s: float = 120,
    module: str = "sdzero.cluster.doctor",
) -> dict:
    """Run `python -m MODULE ARGS` on host (None: here) and parse its JSON line."""
    command = [sys.executable, "-m", module, *args]
    prefix = {"PYTHONPATH": str(REPO_ROOT), **(env or {})}
    if host is None:
        run: list[str] = command
        env_run: dict[str, str] | None = {**os.environ, **prefix}
    else:
        line = " ".join(f"{k}={shlex.quote(v)}" for k, v in prefix.items()) + " " + shlex.join(command)
        ssh = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "ConnectTimeout=10",
            host,
            f"cd {shlex.quote(str(Path.cwd()))} && {line}",
        ]
        run, env_run = ssh, None
    try:
        proc = subprocess.run(run, capture_output=True, text=True, timeout=timeout_s, env=env_run)
    except subprocess.TimeoutExpired:  # a host that never answers: one line naming it, not a traceback
        raise UserError(
            f"{host or 'this machine'}: `{module} {args[0]}` gave no answer in {timeout_s:.0f} s; "
            f"check the node is up and answers `ssh {host or 'localhost'} true` at once"
        ) from None
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{host or 'this machine'}: `{module} {args[0]}` failed ({proc.returncode}): {tail}")
    try:
        return json.loads(lines[-1])
    except ValueError:
        raise UserError(
            f"{host or 'this machine'}: `{module} {args[0]}` answered {lines[-1][:80]!r}"
        ) from None


def _probe_pair(a: str, b: str, size_mib: float, rounds: int) -> float:
    from sdzero.cluster.hostfile import resolve, route_interface

    master = resolve(a)
    port = str(20000 + secrets.randbelow(20000))
    args = ["probe", "--master", master, "--port", port, "--size-mib", str(size_mib), "--rounds", str(rounds)]
    # gloo binds to the address the hostname resolves to unless told the interface that reaches the peer.
    env = {h: {"GLOO_SOCKET_IFNAME": route_interface(h, master)} for h in (a, b)}
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(_remote, h, [*args, "--rank", str(r)], env[h]) for r, h in enumerate((a, b))]
        results = [j.result() for j in jobs]
    return float(results[0]["gbps"])


def doctor_hosts(hostfile: Path | None) -> list[str | None]:
    """The nodes to check: the hostfile's; else, inside a Slurm allocation, its nodes (reached over ssh by
    name, as a job's nodes accept their user's ssh); else [None], this machine alone."""
    from sdzero.cluster.hostfile import HostEntry, check_reachable, parse_hostfile
    from sdzero.cluster.slurm import allocation_nodes

    if hostfile is not None:
        entries = parse_hostfile(hostfile)
    else:
        names = allocation_nodes()
        if names is None:
            return [None]
        entries = [HostEntry(name, 1, number) for number, name in enumerate(names, start=1)]
    check_reachable(entries)
    return [e.host for e in entries]


def diagnose(
    hostfile: Path | None, output_dir: Path, data: Path | None, size_mib: float = 16, rounds: int = 3
) -> tuple[list[dict[str, Any]], dict[str, list[str]], dict[tuple[str, str], float], Findings]:
    """Gather every node's facts, the token cross-check and the pair probes, then assess them."""
    hosts = doctor_hosts(hostfile)
    token_dir = Path(output_dir).absolute() / TOKEN_DIR / secrets.token_hex(6)
    base = ["node", "--output-dir", str(output_dir), "--token-dir", str(token_dir)]
    base += ["--data", str(data)] if data is not None else []
    with ThreadPoolExecutor(min(32, len(hosts))) as pool:
        facts = list(pool.map(lambda h: _remote(h, base), hosts))
        names = [f["host"] for f in facts]
        checks = list(
            pool.map(
                lambda h: _remote(h, ["tokens", "--token-dir", str(token_dir), "--hosts", ",".join(names)]),
                hosts,
            )
        )
        # Only once every node has read: each removes its own token from its own view of the folder.
        list(
            pool.map(
                lambda h: _remote(h, ["tokens", "--token-dir", str(token_dir), "--hosts", "", "--clean"]),
                hosts,
            )
        )
    unseen = {
        f["host"]: [h for h in c["unseen"] if h != f["host"]] for f, c in zip(facts, checks, strict=True)
    }
    pairs: dict[tuple[str, str], float] = {}
    if len(hosts) > 1:
        name = dict(zip(hosts, names, strict=True))  # pairs named as the table names nodes: by hostname
        for a, b in itertools.combinations(hosts, 2):  # one pair at a time: each probe has its link alone
            pairs[(name[a], name[b])] = _probe_pair(a, b, size_mib, rounds)  # type: ignore[arg-type]
    return facts, unseen, pairs, assess(facts, unseen, pairs)


def render_report(facts: list[dict[str, Any]], pairs: dict[tuple[str, str], float], found: Findings) -> int:
    """Print the table and the verdict line; the exit code (1 on a blocker)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sdzero doctor")
    for column in (
        "node",
        "accelerators",
        "driver / CUDA / NCCL",
        "python / torch / deepspeed / diffusers",
        "free disk (GiB)",
        "data",
    ):
        table.add_column(column)
    for f in facts:
        acc = f["accelerators"]
        accel = (
            f"{len(acc)} x {acc[0]['name']} ({acc[0]['memory_bytes'] / GIB:.0f} GiB)"
            if acc
            else f"CPU: {f['cpu']} ({f['cpu_count']} cores)"
        )
        v = f["versions"]
        table.add_row(
            f["host"],
            accel,
            f"{v['driver'] or '-'} / {v['cuda'] or '-'} / {v['nccl'] or '-'}",
            f"{v['python']} / {v['torch']} / {v['deepspeed']} / {v['diffusers']}",
            f"{f['free_disk_bytes'] / GIB:.0f}",
            f["data_fingerprint"] or "-",
        )
    console = Console()
    console.print(table)
    if pairs:
        links = Table(title="all-reduce per node pair (gloo, TCP)")
        links.add_column("pair")
        links.add_column("Gbit/s", justify="right")
        for (a, b), gbps in sorted(pairs.items(), key=lambda kv: kv[1]):
            links.add_row(f"{a} <-> {b}", f"{gbps:.2f}")
        console.print(links)
    for line in found.warnings:
        console.print(f"warning: {line}", markup=False, soft_wrap=True)  # one line each, for grep
    if found.blockers:
        console.print("verdict: NOT READY: " + "; ".join(found.blockers), markup=False, soft_wrap=True)
        return 1
    print(
        f"verdict: ready: {len(facts)} node(s) agree"
        + (f" ({len(found.warnings)} warning(s))" if found.warnings else "")
    )
    return 0


def _node_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m sdzero.cluster.doctor")
    sub = parser.add_subparsers(dest="what", required=True)
    node = sub.add_parser("node")
    node.add_argument("--output-dir", type=Path, required=True)
    node.add_argument("--data", type=Path)
    node.add_argument("--token-dir", type=Path)
    tokens = sub.add_parser("tokens")
    tokens.add_argument("--token-dir", type=Path, required=True)
    tokens.add_argument("--hosts", required=True)
    tokens.add_argument("--clean", action="store_true")
    probe = sub.add_parser("probe")
    probe.add_argument("--rank", type=int, required=True)
    probe.add_argument("--master", required=True)
    probe.add_argument("--port", type=int, required=True)
    probe.add_argument("--size-mib", type=float, default=16)
    probe.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args(argv)
    if a.what == "node":
        result: dict[str, Any] = node_facts(a.output_dir, a.data, a.token_dir)
    elif a.what == "tokens":
        result = {"unseen": list(unseen_tokens(a.token_dir, [h for h in a.hosts.split(",") if h]))}
        if a.clean:
            (a.token_dir / f"{socket.gethostname()}.token").unlink(missing_ok=True)
            for folder in (a.token_dir, a.token_dir.parent):
                with contextlib.suppress(OSError):  # not empty yet: another node's token is still there
                    folder.rmdir()
    else:
        result = {"gbps": probe_allreduce(a.rank, a.master, a.port, a.size_mib, a.rounds)}
    print(json.dumps(result))


if __name__ == "__main__":
    _node_main(sys.argv[1:])
