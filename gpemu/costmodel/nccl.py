"""How NCCL runs a collective over a cluster's links, and what it costs (a pure formula library).

    from gpemu.costmodel.nccl import CommPath, nccl_cost
    path = CommPath.of(cluster, [0, 0, 0, 0, 1, 1, 1, 1])    # the node of each rank of the group
    cost = nccl_cost(Collective.ALL_REDUCE, 1 << 30, path)    # CommCost(seconds, algorithm, protocol, ...)

NCCL prices every (algorithm, protocol) pair it may use and runs the fastest one
(``ncclTopoGetAlgoTime`` in NCCL's ``src/graph/tuning.cc``: ``latency + bytes / bandwidth``); so
does this module, with the same structure and its own calibrated constants (:class:`Constants`):

* **algorithms**: a *ring* over every rank (inside a node over NVLink or PCIe, between nodes over
  the NICs); a *tree* between nodes (a chain inside each node, binary trees across nodes: fewer
  network steps, so lower latency at scale); *NVLS* (NVLink SHARP: the NVSwitch reduces and
  multicasts, one node of Hopper or later) and *NVLS-tree* (NVLS inside the nodes, a tree between
  them); *direct* point-to-point sends (all-to-all, scatter, gather, send/recv);
* **protocols**: *LL* (8-byte flag+data stores: the lowest latency, a quarter of the bandwidth),
  *LL128* (128-byte lines: near full bandwidth on NVLink, mid latency) and *Simple* (full
  bandwidth, the highest latency per step): small messages are latency-bound (LL wins), large
  ones bandwidth-bound (Simple wins);
* **the slowest link on the path**: a ring's bus bandwidth is the least of the fabric's (per GPU)
  and the network's (per node: its NICs, a slow link's when one is described there, divided by
  the fat tree's oversubscription once the group spans more than a leaf); hierarchical algorithms
  take the least of their intra-node and inter-node phases.

Bandwidths here are nccl-tests' *bus* bandwidth (``busbw``): the algorithm bandwidth ``size /
time`` times :func:`bus_factor` (``2 (n-1)/n`` for an all-reduce), which makes one number
comparable across world sizes. Calibration: ``benchmarks/comm_vs_nccl_tests.py`` (the published
nccl-tests tables it was fitted to, and others it was not).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .gpus import find_gpu
from .topology import Cluster, NodeFabric

__all__ = [
    "Algorithm",
    "NcclProtocol",
    "CommPath",
    "CommCost",
    "Constants",
    "CONSTANTS",
    "nccl_cost",
    "bus_factor",
    "KIND_NAMES",
]


class Algorithm(enum.Enum):
    RING = "ring"
    TREE = "tree"
    NVLS = "nvls"
    NVLS_TREE = "nvls_tree"
    DIRECT = "direct"


class NcclProtocol(enum.Enum):
    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


# Collective names as :class:`gpemu.costmodel.comm.Collective` values: nccl.py is below comm.py.
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"
BROADCAST, REDUCE, SCATTER, GATHER, ALL_TO_ALL, SEND = (
    "broadcast",
    "reduce",
    "scatter",
    "gather",
    "all_to_all",
    "send",
)
KIND_NAMES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, REDUCE, SCATTER, GATHER, ALL_TO_ALL, SEND)
_US = 1e-6


def bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests' ``busbw / algbw`` for ``kind`` among ``ranks`` (its ``*_perf`` sources)."""
    n = max(ranks, 1)
    if kind == ALL_REDUCE:
        return 2 * (n - 1) / n
    if kind in (REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL, SCATTER, GATHER):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class Constants:
    """NCCL's behaviour on real hardware, as fractions of the links' rates and as latencies.

    The bandwidth shares are fitted to published nccl-tests tables (see the module docstring);
    the latencies start from NCCL's own tuning tables (``baseLat`` / ``hwLat``, microseconds) and
    are scaled by the same fit. One set serves every cluster: no constant belongs to one system."""

    nvlink_share: float = 0.80  # ring/Simple bus bandwidth / NVLink per direction (A100 ~235 of 300)
    pcie_share: float = 0.80  # peer to peer under one PCIe switch
    cpu_share: float = 0.65  # a ring through the CPU's root complex (H100 PCIe: 35-45 GB/s of 63)
    host_memory_share: float = 0.5  # no peer to peer: every byte crosses PCIe twice (to host, back)
    nvls_share: float = 0.69  # NVLS algorithm bandwidth / (NVLink x n/(n+1)) (H100: ~275 GB/s)
    nvls_tree_share: float = 0.935  # NVLS-tree over NVLS alone (two H200 nodes: ~258 of ~276 GB/s)
    tree_network_share: float = 0.37  # a tree's algorithm bandwidth / the node's NICs (fitted)
    all_to_all_share: float = 0.75  # direct sends over NVLink (A100 all-to-all ~224 of 300)
    ll128_share: float = 0.92  # LL128 / Simple bandwidth (NCCL: 120 of 128 bytes carry data)
    ll_share: float = 0.25  # LL / Simple bandwidth (NCCL: 8-byte stores, half of them flags)
    nic_share: Mapping[str, float] = field(
        default_factory=lambda: {"ib": 0.93, "roce": 0.93, "efa": 0.80, "ethernet": 0.45}
    )
    # Latencies, microseconds: per collective (base) and per step over each kind of hardware.
    base_us: Mapping[tuple[Algorithm, NcclProtocol], float] = field(
        default_factory=lambda: {
            (Algorithm.RING, NcclProtocol.LL): 6.6,
            (Algorithm.RING, NcclProtocol.LL128): 14.0,
            (Algorithm.RING, NcclProtocol.SIMPLE): 8.4,
            (Algorithm.TREE, NcclProtocol.LL): 6.8,
            (Algorithm.TREE, NcclProtocol.LL128): 14.0,
            (Algorithm.TREE, NcclProtocol.SIMPLE): 8.4,
            (Algorithm.NVLS, NcclProtocol.SIMPLE): 25.0,
            (Algorithm.NVLS_TREE, NcclProtocol.SIMPLE): 25.0,
            (Algorithm.DIRECT, NcclProtocol.SIMPLE): 8.4,
        }
    )
    step_us: Mapping[tuple[str, NcclProtocol], float] = field(
        default_factory=lambda: {
            ("nvlink", NcclProtocol.LL): 0.6,
            ("nvlink", NcclProtocol.LL128): 1.9,
            ("nvlink", NcclProtocol.SIMPLE): 3.4,
            ("pcie", NcclProtocol.LL): 1.0,
            ("pcie", NcclProtocol.LL128): 2.5,
            ("pcie", NcclProtocol.SIMPLE): 5.7,
            # NCCL's network steps (2.7 / 4.0 / 14.0) x 5.36: the two-node tables' small sizes
            ("net", NcclProtocol.LL): 14.5,
            ("net", NcclProtocol.LL128): 21.5,
            ("net", NcclProtocol.SIMPLE): 75.0,
        }
    )
    latency_scale: float = 0.73  # all latencies but the launch (fitted: NCCL's tables rank choices, not time)
    nvls_setup_us: float = 74.0  # NVLS's fixed cost (multicast objects, memory barriers; fitted)
    nvls_tree_setup_us: float = 172.0  # NVLS-tree's (the same, and the network's proxy threads; fitted)
    # A collective's launch and completion on the GPU, by generation (the smallest messages' times
    # in the reference tables: ~35 us on A100 systems, ~13 us on H100 ones).
    launch_us: Mapping[str, float] = field(default_factory=lambda: {"ampere": 41.0, "hopper": 11.0})
    # LL's bus bandwidth ceiling, GB/s, by generation, on one node / two / more (NCCL tuning.cc
    # ``llMaxBws``: Volta, Ampere, Hopper rows).
    ll_max_busbw: Mapping[str, tuple[float, float, float]] = field(
        default_factory=lambda: {
            "volta": (39.0, 39.0, 20.4),
            "ampere": (87.7, 22.5, 19.0),
            "hopper": (141.0, 45.0, 35.0),
        }
    )


CONSTANTS = Constants()
_GENERATION_FALLBACK = "ampere"  # a GPU of an unknown generation: NCCL's Ampere figures


@dataclass(frozen=True)
class CommPath:
    """What the ranks of one collective have between them.

    ``ranks`` over ``nodes`` nodes, at most ``per_node`` on one node; ``intra`` is the per-rank
    bus bandwidth of a ring inside a node (Simple protocol; inf with one rank per node) and its
    hardware (``nvlink`` / ``pcie``); ``net`` the per-node bus bandwidth of a ring between nodes
    (the slowest node's NICs usable by the group, over the oversubscription; inf on one node);
    ``nic`` one NIC's rate on the slowest node; ``nvls_bandwidth`` NVLS's algorithm bandwidth
    inside a node (0: no NVLS); ``generation`` the GPUs' architecture (NCCL tunes by it)."""

    ranks: int
    nodes: int
    per_node: int
    intra: float
    intra_hw: str
    net: float
    nic: float
    nvls_bandwidth: float
    link: float  # one GPU's fabric rate per direction
    nvlink: bool
    net_kind: str = ""
    generation: str = _GENERATION_FALLBACK

    @classmethod
    def of(cls, cluster: Cluster, rank_nodes: Sequence[int], constants: Constants = CONSTANTS) -> CommPath:
        """The path of a group whose rank ``i`` is on node ``rank_nodes[i]`` of ``cluster``."""
        counts: dict[int, int] = {}
        for node in rank_nodes:
            counts[node] = counts.get(node, 0) + 1
        ranks, nodes = len(rank_nodes), max(len(counts), 1)
        per_node = max(counts.values(), default=1)
        fabric = cluster.fabric
        intra, hw = _intra(fabric, per_node, constants)
        net, nic, kind = math.inf, math.inf, ""
        if nodes > 1 and cluster.network is not None:
            network = cluster.network
            kind = network.nic
            share = constants.nic_share.get(network.nic, 0.5)
            used = max(1, min(network.nics_per_node, round(network.nics_per_node * per_node / cluster.gpus_per_node)))
            slowest = min(cluster.nic_bandwidth(node) for node in counts)
            spine = network.oversubscription if nodes > network.nodes_per_leaf else 1.0
            net = share * used * slowest / spine
            nic = share * slowest / spine
        nvls = 0.0
        if fabric.nvls and per_node > 2:
            nvls = constants.nvls_share * fabric.link_bandwidth * per_node / (per_node + 1)
        sheet = find_gpu(cluster.gpu)
        generation = sheet.generation if sheet is not None else _GENERATION_FALLBACK
        link = fabric.link_bandwidth
        return cls(ranks, nodes, per_node, intra, hw, net, nic, nvls, link, fabric.over_nvlink, kind, generation)


def _intra(fabric: NodeFabric, per_node: int, c: Constants) -> tuple[float, str]:
    """A ring's per-rank bus bandwidth inside one node, and the hardware it crosses."""
    if per_node <= 1:
        return math.inf, "nvlink" if fabric.over_nvlink else "pcie"
    if fabric.fabric == "nvswitch":
        return c.nvlink_share * fabric.link_bandwidth, "nvlink"
    if not fabric.p2p:
        return c.cpu_share * c.host_memory_share * fabric.link_bandwidth, "pcie"
    under_one_switch = per_node <= max(fabric.gpus_per_pcie_switch, 1)
    return (c.pcie_share if under_one_switch else c.cpu_share) * fabric.link_bandwidth, "pcie"


@dataclass(frozen=True)
class CommCost:
    """One collective's time, how NCCL would run it, and over which links."""

    seconds: float
    algorithm: Algorithm
    protocol: NcclProtocol
    links: str  # "nvlink", "pcie", "nvlink+ib", ... (what the span and the summary name)
    busbw: float  # nccl-tests' bus bandwidth at this size (bytes/s)


def nccl_cost(kind: str, nbytes: int, path: CommPath, constants: Constants = CONSTANTS) -> CommCost:
    """The fastest way NCCL has to run collective ``kind`` (a :data:`KIND_NAMES` value) of
    ``nbytes`` (as ``gpemu.costmodel.comm.Collective`` counts them) over ``path``."""
    if kind not in KIND_NAMES:
        raise ValueError(f"nccl_cost: kind must be one of {', '.join(KIND_NAMES)}, got {kind!r}")
    links = _links(path)
    if nbytes <= 0 or (path.ranks <= 1 and kind != SEND):
        return CommCost(0.0, Algorithm.RING, NcclProtocol.SIMPLE, links, 0.0)
    options = _options(kind, float(nbytes), path, constants)
    best = min(options, key=lambda o: o.seconds)
    busbw = nbytes * bus_factor(kind, path.ranks) / best.seconds if best.seconds > 0 else 0.0
    return CommCost(best.seconds, best.algorithm, best.protocol, links, busbw)


def _links(path: CommPath) -> str:
    inside = "nvlink" if path.nvlink else "pcie"
    if path.nodes <= 1:
        return inside
    between = path.net_kind or "net"
    return between if path.per_node <= 1 else f"{inside}+{between}"


class _Option(NamedTuple):
    seconds: float
    algorithm: Algorithm
    protocol: NcclProtocol


def _options(kind: str, size: float, p: CommPath, c: Constants) -> list[_Option]:
    if kind in (ALL_TO_ALL, SCATTER, GATHER, SEND):
        return [_direct(kind, size, p, c)]
    options = [_ring(kind, size, p, c, proto) for proto in _protocols(p)]
    if kind == ALL_REDUCE:
        if p.nodes > 1:
            options += [_tree(size, p, c, proto) for proto in _protocols(p)]
        if p.nvls_bandwidth > 0:
            options.append(_nvls(size, p, c))
    return options


def _protocols(p: CommPath) -> tuple[NcclProtocol, ...]:
    # NCCL enables LL128 by default only where NVLink carries it (tuning.cc: "other cases are
    # not tested and may cause silent data corruption").
    if p.nvlink:
        return (NcclProtocol.LL, NcclProtocol.LL128, NcclProtocol.SIMPLE)
    return (NcclProtocol.LL, NcclProtocol.SIMPLE)


def _bandwidth(busbw: float, proto: NcclProtocol, p: CommPath, c: Constants) -> float:
    """A protocol's share of ``busbw``; LL capped at NCCL's ceiling for the generation."""
    if proto is NcclProtocol.SIMPLE:
        return busbw
    if proto is NcclProtocol.LL128:
        return busbw * c.ll128_share
    ceilings = c.ll_max_busbw.get(p.generation) or c.ll_max_busbw[_GENERATION_FALLBACK]
    ceiling = ceilings[0 if p.nodes <= 1 else 1 if p.nodes == 2 else 2] * 1e9
    return min(busbw * c.ll_share, ceiling)


def _latency(c: Constants, p: CommPath, algorithm: Algorithm, proto: NcclProtocol, hops: Sequence[_Hops]) -> float:
    """Launch, base latency and per-step latencies (``(hardware, steps)``), in seconds."""
    launch = c.launch_us.get(p.generation, c.launch_us.get(_GENERATION_FALLBACK, 0.0))
    steps = sum(c.step_us[(hw, proto)] * n for hw, n in hops)
    return (launch + (c.base_us.get((algorithm, proto), 0.0) + steps) * c.latency_scale) * _US


_Hops = tuple[str, float]


def _ring(kind: str, size: float, p: CommPath, c: Constants, proto: NcclProtocol) -> _Option:
    """A ring over every rank: each rank's bytes pass every link once per half (twice for an
    all-reduce: a reduce-scatter, then an all-gather); broadcast and reduce are a pipelined chain."""
    n, m = p.ranks, p.nodes
    busbw = _bandwidth(min(p.intra, p.net), proto, p, c)
    steps, inter = (2 * (n - 1), 2 * (m - 1)) if kind == ALL_REDUCE else (n - 1, m - 1)
    seconds = _latency(c, p, Algorithm.RING, proto, [(p.intra_hw, steps - inter), ("net", inter)])
    return _Option(seconds + size * bus_factor(kind, n) / busbw, Algorithm.RING, proto)


def _tree(size: float, p: CommPath, c: Constants, proto: NcclProtocol) -> _Option:
    """All-reduce over a chain inside each node and binary trees between nodes."""
    intra_chain = 0.5 * p.intra if p.per_node > 1 else math.inf
    algbw = _bandwidth(min(intra_chain, c.tree_network_share * p.net), proto, p, c)
    hops = [(p.intra_hw, 2 * (p.per_node - 1)), ("net", 2 * math.ceil(math.log2(p.nodes)))]
    return _Option(_latency(c, p, Algorithm.TREE, proto, hops) + size / algbw, Algorithm.TREE, proto)


def _nvls(size: float, p: CommPath, c: Constants) -> _Option:
    """All-reduce by NVLink SHARP (one node), or NVLS inside nodes and a tree between them."""
    simple = NcclProtocol.SIMPLE
    if p.nodes <= 1:
        seconds = _latency(c, p, Algorithm.NVLS, simple, []) + c.nvls_setup_us * c.latency_scale * _US
        return _Option(seconds + size / p.nvls_bandwidth, Algorithm.NVLS, simple)
    algbw = min(c.nvls_tree_share * p.nvls_bandwidth, p.net)
    hops = [("net", 2 * math.ceil(math.log2(p.nodes)))]
    seconds = _latency(c, p, Algorithm.NVLS_TREE, simple, hops) + c.nvls_tree_setup_us * c.latency_scale * _US
    return _Option(seconds + size / algbw, Algorithm.NVLS_TREE, simple)


def _direct(kind: str, size: float, p: CommPath, c: Constants) -> _Option:
    """Point-to-point sends: all-to-all (each rank to every other), scatter / gather (the root to
    / from every other) and send/recv (one rank to one other)."""
    n, g, simple = p.ranks, p.per_node, NcclProtocol.SIMPLE
    link = c.all_to_all_share * p.link if p.nvlink else min(p.intra, c.pcie_share * p.link)
    if kind == SEND:
        hops = [("net", 1)] if p.nodes > 1 else [(p.intra_hw, 1)]
        seconds = size / (p.nic if p.nodes > 1 else link)
        return _Option(_latency(c, p, Algorithm.DIRECT, simple, hops) + seconds, Algorithm.DIRECT, simple)
    # Each rank sends (n-1)/n of ``size`` (all-to-all), or the root sends / receives it (scatter,
    # gather): the part for its own node over the fabric, the rest through its node's NICs.
    inside = size * (g - 1) / n / link if g > 1 else 0.0
    senders = g if kind == ALL_TO_ALL else 1
    outside = senders * size * (n - g) / n / p.net if p.nodes > 1 else 0.0
    hops = [(p.intra_hw, 1)] + ([("net", 1)] if p.nodes > 1 else [])
    return _Option(_latency(c, p, Algorithm.DIRECT, simple, hops) + max(inside, outside), Algorithm.DIRECT, simple)
