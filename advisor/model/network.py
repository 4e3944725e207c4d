"""The target cluster's network: the link inside a node and the link between nodes, as alpha-beta figures.

Inside a node the figures are measured (`sdzero comm` on this machine, comm_fit.json). Between nodes they
are measured when a hostfile with several hosts was benchmarked (link level `inter`), else described by
the user (--inter-node-gbps, --inter-node-latency-us) or by a named preset. Bandwidths here are bus
bandwidths in bytes/s (nccl-tests' busbw: the per-link rate that does not depend on the group size), and
latencies are per ring hop in seconds.

How a collective crosses the nodes depends on the library (`CollectiveAlgorithm`): NCCL follows the
topology (within the node, then across nodes on the node's share), gloo knows no hosts and runs every
collective as one ring over all ranks in rank order. The measured inter-node link's library says which;
a preset or described link is a GPU cluster's, costed as NCCL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from advisor.measure.alphabeta import AlphaBetaFit, load_fits
from advisor.model.gpu_catalogue import GPUS
from sdzero.errors import UserError

GB = 1e9


@dataclass(frozen=True)
class Preset:
    line_gbit_s: float
    busbw_gbyte_s: float
    """Per NIC: the bus bandwidth nccl-tests reach through one NIC of this kind, not the line rate."""
    hop_latency_us: float
    source: str
    nics_per_node: int = 1
    """NICs a node's ranks spread their inter-node traffic over (rail-optimised nodes: one per GPU)."""


# Where the figures come from:
# [nic-200] NCCL's maintainer, NVIDIA/nccl-tests#119 (2022-11-17): "24GB/s is the peak performance per
#   200G NIC (12 GB/s for 100G NICs)"; the thread's 4 x HDR nodes measure 95-96 GB/s busbw (= 4 x 24).
# [nic-400] NVIDIA, NVIDIA/nccl-tests#267 (2025-01-23): "CX-7 NICs at NDR rate (400Gbps) should achieve
#   up to 48-49GB/s per NIC".
# [hop] NCCL's tuning model (src/graph/tuning.cc, hwLat[NET][Ring][Simple]) charges 6.6-9.6 us per
#   network hop on top of an 8.4 us base; 14 us per hop (base and hop together) is used here for IB.
# [dgx] NVIDIA's DGX A100 and DGX H100 user guides: 8 single-port compute NICs per node, one per GPU
#   (ConnectX-6 HDR 200 Gb/s on A100, ConnectX-7 NDR 400 Gb/s on H100): rail-optimised.
# [eth] No measured source: Ethernet over TCP sockets (no RDMA) is assumed at ~90% of line rate with a
#   few times IB's latency. Measure the real link instead (`sdzero comm --hostfile`, or `advise --hostfile`).
PRESETS: dict[str, Preset] = {
    "ib-100": Preset(100, 12.0, 14.0, "HDR100 InfiniBand, 1 NIC: 12 GB/s [nic-200], 14 us/hop [hop]"),
    "ib-200": Preset(200, 24.0, 14.0, "HDR InfiniBand, 1 NIC: 24 GB/s [nic-200], 14 us/hop [hop]"),
    "ib-400": Preset(400, 48.0, 14.0, "NDR InfiniBand, 1 NIC: 48 GB/s [nic-400], 14 us/hop [hop]"),
    "dgx-a100": Preset(
        200, 24.0, 14.0, "DGX A100: 8 x HDR 200G, one per GPU [dgx], 24 GB/s each [nic-200]", 8
    ),
    "dgx-h100": Preset(
        400, 48.0, 14.0, "DGX H100: 8 x NDR 400G, one per GPU [dgx], 48 GB/s each [nic-400]", 8
    ),
    "eth-25": Preset(25, 2.8, 50.0, "25 GbE over TCP, 1 NIC: assumed 90% of 3.125 GB/s, 50 us/hop [eth]"),
    "eth-100": Preset(100, 11.0, 30.0, "100 GbE over TCP, 1 NIC: assumed 88% of 12.5 GB/s, 30 us/hop [eth]"),
}
"""Sources in the comment above (keys in brackets); advisor.model.network's module doc says how NICs count."""
DEFAULT_PRESET = "ib-200"


@dataclass(frozen=True)
class Machine:
    """A real GPU system: its node (or NVLink domain) and its NICs, each figure from the vendor's spec."""

    gpu: str
    """advisor.model.gpu_catalogue.GPUS name of its GPU (memory, and the compute rate)."""
    gpus_per_node: int
    """GPUs in one NVLink domain: the unit the hierarchical collectives treat as a node. A GB200 NVL72 rack
    is one 72-GPU domain; its 4-GPU compute trays are not nodes on the InfiniBand fabric."""
    nvlink_gbyte_s: float
    """NVLink bandwidth per GPU, one direction (the vendor's bidirectional figure halved)."""
    nic_gbit_s: float
    nic_kind: str
    nics_per_node: int
    nic_busbw_gbyte_s: float
    """Bus bandwidth one NIC of this kind reaches in nccl-tests (see PRESETS' sources)."""
    source: str

    @property
    def intra_busbw_gbyte_s(self) -> float:
        """The bus bandwidth collectives reach inside the domain: NVLINK_EFFICIENCY of one direction's rate."""
        return self.nvlink_gbyte_s * NVLINK_EFFICIENCY

    @property
    def fabric(self) -> Preset:
        what = f"{self.source}: {self.nics_per_node} x {self.nic_kind} {self.nic_gbit_s:g}G, {self.nic_busbw_gbyte_s:g} GB/s each"
        return Preset(self.nic_gbit_s, self.nic_busbw_gbyte_s, 14.0, what, self.nics_per_node)


NVLINK_EFFICIENCY = 230.0 / 300.0
"""nccl-tests reach about 230 GB/s busbw on 8 x A100 (docs/advisor.md, section 2d) of NVLink 3's 300 GB/s
per direction; the same share is assumed for the later NVLink generations, whose switches work alike."""
# Sources (vendor pages, checked 2026-12):
# [dgx-a100] NVIDIA DGX A100 user guide: 8 x A100 SXM4, NVLink 3 600 GB/s per GPU through 6 NVSwitches,
#   8 single-port ConnectX-6 HDR 200 Gb/s compute NICs.
# [dgx-h100] NVIDIA DGX H100/H200 user guide and DGX BasePOD reference architecture (docs.nvidia.com,
#   "Core Components"): 8 Hopper GPUs, 4 NVSwitch chips (NVLink 4, 900 GB/s per GPU), four OSFP ports serving
#   eight single-port ConnectX-7 VPI at up to 400 Gb/s InfiniBand (NDR).
# [dgx-b200] NVIDIA DGX B200 user guide (docs.nvidia.com/dgx/dgxb200-user-guide): 8 x B200, 2 NVLink 5
#   switches (14.4 TB/s aggregate = 1.8 TB/s per GPU), 4 OSFP ports for 8 single-port ConnectX-7 at up to
#   400 Gb/s InfiniBand.
# [nvl72] NVIDIA GB200 NVL72 product page: 72 Blackwell GPUs in one NVLink domain (130 TB/s = 72 x 1.8 TB/s)
#   over 18 compute trays of 4 GPUs; scale-out with one 400 Gb/s ConnectX-7 per GPU (DGX GB200 reference
#   architecture).
# [roce] Meta, "Building Meta's GenAI Infrastructure" (2024-03-12): two 24,576-GPU H100 clusters with
#   400 Gbps endpoints per GPU, one on RDMA over Converged Ethernet (RoCE), one on InfiniBand; RoCE assumed at
#   IB's per-NIC busbw [nic-400], which Meta reports tuning both fabrics to match.
MACHINES: dict[str, Machine] = {
    "dgx-a100": Machine("a100-80gb", 8, 300.0, 200, "InfiniBand HDR", 8, 24.0, "DGX A100 [dgx-a100]"),
    "dgx-h100": Machine("h100-80gb", 8, 450.0, 400, "InfiniBand NDR", 8, 48.0, "DGX H100 [dgx-h100]"),
    "hgx-h200": Machine("h200", 8, 450.0, 400, "InfiniBand NDR", 8, 48.0, "DGX/HGX H200 [dgx-h100]"),
    "dgx-b200": Machine("b200", 8, 900.0, 400, "InfiniBand NDR", 8, 48.0, "DGX B200 [dgx-b200]"),
    "gb200-nvl72": Machine(
        "gb200",
        72,
        900.0,
        400,
        "InfiniBand NDR",
        72,
        48.0,
        "GB200 NVL72 rack = one 72-GPU NVLink domain [nvl72]",
    ),
    "h100-roce": Machine(
        "h100-80gb", 8, 450.0, 400, "RoCE Ethernet", 8, 48.0, "8 x H100 SXM, 8 x 400G RoCE [roce]"
    ),
}
"""`--preset` names of whole machines: the NVLink domain, its intra-node link and its NICs (sources above)."""
GPU_MACHINE = {name: gpu.machine for name, gpu in GPUS.items() if gpu.machine is not None}
"""A --target-gpu's usual node, whose NVLink is the intra-node link when no machine preset names it."""


def machine_intra(preset: str | None, target_gpu: str | None) -> tuple[Link, str]:
    """A GPU target's intra-node link from its machine (the preset's, else the GPU's usual node): never a
    measurement of this machine, whose CPU ranks talk through shared memory."""
    name = preset if preset in MACHINES else GPU_MACHINE.get((target_gpu or "").lower())
    if name is None:
        link = Link(ASSUMED_INTRA_GBYTE_S * GB, 3.4e-6, "assumed NVLink-class, no machine named")
        return (
            link,
            "intra-node link of the target assumed: 188 GB/s busbw, 3.4 us per hop (--preset names a machine)",
        )
    m = MACHINES[name]
    source = f"assumed {name} NVLink: {m.nvlink_gbyte_s:g} GB/s per direction x {NVLINK_EFFICIENCY:.0%} ({m.source})"
    note = f"intra-node link of the target: {source}, not this machine's measurement"
    return Link(m.intra_busbw_gbyte_s * GB, 3.4e-6, source), note


ASSUMED_INTRA_GBYTE_S = 188.0
"""An unmeasured node's inside link: conservative for NVLink (nccl-tests threads show ~230 GB/s busbw on
8 x A100 in one node), with NCCL's NVLink ring hop of 3.4 us (tuning.cc hwLat[NVLINK][Ring])."""


@dataclass(frozen=True)
class CollectiveAlgorithm:
    """How a communication library runs a collective over ranks on several nodes."""

    name: str
    hierarchical: bool
    """Within each node first, then across nodes on the node's share of the buffer (NCCL's rings and trees
    follow the topology). False: one ring over all nodes x ranks-per-node ranks in rank order, whose
    every step waits for a hop across nodes, so a node's link carries the W-rank ring's volume."""
    tree_latency: bool
    """An all-reduce's latency may take a tree's 2 ceil(log2 n) steps where fewer than the ring's 2(n-1)
    (NCCL picks its tree for small messages; MPI libraries recursive doubling). False: the ring's steps
    at every size (gloo's all-reduce is a ring: gloo/allreduce.cc)."""


NCCL = CollectiveAlgorithm("nccl", hierarchical=True, tree_latency=True)
GLOO = CollectiveAlgorithm("gloo", hierarchical=False, tree_latency=False)
FLAT_TREE = CollectiveAlgorithm("mpi", hierarchical=False, tree_latency=True)
"""An MPI library's default collectives: no hierarchy unless asked for, recursive doubling when small."""


def algorithm_for(library: str) -> CollectiveAlgorithm:
    """The algorithm of a library as comm_fit.json names it (gloo, nccl, "Open MPI 4.1.4", ...)."""
    name = library.lower()
    if name.startswith(("nccl", "rccl")):
        return NCCL
    if name.startswith("gloo"):
        return GLOO
    return FLAT_TREE


@dataclass(frozen=True)
class CollectiveFigures:
    """One collective's own figures on a link, where `sdzero comm` measured them."""

    collective: str
    busbw_bytes_s: float
    hop_latency_s: float
    burst_hop_latency_s: float | None = None
    """Per call and hop when many calls are in flight at once (a measured burst), else None."""
    emulated: bool = False
    """The library runs it as another collective (gloo's reduce-scatter is a whole all-reduce): it is
    costed as that one (ring steps and bus volume), see `costed_as`."""
    probe_ranks: int = 0
    """The ranks the probe ran it over (0: not measured)."""

    @property
    def costed_as(self) -> str:
        """The collective whose steps and volume this one really takes on the wire."""
        return "all_reduce" if self.emulated and self.collective == "reduce_scatter" else self.collective


@dataclass(frozen=True)
class Link:
    busbw_bytes_s: float
    hop_latency_s: float
    source: str
    per_collective: tuple[CollectiveFigures, ...] = ()
    """Each collective's own figures where it was measured: libraries run the collectives very differently
    (gloo's all-gather reaches two thirds of its all-reduce's bus bandwidth, and it runs reduce-scatter as
    a whole all-reduce), so each op is costed with its own fit when there is one."""
    library: str = ""
    """The library that was measured on this link ("" for a preset or described link)."""

    def figures(self, collective: str) -> CollectiveFigures:
        """One collective's figures: its own fit, else the link's (with no burst figure)."""
        for own in self.per_collective:
            if own.collective == collective:
                return own
        return CollectiveFigures(collective, self.busbw_bytes_s, self.hop_latency_s)

    def ring_busbw_bytes_s(self, collective: str, ranks: int) -> float:
        """The bus bandwidth `collective` gets in a ring of `ranks` ranks on this link: its own fit's, except
        gloo's all-gather probed at 2 ranks and costed in a ring of 3 or more, which gets the link's rate.

        At 2 ranks gloo's all-gather (gloo/allgather.cc: both halves of the one chunk posted at once, to
        and from the same peer) reads well below the rate the all-reduce, gloo's pipelined ring, reads on
        the same link, while at 4 ranks all three collectives read the link's rate, and so does a 4-rank
        ring over 2 hosts x 2 ranks (docs/calibration/scaleout-rounds.md). The slower reading is the 2-rank
        exchange's, not the link's: it holds at its own group size only."""
        own = self.figures(collective)
        if (
            self.library.startswith("gloo")
            and own.collective == "all_gather"
            and own.probe_ranks == 2
            and ranks > 2
        ):
            return max(own.busbw_bytes_s, self.figures("all_reduce").busbw_bytes_s)
        return own.busbw_bytes_s


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra: Link
    inter: Link
    """The node's inter-node link: its NICs together (see `scaled_link`)."""
    nics_per_node: int = 1
    algorithm: CollectiveAlgorithm = NCCL
    """How collectives cross the nodes (see the module doc)."""

    def describe(self) -> str:
        return (
            f"{self.gpus_per_node} ranks per node; intra-node {self.intra.busbw_bytes_s / GB:.2f} GB/s, "
            f"{self.intra.hop_latency_s * 1e6:.1f} us/hop ({self.intra.source}); inter-node "
            f"{self.inter.busbw_bytes_s / GB:.2f} GB/s, {self.inter.hop_latency_s * 1e6:.1f} us/hop "
            f"({self.inter.source})"
        )


def scaled_link(link: Link, nics: int, gpus_per_node: int) -> Link:
    """A node's inter-node link from one NIC's figures: the hierarchical collectives leave each of the
    node's g ranks 1/g of the buffer to move across nodes, so with one NIC per rank (rail-optimised) the
    g transfers run side by side on their own NICs and the node's bandwidth is min(NICs, g) times one
    NIC's; with fewer NICs than ranks the ranks share them. Latency per hop does not change."""
    rails = max(1, min(nics, gpus_per_node))
    if rails == 1:
        return link
    own = tuple(replace(f, busbw_bytes_s=f.busbw_bytes_s * rails) for f in link.per_collective)
    return replace(
        link,
        busbw_bytes_s=link.busbw_bytes_s * rails,
        source=f"{link.source}; x{rails} NICs",
        per_collective=own,
    )


def link_from_fits(fits: list[AlphaBetaFit], level: str, library: str | None = None) -> Link | None:
    """The median busbw and hop latency over the torch backend's collectives at this link level."""
    chosen = [f for f in fits if f.link_level == level and f.backend == "torch" and f.beta_s_per_byte > 0]
    if library:
        chosen = [f for f in chosen if f.library == library] or chosen
    if not chosen:
        return None
    # A fit whose sweep stopped short of the bandwidth regime gives the rate it surely reached, not its
    # slope (AlphaBetaFit.sure_bandwidth_gbps).
    chosen.sort(key=lambda f: f.sure_bandwidth_gbps)
    mid = chosen[len(chosen) // 2]
    latencies = sorted(f.hop_latency_us for f in chosen)
    own = tuple(
        CollectiveFigures(
            f.collective,
            f.sure_bandwidth_gbps * GB,
            f.hop_latency_us * 1e-6,
            f.burst_hop_latency_s,
            f.emulated,
            f.ranks,
        )
        for f in chosen
    )
    return Link(
        mid.sure_bandwidth_gbps * GB,
        latencies[len(latencies) // 2] * 1e-6,
        f"measured, {mid.library}, comm_fit.json",
        own,
        mid.library,
    )


def build_network(
    comm_fit: Path | None,
    gpus_per_node: int,
    preset: str | None = None,
    inter_node_gbps: float | None = None,
    inter_node_latency_us: float | None = None,
    nics_per_node: int | None = None,
    gpu_target: str | None = None,
) -> tuple[Network, list[str]]:
    """The network to predict with, and notes saying where each figure came from. Preset, described and
    measured inter-node figures are one NIC's (`sdzero comm --hostfile` runs one rank per host); the node's
    link is `nics_per_node` of them (default: the preset's, else 1), see `scaled_link`."""
    if nics_per_node is not None and nics_per_node < 1:
        raise UserError(f"--nics-per-node {nics_per_node}: must be at least 1 (rail-optimised: one per GPU)")
    if gpus_per_node < 1:
        raise UserError(f"--gpus-per-node {gpus_per_node}: must be at least 1")
    if preset is not None and preset not in PRESETS and preset not in MACHINES:
        names = ", ".join(dict.fromkeys([*PRESETS, *MACHINES]))
        raise UserError(f"--preset {preset!r}: unknown; choose from {names}")
    if inter_node_gbps is not None and not inter_node_gbps > 0:
        raise UserError(f"--inter-node-gbps {inter_node_gbps}: must be a positive number of Gbit/s")
    if inter_node_latency_us is not None and not inter_node_latency_us >= 0:
        raise UserError(f"--inter-node-latency-us {inter_node_latency_us}: must be >= 0")
    # present but unreadable is an error, never the same answer as "not measured" (load_fits names it)
    fits = load_fits(comm_fit) if comm_fit and os.path.lexists(comm_fit) else []
    notes: list[str] = []
    intra = None if gpu_target else link_from_fits(fits, "intra")
    if gpu_target:  # trials on another device: its measured link says nothing of the target's NVLink
        intra, note = machine_intra(preset, gpu_target)
        notes.append(note)
    elif intra is None:
        intra = Link(ASSUMED_INTRA_GBYTE_S * GB, 3.4e-6, "assumed NVLink-class, no measurement")
        notes.append("intra-node link not measured: assumed 188 GB/s busbw, 3.4 us per hop")
    measured_inter = link_from_fits(fits, "inter")
    named = (
        PRESETS[preset]
        if preset in PRESETS
        else (MACHINES[preset].fabric if preset else PRESETS[DEFAULT_PRESET])
    )
    algorithm = NCCL
    if measured_inter is not None and preset is None and inter_node_gbps is None:
        inter = measured_inter
        algorithm = algorithm_for(measured_inter.library)
        if not algorithm.hierarchical and gpus_per_node > 1:
            notes.append(
                f"inter-node link measured with {measured_inter.library}, which runs each collective as one "
                f"ring over all ranks: large ops are costed as a ring of nodes x {gpus_per_node} ranks across nodes"
            )
        thin = [f.collective for f in fits if f.link_level == "inter" and not f.bandwidth_bound]
        if thin:
            notes.append(
                "inter-node sweep stopped before the bandwidth regime for "
                + ", ".join(sorted(set(thin)))
                + " (its largest size spent less on bytes than twice the latency): costed at the busbw that "
                "size reached, a lower bound; probe larger sizes (sdzero comm --max-bytes, a longer --budget-s)"
            )
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
            notes.append(
                f"inter-node link neither measured nor described: assumed preset {DEFAULT_PRESET} "
                "(pass --hostfile, --preset or --inter-node-gbps)"
            )
        inter = Link(bandwidth, latency, what)
    nics = nics_per_node or (named.nics_per_node if preset is not None and inter_node_gbps is None else 1)
    if nics > gpus_per_node:
        notes.append(f"{nics} NICs per node but {gpus_per_node} ranks: only {gpus_per_node} carry traffic")
    return Network(gpus_per_node, intra, scaled_link(inter, nics, gpus_per_node), nics, algorithm), notes
