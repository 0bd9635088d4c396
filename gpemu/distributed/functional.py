"""Functional collectives (``torch.ops._c10d_functional.*``: DTensor, FSDP2, tensor parallelism).

They reach the emulated tensor's dispatch as ops, which hands them to the handlers here
(``TensorState.op_handlers``, by ``id(op)``): the outputs are what the op's meta kernel says; the
time, the meeting and the values are those of the c10d collective (:mod:`.collectives`); a
collective's result is ready when it returns, so ``wait_tensor`` has nothing left to wait for
(stream order already holds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..device import EmuTensor, from_meta
from .collectives import Call, Collectives, Root
from .meeting import device_of, functional_values_op, knows, proxy, tensor_bytes

__all__ = ["Functional", "HANDLERS", "NAMESPACES"]

NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")
# op name (every overload) -> the Functional method that handles it
HANDLERS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_": "all_reduce_",
    "all_reduce_coalesced_": "all_reduce_",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast_",
    "wait_tensor": "wait_tensor",
}


def _meta_like(x: Any) -> Any:
    if isinstance(x, EmuTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta_like(v) for v in x)
    return x


def _group(name: Any) -> ProcessGroup:
    if isinstance(name, ProcessGroup):
        return name
    return c10d_module._resolve_process_group(name)


def _listed(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class Functional:
    """The handlers of one run; each takes ``(op, args, kwargs)`` as the dispatch calls it."""

    def __init__(self, shared: Collectives) -> None:
        self.shared = shared

    def handlers(self) -> dict[int, Callable[[Any, tuple, dict], Any]]:
        """id(op) -> handler, for the functional collectives this torch has."""
        table: dict[int, Callable[[Any, tuple, dict], Any]] = {}
        for namespace in NAMESPACES:
            ops = getattr(torch.ops, namespace, None)
            for name, method in HANDLERS.items():
                try:
                    packet = getattr(ops, name)
                except (AttributeError, RuntimeError):
                    continue
                for overload in packet.overloads():
                    table[id(getattr(packet, overload))] = getattr(self, method)
        return table

    def outputs(self, func: OpOverload, args: tuple, kwargs: dict, dev: int) -> Any:
        """The op's outputs as its meta kernel makes them, emulated on ``dev``."""
        mout = func(*_meta_like(list(args)), **{k: _meta_like(v) for k, v in kwargs.items()})
        ts = self.shared.parts.tensors
        leaves, spec = tree_flatten(mout)
        return tree_unflatten([from_meta(ts, m, dev) if isinstance(m, torch.Tensor) else m for m in leaves], spec)

    # (inputs, reduce_op, group_name)
    def all_reduce(self, func: OpOverload, args: tuple, kwargs: dict, inplace: bool = False) -> Any:
        inputs = _listed(args[0])
        call = Call("all_reduce", _group(args[2]), device_of(inputs))
        out = args[0] if inplace else self.outputs(func, args, kwargs, call.dev)
        how = functional_values_op(args[1])
        self.shared.all_reduce(call, inputs, _listed(out), how, [tensor_bytes(t) for t in inputs])
        return out

    def all_reduce_(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        return self.all_reduce(func, args, kwargs, inplace=True)

    # (inputs, group_size, group_name)
    def all_gather(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        inputs = _listed(args[0])
        call = Call("all_gather_into_tensor", _group(args[2]), device_of(inputs))
        out = kwargs["out"] if "out" in kwargs else self.outputs(func, args, kwargs, call.dev)
        self.shared.all_gather(call, inputs, _listed(out))
        return out

    # (inputs, reduce_op, group_size, group_name)
    def reduce_scatter(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        inputs = _listed(args[0])
        call = Call("reduce_scatter_tensor", _group(args[3]), device_of(inputs))
        out = self.outputs(func, args, kwargs, call.dev)
        fulls = [proxy(t) if knows(t) else None for t in inputs]
        how = functional_values_op(args[1])
        self.shared.reduce_scatter(call, fulls, _listed(out), how, [tensor_bytes(t) for t in inputs])
        return out

    # (input, output_split_sizes, input_split_sizes, group_name)
    def all_to_all(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        call = Call("all_to_all_single", _group(args[3]), device_of(args[0]))
        out = self.outputs(func, args, kwargs, call.dev)
        self.shared.all_to_all(call, [tensor_bytes(args[0])], _listed(out))
        return out

    # (input, src (a rank of the group), group_name)
    def broadcast(self, func: OpOverload, args: tuple, kwargs: dict, inplace: bool = False) -> Any:
        tensor = args[0]
        call = Call("broadcast", _group(args[2]), device_of(tensor))
        out = tensor if inplace else self.outputs(func, args, kwargs, call.dev)
        self.shared.broadcast(call, tensor, out, Root(None, int(args[1])))
        return out

    def broadcast_(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        return self.broadcast(func, args, kwargs, inplace=True)

    def wait_tensor(self, func: OpOverload, args: tuple, kwargs: dict) -> Any:
        return args[0]
