"""The kernels ``torch.compile``'s Inductor emits for a run of ops, and their price.

Inductor lowers a captured graph to two kinds of kernels (its ``scheduler``): *extern* kernels
(matrix products, convolutions, attention, collectives: library calls, priced by the cost model as
in eager mode) and generated Triton kernels, each a fused group of pointwise ops, reductions with
their pointwise prologue and epilogue, and the copies, norms and pooling it lowers to loops. A
fused kernel reads its inputs and writes its outputs once: the intermediates between its ops stay
in registers. Views cost nothing.

:class:`KernelGroups` forms those groups from a stream of ops as they run (:class:`OpRecord`, one
per aten op: its class, the memory blocks it reads and writes and their bytes). An op joins the
open group when it is fusible, on the same device and pass, connected to the group (it reads what
the group wrote, or what the group read: vertical and horizontal fusion) and of the group's
iteration size (its largest tensor has the group's element count, or it is an epilogue on a
smaller result the group made), and not dependent on an extern kernel that read the group's
results; else the group closes. Extern kernels do not close the open group unless they overwrite
what it touches: Inductor's scheduler orders kernels by their dependencies, not by the program's
order (a bias gradient's sum fuses with the activation's backward whose result the weight
gradient's matrix product also reads); those that need the group's results launch after it.

A closed group's boundary: the bytes it read from outside, and the bytes it wrote that are still
alive when it closes (read later, saved for the backward, or returned); an intermediate freed
inside the group was never written. (Inductor's partitioner may recompute a cheap activation in
the backward instead of saving it: here what eager autograd saves is written.)

:class:`FusionRegion` is what a compiled call installs as ``TensorState.fusion`` while it runs
(:mod:`gpemu.compiled`): the cached ops it receives are grouped, and each closed group is charged
as one kernel (one launch) through the usual :meth:`~gpemu.device.TensorState.charge`, so cost
taps, module passes and replays see the compiled kernels. A group of one op is that op, priced
as it is in eager mode. The cost model prices a fused kernel on its memory-bound (streaming,
elementwise) curve at its boundary bytes, and no lower than its slowest op alone that is more than
a stream of its bytes (a reduction, a norm, a gather: :func:`sets_floor`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from . import costs
from .costmodel import OpClass, OpFeatures
from .device import EmuTensor, OwnNodes

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = [
    "OpRecord",
    "Kernel",
    "KernelGroups",
    "FusionRegion",
    "FUSIBLE",
    "fused_features",
    "fused_price",
    "sets_floor",
    "op_floor_seconds",
]

# What Inductor generates itself (Triton loops); the other classes are extern kernels.
FUSIBLE = frozenset(
    {OpClass.ELEMENTWISE, OpClass.REDUCTION, OpClass.NORM, OpClass.COPY, OpClass.POOLING, OpClass.EMBEDDING}
)
_REDUCING = frozenset({OpClass.REDUCTION, OpClass.NORM})
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass


class OpRecord(NamedTuple):
    """One op as the fusion grouping sees it."""

    name: str
    op_class: OpClass | None  # None: no cost-model features (an extern kernel, priced as it is)
    backward: bool
    flops: float
    dtype: str
    dev: int
    reads: dict[int, int]  # memory block (numbered) -> bytes read of it
    writes: dict[int, int]  # memory block (numbered) -> bytes written to it
    size: int  # the element count of its largest tensor (its iteration size)
    out_size: int  # the element count of its largest output
    payload: Any = None  # what charges it alone (the op cache's entry)


class Kernel(NamedTuple):
    """One kernel launch: a fused group (``fused``), or one op as it is."""

    ops: tuple[OpRecord, ...]
    read_bytes: int  # read from outside the kernel
    write_bytes: int  # written and still alive when it closed
    fused: bool


class _Group:
    """The open group of :class:`KernelGroups`."""

    def __init__(self, op: OpRecord) -> None:
        self.ops: list[OpRecord] = [op]
        self.size = op.size
        self.outside: dict[int, int] = dict(op.reads)  # blocks read from outside the group
        self.made: dict[int, int] = dict(op.writes)  # blocks the group wrote
        self.reduced: set[int] = set(op.writes) if op.op_class in _REDUCING else set()
        self.after: set[int] = set()  # what extern kernels made from the group's results
        self.waiting: list[Kernel] = []  # those extern kernels, launched after the group

    def takes(self, op: OpRecord) -> bool:
        if op.dev != self.ops[0].dev or op.backward != self.ops[0].backward:
            return False
        made, outside = self.made, self.outside
        if not any(b in made or b in outside for b in op.reads) or any(b in self.after for b in op.reads):
            return False
        if op.size == self.size:
            return True
        # an epilogue over a result the group reduced (a softmax's normalisation, a loss's mean)
        return op.size < self.size and any(b in self.reduced for b in op.reads)

    def overwritten_by(self, op: OpRecord) -> bool:
        """Whether ``op`` writes what the group reads or wrote."""
        made, outside = self.made, self.outside
        return any(b in made or b in outside for b in op.writes)

    def add(self, op: OpRecord) -> None:
        self.ops.append(op)
        for b, n in op.reads.items():
            if b not in self.made and n > self.outside.get(b, 0):
                self.outside[b] = n
        for b, n in op.writes.items():
            if n > self.made.get(b, 0):
                self.made[b] = n
        if op.op_class in _REDUCING:
            self.reduced.update(op.writes)


class KernelGroups:
    """Ops in, kernels out (see the module's doc). ``alive(block)``: whether a block the group
    wrote is still held by anything when the group closes."""

    def __init__(self, alive: Callable[[int], bool]) -> None:
        self.alive = alive
        self.group: _Group | None = None

    def add(self, op: OpRecord) -> list[Kernel]:
        """Take one op; returns the kernels it closed, in launch order (an extern op closes the
        open group and is a kernel of its own)."""
        group = self.group
        if op.op_class not in FUSIBLE:
            alone = Kernel((op,), sum(op.reads.values()), sum(op.writes.values()), False)
            # (Inductor's scheduler orders kernels by their dependencies: an extern kernel that
            # needs the open group's results is launched after the group, and only what needs its
            # own result cannot join the group; one that overwrites what the group touches splits it)
            if group is None:
                return [alone]
            if group.overwritten_by(op):
                return [*self.close(), alone]
            after = group.after
            if any(b in group.made or b in after for b in op.reads):
                after.update(op.writes)
                group.waiting.append(alone)
                return []
            return [alone]
        if group is not None and group.takes(op):
            group.add(op)
            return []
        closed = self.close()
        self.group = _Group(op)
        return closed

    def close(self) -> list[Kernel]:
        """Close the open group (a graph's end, a graph break, an extern kernel)."""
        group, self.group = self.group, None
        if group is None:
            return []
        written = sum(n for b, n in group.made.items() if self.alive(b))
        read = sum(group.outside.values())
        return [Kernel(tuple(group.ops), read, written, len(group.ops) > 1), *group.waiting]


def fused_features(kernel: Kernel) -> OpFeatures:
    """A fused kernel as the cost model sees it: a streaming (elementwise) kernel of its boundary
    bytes."""
    ops = kernel.ops
    return OpFeatures(
        f"fused_{len(ops)}",
        OpClass.ELEMENTWISE,
        ops[0].backward,
        sum(op.flops for op in ops),
        float(kernel.read_bytes + kernel.write_bytes),
        ops[0].dtype,
    )


# Ops whose whole cost is streaming their bytes once: pointwise math (the elementwise class) and
# dtype casts and plain copies. Fused, they cost what the group's boundary moves.
_STREAMING_COPIES = frozenset({"_to_copy", "copy_", "clone"})


def sets_floor(op: OpRecord) -> bool:
    """Whether an op's eager price is a floor for a fused kernel holding it: a reduction's, a
    norm's, a gather's access pattern is not made faster by fusing what is around it; a pointwise
    op or a cast is nothing but its bytes, which fusion keeps in registers (an fp32 upcast that a
    float8 cast multiplies and clamps is never written)."""
    return op.op_class is not OpClass.ELEMENTWISE and op.name.split(".")[0] not in _STREAMING_COPIES


def op_floor_seconds(rt: Runtime, op: OpRecord) -> float:
    """What ``op`` alone costs as the floor of a fused kernel holding it (:func:`sets_floor`): its
    eager price; but a forward kind of op run in a backward pass (a ``sum`` or an ``amax`` that
    Inductor generates into the backward graph) costs its forward price. The backward curves were
    fitted to backward kernels (a softmax's backward reads its input twice) and to the bookkeeping
    eager autograd does around each op; a forward reduction in a compiled backward is neither."""
    price = op.payload.price
    features = price.op
    if not features.backward or "backward" in features.name:
        return price.gpu
    return costs.kernel_price(rt, op.dev, replace(features, backward=False)).gpu


def fused_price(streaming: Any, kernel: Kernel, floors: Iterable[float]) -> Any:
    """A fused kernel's :class:`gpemu.costs.OpPrice`: the streaming price of its boundary bytes
    (``streaming``), but no less than its ``floors`` (:func:`op_floor_seconds` of each op that
    :func:`sets_floor`). Its reference price is its ops' eager ones (the profile database measured
    eager runs): a measured model's time carried by the ratio of the ops it ran
    (``gpemu.model_pricing.price_ratio``) carries the fusion too."""
    gpu = max(streaming.gpu, max(floors, default=0.0))
    return streaming._replace(gpu=gpu, reference=sum(op.payload.price.reference for op in kernel.ops))


class FusionRegion:
    """A compiled call's ops grouped and charged as fused kernels (``TensorState.fusion``).

    ``own``: for a backward region, the compiled forward's autograd nodes (ops run by other nodes,
    the loss's backward, are charged as they run)."""

    def __init__(self, rt: Runtime, own: OwnNodes | None = None) -> None:
        self.rt = rt
        self.ts = rt.tensors
        self.own = own
        self.thread = threading.get_ident()
        # The memory blocks the region's ops touched, numbered in order (see _number).
        self.keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.blocks: list[weakref.ref] = []
        self.groups = KernelGroups(self._alive)
        self.kernels = 0  # launches charged (fused groups and single ops)
        self.ops = 0  # ops they stood for

    def _alive(self, key: int) -> bool:
        return self.blocks[key]() is not None

    def op(self, entry: Any, dev: int, args: tuple, out: Any) -> None:
        """One cached op (called by the op cache instead of charging it)."""
        ts = self.ts
        own = self.own
        if own is not None and _graph_task() != own.task and threading.get_ident() == self.thread:
            # A backward region whose pass ended without its end (an error inside the backward
            # skips the engine's callbacks): it ends now, and the op is the program's own.
            self.flush()
            if ts.fusion is self:
                ts.fusion = None
            ts.charge_entry(entry, dev)
            return
        if threading.get_ident() != self.thread or (own is not None and not own.running()):
            ts.charge_entry(entry, dev)
            return
        price = entry.price
        if not entry.cost or price is None or price.op is None:
            if entry.cost:
                self._charge(self.groups.close())
                ts.charge_entry(entry, dev)
            return  # (views, metadata: no kernel)
        self._charge(self.groups.add(self._record(entry, price.op, dev, args, out)))

    def _number(self, block: Any) -> int:
        """A block's number in this region (not ``id()``: a freed block's address is reused)."""
        key = self.keys.get(block)
        if key is None:
            key = self.keys[block] = len(self.blocks)
            self.blocks.append(weakref.ref(block))
        return key

    def _record(self, entry: Any, features: OpFeatures, dev: int, args: tuple, out: Any) -> OpRecord:
        reads: dict[int, int] = {}
        writes: dict[int, int] = {}
        size = out_size = 0
        for t in tree_flatten(args)[0]:
            if isinstance(t, EmuTensor) and t.emu_block is not None:
                n = t.numel()
                b = self._number(t.emu_block)
                reads[b] = max(reads.get(b, 0), n * t.element_size())
                size = max(size, n)
        for t in tree_flatten(out)[0]:
            if isinstance(t, EmuTensor) and t.emu_block is not None:
                n = t.numel()
                b = self._number(t.emu_block)
                writes[b] = max(writes.get(b, 0), n * t.element_size())
                out_size = max(out_size, n)
        return OpRecord(
            entry.name,
            features.op_class,
            features.backward,
            features.flops,
            features.dtype,
            dev,
            reads,
            writes,
            max(size, out_size),
            out_size,
            entry,
        )

    def _charge(self, kernels: list[Kernel]) -> None:
        ts = self.ts
        for k in kernels:
            self.kernels += 1
            self.ops += len(k.ops)
            first = k.ops[0]
            if not k.fused:
                ts.charge_entry(first.payload, first.dev)
                continue
            floors = [op_floor_seconds(self.rt, op) for op in k.ops if sets_floor(op)]
            price = fused_price(costs.kernel_price(self.rt, first.dev, fused_features(k)), k, floors)
            name = "+".join(op.name.split(".")[0] for op in k.ops[:4]) + ("+..." if len(k.ops) > 4 else "")
            ts.charge(price.gpu, first.dev, f"fused: {name}", price)

    def flush(self) -> None:
        """The graph ends here (the call's end, a graph break): the open group is charged."""
        self._charge(self.groups.close())
