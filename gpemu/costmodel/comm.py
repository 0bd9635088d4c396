"""Communication time between GPUs: what a collective costs (a pure formula library).

    from gpemu.costmodel.comm import Collective, collective_cost, CommPath
    path = CommPath.of(cluster, rank_nodes)      # a gpemu.costmodel.topology.Cluster, each rank's node
    collective_cost(Collective.ALL_REDUCE, 100 << 20, path)     # CommCost(seconds, algorithm, ...)
    overlapped_seconds(comm, compute, k)          # both at once on one GPU (Morphling's form)

:func:`collective_cost` is NCCL's choice of algorithm and protocol over a cluster's links
(:mod:`.nccl`, topologies in :mod:`.topology`). The older single-link form stays for a caller
without a cluster: :func:`collective_seconds` over a :class:`Link` (:func:`gpu_link`) is NCCL's
ring over one link per GPU model (NVLink where it joins every GPU of a node, else PCIe), ``n``
ranks, ``b`` bytes, bus bandwidth ``bw``, per-step latency ``a``:

* all-reduce: ``2 (n-1)/n * b / bw + 2 (n-1) * a`` (a reduce-scatter, then an all-gather);
* reduce-scatter, all-gather, broadcast, reduce, scatter, gather, all-to-all: half of that, of the
  bytes :class:`Collective` names for each;
* point to point (send/recv): ``b / bw + a``, whatever the world size.

**Overlap.** Communication on one stream beside computation on another shares the GPU: NCCL's
kernels take SMs and memory bandwidth the computation wanted. Morphling's form (Wang et al.,
"Morphling", the overlap model of issue 30) prices the two together as ``f(Tx, Ty) = (Tx^k +
Ty^k)^(1/k)``: ``k = 1`` serialises them (two transfers sharing one link's bandwidth), ``k -> inf``
overlaps them perfectly; :func:`overlapped_seconds`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .gpus import find_gpu
from .nccl import Algorithm, CommCost, CommPath, NcclProtocol, bus_factor, nccl_cost

__all__ = [
    "Collective",
    "CommPath",
    "CommCost",
    "Algorithm",
    "NcclProtocol",
    "collective_cost",
    "busbw_factor",
    "overlapped_seconds",
    "overlap_penalty",
    "Link",
    "GpuLinkFacts",
    "collective_seconds",
    "gpu_link",
    "gradient_buckets",
    "overlapped_all_reduce_end",
    "RING_STEP_LATENCY",
    "NCCL_NVLINK_FRACTION",
    "NVLINK_BUS_BANDWIDTH_BY_FORM",
    "UNKNOWN_LINK_BANDWIDTH",
]

# Seconds per ring step: NCCL's small-message latency within a node.
RING_STEP_LATENCY = 8e-6
# NCCL's all-reduce bus bandwidth within a node reaches about 80% of the NVLink bandwidth per
# direction (the datasheet's total / 2): nccl-tests on DGX A100 ~230 of 300 GB/s, on H100 SXM
# ~360-370 of 450 GB/s.
NCCL_NVLINK_FRACTION = 0.8
# For a GPU whose NVLink figure is unknown (a database row without it, e.g. one added by hand): the
# bus bandwidth nccl-tests' all-reduce reaches within one node, by the name's form factor (DGX-1
# V100 SXM2 ~130 GB/s, DGX A100 SXM4 ~230, DGX H100 SXM5 ~360). Not datasheet figures, so the
# database does not carry them.
NVLINK_BUS_BANDWIDTH_BY_FORM: tuple[tuple[str, float], ...] = (("SXM4", 230e9), ("SXM5", 360e9), ("SXM2", 130e9))
# A GPU whose host link is unknown: PCIe 3.0 x16's pinned copy rate, bytes/s.
UNKNOWN_LINK_BANDWIDTH = 12e9


class Collective(enum.Enum):
    """A collective, and what the ``nbytes`` of :func:`collective_seconds` counts for it."""

    ALL_REDUCE = "all_reduce"  # the tensor
    REDUCE_SCATTER = "reduce_scatter"  # the full input (every rank's share)
    ALL_GATHER = "all_gather"  # the gathered output (every rank's share)
    BROADCAST = "broadcast"  # the tensor
    REDUCE = "reduce"  # the tensor
    SCATTER = "scatter"  # every rank's share together
    GATHER = "gather"  # every rank's share together
    ALL_TO_ALL = "all_to_all"  # what one rank sends in all (a share (n-1)/n leaves the GPU)
    SEND = "send"  # the tensor, one rank to one other (point to point)


# The ring's halves: each moves (n-1)/n of its bytes once, where an all-reduce moves them twice.
_HALF_RING = frozenset(
    {
        Collective.REDUCE_SCATTER,
        Collective.ALL_GATHER,
        Collective.BROADCAST,
        Collective.REDUCE,
        Collective.SCATTER,
        Collective.GATHER,
        Collective.ALL_TO_ALL,
    }
)


@dataclass(frozen=True)
class Link:
    """One GPU-to-GPU path: the bus bandwidth a ring reaches over it (bytes/s) and its latency per
    step (seconds)."""

    bandwidth: float
    latency: float = RING_STEP_LATENCY

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"Link.bandwidth must be a positive number of bytes/s, got {self.bandwidth!r}")
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"Link.latency must be a number of seconds >= 0, got {self.latency!r}")


def collective_seconds(kind: Collective, nbytes: int, world_size: int, link: Link) -> float:
    """Seconds ``kind`` takes among ``world_size`` GPUs over ``link``, ``nbytes`` as
    :class:`Collective` says for the kind. Nothing to exchange (one rank, no bytes): 0."""
    if not isinstance(kind, Collective):
        valid = ", ".join(c.name for c in Collective)
        raise ValueError(f"collective_seconds: kind must be a Collective ({valid}), got {kind!r}")
    if kind is Collective.SEND:
        return nbytes / link.bandwidth + link.latency
    if world_size <= 1 or nbytes <= 0:
        return 0.0
    n = world_size
    all_reduce = 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency
    return all_reduce / 2 if kind in _HALF_RING else all_reduce


class GpuLinkFacts(Protocol):
    """The facts of a GPU its links come from (``gpemu.db.GpuSpec`` has them)."""

    @property
    def name(self) -> str: ...

    @property
    def host_link_bandwidth_pinned(self) -> float: ...

    @property
    def nvlink_bandwidth(self) -> float | None: ...


def gpu_link(gpu: GpuLinkFacts) -> Link:
    """The GPU-to-GPU path of a node of these GPUs: NVLink where it joins every GPU of the node
    (SXM boards), at :data:`NCCL_NVLINK_FRACTION` of its per-direction bandwidth; else PCIe at
    the host link's pinned rate. A bridge joins two cards only (H100 PCIe, Quadro RTX 6000): a
    ring over more GPUs crosses PCIe, so PCIe. NVLink unknown (None): by the name's form factor
    (:data:`NVLINK_BUS_BANDWIDTH_BY_FORM`), else PCIe."""
    pcie = float(gpu.host_link_bandwidth_pinned or UNKNOWN_LINK_BANDWIDTH)
    nvlink = gpu.nvlink_bandwidth
    name = str(gpu.name)
    if nvlink is None:
        return Link(next((bw for form, bw in NVLINK_BUS_BANDWIDTH_BY_FORM if form in name.upper()), pcie))
    sheet = find_gpu(name)
    if not nvlink or (sheet is not None and sheet.nvlink_bridge):
        return Link(pcie)
    return Link(max(NCCL_NVLINK_FRACTION * float(nvlink) / 2, pcie))


def gradient_buckets(sizes: Sequence[int], cap: int) -> list[int]:
    """DDP's gradient buckets (bytes each) for gradients of ``sizes`` bytes in the order they
    become ready: a bucket closes once it holds ``cap`` bytes or more."""
    buckets: list[int] = []
    filling = 0
    for size in sizes:
        filling += size
        if filling >= cap:
            buckets.append(filling)
            filling = 0
    if filling:
        buckets.append(filling)
    return buckets


def overlapped_all_reduce_end(
    start: float,
    end: float,
    buckets: Sequence[int],
    world_size: int,
    link: Link | CommPath,
    k: float = math.inf,
) -> float:
    """When the last bucket's all-reduce ends, for a backward pass from ``start`` to ``end``
    whose gradients become ready evenly by bytes, each bucket's all-reduce starting when its
    gradients are ready and the previous bucket's is done (never before ``end``). ``link``: one
    link (the ring formula) or the group's path (NCCL's choice); a bucket that runs beside the
    backward is slowed by the overlap form with exponent ``k`` (inf: not at all)."""
    total = sum(buckets) or 1
    duration = end - start
    done = 0
    link_free = start
    for size in buckets:
        done += size
        ready = start + duration * done / total
        begin = max(ready, link_free)
        if isinstance(link, CommPath):
            alone = collective_cost(Collective.ALL_REDUCE, size, link).seconds
        else:
            alone = collective_seconds(Collective.ALL_REDUCE, size, world_size, link)
        beside = min(max(0.0, end - begin), alone)  # the backward still running meanwhile
        link_free = begin + alone + (overlap_penalty(alone, beside, k) if math.isfinite(k) else 0.0)
    return max(link_free, end)


def collective_cost(kind: Collective, nbytes: int, path: CommPath) -> CommCost:
    """``kind`` of ``nbytes`` (as :class:`Collective` counts them) over ``path``, run as NCCL
    would: the algorithm and protocol, the links, the seconds and nccl-tests' bus bandwidth."""
    if not isinstance(kind, Collective):
        valid = ", ".join(c.name for c in Collective)
        raise ValueError(f"collective_cost: kind must be a Collective ({valid}), got {kind!r}")
    return nccl_cost(kind.value, int(nbytes), path)


def busbw_factor(kind: Collective, ranks: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth for ``kind`` among ``ranks``."""
    return bus_factor(kind.value, ranks)


def overlapped_seconds(first: float, second: float, k: float) -> float:
    """How long two pieces of GPU work take together, ``first`` and ``second`` seconds alone, when
    they share the GPU (Morphling's ``(Tx^k + Ty^k)^(1/k)``; ``k >= 1``)."""
    if first <= 0 or second <= 0:
        return max(first, second, 0.0)
    if not k >= 1:
        raise ValueError(f"overlapped_seconds: k must be >= 1 (1: no overlap at all), got {k!r}")
    if math.isinf(k):
        return max(first, second)
    big = max(first, second)
    return big * ((first / big) ** k + (second / big) ** k) ** (1.0 / k)


def overlap_penalty(comm: float, beside: float, k: float) -> float:
    """What running ``comm`` seconds of communication beside ``beside`` seconds of other work
    adds over a perfect overlap (``max`` of the two): the seconds the communication is late."""
    return overlapped_seconds(comm, beside, k) - max(comm, beside, 0.0)
