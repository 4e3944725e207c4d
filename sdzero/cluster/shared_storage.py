"""Do all nodes share --output-dir and see the same --data? Checked at trainer start, before anything is
read from or written to either.

A node that mounts a private copy of the output folder writes checkpoints nobody else sees (and a resume
picks a different checkpoint on each node); one with a stale or partial copy of the data counts the images
it lacks as "unreadable", which can slip under --max-bad-fraction. Both are cheap to catch:
- shared output: the first rank of each node writes a token file into --output-dir, and reads the tokens
  of the others after a barrier (a few tiny files per node, nothing per image);
- same data: each node fingerprints the metadata file's bytes and the folder's top-level listing (names
  only: no image is opened or even stat-ed, which on NFS costs a round trip per file), and the
  fingerprints are compared with rank 0's.
Every rank gets the gathered reports, so every rank reaches the same verdict and raises the same error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from sdzero.atomic import remove_tree, write_text_atomic
from sdzero.errors import AgreedError

TOKEN_DIR = ".sdzero-shared-check"


@dataclass(frozen=True)
class NodeReport:
    host: str
    rank: int
    data_fingerprint: str
    unseen_tokens: tuple[str, ...]
    """Hosts whose token this node could not read in --output-dir."""


def listing_fingerprint(data: Path) -> str:
    """sha256 of the top-level names and of every metadata file's bytes; no image is read. Tar shards:
    each shard's name and size (no member is read)."""
    digest = hashlib.sha256()
    from sdzero.config.data_source import data_root, is_shard_source, shard_paths

    if is_shard_source(data):
        root = data_root(data)
        for path in shard_paths(data):
            digest.update(f"{path.relative_to(root).as_posix()} {path.stat().st_size}\n".encode())
        return digest.hexdigest()[:16]
    for name in sorted(os.listdir(data)):
        digest.update(f"{name}\n".encode())
        meta = Path(data) / name
        if name.startswith("metadata.") and meta.is_file():
            digest.update(meta.read_bytes())
    return digest.hexdigest()[:16]


def write_token(folder: Path, host: str) -> None:
    write_text_atomic(folder / f"{host}.token", host)  # readers see a whole token or none


def unseen_tokens(folder: Path, hosts: list[str]) -> tuple[str, ...]:
    def readable(host: str) -> bool:
        try:
            return (folder / f"{host}.token").read_text() == host
        except OSError:
            return False

    return tuple(h for h in hosts if not readable(h))


def verdict(reports: list[NodeReport], output_dir: Path, data: Path) -> str | None:
    """The error naming the nodes that do not share storage with rank 0's node, or None."""
    first = min(reports, key=lambda r: r.rank)
    unshared = sorted(
        {r.host for r in reports if r.host != first.host and r.host in first.unseen_tokens}
        | {r.host for r in reports if first.host in r.unseen_tokens}
    )
    if unshared:
        return (
            f"--output-dir {output_dir}: node {', '.join(unshared)} does not share it with node {first.host} "
            "(rank 0): a token written there by one was not readable by the other. Every node must mount "
            "the same shared folder (NFS, Lustre, a ReadWriteMany volume), or checkpoints and resume diverge"
        )
    differing = sorted({r.host for r in reports if r.data_fingerprint != first.data_fingerprint})
    if differing:
        return (
            f"--data {data}: node {', '.join(differing)} sees different files or metadata than node "
            f"{first.host} (rank 0); every node must read the same folder (shared storage or identical "
            "copies), or the images one node lacks are counted as unreadable"
        )
    return None


def check_shared_storage(output_dir: Path, data: Path, rank: int, world: int) -> None:
    """Collective: every rank calls it after the process group exists; raises UserError on every rank."""
    import torch.distributed as dist

    host = socket.gethostname()
    node_firsts: list[tuple[str, int]] = [("", 0)] * world
    dist.all_gather_object(node_firsts, (host, rank))
    first_of_host = {h: min(r for hh, r in node_firsts if hh == h) for h, _ in node_firsts}
    hosts = sorted(first_of_host)
    if len(hosts) == 1:
        return  # one node: it shares everything with itself
    run_id = [secrets.token_hex(6)]
    dist.broadcast_object_list(run_id, src=0)
    folder = Path(output_dir) / TOKEN_DIR / run_id[0]
    leads = first_of_host[host] == rank  # one rank per node does the file work
    if leads:
        write_token(folder, host)
    dist.barrier()  # every token is written before any is read
    report = None
    if leads:
        others = [h for h in hosts if h != host]
        report = NodeReport(host, rank, listing_fingerprint(data), unseen_tokens(folder, others))
    gathered: list[NodeReport | None] = [None] * world
    dist.all_gather_object(gathered, report)
    dist.barrier()  # every token is read before any is removed
    if leads:
        remove_tree(folder)
        with contextlib.suppress(OSError):  # another node may have removed it already, or left a token
            folder.parent.rmdir()
    problem = verdict([r for r in gathered if r is not None], output_dir, data)
    if problem:
        raise AgreedError(problem)  # the same verdict on every rank: rank 0 alone reports it
