"""The target cluster's network: the link inside a node and the link between nodes, as alpha-beta figures.

Inside a node the figures are measured (`sdzero comm` on this machine, comm_fit.json). Between nodes they
are measured when a hostfile with several hosts was benchmarked (link level `inter`), else described by
the user (--inter-node-gbps, --inter-node-latency-us) or by a named preset. Bandwidths here are bus
bandwidths in bytes/s (nccl-tests' busbw: the per-link rate that does not depend on the group size), and
latencies are per ring hop in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from advisor.model.alphabeta import AlphaBetaFit, load_fits
from sdzero.errors import UserError

GB = 1e9


@dataclass(frozen=True)
class Preset:
    line_gbit_s: float
    busbw_gbyte_s: float
    hop_latency_us: float
    source: str


PRESETS: dict[str, Preset] = {
    # One NIC per node. busbw is the achieved rate nccl-tests threads report, not the line rate; latency is
    # NCCL's own default per network hop (src/graph/tuning.cc, ~14 us) for InfiniBand.
    "ib-100": Preset(100, 11.5, 14.0, "HDR100 InfiniBand: ~92% of 12.5 GB/s line rate"),
    "ib-200": Preset(200, 22.5, 14.0, "HDR InfiniBand: 86-91 GB/s busbw over 4 HDR NICs in nccl-tests, /4"),
    "ib-400": Preset(400, 47.0, 14.0, "NDR InfiniBand: 46-48 GB/s busbw per NDR NIC in nccl-tests"),
    # Ethernet: RoCE-less TCP sockets reach ~90% of line rate with a few times InfiniBand's latency.
    "eth-25": Preset(25, 2.8, 50.0, "25 GbE, TCP: ~90% of 3.125 GB/s line rate, ~50 us per hop"),
    "eth-100": Preset(100, 11.0, 30.0, "100 GbE (RoCE): ~88% of 12.5 GB/s line rate, ~30 us per hop"),
}
DEFAULT_PRESET = "ib-200"


@dataclass(frozen=True)
class CollectiveFigures:
    """One collective's own figures on a link, where `sdzero comm` measured them."""

    collective: str
    busbw_bytes_s: float
    hop_latency_s: float
    burst_hop_latency_s: float | None = None
    """Per call and hop when many calls are in flight at once (a measured burst), else None."""


@dataclass(frozen=True)
class Link:
    busbw_bytes_s: float
    hop_latency_s: float
    source: str
    per_collective: tuple[CollectiveFigures, ...] = ()
    """Each collective's own figures where it was measured: libraries run the collectives very differently
    (gloo's all-gather reaches two thirds of its all-reduce's bus bandwidth, and it runs reduce-scatter as
    a whole all-reduce), so each op is costed with its own fit when there is one."""

    def figures(self, collective: str) -> CollectiveFigures:
        """One collective's figures: its own fit, else the link's (with no burst figure)."""
        for own in self.per_collective:
            if own.collective == collective:
                return own
        return CollectiveFigures(collective, self.busbw_bytes_s, self.hop_latency_s)


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra: Link
    inter: Link

    def describe(self) -> str:
        return (f"{self.gpus_per_node} ranks per node; intra-node {self.intra.busbw_bytes_s / GB:.2f} GB/s, "
                f"{self.intra.hop_latency_s * 1e6:.1f} us/hop ({self.intra.source}); inter-node "
                f"{self.inter.busbw_bytes_s / GB:.2f} GB/s, {self.inter.hop_latency_s * 1e6:.1f} us/hop "
                f"({self.inter.source})")  # fmt: skip


def link_from_fits(fits: list[AlphaBetaFit], level: str, library: str | None = None) -> Link | None:
    """The median busbw and hop latency over the torch backend's collectives at this link level."""
    chosen = [f for f in fits if f.link_level == level and f.backend == "torch" and f.beta_s_per_byte > 0]
    if library:
        chosen = [f for f in chosen if f.library == library] or chosen
    if not chosen:
        return None
    chosen.sort(key=lambda f: f.bandwidth_gbps)
    mid = chosen[len(chosen) // 2]
    latencies = sorted(f.hop_latency_us for f in chosen)
    own = tuple(
        CollectiveFigures(f.collective, f.bandwidth_gbps * GB, f.hop_latency_us * 1e-6, f.burst_hop_latency_s)
        for f in chosen
    )
    return Link(mid.bandwidth_gbps * GB, latencies[len(latencies) // 2] * 1e-6,
                f"measured, {mid.library}, comm_fit.json", own)  # fmt: skip


def build_network(
    comm_fit: Path | None,
    gpus_per_node: int,
    preset: str | None = None,
    inter_node_gbps: float | None = None,
    inter_node_latency_us: float | None = None,
) -> tuple[Network, list[str]]:
    """The network to predict with, and notes saying where each figure came from."""
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    if preset is not None and preset not in PRESETS:
        raise UserError(f"--preset {preset!r}: unknown; choose from {', '.join(PRESETS)}")
    if inter_node_gbps is not None and not inter_node_gbps > 0:
        raise UserError(f"--inter-node-gbps {inter_node_gbps}: must be a positive number of Gbit/s")
    if inter_node_latency_us is not None and not inter_node_latency_us >= 0:
        raise UserError(f"--inter-node-latency-us {inter_node_latency_us}: must be >= 0")
    fits = load_fits(comm_fit) if comm_fit and comm_fit.is_file() else []
    notes: list[str] = []
    intra = link_from_fits(fits, "intra")
    if intra is None:
        intra = Link(PRESETS["ib-400"].busbw_gbyte_s * GB * 4, 3.4e-6, "assumed NVLink-class, no measurement")
        notes.append("intra-node link not measured: assumed 188 GB/s busbw, 3.4 us per hop")
    measured_inter = link_from_fits(fits, "inter")
    named = PRESETS[preset or DEFAULT_PRESET]
    if measured_inter is not None and preset is None and inter_node_gbps is None:
        inter = measured_inter
    else:
        bandwidth = inter_node_gbps / 8 * GB if inter_node_gbps else named.busbw_gbyte_s * GB
        latency = (
            inter_node_latency_us * 1e-6 if inter_node_latency_us is not None else named.hop_latency_us * 1e-6
        )
        what = (
            "described by --inter-node-gbps/--inter-node-latency-us"
            if inter_node_gbps
            else f"preset {preset or DEFAULT_PRESET} ({named.source})"
        )
        if preset is None and inter_node_gbps is None:
            notes.append(f"inter-node link neither measured nor described: assumed preset {DEFAULT_PRESET} "
                         "(pass --hostfile, --preset or --inter-node-gbps)")  # fmt: skip
        inter = Link(bandwidth, latency, what)
    return Network(gpus_per_node, intra, inter), notes
