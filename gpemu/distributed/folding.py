"""More GPUs than processes: one process stands for a group of identical ranks.

In a symmetric job every data-parallel replica, FSDP shard and TP peer does the same work, so
one process can run rank r and stand for its peers. The program's process group is torch's fake
process group of the full world size (``torch.testing._internal.distributed.fake_pg``, made for
single-process tracing): every rank number, subgroup and DeviceMesh of the world exists, FSDP2
shards over the whole world, and each collective is priced for the ranks it really spans; the
ranks a process stands for never run. Memory per rank is what the one rank holds, and a run's CPU
and memory do not grow with the world size.

Asymmetric roles (pipeline stages, the first and last stage's embedding and head) run one
process per role: of ``P`` processes, process ``p`` runs rank ``p * W / P`` and stands for the
ranks ``[p * W / P, (p + 1) * W / P)`` (pipeline stages are the outermost mesh dimension, as in
torchtitan's and Megatron's rank order). A real gloo group among the processes carries what
crosses roles (:class:`Wire`): the ranks' meetings, values, and point-to-point sends between
stages; a collective inside one process's ranks sends nothing.

Values flow as if the peers existed: an identical peer holds what this rank holds, so a SUM over
``n`` copies of each process's value is ``n`` times the processes' sum, an all-gather repeats each
process's share over the ranks it stands for, a broadcast from a folded peer keeps this rank's
value.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d_module

from .meeting import HOST_PATH, ORIGINAL, group_rank

__all__ = ["Fold", "FoldError", "Root", "Route", "Wire", "fold_store", "global_rank"]

_OPS = dist.ReduceOp


class FoldError(ValueError):
    """A process group the folded run cannot carry; the message says what to change."""


@dataclass(frozen=True)
class Fold:
    """``world`` emulated ranks run as ``processes`` processes; this one is ``process``."""

    world: int
    processes: int
    process: int

    @property
    def per_process(self) -> int:
        return self.world // self.processes

    @property
    def rank(self) -> int:
        """The rank this process runs (the first it stands for)."""
        return self.process * self.per_process

    def process_of(self, rank: int) -> int:
        return rank // self.per_process

    def describe(self, gpu: str, nodes: int, per_node: int) -> str:
        """The run's first line: what stands for what."""
        last = self.rank + self.per_process - 1
        where = f"{nodes} node(s) x {per_node}" if nodes > 1 else "1 node"
        return (
            f"{self.world} emulated {gpu} ranks ({where}) as {self.processes} process(es): process {self.process} "
            f"runs rank {self.rank} and stands for ranks {self.rank}-{last}, identical to it (collectives priced "
            f"for the ranks they span, memory per rank what rank {self.rank} holds, values as if the peers existed)"
        )


def fold_store() -> dist.Store:
    """The store of torch's fake process group (importing its module registers the backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


class Route(NamedTuple):
    """How a process group's messages travel in a folded run."""

    real: ProcessGroup | None  # the real group among processes that carries them (None: this process alone)
    processes: list[int]  # the processes whose ranks the group spans, in order
    copies: int  # identical ranks each of those processes stands for in the group


class Wire:
    """The real messages of a run: torch's own functions, or, in a folded run, the processes'
    real gloo group with each value made what the folded peers would have given."""

    def __init__(self, fold: Fold | None = None, real: ProcessGroup | None = None) -> None:
        self.fold = fold
        self.real = real
        self._sending: list[Any] = []

    @classmethod
    def folded(cls, fold: Fold, timeout: timedelta | None = None) -> Wire:
        """After the fake process group is made: the processes meet in a real gloo group (through
        torch's env:// rendezvous: MASTER_ADDR / MASTER_PORT) when there are several."""
        if fold.processes == 1:
            return cls(fold, None)
        wait = timeout or timedelta(minutes=10)
        store, _, _ = next(dist.rendezvous("env://", fold.process, fold.processes, timeout=wait))
        prefixed = dist.PrefixStore("gpemu-fold", store)
        gloo = dist.ProcessGroupGloo(prefixed, fold.process, fold.processes, wait)
        # (a process group outside c10d's registry: the program's world stays the fake one)
        real = ProcessGroup(prefixed, fold.process, fold.processes)
        real._set_default_backend(ProcessGroup.BackendType.GLOO)
        real._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
        return cls(fold, real)

    # ------------------------------------------------------------------ routes
    def route(self, group: ProcessGroup | None) -> Route:
        fold = self.fold
        assert fold is not None
        ranks = list(range(fold.world)) if group is None else dist.get_process_group_ranks(group)
        processes = sorted({fold.process_of(r) for r in ranks})
        copies = max(len(ranks) // len(processes), 1)
        if processes == [fold.process]:
            return Route(None, processes, copies)
        if len(processes) == fold.processes:
            return Route(self.real, processes, copies)
        raise FoldError(
            f"a process group spans the ranks of processes {processes} of {fold.processes}: a folded run carries "
            "groups inside one process's ranks or across all processes; give --processes equal to the number "
            "of pipeline stages (the outermost mesh dimension), or run without folding"
        )

    # ------------------------------------------------------------------ messages
    # Each returns torch's work object: in a folded run the fake group's (complete at once), after
    # the real message among processes, if any, and the folded peers' part.
    def all_reduce(self, tensor: torch.Tensor, op: Any = _OPS.SUM, group: ProcessGroup | None = None) -> Any:
        """In place, as every rank of ``group`` reducing would leave it."""
        work = ORIGINAL["all_reduce"](tensor, op=op, group=group, async_op=True)
        work.wait()
        if self.fold is not None:
            route = self.route(group)
            if route.real is not None:
                options = dist.AllreduceOptions()
                options.reduceOp = op
                route.real.allreduce([tensor], options).wait()
            _repeat(tensor, op, route.copies)
        return work

    def all_gather_into(self, out: torch.Tensor, share: torch.Tensor, group: ProcessGroup | None = None) -> Any:
        """``out`` (flat) gets every rank's ``share`` in the group's rank order."""
        work = HOST_PATH["all_gather_into_tensor"](out, share, group=group, async_op=True)
        work.wait()
        if self.fold is not None:
            out.copy_(torch.cat([s.reshape(-1) for s in self.gather_shares(share, group)]).reshape(out.shape))
        return work

    def all_gather(self, outs: list[torch.Tensor], share: torch.Tensor, group: ProcessGroup | None = None) -> Any:
        work = ORIGINAL["all_gather"](outs, share, group=group, async_op=True)
        work.wait()
        if self.fold is not None:
            for dst, value in zip(outs, self.gather_shares(share, group), strict=False):
                dst.copy_(value.reshape(dst.shape))
        return work

    def gather_shares(self, share: torch.Tensor, group: ProcessGroup | None) -> list[torch.Tensor]:
        """Each rank's share of the group, in its rank order: each process's share repeated over
        the ranks it stands for."""
        fold = self.fold
        assert fold is not None
        route = self.route(group)
        by_process = {fold.process: share}
        if route.real is not None:
            gathered = [torch.zeros_like(share) for _ in range(fold.processes)]
            route.real.allgather([gathered], [share]).wait()
            by_process = dict(enumerate(gathered))
        ranks = list(range(fold.world)) if group is None else dist.get_process_group_ranks(group)
        return [by_process[fold.process_of(r)] for r in ranks]

    def broadcast(self, tensor: torch.Tensor, root: Root, group: ProcessGroup | None = None) -> Any:
        """``tensor`` of the root rank; a folded peer's is this rank's own."""
        work = ORIGINAL["broadcast"](tensor, src=root.rank, group=group, async_op=True, group_src=root.group_rank)
        work.wait()
        if self.fold is not None:
            route = self.route(group)
            if route.real is not None:
                options = dist.BroadcastOptions()
                options.rootRank = self.fold.process_of(global_rank(group, root.rank, root.group_rank) or 0)
                route.real.broadcast([tensor], options).wait()
        return work

    def send(self, tensor: torch.Tensor, peer: Root, group: ProcessGroup | None = None, tag: int = 0) -> Any:
        """To ``peer`` (c10d's ``dst`` / ``group_dst``), not waited for (the caller waits: a batch
        of sends and receives posts its sends first); in a folded run only to another process's
        rank."""
        if self.fold is None:
            work = ORIGINAL["isend"](tensor, dst=peer.rank, group=group, tag=tag, group_dst=peer.group_rank)
        else:
            process = self._process(group, peer)
            if process is None or self.real is None:
                return self.complete()
            work = self.real.send([tensor], process, tag)
        self._keep(work)
        return work

    def _keep(self, work: Any) -> None:
        """Hold a send's work until it ends (a dropped gloo work object drops its send)."""
        self._sending = [w for w in self._sending if not w.is_completed()]
        self._sending.append(work)

    def recv(self, tensor: torch.Tensor, peer: Root, group: ProcessGroup | None = None, tag: int = 0) -> Any:
        """From ``peer`` (c10d's ``src`` / ``group_src``; None: any rank). In a folded run a
        folded peer sends nothing and ``tensor`` is left as it is."""
        if self.fold is None:
            work = ORIGINAL["irecv"](tensor, src=peer.rank, group=group, tag=tag, group_src=peer.group_rank)
            work.wait()
            return work  # (waited: its source rank, for a receive from any rank)
        process = self._process(group, peer)
        if process is not None and self.real is not None:
            self.real.recv([tensor], process, tag).wait()
        return self.complete()

    def _process(self, group: ProcessGroup | None, peer: Root) -> int | None:
        """The other process that runs ``peer``; None for a folded peer of this process or any rank."""
        fold = self.fold
        assert fold is not None
        rank = global_rank(group, peer.rank, peer.group_rank)
        if rank is None:
            return None
        process = fold.process_of(rank)
        return None if process == fold.process else process

    def complete(self) -> Any:
        """A finished work object, which may be waited on again (a gloo receive's may not)."""
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result([])
        # (torch's stubs omit the binding; it exists since torch 2.0)
        return torch._C._distributed_c10d._create_work_from_future(done)  # type: ignore[attr-defined]

    def barrier(self, group: ProcessGroup | None = None, async_op: bool = False) -> Any:
        if self.fold is None or self.route(group).real is None:
            return ORIGINAL["barrier"](group=group, async_op=async_op)
        work = self.real.barrier() if self.real is not None else None
        if work is not None:
            work.wait()
        return ORIGINAL["barrier"](group=group, async_op=async_op)


class Root(NamedTuple):
    """A rank a rooted or point-to-point message starts or ends at: a global rank, or a rank
    within the group (c10d's ``group_src`` / ``group_dst``)."""

    rank: int | None
    group_rank: int | None

    def is_me(self, group: ProcessGroup | None) -> bool:
        if self.group_rank is not None:
            return group_rank(group) == self.group_rank
        return dist.get_rank() == self.rank


def global_rank(group: ProcessGroup | None, rank: int | None, group_rank: int | None) -> int | None:
    """The global rank from c10d's ``dst``/``src`` or ``group_dst``/``group_src`` (None: any)."""
    if rank is not None:
        return rank
    if group_rank is None:
        return None
    return dist.get_global_rank(group if group is not None else c10d_module._get_default_group(), group_rank)


def _repeat(tensor: torch.Tensor, op: Any, copies: int) -> None:
    """``tensor`` reduced with ``copies`` identical copies of each value (in place)."""
    if copies <= 1:
        return
    with torch.no_grad():
        if op == _OPS.SUM:
            tensor.mul_(copies)
        elif op == _OPS.PRODUCT:
            tensor.pow_(copies)
        elif op == _OPS.BXOR and copies % 2 == 0:
            tensor.zero_()
        # (MAX, MIN, BAND, BOR and AVG of identical copies are the processes' own)
