"""Where each rank is: the cluster a run's collectives cross, each rank's node, and what one
process group's ranks have between them.

Every rank knows its own node: ``config.node_rank`` (``gpemu run --node-rank``, else torchrun's
``GROUP_RANK`` for its workers), else the cluster's layout (ranks fill nodes in order), else node
0. Right after ``init_process_group`` the ranks tell each other in ONE real gloo message
(:meth:`Placement.meet`), so a collective among any group of ranks is priced over the links it
really crosses: NVLink or PCIe inside a node, the NICs between nodes (:mod:`gpemu.costmodel.nccl`).
Without a described cluster the run assumes nodes of its own GPUs, as many as the ranks said.

:class:`CommLog` keeps each device's recent collectives, so one that runs beside another (two
streams, the same links) or beside computation is priced with the overlap of
:func:`gpemu.costmodel.comm.overlapped_seconds`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..costmodel.comm import CommPath
from ..costmodel.gpus import gpu_sheet
from ..costmodel.topology import Cluster, default_cluster
from .folding import Fold, Wire
from .meeting import ORIGINAL

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = ["Placement", "PlacementError", "CommLog", "CommInterval", "spread"]

_KEEP = 256  # recent collectives remembered per device (older ones cannot overlap new work)


class PlacementError(ValueError):
    """The ranks' nodes do not fit the described cluster; the message says how to make them fit."""


class CommInterval(NamedTuple):
    stream: int
    start: float
    end: float
    links: str


@dataclass
class CommLog:
    """Each device's recent collectives (stream, GPU interval, links)."""

    by_device: dict[int, list[CommInterval]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def beside(self, device: int, stream: int, start: float, links: str) -> tuple[float, float]:
        """Seconds of other streams' collectives still running after ``start``: over the same
        links, and over others."""
        same = other = 0.0
        with self.lock:
            for item in self.by_device.get(device, ()):
                if item.stream == stream or item.end <= start:
                    continue
                left = item.end - max(start, item.start)
                if item.links == links:
                    same += left
                else:
                    other += left
        return same, other

    def add(self, device: int, interval: CommInterval) -> None:
        with self.lock:
            items = self.by_device.setdefault(device, [])
            items.append(interval)
            if len(items) > _KEEP:
                del items[: len(items) - _KEEP]


class Placement:
    """The run's cluster and each rank's node (``rt.placement``, made by the component)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.described: Cluster | None = rt.config.described_cluster()
        self.cluster: Cluster | None = self.described
        self.rank_nodes: list[int] | None = None  # global rank -> node, once the ranks met
        self.comm = CommLog()
        self._paths: dict[tuple[str, int], CommPath] = {}
        config = rt.config
        # More GPUs than processes (--world-size): which ranks this process stands for.
        self.fold: Fold | None = (
            Fold(config.world_size, config.processes, config.fold_process) if config.world_size else None
        )
        self.wire = Wire()  # the real messages; the folded run's once its process group exists

    # ------------------------------------------------------------------ nodes
    def own_node(self, rank: int, world: int) -> int:
        """This process's node: said by the configuration, else the cluster's layout, else the
        ranks split evenly over ``config.nodes`` nodes (``--nodes`` without a cluster), else 0."""
        config = self.rt.config
        if config.node_rank is not None:
            return config.node_rank
        if self.described is not None:
            return self.described.node_of(rank)
        return spread(rank, world, config.nodes or 1)

    def layout_node(self, rank: int, world: int) -> int:
        """The node the cluster's layout gives ``rank`` (a folded run: nodes of the run's GPUs
        per node, as many as the world needs, unless --nodes says)."""
        if self.described is not None:
            return self.described.node_of(rank)
        nodes = self.rt.config.nodes or -(-world // self.rt.num_devices)
        return spread(rank, world, nodes)

    def fold_in(self, timeout: Any = None) -> None:
        """Right after the fake process group is made: the processes' real group, if several."""
        if self.fold is not None:
            self.wire = Wire.folded(self.fold, timeout)

    def node_of(self, rank: int) -> int:
        if self.rank_nodes is not None and 0 <= rank < len(self.rank_nodes):
            return self.rank_nodes[rank]
        return self.described.node_of(rank) if self.described is not None else 0

    def meet(self) -> None:
        """After ``init_process_group``: every rank learns every rank's node (one gloo message:
        each rank writes its node + 1 at its index, a SUM fills the rest). In a folded run the
        ranks that do not run are where the cluster's layout puts them."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if self.fold is not None:
            nodes = [self.layout_node(r, world) for r in range(world)]
        else:
            said = torch.zeros(world, dtype=torch.int64)
            said[rank] = self.own_node(rank, world) + 1
            ORIGINAL["all_reduce"](said, op=dist.ReduceOp.SUM)
            nodes = [int(v) - 1 for v in said.tolist()]
        self.cluster = self._cluster_for(nodes)
        self.rank_nodes = nodes
        self._paths.clear()
        if self.cluster.nodes > 1:
            node = nodes[rank]
            self.rt.say_once(
                f"cluster {self.cluster.name}: {world} ranks on {len(set(nodes))} node(s); this rank is on node "
                f"{node}: collectives priced over NVLink/PCIe inside a node and the NICs between nodes"
            )

    def _cluster_for(self, nodes: Sequence[int]) -> Cluster:
        """The described cluster, checked against where the ranks are; else nodes of this run's
        GPUs, as many and as large as the ranks say."""
        per_node: dict[int, int] = {}
        for node in nodes:
            per_node[node] = per_node.get(node, 0) + 1
        largest = max(per_node.values())
        if self.described is None:
            sheet = gpu_sheet(self.rt.gpus[0])
            return default_cluster(sheet, largest, max(max(nodes) + 1, self.rt.config.nodes or 1))
        cluster = self.described
        if max(nodes) >= cluster.nodes:
            rank = next(r for r, n in enumerate(nodes) if n >= cluster.nodes)
            raise PlacementError(
                f"rank {rank} is on node {nodes[rank]} but the cluster {cluster.name!r} has {cluster.nodes} "
                f"node(s); give --nodes {max(nodes) + 1} (GPEMU_NODES)"
            )
        if largest > cluster.gpus_per_node:
            node = next(n for n, count in per_node.items() if count == largest)
            raise PlacementError(
                f"node {node} runs {largest} ranks but the cluster {cluster.name!r} has {cluster.gpus_per_node} "
                "GPUs per node; start fewer ranks per node (torchrun --nproc-per-node) or describe larger nodes"
            )
        return cluster

    # ------------------------------------------------------------------ paths
    def path(self, group: ProcessGroup | None) -> CommPath:
        """What the ranks of ``group`` (None: every rank) have between them."""
        ranks = _ranks(group)
        key = (_group_name(group), len(ranks))
        found = self._paths.get(key)
        if found is not None:
            return found
        cluster = self.cluster
        if cluster is None:  # no meeting (yet): one node holding every rank
            cluster = default_cluster(gpu_sheet(self.rt.gpus[0]), max(len(ranks), 1))
        made = CommPath.of(cluster, [self.node_of(r) for r in ranks])
        self._paths[key] = made
        return made

    def pair_path(self, rank: int, peer: int) -> CommPath:
        """What two ranks have between them (a point-to-point send)."""
        key = (f"pair {min(rank, peer)} {max(rank, peer)}", 2)
        found = self._paths.get(key)
        if found is None:
            cluster = self.cluster or default_cluster(gpu_sheet(self.rt.gpus[0]), 2)
            found = self._paths[key] = CommPath.of(cluster, [self.node_of(rank), self.node_of(peer)])
        return found

    @property
    def overlap_k(self) -> float:
        return self.cluster.overlap_k if self.cluster is not None else 4.0


def spread(rank: int, world: int, nodes: int) -> int:
    """The node of ``rank`` when ``world`` ranks fill ``nodes`` nodes evenly, in order."""
    return min(rank * nodes // max(world, 1), nodes - 1)


def _ranks(group: ProcessGroup | None) -> list[int]:
    if not dist.is_initialized():
        return [0]
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _group_name(group: Any) -> str:
    if group is None:
        return "default"
    return str(getattr(group, "group_name", id(group)))
