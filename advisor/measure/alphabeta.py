"""Latency-bandwidth (alpha-beta) model of collectives, fitted to `sdzero comm` measurements.

The model is the one NCCL's own tuner uses (src/graph/tuning.cc): time = latency + bytes / bandwidth,
written here as ``t = alpha + size_bytes * beta``. ``size_bytes`` follows nccl-tests: the whole buffer of
an all-reduce, the (larger) input of a reduce-scatter, the (larger) output of an all-gather.

Bandwidths follow nccl-tests' doc/PERFORMANCE.md:
  algbw = size_bytes / t
  busbw = algbw * 2(n-1)/n   for all-reduce
  busbw = algbw * (n-1)/n    for reduce-scatter and all-gather
busbw is the per-link figure that does not depend on n, so it is what the advisor extrapolates with.
A collective the library runs as another (gloo's reduce-scatter is a whole all-reduce: `emulated`) is
normalised by what really crosses the wire, the all-reduce's 2(n-1)/n and 2(n-1) ring steps, so its busbw
is a link rate like the others' and extrapolates to another n as an all-reduce does.

beta is fitted over the largest sizes and alpha over the smallest (see fit_line for why not one line
over everything): the model is right at both ends and reports how far the middle strays.

All bandwidths in this module are GB/s with G = 1e9 bytes (nccl-tests' unit), despite the `_gbps` suffix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sdzero.config.user_file import read_user_json
from sdzero.errors import UserError

COLLECTIVES: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather")
"""Collectives the benchmark measures, in the order it measures them."""

FIT_SCHEMA = "sdzero.comm_fit/1"

# Grouping keys: one fit per backend, library, collective, link level and group size.
FIT_KEYS: tuple[str, ...] = ("backend", "library", "collective", "link_level", "ranks", "nodes")

# A clamped parameter is set to this fraction of the scale the data shows (see fit_line).
_FLOOR_FRACTION = 1e-3
REGIME_SPAN = 8.0
"""Sizes within this factor of the largest set beta; within it of the smallest, alpha (4 doublings each)."""
NOISY_SPREAD = 1.0
"""A point whose timed repeats differ by more than this fraction of their median is noise, not transport."""


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
    """Result of fitting t = alpha + size_bytes * beta."""

    alpha_s: float
    beta_s_per_byte: float
    clamped: tuple[str, ...]
    """Parameters that came out at or below zero and were floored (see fit_line)."""
    rel_rmse: float
    """Root mean square of the relative residuals (t_fit - t) / t over every point."""
    max_rel_error: float
    """Largest |t_fit - t| / t: large when the transport changes regime inside the sweep."""


def _relative_errors(x: np.ndarray, t: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    return (alpha + beta * x - t) / t


BANDWIDTH_BOUND = 2.0
"""A fit's sweep reached the bandwidth regime when its largest size's bytes took this many latencies."""
SLOW_OUTLIER = 0.25
"""A bandwidth-regime point this much slower than the line through the others is left out of the slope."""


def _line(x: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) by ordinary least squares."""
    design = np.column_stack([np.ones(x.size), x])
    (alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    return float(alpha), float(beta)


def _bandwidth_slope(x: np.ndarray, t: np.ndarray) -> float:
    """beta from the largest sizes (within REGIME_SPAN of the largest): the least-squares slope, without
    the one point that is far slower than the line through the others (SLOW_OUTLIER) where four or more
    sizes leave three to fit.

    Noise on a shared machine only ever adds time, and one slowed size (another process on the same
    cores) moves a least-squares slope a long way: the link then reads far slower than it is.
    """
    top = x >= x.max() / REGIME_SPAN
    xs, ts = x[top], t[top]
    keep = np.ones(xs.size, dtype=bool)
    if np.unique(xs).size >= 4:
        excess = np.zeros(xs.size)
        for i in range(xs.size):
            others = np.arange(xs.size) != i
            alpha, beta = _line(xs[others], ts[others])
            expected = alpha + beta * xs[i]
            excess[i] = ts[i] / expected - 1.0 if expected > 0 else 0.0
        if excess.max() > SLOW_OUTLIER:
            keep[int(np.argmax(excess))] = False
    _, beta = _line(xs[keep], ts[keep])
    if beta > 0.0:
        return float(beta)
    # noise in a range too narrow to show a slope: fall back to a relative-error fit over every point
    design = np.column_stack([np.ones_like(x), x]) / t[:, None]
    (_, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(beta)


def _latency_intercept(x: np.ndarray, t: np.ndarray) -> float:
    """alpha: intercept of a line over the smallest sizes, least squares in relative error.

    The small-size regime's own line, not t - beta*x with the large-size beta: where a transport is
    faster in cache than out of it, that beta overstates the small messages' byte cost and would push
    alpha below zero.
    """
    low = x <= x.min() * REGIME_SPAN
    if np.unique(x[low]).size < 2:
        return float(np.min(t[low]))
    design = np.column_stack([np.ones(int(low.sum())), x[low]]) / t[low, None]
    (alpha, _), *_ = np.linalg.lstsq(design, np.ones(int(low.sum())), rcond=None)
    # No message is faster than the latency: a line through noisy small sizes that falls with size (a
    # shaped link's bursts, a shared CPU) would put its intercept above every time measured there.
    return float(min(alpha, np.min(t[low])))


def fit_line(size_bytes: Sequence[float] | np.ndarray, time_s: Sequence[float] | np.ndarray) -> LineFit:
    """Fit t = alpha + size_bytes * beta with numpy least squares, both parameters positive.

    beta is the slope over the bandwidth regime (sizes within REGIME_SPAN of the largest), alpha the
    intercept over the latency regime (within REGIME_SPAN of the smallest), just as one reads latency off
    nccl-tests' first rows and busbw off its last. One least-squares line over every size would be the textbook fit, but transports
    change regime inside the sweep (MPI's eager-to-rendezvous switch, shared memory falling out of
    cache): measured on this project's CPU box, such a line was 75 % optimistic at 32 MiB, the size
    class of ZeRO buckets. This fit is exact at both ends and errs on the slow side in between;
    rel_rmse and max_rel_error say how far the middle strays.

    A parameter that comes out at or below zero (latency under the noise, or no growth with size over
    a narrow range) is floored at 1e-3 of the scale the data shows and listed in `clamped`.
    """
    x = np.asarray(size_bytes, dtype=np.float64)
    t = np.asarray(time_s, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError("size_bytes and time_s must be 1-D and of equal length")
    if np.unique(x).size < 2:
        raise ValueError("an alpha-beta fit needs at least two distinct message sizes")
    if np.any(x <= 0) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("sizes and times must be positive and finite")
    clamped: list[str] = []
    beta = _bandwidth_slope(x, t)
    if beta <= 0.0:
        beta = _FLOOR_FRACTION * float(np.min(t / x))
        clamped.append("beta")
    alpha = _latency_intercept(x, t)
    if alpha <= 0.0:
        alpha = _FLOOR_FRACTION * float(t.min())
        clamped.insert(0, "alpha")
    errors = _relative_errors(x, t, alpha, beta)
    return LineFit(
        alpha, beta, tuple(clamped), float(np.sqrt(np.mean(errors**2))), float(np.max(np.abs(errors)))
    )


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
    max_rel_error: float = 0.0
    clamped: tuple[str, ...] = ()
    emulated: bool = False
    """True when the library does not run this collective natively (e.g. gloo's reduce-scatter)."""
    noisy_points_dropped: int = 0
    """Points left out because their repeats disagreed by more than NOISY_SPREAD (see fit_table)."""
    burst_alpha_s: float | None = None
    """Latency per call when many calls are in flight at once (the sweep's burst; all-gather only):
    what each of ZeRO-3's back-to-back parameter gathers costs besides its bytes. None: not measured."""
    burst_in_flight: int = 0
    largest_time_s: float | None = None
    """Median time of the largest size fitted (None: a fit recorded before it was kept)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wire_collective(self) -> str:
        """What crosses the wire: an emulated reduce-scatter is an all-reduce (see the module doc)."""
        return "all_reduce" if self.emulated and self.collective == "reduce_scatter" else self.collective

    @property
    def bandwidth_bound(self) -> bool:
        """The sweep reached the bandwidth regime: its largest size spent at least BANDWIDTH_BOUND times
        the latency on bytes. Short of it the slope is read in the transition, where a pipelined ring
        hides part of its latency under the transfer, and under-reads the cost per byte (a 4-host gloo
        all-reduce through 1 Gbit/s links read 1.2 Gbit/s busbw with 2 MiB its largest size)."""
        return self.beta_s_per_byte * self.max_bytes >= BANDWIDTH_BOUND * self.alpha_s

    @property
    def sure_bandwidth_gbps(self) -> float:
        """The busbw the slope may claim, at most: where the sweep stopped short of the bandwidth regime
        (`bandwidth_bound`), the largest size's own busbw (its whole time, latency included, spent on its
        bytes), a rate the link surely reaches; the slope there can read a 200 Mbit/s link as 1.8 Gbit/s
        (4 hosts swept to 512 KiB, all in the latency regime). Otherwise the slope's."""
        if self.bandwidth_bound or not self.largest_time_s:
            return self.bandwidth_gbps
        sure = busbw_gbps(self.wire_collective, self.ranks, self.max_bytes, self.largest_time_s)
        return min(self.bandwidth_gbps, sure)

    @property
    def latency_us(self) -> float:
        return self.alpha_s * 1e6

    @property
    def hop_latency_us(self) -> float:
        """alpha divided by the ring's sequential steps: a per-hop latency comparable across n."""
        return self.latency_us / max(ring_latency_steps(self.wire_collective, self.ranks), 1)

    @property
    def burst_hop_latency_s(self) -> float | None:
        """burst_alpha_s per ring step, like hop_latency_us."""
        if self.burst_alpha_s is None:
            return None
        return self.burst_alpha_s / max(ring_latency_steps(self.wire_collective, self.ranks), 1)

    @property
    def algbw_gbps(self) -> float:
        """Asymptotic algorithm bandwidth 1/beta, GB/s (1e9 bytes/s)."""
        return 1.0 / self.beta_s_per_byte / 1e9

    @property
    def bandwidth_gbps(self) -> float:
        """Asymptotic bus bandwidth (nccl-tests busbw of an infinitely large message), GB/s."""
        return self.algbw_gbps * bus_factor(self.wire_collective, self.ranks)

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
            busbw_factor=bus_factor(self.wire_collective, self.ranks),
            bandwidth_bound=self.bandwidth_bound,
        )
        out.update(extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AlphaBetaFit:
        names = {f for f in cls.__dataclass_fields__ if f != "extra"}  # derived figures are recomputed
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["clamped"] = tuple(kwargs.get("clamped", ()))
        return cls(**kwargs)


def _quiet_points(group: pd.DataFrame) -> pd.DataFrame:
    """Drop points whose repeats disagree wildly (a rank descheduled by another job), if 2 sizes remain."""
    if "time_spread" not in group:
        return group
    quiet = group[group["time_spread"] <= NOISY_SPREAD]
    return quiet if quiet["size_bytes"].nunique() >= 2 else group


def fit_table(table: pd.DataFrame) -> list[AlphaBetaFit]:
    """One AlphaBetaFit per (backend, library, collective, link level, ranks, nodes) in a comm.csv table.

    Rows that failed the correctness check are left out (a wrong result says nothing about speed), and so
    are noisy rows (see _quiet_points). Groups with fewer than two sizes cannot be fitted and are skipped.
    """
    fits: list[AlphaBetaFit] = []
    good = table[table["correct"].astype(bool)]
    in_flight = good["in_flight"].fillna(1) if "in_flight" in good else pd.Series(1, index=good.index)
    bursts, good = good[in_flight > 1], good[in_flight <= 1]
    for key, group in good.groupby(list(FIT_KEYS), sort=True):
        if group["size_bytes"].nunique() < 2:
            continue
        used = _quiet_points(group)
        line = fit_line(used["size_bytes"].to_numpy(), used["time_s"].to_numpy())
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
                n_points=len(used),
                min_bytes=int(used["size_bytes"].min()),
                max_bytes=int(used["size_bytes"].max()),
                rel_rmse=line.rel_rmse,
                max_rel_error=line.max_rel_error,
                clamped=line.clamped,
                emulated=bool(group["emulated"].astype(bool).any()),
                noisy_points_dropped=len(group) - len(used),
                largest_time_s=float(
                    used.loc[used["size_bytes"] == used["size_bytes"].max(), "time_s"].median()
                ),
                **_burst_latency(bursts, values, line.beta_s_per_byte),
            )
        )
    return fits


def _burst_latency(bursts: pd.DataFrame, key: dict[str, Any], beta: float) -> dict[str, Any]:
    """burst_alpha_s for one fit: the time per call of its burst rows less their bytes' share (beta from
    the blocking sweep), floored at zero; nothing when that group had no burst."""
    mine = bursts
    for name, value in key.items():
        mine = mine[mine[name] == value]
    if mine.empty:
        return {}
    per_call = float(np.median(mine["time_s"] - mine["size_bytes"] * beta))
    return {"burst_alpha_s": max(per_call, 0.0), "burst_in_flight": int(mine["in_flight"].max())}


def fits_payload(fits: Iterable[AlphaBetaFit], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document written to comm_fit.json."""
    return {
        "schema": FIT_SCHEMA,
        "model": "time_s = alpha_s + size_bytes * beta_s_per_byte; size_bytes as in nccl-tests "
        "(all-reduce buffer, reduce-scatter input, all-gather output)",
        "method": f"beta: least-squares slope over sizes >= max/{REGIME_SPAN:g}, without the one point "
        f"over {SLOW_OUTLIER:.0%} slower than the line through the others (given 4+ sizes); alpha: least squares in "
        f"relative error, intercept over sizes <= min*{REGIME_SPAN:g}; floored parameters listed in 'clamped'; "
        f"points whose repeats spread over {NOISY_SPREAD:g}x their median left out (noisy_points_dropped)",
        "units": {
            "alpha_s": "seconds",
            "beta_s_per_byte": "seconds per byte",
            "latency_us": "alpha in microseconds",
            "hop_latency_us": "alpha / ring steps (2(n-1) all-reduce and emulated reduce-scatter, n-1 "
            "otherwise), microseconds",
            "burst_alpha_s": "latency per call with burst_in_flight calls started before waiting, seconds",
            "algbw_gbps": "1 / beta in GB/s, G = 1e9 bytes (nccl-tests unit, not gigabits)",
            "bandwidth_gbps": "asymptotic busbw = algbw_gbps * busbw_factor, GB/s (1e9 bytes/s); an "
            "emulated reduce-scatter takes the all-reduce's factor",
            "bandwidth_bound": f"the largest size's bytes took >= {BANDWIDTH_BOUND:g}x alpha (else the busbw "
            "may over-read: the sweep stopped in the latency-to-bandwidth transition)",
            "rel_rmse": "root mean square of (fit - measured) / measured over all sizes",
            "max_rel_error": "largest |fit - measured| / measured; high when the transport changes regime",
        },
        "meta": meta or {},
        "fits": [fit.to_dict() for fit in fits],
    }


def load_fits(path: Path) -> list[AlphaBetaFit]:
    """Read the fits back from a comm_fit.json file."""
    data = read_user_json(path, "the link fits")  # a FIFO or a device: named, never read for ever
    if not isinstance(data, dict) or data.get("schema") != FIT_SCHEMA:
        schema = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise UserError(
            f"{path}: not a comm_fit.json this version reads (schema {schema!r}, not {FIT_SCHEMA}); rerun sdzero comm"
        )
    try:
        return [AlphaBetaFit.from_dict(item) for item in data["fits"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"{path}: not a comm_fit.json this version reads (a fit without its fields: {exc!r}); rerun sdzero comm"
        ) from None


def is_positive_finite(value: float) -> bool:
    return math.isfinite(value) and value > 0.0
