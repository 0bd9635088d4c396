"""Each collective on emulated tensors, written once for both of torch's forms of it.

A collective is priced by :mod:`gpemu.costmodel.comm` over the GPU's link, charged on the device's
current stream ending when the last rank's ends (the ranks meet once, :mod:`.meeting`), and, when
every rank knows its values, the values are exchanged for real and stored in the outputs. The
c10d form (:mod:`.c10d`: ``dist.all_reduce(t)``) and the functional form (:mod:`.functional`:
``torch.ops._c10d_functional.all_reduce``, what DTensor and FSDP2 use) read their arguments into
a :class:`Call` and the tensors, and call the same method here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..costmodel.comm import Collective, Link, collective_seconds, gpu_link
from ..hostvalues import SHADOW_MAX_ELEMENTS
from .meeting import (
    HOST_PATH,
    ORIGINAL,
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
from .run_parts import RunParts

__all__ = ["Call", "Root", "Collectives"]


@dataclass(frozen=True)
class Call:
    """One emulated collective, as its form read it."""

    name: str  # the comm span's name
    group: ProcessGroup | None  # the process group (None: the default group)
    dev: int  # the emulated device it runs on

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)


class Root(NamedTuple):
    """The rank a rooted collective (broadcast, reduce, scatter, gather) starts or ends at: a
    global rank, or a rank within the group (c10d's ``group_src`` / ``group_dst``)."""

    rank: int | None
    group_rank: int | None

    def is_me(self, group: ProcessGroup | None) -> bool:
        if self.group_rank is not None:
            return group_rank(group) == self.group_rank
        return dist.get_rank() == self.rank


class Collectives:
    """The collectives of one run's emulated tensors (shared by the c10d and functional forms)."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts

    # ---------------------------------------------------------------- time and the meeting
    def link(self, dev: int) -> Link:
        return gpu_link(self.parts.rt.gpus[dev])

    def seconds(self, kind: Collective, sizes: Iterable[int], call: Call) -> float:
        """``kind``'s time for messages of ``sizes`` bytes, one after the other."""
        world, link = call.world, self.link(call.dev)
        return sum(collective_seconds(kind, nbytes, world, link) for nbytes in sizes)

    def charge(self, call: Call, seconds: float, knows: bool) -> Meeting:
        """Charge ``seconds`` of communication on the device's current stream, ending when the last
        rank's ends (the ranks meet once)."""
        engine = self.parts.engine
        stream = engine.stream(call.dev)
        start = max(stream.busy_until, engine.now())
        met = meet(call.group, start + seconds, knows)
        # Issued at ``start``: the host time the message itself took is the emulator's (NCCL
        # would have returned to the program at once), waiting for a later rank is the GPU's.
        if met.finish > start:
            stream.enqueue(met.finish - start, "comm", call.name, 0, start)
        self.parts.rt.recorder.add_many(("comm_collectives", 1.0), ("comm_messages", 1.0))
        return met

    def values_sent(self) -> None:
        self.parts.rt.recorder.add("comm_messages", 1.0)

    def reduced(self, value: torch.Tensor, how: ValuesOp, group: ProcessGroup | None) -> tuple[torch.Tensor, Any]:
        """``value`` (a host proxy) all-reduced for real among the group, averaged if ``how``
        says, and the real work object."""
        work = ORIGINAL["all_reduce"](value, op=how.op, group=group, async_op=True)
        work.wait()
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
        met = self.charge(call, self.seconds(Collective.ALL_REDUCE, sizes, call), knowing)
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
        met = self.charge(call, self.seconds(Collective.ALL_GATHER, map(tensor_bytes, outputs), call), knowing)
        work = met.work
        for src, dst in zip(inputs, outputs, strict=False):
            value = None
            if met.everyone_knows:
                share = proxy(src)
                value = torch.zeros(dst.numel(), dtype=share.dtype)
                work = HOST_PATH["all_gather_into_tensor"](value, share, group=call.group, async_op=True)
                work.wait()
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
        met = self.charge(call, self.seconds(Collective.REDUCE_SCATTER, sizes, call), knowing)
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
        seconds = self.seconds(Collective.BROADCAST, [tensor_bytes(tensor)], call)
        met = self.charge(call, seconds, knows(tensor) if is_root else True)
        work, value = met.work, None
        if met.everyone_knows:
            value = proxy(tensor) if is_root else torch.zeros(tensor.numel(), dtype=proxy_dtype(tensor))
            work = ORIGINAL["broadcast"](
                value, src=root.rank, group=call.group, async_op=True, group_src=root.group_rank
            )
            work.wait()
            self.values_sent()
        store(out, value)
        return work

    def all_to_all(self, call: Call, sizes: Iterable[int], outputs: Sequence[torch.Tensor]) -> Any:
        """Every rank's shares to every other; values are not carried (the outputs are unknown)."""
        met = self.charge(call, self.seconds(Collective.ALL_TO_ALL, sizes, call), False)
        for t in outputs:
            store(t, None)
        return met.work
