"""Latency-bandwidth (alpha-beta) model of collectives, fitted to `sdzero comm` measurements.

The model is the one NCCL's own tuner uses (src/graph/tuning.cc): time = latency + bytes / bandwidth,
written here as ``t = alpha + size_bytes * beta``. ``size_bytes`` follows nccl-tests: the whole buffer of
an all-reduce, the (larger) input of a reduce-scatter, the (larger) output of an all-gather.

Bandwidths follow nccl-tests' doc/PERFORMANCE.md:
  algbw = size_bytes / t
  busbw = algbw * 2(n-1)/n   for all-reduce
  busbw = algbw * (n-1)/n    for reduce-scatter and all-gather
busbw is the per-link figure that does not depend on n, so it is what the advisor extrapolates with.

All bandwidths in this module are GB/s with G = 1e9 bytes (nccl-tests' unit), despite the `_gbps` suffix.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

COLLECTIVES: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather")
"""Collectives the benchmark measures, in the order it measures them."""

FIT_SCHEMA = "sdzero.comm_fit/1"

# Grouping keys: one fit per backend, library, collective, link level and group size.
FIT_KEYS: tuple[str, ...] = ("backend", "library", "collective", "link_level", "ranks", "nodes")

# A clamped parameter is set to this fraction of the scale the data shows (see _fit_with_floor).
_FLOOR_FRACTION = 1e-3


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; expected one of {', '.join(COLLECTIVES)}")


def bus_factor(collective: str, num_ranks: int) -> float:
    """busbw / algbw for `collective` over `num_ranks` ranks (nccl-tests' doc/PERFORMANCE.md)."""
    _check_collective(collective)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if collective == "all_reduce":
        return 2.0 * (num_ranks - 1) / num_ranks
    return (num_ranks - 1) / num_ranks


def ring_latency_steps(collective: str, num_ranks: int) -> int:
    """Sequential hops of a ring algorithm: 2(n-1) for all-reduce, n-1 for reduce-scatter/all-gather."""
    _check_collective(collective)
    steps = num_ranks - 1
    return 2 * steps if collective == "all_reduce" else steps


def algbw_gbps(size_bytes: float, time_s: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s)."""
    return size_bytes / time_s / 1e9


def busbw_gbps(collective: str, num_ranks: int, size_bytes: float, time_s: float) -> float:
    """Bus bandwidth in GB/s (1e9 bytes/s), nccl-tests' definition."""
    return algbw_gbps(size_bytes, time_s) * bus_factor(collective, num_ranks)


@dataclass(frozen=True)
class LineFit:
    """Result of fitting t = alpha + x * beta."""

    alpha_s: float
    beta_s_per_byte: float
    clamped: tuple[str, ...]
    """Parameters that the unconstrained fit put at or below zero and that were floored (see fit_line)."""
    rel_rmse: float
    """Root mean square of the relative residuals (t_fit - t) / t."""


def _relative_rmse(x: np.ndarray, t: np.ndarray, alpha: float, beta: float) -> float:
    return float(np.sqrt(np.mean(((alpha + beta * x - t) / t) ** 2)))


def _fit_with_floor(
    x: np.ndarray, t: np.ndarray, alpha: float, beta: float
) -> tuple[float, float, tuple[str, ...]]:
    """Floor a non-positive parameter and refit the other one with it held fixed.

    A non-positive alpha means the latency is below what the noise at the measured sizes can resolve;
    a non-positive beta means time did not grow with size over the range measured. Neither is a
    physical value, so the parameter is set to a small fraction of the scale the data shows and the
    other one is refitted (same relative-error weighting), and the JSON says which was clamped.
    """
    weights = 1.0 / t
    alpha_floor = _FLOOR_FRACTION * float(t.min())
    if alpha <= 0.0:
        # minimise sum(((alpha_floor + beta x - t) / t)^2) over beta alone
        xw = x * weights
        beta = float(np.sum(xw * (1.0 - alpha_floor * weights)) / np.sum(xw * xw))
        if beta > 0.0:
            return alpha_floor, beta, ("alpha",)
    beta = _FLOOR_FRACTION * float(np.min(t / x))
    # minimise sum(((alpha + beta x - t) / t)^2) over alpha alone
    alpha = float(np.sum(weights * (1.0 - beta * x * weights)) / np.sum(weights * weights))
    if alpha <= alpha_floor:
        return alpha_floor, beta, ("alpha", "beta")
    return alpha, beta, ("beta",)


def fit_line(size_bytes: Sequence[float] | np.ndarray, time_s: Sequence[float] | np.ndarray) -> LineFit:
    """Fit t = alpha + size_bytes * beta with numpy least squares, both parameters positive.

    The fit minimises *relative* residuals ((fit - t) / t): sizes span five orders of magnitude, and an
    absolute least-squares fit would let the largest messages decide everything, leaving alpha to noise.
    """
    x = np.asarray(size_bytes, dtype=np.float64)
    t = np.asarray(time_s, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError("size_bytes and time_s must be 1-D and of equal length")
    if np.unique(x).size < 2:
        raise ValueError("an alpha-beta fit needs at least two distinct message sizes")
    if np.any(x <= 0) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("sizes and times must be positive and finite")
    design = np.column_stack([np.ones_like(x), x]) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    clamped: tuple[str, ...] = ()
    if alpha <= 0.0 or beta <= 0.0:
        alpha, beta, clamped = _fit_with_floor(x, t, float(alpha), float(beta))
    return LineFit(float(alpha), float(beta), clamped, _relative_rmse(x, t, float(alpha), float(beta)))


@dataclass(frozen=True)
class AlphaBetaFit:
    """Fitted t = alpha + size_bytes * beta for one backend, collective, link level and group size."""

    backend: str
    """`torch` (torch.distributed) or `mpi` (mpi4py)."""
    library: str
    """What ran underneath: gloo, nccl, or the MPI library's name and version."""
    collective: str
    link_level: str
    """`intra` (ranks on one node) or `inter` (one rank per node, across nodes)."""
    ranks: int
    nodes: int
    alpha_s: float
    beta_s_per_byte: float
    n_points: int
    min_bytes: int
    max_bytes: int
    rel_rmse: float
    clamped: tuple[str, ...] = ()
    emulated: bool = False
    """True when the library does not run this collective natively (e.g. gloo's reduce-scatter)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def latency_us(self) -> float:
        return self.alpha_s * 1e6

    @property
    def hop_latency_us(self) -> float:
        """alpha divided by the ring's sequential steps: a per-hop latency comparable across n."""
        return self.latency_us / max(ring_latency_steps(self.collective, self.ranks), 1)

    @property
    def algbw_gbps(self) -> float:
        """Asymptotic algorithm bandwidth 1/beta, GB/s (1e9 bytes/s)."""
        return 1.0 / self.beta_s_per_byte / 1e9

    @property
    def bandwidth_gbps(self) -> float:
        """Asymptotic bus bandwidth (nccl-tests busbw of an infinitely large message), GB/s."""
        return self.algbw_gbps * bus_factor(self.collective, self.ranks)

    def predict_s(self, size_bytes: float) -> float:
        return self.alpha_s + size_bytes * self.beta_s_per_byte

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["clamped"] = list(self.clamped)
        extra = out.pop("extra")
        out.update(
            latency_us=self.latency_us,
            hop_latency_us=self.hop_latency_us,
            algbw_gbps=self.algbw_gbps,
            bandwidth_gbps=self.bandwidth_gbps,
            busbw_factor=bus_factor(self.collective, self.ranks),
        )
        out.update(extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlphaBetaFit:
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["clamped"] = tuple(kwargs.get("clamped", ()))
        return cls(**kwargs)


def fit_table(table: pd.DataFrame) -> list[AlphaBetaFit]:
    """One AlphaBetaFit per (backend, library, collective, link level, ranks, nodes) in a comm.csv table.

    Rows that failed the correctness check are left out: a wrong result says nothing about speed.
    Groups with fewer than two sizes cannot be fitted and are skipped.
    """
    fits: list[AlphaBetaFit] = []
    good = table[table["correct"].astype(bool)]
    for key, group in good.groupby(list(FIT_KEYS), sort=True):
        if group["size_bytes"].nunique() < 2:
            continue
        line = fit_line(group["size_bytes"].to_numpy(), group["time_s"].to_numpy())
        values = dict(zip(FIT_KEYS, key, strict=True))
        fits.append(
            AlphaBetaFit(
                backend=str(values["backend"]),
                library=str(values["library"]),
                collective=str(values["collective"]),
                link_level=str(values["link_level"]),
                ranks=int(values["ranks"]),
                nodes=int(values["nodes"]),
                alpha_s=line.alpha_s,
                beta_s_per_byte=line.beta_s_per_byte,
                n_points=len(group),
                min_bytes=int(group["size_bytes"].min()),
                max_bytes=int(group["size_bytes"].max()),
                rel_rmse=line.rel_rmse,
                clamped=line.clamped,
                emulated=bool(group["emulated"].astype(bool).any()),
            )
        )
    return fits


def fits_payload(fits: Iterable[AlphaBetaFit], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document written to comm_fit.json."""
    return {
        "schema": FIT_SCHEMA,
        "model": "time_s = alpha_s + size_bytes * beta_s_per_byte; size_bytes as in nccl-tests "
        "(all-reduce buffer, reduce-scatter input, all-gather output)",
        "units": {
            "alpha_s": "seconds",
            "beta_s_per_byte": "seconds per byte",
            "latency_us": "alpha in microseconds",
            "hop_latency_us": "alpha / ring steps (2(n-1) all-reduce, n-1 otherwise), microseconds",
            "algbw_gbps": "1 / beta in GB/s, G = 1e9 bytes (nccl-tests unit, not gigabits)",
            "bandwidth_gbps": "asymptotic busbw = algbw_gbps * busbw_factor, GB/s (1e9 bytes/s)",
        },
        "meta": meta or {},
        "fits": [fit.to_dict() for fit in fits],
    }


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON next to `path` and rename it into place, so a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, allow_nan=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_fits(path: Path) -> list[AlphaBetaFit]:
    """Read the fits back from a comm_fit.json file."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != FIT_SCHEMA:
        raise ValueError(f"{path}: not a {FIT_SCHEMA} file (schema={data.get('schema')!r})")
    return [AlphaBetaFit.from_dict(item) for item in data["fits"]]


def is_positive_finite(value: float) -> bool:
    return math.isfinite(value) and value > 0.0
