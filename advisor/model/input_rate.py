"""What can feed the GPUs: each node count's input rate, and every prediction bounded by it.

A step's rate is the least of what the chain sustains: storage -> loader workers -> compute ->
communication. The trials measure one loader worker's samples/s (read, decode, resize and crop,
tokenize; or a latent-cache read) and the storage's read rate with a node's readers
(sdzero.data.input_probe). From them, at n nodes:

- loader workers: n x (workers a node runs) x (one worker's samples/s), the workers a node runs being
  --loader-workers per rank x ranks per node, at most one per core (--cpu-cores-per-node, else the trial
  machine's cores when the target is nodes like it);
- the node's cores: its cores over the CPU seconds a sample costs, its rank's (measured in the trials'
  timed steps: the whole step on CPU ranks, the driving of the GPU on GPU ones) and its worker's
  (1 / the worker's rate) together;
- a node's storage reads: n x (bytes/s one node's readers measured) / (bytes per sample);
- the shared storage: its aggregate rate (--storage-gbps) / (bytes per sample), whatever n: one shared
  filesystem does not grow with the nodes reading it. Not measured by the trials (one node reads); the
  row says so where it is not given.

A prediction whose training rate is above the input rate takes the input rate, its step time and time to
train grow alike, and the row names the link that binds ("input-bound: 16 nodes need 2,300 images/s, the
storage gives 1,900") and the remedy the measurements support.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

LOADER, NODE_STORAGE, SHARED_STORAGE = "loader workers", "storage", "shared storage"
CORES = "CPU cores"
"""The link where ranks and loader workers share a node's cores (CPU nodes)."""


@dataclass(frozen=True)
class InputPlan:
    """The measured input figures and the node's settings they are applied with."""

    worker_samples_per_s: float
    """One loader worker, measured alone on the trial machine."""
    kind: str
    """"images" (decoded from the data) or "cache" (read from a latent cache)."""
    workers_per_rank: int
    """--loader-workers, else the trials' --num-workers."""
    gpus_per_node: int
    cores_per_node: int | None
    """Cores a node's loader workers may use; None: not known (no cap)."""
    node_storage_bytes_per_s: float | None = None
    """What one node's readers read from the data's location, measured; None: not measured (a cache)."""
    bytes_per_sample: float | None = None
    shared_storage_bytes_per_s: float | None = None
    """The shared storage's aggregate, declared (--storage-gbps); None: not known."""
    source: str = "measured"
    rank_cpu_s_per_sample: float | None = None
    """CPU seconds a rank's own process spends per sample it trains (measured over the launches' timed
    steps): the part of the node's cores its loader workers cannot have. None where the trials' workers
    kept up with the ranks (plan_from): the training rate then holds the cores' sharing already."""

    @property
    def workers_per_node(self) -> int:
        """The loader workers a node runs: per rank x ranks, at most one per core."""
        wanted = max(1, self.workers_per_rank) * self.gpus_per_node
        return wanted if self.cores_per_node is None else max(1, min(wanted, self.cores_per_node))

    def limits(self, nodes: int) -> dict[str, float]:
        """Samples/s each link of the input chain sustains at `nodes` nodes."""
        out = {LOADER: nodes * self.workers_per_node * self.worker_samples_per_s}
        if self.rank_cpu_s_per_sample and self.cores_per_node:
            # a sample costs the node its rank's CPU seconds and its worker's (1 / the worker's rate)
            cpu_s = self.rank_cpu_s_per_sample + 1.0 / self.worker_samples_per_s
            out[CORES] = nodes * self.cores_per_node / cpu_s
        if self.bytes_per_sample:
            if self.node_storage_bytes_per_s:
                out[NODE_STORAGE] = nodes * self.node_storage_bytes_per_s / self.bytes_per_sample
            if self.shared_storage_bytes_per_s:
                out[SHARED_STORAGE] = self.shared_storage_bytes_per_s / self.bytes_per_sample
        return out

    def rate(self, nodes: int) -> tuple[float, str]:
        """(samples/s the input sustains at `nodes` nodes, the link that sets it)."""
        limits = self.limits(nodes)
        link = min(limits, key=limits.__getitem__)
        return limits[link], link

    def record(self) -> dict[str, Any]:
        return asdict(self) | {"workers_per_node": self.workers_per_node}


def plan_from(
    sections: list[dict[str, Any]],
    gpus_per_node: int,
    workers_per_rank: int | None,
    cores_per_node: int | None,
    shared_storage_gbps: float | None,
) -> InputPlan | None:
    """The plan from the launches' "input" sections (the median of each figure); None without any."""
    found = [s for s in sections if s and s.get("worker", {}).get("samples_per_s")]
    if not found:
        return None
    storage = [s["storage"] for s in found if s.get("storage")]
    return InputPlan(
        worker_samples_per_s=_median([s["worker"]["samples_per_s"] for s in found]),
        kind=str(found[-1].get("kind", "images")),
        workers_per_rank=workers_per_rank or int(found[-1].get("workers_per_rank") or 1),
        gpus_per_node=gpus_per_node,
        cores_per_node=cores_per_node,
        node_storage_bytes_per_s=_median([s["bytes_per_s"] for s in storage]) if storage else None,
        bytes_per_sample=_median([s["bytes_per_file"] for s in storage]) if storage else None,
        shared_storage_bytes_per_s=None if shared_storage_gbps is None else shared_storage_gbps * 1e9 / 8,
        rank_cpu_s_per_sample=_rank_cpu(found),
        source=f"measured in {len(found)} launch{'es' if len(found) != 1 else ''}",
    )


WAIT_SHARE_KEPT_UP = 0.05
"""Trials whose ranks waited on their loader workers for less than this share of the step: the workers
kept up, on the very cores the ranks used."""


def _rank_cpu(found: list[dict[str, Any]]) -> float | None:
    """The ranks' CPU seconds per sample, for the cores' link; None where the trials' workers kept up:
    their training rate was then measured with the workers on the same cores, so it already holds the
    cores' sharing (counting it again would put the bound below a rate the trials reached)."""
    starved = [s for s in found if s.get("loader_wait_share", 1.0) >= WAIT_SHARE_KEPT_UP]
    cpu = [s["rank_cpu_s_per_sample"] for s in starved if s.get("rank_cpu_s_per_sample")]
    return _median(cpu) if cpu else None


def _median(values: list[float]) -> float:
    ordered = sorted(float(v) for v in values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


INPUT_COLUMNS = ("training_samples_per_s", "input_samples_per_s", "input_link", "input_bound", "input_note")
"""What bound_predictions adds to a prediction (and the scaling table carries for its row)."""
RATE_COLUMNS = ("samples_per_s", "samples_per_s_lo", "samples_per_s_hi")
TIME_COLUMNS = ("step_time_s", "step_time_s_lo", "step_time_s_hi")


def bound_predictions(table: pd.DataFrame, plan: InputPlan | None) -> pd.DataFrame:
    """Every prediction at most its node count's input rate: `training_samples_per_s` keeps the compute
    and communication figure, `input_samples_per_s` and `input_link` say what the input gives and which
    link sets it, `input_bound` whether it binds and `input_note` says so in words (with the remedy);
    samples/s and step time take the bound. Before the time to train and the intervals are added."""
    if plan is None or table.empty:
        return table
    out = table.copy()
    rates = [plan.rate(int(n)) for n in out["node_count"]]
    out["training_samples_per_s"] = out["samples_per_s"]
    out["input_samples_per_s"] = [r for r, _ in rates]
    out["input_link"] = [link for _, link in rates]
    held = out["input_samples_per_s"] < out["samples_per_s"]
    factor = (out["input_samples_per_s"] / out["samples_per_s"]).clip(upper=1.0)
    # the cores' link is the input's only where the workers take the larger part of a sample's CPU
    # seconds; else the ranks' own compute fills the cores, and no input remedy would lift it
    input_share = _worker_cpu_share(plan)
    out["input_bound"] = held & ((out["input_link"] != CORES) | (input_share >= 0.5))
    for column in RATE_COLUMNS:
        if column in out:
            out[column] = out[column].where(~held, out[column].clip(upper=out["input_samples_per_s"]))
    before_s = out["step_time_s"].copy() if "step_time_s" in out else None
    for column in TIME_COLUMNS:
        if column in out:
            out[column] = out[column] / factor
    if before_s is not None:
        # the step's parts still add up: compute + exposed communication + the wait for the input
        out["input_wait_s"] = out["step_time_s"] - before_s
    out["input_note"] = [bound_note(row, plan) for row in out.to_dict("records")]
    return out


def _worker_cpu_share(plan: InputPlan) -> float:
    """The workers' part of a sample's CPU seconds on the node (1.0 where the ranks' are not counted)."""
    if not plan.rank_cpu_s_per_sample:
        return 1.0
    worker_s = 1.0 / plan.worker_samples_per_s
    return worker_s / (worker_s + plan.rank_cpu_s_per_sample)


def remedies(plan: InputPlan, link: str) -> list[str]:
    """What the measurements say would lift the bound at `link`, most effective first."""
    out = []
    if link in (LOADER, CORES):
        if plan.kind == "images":
            out.append("a latent cache (`sdzero cache`, then --cache-dir: workers read latents, not images)")
        spare = None if plan.cores_per_node is None else plan.cores_per_node - plan.workers_per_node
        if spare is None or spare > 0:
            more = plan.workers_per_rank + max(1, (spare or plan.gpus_per_node) // plan.gpus_per_node)
            out.append(f"more loader workers (--num-workers {more})")
    else:
        out.append("tar shards (`sdzero shard`: a few large files instead of one per image)")
        out.append("a local copy of the data on each node")
        if plan.kind == "images":
            out.append("a latent cache (`sdzero cache`: fewer bytes per sample)")
    return out


def bound_note(row: dict[str, Any] | pd.Series, plan: InputPlan | None) -> str:
    """'input-bound: 16 nodes need 2,300 images/s, the storage gives 1,900; remedy: ...', or ''."""
    if plan is None or not bool(row.get("input_bound", False)):
        return ""
    n = int(row["node_count"])
    what = "images" if plan.kind == "images" else "samples"
    need, give = float(row["training_samples_per_s"]), float(row["input_samples_per_s"])
    link = str(row["input_link"])
    fix = remedies(plan, link)
    return (
        f"input-bound: {n} node{'s need' if n != 1 else ' needs'} {_count(need)} {what}/s, the {link} give"
        f"{'s' if link not in (LOADER, CORES) else ''} {_count(give)}"
        + (f"; remedy: {fix[0]}" if fix else "")
    )


def _count(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}" if math.isfinite(value) else "?"
