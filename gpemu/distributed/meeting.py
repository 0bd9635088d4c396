"""Ranks meet: one small real gloo message per emulated collective, and the values it carries.

An emulated collective's ranks really exchange ONE 16-byte host message (a MAX all-reduce): the
latest finish time, since a collective ends when the last rank's ends, and whether every rank
knows the values. Only for known values (:mod:`gpemu.hostvalues`) does a second message carry
them, as float64 / int64 host stand-ins (:func:`proxy`) that gloo reduces.

The unpatched c10d functions are kept here (:data:`ORIGINAL`, :data:`HOST_PATH`): this module is
imported before ``install`` patches them, and the messages go through them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d_module

from ..device import EmuTensor, host_shadow, set_host_shadow
from ..hostvalues import SHADOW_MAX_ELEMENTS
from ..runtime import current

__all__ = [
    "ORIGINAL",
    "HOST_PATH",
    "Meeting",
    "ValuesOp",
    "meet",
    "barrier",
    "lockstep",
    "knows",
    "known_or_host",
    "proxy",
    "proxy_dtype",
    "store",
    "values_op",
    "functional_values_op",
    "outside",
    "group_rank",
    "is_emulated",
    "tensor_bytes",
    "device_of",
    "any_emulated",
]

# The unpatched c10d functions (this module is imported before install patches them).
ORIGINAL: dict[str, Callable[..., Any]] = {
    name: getattr(c10d_module, name)
    for name in (
        "init_process_group",
        "new_group",
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather",
        "all_gather_single",
        "all_gather_into_tensor",
        "_all_gather_base",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
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
    if hasattr(c10d_module, name)
}
# What each collective does with host tensors: torch's own function, except the single-tensor
# all-gather and reduce-scatter, which go to the function every other name of them calls
# (``all_gather_single`` since torch 2.13; ``all_gather_into_tensor`` calls it), never to a name
# that would call back into a patched one.
HOST_PATH: dict[str, Callable[..., Any]] = {
    **ORIGINAL,
    "all_gather_into_tensor": ORIGINAL.get("all_gather_single") or ORIGINAL["all_gather_into_tensor"],
    "reduce_scatter_tensor": ORIGINAL.get("reduce_scatter_single") or ORIGINAL["reduce_scatter_tensor"],
}
_MAX = dist.ReduceOp.MAX


class Meeting(NamedTuple):
    """What the ranks agreed in their one message."""

    finish: float  # the latest rank's finish time
    everyone_knows: bool  # every rank knows its values
    work: Any  # the message's (completed) work object


def meet(group: ProcessGroup | None, finish: float, knows: bool = True) -> Meeting:
    """One real gloo all-reduce (MAX) of a 16-byte host tensor among the group's ranks.

    Note: on virtual time the ranks' times are comparable (one origin for the run, each rank's
    host time its own CPU time), so the latest ``finish`` is the latest arrival plus the
    collective's price whatever the real order of arrival on a busy host; the message itself is
    the emulator's own work (NCCL would have returned to the program at once), forgiven."""
    rt = current()
    if rt is not None and rt.config.virtual_time:
        return rt.engine.call(_meet, group, finish, knows)
    return _meet(group, finish, knows)


def _meet(group: ProcessGroup | None, finish: float, knows: bool) -> Meeting:
    t = torch.tensor([finish, 0.0 if knows else 1.0], dtype=torch.float64)
    rt = current()
    if rt is not None and rt.placement is not None:  # the run's wire (a folded run's processes)
        work = rt.placement.wire.all_reduce(t, _MAX, group)
    else:
        work = ORIGINAL["all_reduce"](t, op=_MAX, group=group, async_op=True)
        work.wait()
    return Meeting(float(t[0]), t[1].item() == 0.0, work)


def barrier(group: ProcessGroup | None, async_op: bool) -> Any:
    """``dist.barrier()``: torch's own; on virtual time the ranks also meet on their times and
    each leaves at the latest arrival, an arrival being when both its host and its device's
    work reached the barrier (NCCL's barrier is a collective its host then waits for)."""
    rt = current()
    if rt is None or not rt.config.virtual_time:
        if rt is not None and rt.placement is not None:
            return rt.placement.wire.barrier(group, async_op)
        return ORIGINAL["barrier"](group=group, async_op=async_op)
    engine = rt.engine
    device = engine.current_device()
    arrival = max(engine.now(), engine.device_busy_until(device))
    met = meet(group, arrival)
    engine.arrive(met.finish, "barrier")
    return met.work if async_op else None


def lockstep(group: ProcessGroup | None, value: float) -> float:
    """The group's latest ``value`` (one real gloo message): ranks wait for the slowest."""
    return meet(group, value).finish


def is_emulated(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def device_of(*tensors: Any) -> int:
    """The emulated device of the first emulated tensor among ``tensors`` (lists are looked into);
    0 when there is none."""
    for t in _flat(tensors):
        if is_emulated(t):
            return t.device.index or 0
    return 0


def any_emulated(*items: Any) -> bool:
    """Whether any of ``items`` (tensors, lists of them, other arguments) is an emulated tensor."""
    return any(is_emulated(t) for t in _flat(items))


def _flat(items: Iterable[Any]) -> Iterable[Any]:
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from item
        else:
            yield item


def knows(t: Any) -> bool:
    """Whether this rank knows the values of emulated tensor ``t`` (small enough to carry)."""
    # (complex values would need two reals per element on the wire: left unknown)
    return (
        isinstance(t, EmuTensor)
        and t.numel() <= SHADOW_MAX_ELEMENTS
        and not t.dtype.is_complex
        and host_shadow(t) is not None
    )


def known_or_host(t: Any) -> bool:
    """Known values, or a host tensor (whose values are its own)."""
    return knows(t) or not is_emulated(t)


def proxy_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if (t.dtype.is_floating_point or t.dtype.is_complex) else torch.int64


def proxy(t: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """A flat host stand-in of ``t`` for gloo: its known values (zeros where this rank has none),
    as float64 or int64 (gloo reduces both; they hold every value a host shadow may have)."""
    if value is None:
        value = host_shadow(t) if isinstance(t, EmuTensor) else (t if t.device.type == "cpu" else None)
    dtype = proxy_dtype(t)
    if value is None:
        return torch.zeros(t.numel(), dtype=dtype)
    return value.detach().reshape(-1).to(dtype).clone()


def store(t: Any, value: torch.Tensor | None) -> None:
    """Give ``t`` (emulated or host) the value a collective left in it (None: unknown)."""
    if isinstance(t, EmuTensor):
        set_host_shadow(t, None if value is None else value.reshape(t.shape))
    elif isinstance(t, torch.Tensor) and value is not None and t.numel() == value.numel():
        with torch.no_grad():
            t.copy_(value.reshape(t.shape))


class ValuesOp(NamedTuple):
    """How gloo reproduces a reduction's values: its reduce op (None: the values are not
    reproduced), and whether to divide by the world size after it (an average)."""

    op: Any
    average: bool


_NOT_REPRODUCED = ValuesOp(None, False)
# The functional collectives' reduce-op names.
_FUNCTIONAL_OPS = {
    "sum": ValuesOp(dist.ReduceOp.SUM, False),
    "avg": ValuesOp(dist.ReduceOp.SUM, True),
    "max": ValuesOp(dist.ReduceOp.MAX, False),
    "min": ValuesOp(dist.ReduceOp.MIN, False),
    "product": ValuesOp(dist.ReduceOp.PRODUCT, False),
    "band": ValuesOp(dist.ReduceOp.BAND, False),
    "bor": ValuesOp(dist.ReduceOp.BOR, False),
    "bxor": ValuesOp(dist.ReduceOp.BXOR, False),
}


def values_op(op: Any) -> ValuesOp:
    """For a c10d reduce op; PREMUL_SUM's factor is opaque: not reproduced."""
    if op is None or op == dist.ReduceOp.SUM:
        return ValuesOp(dist.ReduceOp.SUM, False)
    if op == dist.ReduceOp.AVG:
        return ValuesOp(dist.ReduceOp.SUM, True)
    for name in ("MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"):
        if op == getattr(dist.ReduceOp, name):
            return ValuesOp(op, False)
    return _NOT_REPRODUCED


def functional_values_op(name: Any) -> ValuesOp:
    """For a functional collective's reduce-op name ('sum', 'avg', ...)."""
    return _FUNCTIONAL_OPS.get(name, _NOT_REPRODUCED)


def outside(group: ProcessGroup | None) -> bool:
    """This rank is not a member of ``group``: c10d's collectives do nothing here (as torch's)."""
    return group is not None and c10d_module._rank_not_in_group(group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()
