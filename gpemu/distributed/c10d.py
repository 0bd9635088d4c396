"""c10d's collectives (``dist.all_reduce(t)``, ...) on emulated tensors; host tensors go to gloo.

Every collective shares one preamble (:func:`c10d_form`): host tensors only, torch's own function;
a group this rank is not in, nothing (as torch); the work object only for ``async_op=True``. The
body is the emulated case, and calls the collective of :mod:`.collectives` that the functional
form calls too; reduce, scatter, gather, the list all-gather and point-to-point are c10d's only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..costmodel.comm import Collective
from ..device import EmuTensor, host_shadow
from ..hostvalues import SHADOW_MAX_ELEMENTS
from .collectives import Call, Collectives
from .folding import Root, global_rank
from .meeting import (
    HOST_PATH,
    ORIGINAL,
    any_emulated,
    device_of,
    group_rank,
    known_or_host,
    knows,
    outside,
    proxy,
    proxy_dtype,
    store,
    tensor_bytes,
    values_op,
)
from .meeting import barrier as meeting_barrier

__all__ = ["C10d", "c10d_form", "C10D_NAMES"]

_SUM = dist.ReduceOp.SUM
_NOT_FOLDED = object()  # a host collective that torch's own function does
# The c10d functions replaced (module attributes of torch.distributed and every by-name copy).
C10D_NAMES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "scatter",
    "gather",
    "all_to_all_single",
    "all_to_all",
    "barrier",
    "isend",
    "irecv",
    "send",
    "recv",
    "batch_isend_irecv",
)
# Other names of the single-tensor all-gather and reduce-scatter, where this torch has them.
_ALIASES = {
    "all_gather_single": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
}


def c10d_form(torch_name: str, outside_value: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The preamble of c10d collective ``torch_name`` (the decorated method has torch's signature
    and is the emulated case only): without an emulated tensor among the arguments, torch's own
    function runs (:data:`HOST_PATH`); on a rank outside the group, nothing (``outside_value``);
    the body's work object is returned only for ``async_op=True`` (where the signature has it)."""

    def form(body: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(body)
        returns_work = "async_op" in signature.parameters

        @functools.wraps(body)
        def collective(self: C10d, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)
            given = bound.arguments
            if not any_emulated(*given.values()):
                folded = self.folded_host(torch_name, given)
                if folded is not _NOT_FOLDED:
                    return folded if given.get("async_op") else None
                return HOST_PATH[torch_name](*bound.args[1:], **bound.kwargs)
            if outside(given.get("group")):
                return outside_value
            result = body(self, *args, **kwargs)
            return result if not returns_work or given.get("async_op") else None

        return collective

    return form


class C10d:
    """The c10d collectives of one run (patched in as bound methods)."""

    def __init__(self, shared: Collectives) -> None:
        self.shared = shared

    def replacements(self) -> dict[str, Callable[..., Any]]:
        """torch name -> this run's function, for the names this torch has."""
        table = {name: getattr(self, name) for name in C10D_NAMES}
        table.update({alias: getattr(self, ours) for alias, ours in _ALIASES.items() if alias in ORIGINAL})
        return table

    def folded_host(self, torch_name: str, given: dict[str, Any]) -> Any:
        """A collective on host tensors in a folded run, as the ranks the processes stand for
        would leave it (torch's fake process group leaves a sum one rank's); the work object, or
        ``_NOT_FOLDED`` where torch's own function does it (outside a folded run, other names)."""
        wire = self.shared.parts.placement.wire
        if wire.fold is None:
            return _NOT_FOLDED
        group, op = given.get("group"), given.get("op", _SUM)
        if torch_name in ("all_reduce", "reduce"):
            return wire.all_reduce(given["tensor"], op, group)
        if torch_name == "broadcast":
            return wire.broadcast(given["tensor"], Root(given.get("src"), given.get("group_src")), group)
        if torch_name == "all_gather_into_tensor":
            return wire.all_gather_into(given["output_tensor"], given["input_tensor"], group)
        if torch_name == "all_gather":
            return wire.all_gather(given["tensor_list"], given["tensor"], group)
        if torch_name == "reduce_scatter_tensor":
            output = given["output"]
            whole = given["input"].detach().reshape(-1).clone()
            work = wire.all_reduce(whole, op, group)
            share, rank = output.numel(), group_rank(group)
            with torch.no_grad():
                output.copy_(whole[rank * share : (rank + 1) * share].reshape(output.shape))
            return work
        return _NOT_FOLDED

    # ---------------------------------------------------------------- shared with the functional form
    @c10d_form("all_reduce")
    def all_reduce(
        self, tensor: torch.Tensor, op: Any = _SUM, group: ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        call = Call("all_reduce", group, device_of(tensor))
        return self.shared.all_reduce(call, [tensor], [tensor], values_op(op), [tensor_bytes(tensor)])

    @c10d_form("all_reduce_coalesced")
    def all_reduce_coalesced(
        self, tensors: list, op: Any = _SUM, group: ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        tensors = list(tensors)
        call = Call("all_reduce_coalesced", group, device_of(tensors))
        nbytes = sum(tensor_bytes(t) for t in tensors)  # one message
        return self.shared.all_reduce(call, tensors, tensors, values_op(op), [nbytes])

    @c10d_form("broadcast")
    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: ProcessGroup | None = None,
        async_op: bool = False,
        group_src: int | None = None,
    ) -> Any:
        return self.shared.broadcast(Call("broadcast", group, device_of(tensor)), tensor, tensor, Root(src, group_src))

    @c10d_form("all_gather_into_tensor")
    def all_gather_into_tensor(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        call = Call("all_gather_into_tensor", group, device_of(output_tensor, input_tensor))
        return self.shared.all_gather(call, [input_tensor], [output_tensor])

    @c10d_form("reduce_scatter_tensor")
    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: Any = _SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        call = Call("reduce_scatter_tensor", group, device_of(output, input))
        full = proxy(input) if knows(input) else None
        return self.shared.reduce_scatter(call, [full], [output], values_op(op), [tensor_bytes(input)])

    @c10d_form("reduce_scatter")
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list,
        op: Any = _SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        call = Call("reduce_scatter", group, device_of(output, input_list))
        values = [host_shadow(t) if isinstance(t, EmuTensor) else t for t in input_list]
        known = all(v is not None for v in values) and sum(t.numel() for t in input_list) <= SHADOW_MAX_ELEMENTS
        full = torch.cat([proxy(t, v) for t, v in zip(input_list, values, strict=False)]) if known else None
        nbytes = sum(tensor_bytes(t) for t in input_list)
        return self.shared.reduce_scatter(call, [full], [output], values_op(op), [nbytes])

    @c10d_form("all_to_all_single")
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        call = Call("all_to_all_single", group, device_of(output, input))
        return self.shared.all_to_all(call, [tensor_bytes(input)], [output])

    @c10d_form("all_to_all")
    def all_to_all(
        self,
        output_tensor_list: list,
        input_tensor_list: list,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        call = Call("all_to_all", group, device_of(output_tensor_list, input_tensor_list))
        nbytes = sum(tensor_bytes(t) for t in input_tensor_list)
        return self.shared.all_to_all(call, [nbytes], output_tensor_list)

    # ---------------------------------------------------------------- c10d's own
    @c10d_form("reduce")
    def reduce(
        self,
        tensor: torch.Tensor,
        dst: int | None = None,
        op: Any = _SUM,
        group: ProcessGroup | None = None,
        async_op: bool = False,
        group_dst: int | None = None,
    ) -> Any:
        call, how, shared = Call("reduce", group, device_of(tensor)), values_op(op), self.shared
        is_root = Root(dst, group_dst).is_me(group)
        seconds = shared.price(Collective.REDUCE, [tensor_bytes(tensor)], call)
        met = shared.charge(call, seconds, knows(tensor) and how.op is not None)
        work = met.work
        if met.everyone_knows:
            value, work = shared.reduced(proxy(tensor), how, group)
            if is_root:
                store(tensor, value)
        elif is_root:
            store(tensor, None)
        return work

    @c10d_form("all_gather")
    def all_gather(
        self, tensor_list: list, tensor: torch.Tensor, group: ProcessGroup | None = None, async_op: bool = False
    ) -> Any:
        call, shared = Call("all_gather", group, device_of(tensor, tensor_list)), self.shared
        seconds = shared.price(Collective.ALL_GATHER, [tensor_bytes(tensor) * call.world], call)
        met = shared.charge(call, seconds, known_or_host(tensor))
        work = met.work
        if not met.everyone_knows:
            for dst in tensor_list:
                store(dst, None)
            return work
        share = proxy(tensor)
        outs = [torch.zeros_like(share) for _ in tensor_list]
        work = shared.parts.placement.wire.all_gather(outs, share, group)
        shared.values_sent()
        for dst, value in zip(tensor_list, outs, strict=False):
            store(dst, value)
        return work

    @c10d_form("scatter")
    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list | None = None,
        src: int | None = None,
        group: ProcessGroup | None = None,
        async_op: bool = False,
        group_src: int | None = None,
    ) -> Any:
        call, shared = Call("scatter", group, device_of(tensor, scatter_list)), self.shared
        world, share, shares = call.world, tensor.numel(), scatter_list or []
        is_root = Root(src, group_src).is_me(group)
        knowing = not is_root or (
            bool(shares) and all(known_or_host(t) for t in shares) and share * world <= SHADOW_MAX_ELEMENTS
        )
        met = shared.charge(call, shared.price(Collective.SCATTER, [tensor_bytes(tensor) * world], call), knowing)
        work, value = met.work, None
        if met.everyone_knows:
            dtype = proxy_dtype(tensor)
            joined = torch.cat([proxy(t) for t in shares]) if is_root else torch.zeros(share * world, dtype=dtype)
            joined = joined.to(dtype)
            work = shared.parts.placement.wire.broadcast(joined, Root(src, group_src), group)
            shared.values_sent()
            rank = group_rank(group)
            value = joined[rank * share : (rank + 1) * share]
        store(tensor, value)
        return work

    @c10d_form("gather")
    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list | None = None,
        dst: int | None = None,
        group: ProcessGroup | None = None,
        async_op: bool = False,
        group_dst: int | None = None,
    ) -> Any:
        call, shared = Call("gather", group, device_of(tensor, gather_list)), self.shared
        world = call.world
        met = shared.charge(call, shared.price(Collective.GATHER, [tensor_bytes(tensor) * world], call), knows(tensor))
        work, outs = met.work, None
        if met.everyone_knows:
            share = proxy(tensor)
            outs = [torch.zeros_like(share) for _ in range(world)]
            work = shared.parts.placement.wire.all_gather(outs, share, group)
            shared.values_sent()
        for i, t in enumerate(gather_list or ()):
            store(t, outs[i] if outs is not None else None)
        return work

    def barrier(self, group: ProcessGroup | None = None, async_op: bool = False, device_ids: Any = None) -> Any:
        # gloo has no per-device barrier; the device list only matters to NCCL.
        return meeting_barrier(group, async_op)

    # ---------------------------------------------------------------- point to point
    def batch_isend_irecv(self, p2p_op_list: list) -> list:
        """torch's batch (pipeline stages' activations and gradients): with emulated tensors, its
        sends are posted first, then its receives, each as :meth:`isend` / :meth:`irecv` (torch
        would coalesce them, and a coalesced send is not sent until the batch ends, while an
        emulated receive waits for its header at once)."""
        if not any_emulated([op.tensor for op in p2p_op_list]):
            return HOST_PATH["batch_isend_irecv"](p2p_op_list)
        sends = [op for op in p2p_op_list if getattr(op.op, "__name__", "") in ("isend", "send")]
        works = [self.isend(op.tensor, op.peer, op.group, op.tag) for op in sends]
        for op in p2p_op_list:
            if op not in sends:
                works.append(self.irecv(op.tensor, op.peer, op.group, op.tag))
        return works

    @c10d_form("isend")
    def isend(
        self,
        tensor: torch.Tensor,
        dst: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_dst: int | None = None,
    ) -> Any:
        # A header (when the transfer can end, whether values follow), then the known values.
        call, shared = Call("send", group, device_of(tensor)), self.shared
        engine = shared.parts.engine
        stream = engine.stream(call.dev)
        start = max(stream.busy_until, engine.now())
        priced = shared.price_pair(tensor_bytes(tensor), call, global_rank(group, dst, group_dst))
        finish = start + priced.seconds
        knowing = knows(tensor)
        header = torch.tensor([finish, 1.0 if knowing else 0.0], dtype=torch.float64)
        wire, peer = shared.parts.placement.wire, Root(dst, group_dst)
        work = wire.send(header, peer, group, tag)
        if knowing:  # (gloo keeps one pair's messages in order: the values' work ends last)
            work = wire.send(proxy(tensor), peer, group, tag)
            shared.values_sent()
        stream.enqueue(finish - start, "comm", f"{call.name} ({priced.links})", 0, start)
        shared.record(priced, priced.seconds, 0.0)
        return work

    @c10d_form("irecv")
    def irecv(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_src: int | None = None,
    ) -> Any:
        self.receive(tensor, Root(src, group_src), group, tag)
        # (a gloo receive's work, once waited, must not be waited again: a finished one instead)
        return self.shared.parts.placement.wire.complete()

    def receive(self, tensor: torch.Tensor, peer: Root, group: ProcessGroup | None, tag: int) -> int | None:
        """A header (when the sender's transfer ends, whether values follow), then the values;
        the time spent waiting for the sender is the receiving stage's pipeline bubble. The
        sender's global rank (None: unknown)."""
        call, shared = Call("recv", group, device_of(tensor)), self.shared
        engine = shared.parts.engine
        stream = engine.stream(call.dev)
        start = max(stream.busy_until, engine.now())
        header = torch.zeros(2, dtype=torch.float64)
        wire = shared.parts.placement.wire
        work = wire.recv(header, peer, group, tag)
        value = None
        source = global_rank(group, peer.rank, peer.group_rank)
        if source is None and wire.fold is None:  # received from any rank: the values come from it
            source = work._source_rank()
        if header[1].item():
            value = proxy(tensor)
            wire.recv(value, Root(source, None), group, tag)
            shared.values_sent()
        priced = shared.price_pair(tensor_bytes(tensor), call, source)
        finish = max(float(header[0]), start + priced.seconds)
        waited = finish - start - priced.seconds
        if waited > 0:
            stream.enqueue(waited, "comm", f"{call.name}: waiting for rank {source} (pipeline bubble)", 0, start)
        stream.enqueue(priced.seconds, "comm", f"{call.name} ({priced.links})", 0, start + max(waited, 0.0))
        shared.record(priced, priced.seconds, waited)
        shared.parts.rt.recorder.add("comm_p2p_wait_seconds", max(waited, 0.0))
        store(tensor, value)
        return source

    @c10d_form("send")
    def send(
        self,
        tensor: torch.Tensor,
        dst: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_dst: int | None = None,
    ) -> None:
        self.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst).wait()

    @c10d_form("recv", outside_value=-1)
    def recv(
        self,
        tensor: torch.Tensor,
        src: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_src: int | None = None,
    ) -> int:
        """The sender's global rank."""
        source = self.receive(tensor, Root(src, group_src), group, tag)
        return -1 if source is None else source
