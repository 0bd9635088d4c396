"""Each collective on emulated tensors, written once for both of torch's forms of it.

A collective is priced by :mod:`gpemu.costmodel.comm` as NCCL would run it over the links its
group's ranks cross (:mod:`.placement`), slowed where it shares the GPU with other streams' work
(Morphling's overlap form), charged on the device's current stream ending when the last rank's
ends (the ranks meet once, :mod:`.meeting`), and, when every rank knows its values, the values are
exchanged for real and stored in the outputs. The c10d form (:mod:`.c10d`: ``dist.all_reduce(t)``)
and the functional form (:mod:`.functional`: ``torch.ops._c10d_functional.all_reduce``, what
DTensor and FSDP2 use) read their arguments into a :class:`Call` and the tensors, and call the
same method here.

Each collective leaves counters (``comm_seconds/<kind>/<links>``, ``comm_bytes/...``,
``comm_count/...``, and ``comm_wait_seconds``: the time spent waiting for slower ranks) that the
summary shows per collective kind and link.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..costmodel.comm import Collective, collective_cost, overlap_penalty
from ..hostvalues import SHADOW_MAX_ELEMENTS
from .folding import Root
from .meeting import (
    Meeting,
    ValuesOp,
    group_rank,
    known_or_host,
    knows,
    meet,
    proxy,
    proxy_dtype,
    store,
    tensor_bytes,
)
from .placement import CommInterval
from .run_parts import RunParts

__all__ = ["Call", "Root", "Collectives", "Priced"]


@dataclass(frozen=True)
class Call:
    """One emulated collective, as its form read it."""

    name: str  # the comm span's name
    group: ProcessGroup | None  # the process group (None: the default group)
    dev: int  # the emulated device it runs on

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)


class Priced(NamedTuple):
    """A collective's price: seconds alone on the GPU, what it is, its bytes and links."""

    seconds: float
    kind: Collective
    nbytes: int
    links: str
    how: str  # NCCL's algorithm/protocol, e.g. "ring/LL128"


class Collectives:
    """The collectives of one run's emulated tensors (shared by the c10d and functional forms)."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts

    # ---------------------------------------------------------------- time and the meeting
    def price(self, kind: Collective, sizes: Iterable[int], call: Call) -> Priced:
        """``kind``'s price for messages of ``sizes`` bytes, one after the other, over the links
        the call's group crosses."""
        path = self.parts.placement.path(call.group)
        seconds, total, how = 0.0, 0, ""
        for nbytes in sizes:
            cost = collective_cost(kind, nbytes, path)
            seconds += cost.seconds
            total += nbytes
            how = how or f"{cost.algorithm.value}/{cost.protocol.value}"
        links = collective_cost(kind, 1, path).links
        return Priced(seconds, kind, total, links, how)

    def price_pair(self, nbytes: int, call: Call, peer: int | None) -> Priced:
        """A point-to-point send of ``nbytes`` between this rank and global rank ``peer`` (None:
        any rank of the call's group)."""
        placement = self.parts.placement
        if peer is None or not dist.is_initialized():
            path = placement.path(call.group)
        else:
            path = placement.pair_path(dist.get_rank(), peer)
        cost = collective_cost(Collective.SEND, nbytes, path)
        return Priced(cost.seconds, Collective.SEND, nbytes, cost.links, "")

    def charge(self, call: Call, priced: Priced, knows: bool) -> Meeting:
        """Charge ``priced`` communication on the device's current stream (slowed by what other
        streams of the device run meanwhile), ending when the last rank's ends (the ranks meet
        once)."""
        engine = self.parts.engine
        stream = engine.stream(call.dev)
        start = max(stream.busy_until, engine.now())
        seconds = priced.seconds + self.contention(call.dev, stream.stream_id, start, priced)
        met = meet(call.group, start + seconds, knows)
        # Issued at ``start``: the host time the message itself took is the emulator's (NCCL
        # would have returned to the program at once), waiting for a later rank is the GPU's.
        if met.finish > start:
            name = f"{call.name} ({priced.links}, {priced.how})" if priced.how else call.name
            stream.enqueue(met.finish - start, "comm", name, 0, start)
            self.parts.placement.comm.add(call.dev, CommInterval(stream.stream_id, start, met.finish, priced.links))
        self.record(priced, seconds, max(0.0, met.finish - start - seconds))
        return met

    def contention(self, dev: int, stream_id: int, start: float, priced: Priced) -> float:
        """Seconds a collective is late because other streams of its GPU work meanwhile: other
        collectives over the same links share their bandwidth (one after the other, k = 1);
        computation and collectives over other links share SMs and memory (the cluster's k)."""
        if priced.seconds <= 0:
            return 0.0
        placement = self.parts.placement
        same, other = placement.comm.beside(dev, stream_id, start, priced.links)
        busy = max(0.0, self.parts.engine.device_busy_until(dev) - start)
        compute = max(0.0, busy - same - other)
        alone, k = priced.seconds, placement.overlap_k
        return (
            overlap_penalty(alone, min(same, alone), 1.0)
            + overlap_penalty(alone, min(other, alone), k)
            + overlap_penalty(alone, min(compute, alone), k)
        )

    def record(self, priced: Priced, seconds: float, waited: float) -> None:
        """Counters for the summary: per collective kind and links, and waiting for slower ranks."""
        key = f"{priced.kind.value}/{priced.links}"
        self.parts.rt.recorder.add_many(
            ("comm_collectives", 1.0),
            ("comm_messages", 1.0),
            (f"comm_seconds/{key}", seconds),
            (f"comm_bytes/{key}", float(priced.nbytes)),
            (f"comm_count/{key}", 1.0),
            ("comm_wait_seconds", waited),
        )

    def values_sent(self) -> None:
        self.parts.rt.recorder.add("comm_messages", 1.0)

    def reduced(self, value: torch.Tensor, how: ValuesOp, group: ProcessGroup | None) -> tuple[torch.Tensor, Any]:
        """``value`` (a host proxy) all-reduced for real among the group, averaged if ``how``
        says, and the real work object."""
        work = self.parts.placement.wire.all_reduce(value, how.op, group)
        self.values_sent()
        return (value / dist.get_world_size(group) if how.average else value), work

    # ---------------------------------------------------------------- the collectives
    def all_reduce(
        self,
        call: Call,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        how: ValuesOp,
        sizes: Iterable[int],
    ) -> Any:
        """All-reduce of each input into its output, priced as messages of ``sizes`` bytes."""
        knowing = how.op is not None and all(known_or_host(t) for t in inputs)
        met = self.charge(call, self.price(Collective.ALL_REDUCE, sizes, call), knowing)
        work = met.work
        for src, dst in zip(inputs, outputs, strict=False):
            value = None
            if met.everyone_knows:
                value, work = self.reduced(proxy(src), how, call.group)
            store(dst, value)
        return work

    def all_gather(self, call: Call, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> Any:
        """Each input gathered from every rank into its (flat, rank-ordered) output."""
        knowing = all(
            knows(src) and dst.numel() <= SHADOW_MAX_ELEMENTS for src, dst in zip(inputs, outputs, strict=False)
        )
        met = self.charge(call, self.price(Collective.ALL_GATHER, map(tensor_bytes, outputs), call), knowing)
        work = met.work
        for src, dst in zip(inputs, outputs, strict=False):
            value = None
            if met.everyone_knows:
                share = proxy(src)
                value = torch.zeros(dst.numel(), dtype=share.dtype)
                work = self.parts.placement.wire.all_gather_into(value, share, call.group)
                self.values_sent()
            store(dst, value)
        return work

    def reduce_scatter(
        self,
        call: Call,
        inputs: Sequence[torch.Tensor | None],
        outputs: Sequence[torch.Tensor],
        how: ValuesOp,
        sizes: Iterable[int],
    ) -> Any:
        """Each full input (a host proxy of every rank's share; None: unknown) reduced among the
        ranks, this rank's share stored in its output; priced as messages of ``sizes`` bytes."""
        knowing = how.op is not None and all(full is not None for full in inputs)
        met = self.charge(call, self.price(Collective.REDUCE_SCATTER, sizes, call), knowing)
        work = met.work
        rank = group_rank(call.group)
        for full, dst in zip(inputs, outputs, strict=False):
            value = None
            if met.everyone_knows and full is not None:
                # (gloo has no reduce-scatter of every dtype: an all-reduce, then this rank's share)
                whole, work = self.reduced(full, how, call.group)
                share = dst.numel()
                value = whole[rank * share : (rank + 1) * share]
            store(dst, value)
        return work

    def broadcast(self, call: Call, tensor: torch.Tensor, out: torch.Tensor, root: Root) -> Any:
        """``tensor`` of the root rank into ``out`` of every rank (``out`` is ``tensor`` in c10d)."""
        is_root = root.is_me(call.group)
        seconds = self.price(Collective.BROADCAST, [tensor_bytes(tensor)], call)
        met = self.charge(call, seconds, knows(tensor) if is_root else True)
        work, value = met.work, None
        if met.everyone_knows:
            value = proxy(tensor) if is_root else torch.zeros(tensor.numel(), dtype=proxy_dtype(tensor))
            work = self.parts.placement.wire.broadcast(value, root, call.group)
            self.values_sent()
        store(out, value)
        return work

    def all_to_all(self, call: Call, sizes: Iterable[int], outputs: Sequence[torch.Tensor]) -> Any:
        """Every rank's shares to every other; values are not carried (the outputs are unknown)."""
        met = self.charge(call, self.price(Collective.ALL_TO_ALL, sizes, call), False)
        for t in outputs:
            store(t, None)
        return met.work
