"""``torch.nn.DataParallel`` across emulated GPUs.

Its scatter / broadcast / gather / reduce primitives are C functions of the CUDA build; here they
become copies between emulated devices (each charged as a transfer by the device layer).

Replicas (:mod:`.replicas`): device 0 runs the ORIGINAL module on its chunk, and when that call
was charged as whole-module work (no per-op pricing) each other replica is a mirror of it on its
own device: the same spans, outputs shaped as device 0's, its saved-activation memory, and
gradients for its input chunk and parameter copies (so DataParallel's gradient reduction to
device 0 happens as usual). Replicas run op by op as they are when the mirror does not apply:
chunks of other shapes than device 0's, module hooks (they would fire once, not per replica), a
first call priced op by op, or a sharing backend.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import _functions, comm
from torch.nn.parallel.replicate import _broadcast_coalesced_reshape
from torch.nn.parallel.replicate import replicate as torch_replicate
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..device import EmuTensor, peer_copy
from .meeting import tensor_bytes
from .replicas import DeferredReplicas, Mirror, MirrorPlan, ReplicaOutput, has_hooks, leaf_spec, replicate
from .run_parts import RunParts

__all__ = ["DataParallelSurface", "install_data_parallel"]

# (the package re-exports the function under the module's name)
_PARALLEL_APPLY_MODULE = importlib.import_module("torch.nn.parallel.parallel_apply")
# torch.nn.parallel.comm's C primitives -> the DataParallelSurface method standing for each
_COMM = ("broadcast_coalesced", "scatter", "gather", "reduce_add_coalesced")


def _cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


@dataclass(frozen=True)
class _FirstCall:
    """Device 0's call of the original module."""

    output: Any
    spans: list  # its spans on device 0
    memory_before: int  # bytes allocated on device 0 before it


class DataParallelSurface:
    """DataParallel's primitives and replica runs of one run; each public method stands for the
    torch function of its name (patched in as bound methods)."""

    def __init__(self, parts: RunParts) -> None:
        self.parts = parts
        self.rt = parts.rt
        self.device_index = parts.cuda.device_index
        # per original module: device -> recorder index its mirrored backward reached
        self.progress: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
        # The background copy streams of torch's Scatter, one per device (as torch keeps them): a
        # batch copied from the host does not wait for the device's compute stream.
        self.side_streams: dict[int, Any] = {}

    def indices(self, devices: Any) -> list[int]:
        return [self.device_index(d) for d in devices]

    @staticmethod
    def copy_to(t: torch.Tensor, d: int) -> torch.Tensor:
        # (inside the autograd Functions of torch.nn.parallel: a plain copy between emulated GPUs)
        if isinstance(t, EmuTensor):
            return t if t.get_device() == d else peer_copy(t, d)
        return t.to(_cuda(d), non_blocking=True)

    # ---------------------------------------------------------------- torch.nn.parallel.comm
    def broadcast_coalesced(self, tensors: Any, devices: Any, buffer_size: int = 10485760) -> list:
        return [[self.copy_to(t, d) for t in tensors] for d in self.indices(devices)]

    def scatter(
        self,
        tensor: torch.Tensor,
        devices: Any = None,
        chunk_sizes: Any = None,
        dim: int = 0,
        streams: Any = None,
        *,
        out: Any = None,
    ) -> tuple:
        if out is not None:
            chunks = tensor.split([o.shape[dim] for o in out], dim)
            for o, c in zip(out, chunks, strict=False):
                o.copy_(c, non_blocking=True)
            return tuple(out)
        devs = self.indices(devices)
        chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devs), dim)
        outputs = []
        for i, (c, d) in enumerate(zip(chunks, devs, strict=False)):
            with torch.cuda.stream(streams[i]) if streams else contextlib.nullcontext():
                outputs.append(c.to(_cuda(d), non_blocking=True) if c.device != _cuda(d) else c.contiguous())
        return tuple(outputs)

    def gather(self, tensors: Any, dim: int = 0, destination: Any = None, *, out: Any = None) -> torch.Tensor:
        if out is not None:
            return torch.cat([t.to(out.device, non_blocking=True) for t in tensors], dim, out=out)
        if destination == -1 or destination == "cpu":
            target = torch.device("cpu")
        else:
            target = _cuda(self.device_index(destination))
        return torch.cat([t.to(target, non_blocking=True) for t in tensors], dim)

    def reduce_add_coalesced(self, inputs: Any, destination: Any = None, buffer_size: int = 10485760) -> tuple:
        target = self.device_index(destination)
        result = []
        for group in zip(*inputs, strict=False):
            total = None
            for t in group:
                t = self.copy_to(t, target)
                total = t if total is None else total + t
            result.append(total)
        return tuple(result)

    # ---------------------------------------------------------------- torch.nn.parallel._functions
    def get_stream(self, device: Any) -> Any:
        index = self.device_index(device)
        if index not in self.side_streams:
            self.side_streams[index] = self.parts.cuda.Stream(device=index)
        return self.side_streams[index]

    def scatter_forward(self, ctx: Any, target_gpus: Any, chunk_sizes: Any, dim: int, input: torch.Tensor) -> tuple:
        """``Scatter.forward``: torch's, without torch.device(int) (C-level parsing that needs a
        real accelerator)."""
        target_gpus = self.indices(target_gpus)
        ctx.dim = dim
        ctx.input_device = input.get_device() if input.device.type != "cpu" else -1
        streams = [self.get_stream(d) for d in target_gpus] if ctx.input_device == -1 else None
        outputs = self.scatter(input, target_gpus, chunk_sizes, dim, streams)
        if streams is not None:  # the compute streams wait for the copies (GPU side)
            for d, stream in zip(target_gpus, streams, strict=False):
                with torch.cuda.device(d):
                    torch.cuda.current_stream().wait_stream(stream)
        return outputs

    # ---------------------------------------------------------------- torch.nn.parallel.parallel_apply
    def parallel_apply(self, modules: Any, inputs: Any, kwargs_tup: Any = None, devices: Any = None) -> list:
        if kwargs_tup is None:
            kwargs_tup = ({},) * len(modules)
        if isinstance(modules, DeferredReplicas):
            return self.apply_deferred(modules, inputs, kwargs_tup, list(devices or modules.devices))
        if devices is None:
            devices = [None] * len(modules)
        return [self.run_replica(m, a, k, d) for m, a, k, d in zip(modules, inputs, kwargs_tup, devices, strict=False)]

    def run_replica(self, module: nn.Module, args: Any, kwargs: dict, device: Any) -> Any:
        if device is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else self.rt.current_device
        if not isinstance(args, (list, tuple)):
            args = (args,)
        with torch.cuda.device(self.device_index(device)):
            return module(*args, **kwargs)

    def mirrorable(self, origin: nn.Module, inputs: Any, kwargs_tup: Any) -> bool:
        """Whether the other replicas can be mirrors of device 0 (before running anything)."""
        if self.rt.sharing is not None or has_hooks(origin):
            return False
        leaves0, spec0 = tree_flatten((inputs[0], kwargs_tup[0]))
        key0 = [leaf_spec(x) for x in leaves0]
        for args, kwargs in zip(inputs[1:], kwargs_tup[1:], strict=False):
            leaves, spec = tree_flatten((args, kwargs))
            if spec != spec0 or [leaf_spec(x) for x in leaves] != key0:
                return False
        return True

    def apply_deferred(self, deferred: DeferredReplicas, inputs: Any, kwargs_tup: Any, devices: list) -> list:
        origin = deferred.module
        devs = self.indices(devices)
        dev0 = devs[0]
        if not self.mirrorable(origin, inputs, kwargs_tup):
            replicas = [origin, *torch_replicate(origin, devs[1:], deferred.detach)]
            return [
                self.run_replica(m, a, k, d) for m, a, k, d in zip(replicas, inputs, kwargs_tup, devs, strict=False)
            ]
        spans = self.rt.recorder.spans
        before_spans, before_memory = len(spans), self.rt.memory[dev0].allocated
        out0 = self.run_replica(origin, inputs[0], kwargs_tup[0], dev0)
        first = _FirstCall(out0, [s for s in spans[before_spans:] if s.device == dev0], before_memory)
        out_leaves, _ = tree_flatten(out0)
        tensors = [o for o in out_leaves if isinstance(o, torch.Tensor)]
        if (
            not first.spans
            or any(s.kind != "forward" for s in first.spans)
            or not all(isinstance(o, EmuTensor) for o in tensors)
        ):
            # Device 0's work was priced op by op (a first call): the replicas run as they are.
            replicas = torch_replicate(origin, devs[1:], deferred.detach)
            return [out0] + [
                self.run_replica(m, a, k, d)
                for m, a, k, d in zip(replicas, inputs[1:], kwargs_tup[1:], devs[1:], strict=False)
            ]
        return [out0, *self.mirrors(deferred, first, inputs[1:], kwargs_tup[1:], devs)]

    def mirrors(self, deferred: DeferredReplicas, first: _FirstCall, inputs: Any, kwargs_tup: Any, devs: list) -> list:
        """The outputs of mirrors of device 0's call on ``devs[1:]``."""
        origin, dev0 = deferred.module, devs[0]
        # The parameters and buffers are broadcast as replicate() does (the parameter copies carry
        # each replica's gradients back); the replica modules themselves are not needed.
        # (Buffer copies, which replicate() also makes, would be dropped at once: not made.)
        copies = _broadcast_coalesced_reshape(list(origin.parameters()), devs[1:], deferred.detach)
        out_leaves, out_spec = tree_flatten(first.output)
        tensors = [o for o in out_leaves if isinstance(o, torch.Tensor)]
        out_specs = [
            ReplicaOutput(tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, tensor_bytes(o), o.requires_grad)
            for o in tensors
        ]
        allocated = self.rt.memory[dev0].allocated
        saved = max(0, allocated - first.memory_before - sum(spec.nbytes for spec in out_specs))
        plan_spans = [(s.kind, s.name, s.end - s.start) for s in first.spans]
        done = self.progress.setdefault(origin, {})
        since = len(self.rt.recorder.spans)
        outputs = []
        for j, (args, kwargs, dev) in enumerate(zip(inputs, kwargs_tup, devs[1:], strict=False)):
            plan = MirrorPlan(self.parts, dev, dev0, plan_spans, since, out_specs, saved, done)
            grads_from = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            grads_from += [p for p in copies[j] if isinstance(p, torch.Tensor)]
            mirrored_out = iter(Mirror.apply(plan, *grads_from))
            outputs.append(
                tree_unflatten([next(mirrored_out) if isinstance(o, torch.Tensor) else o for o in out_leaves], out_spec)
            )
        self.rt.recorder.add("dp_mirrored_replicas", float(len(devs) - 1))
        return outputs


def _data_parallel_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The wrapper itself is not the unit whose GPU time is charged: each replica's work is
    # charged on its own device (a batch/N share each), so N emulated GPUs work in parallel.
    return nn.Module._call_impl(self, *args, **kwargs)


def install_data_parallel(parts: RunParts) -> None:
    """torch.nn.DataParallel across the run's emulated GPUs (through ``rt.patcher``)."""
    surface, patcher = DataParallelSurface(parts), parts.rt.patcher
    pairs = [(getattr(comm, name), getattr(surface, name)) for name in _COMM]
    pairs.append((_PARALLEL_APPLY_MODULE.parallel_apply, surface.parallel_apply))
    patcher.replace_everywhere_many(pairs)
    patcher.replace(_functions, "_get_stream", surface.get_stream)
    patcher.replace(_functions.Scatter, "forward", staticmethod(surface.scatter_forward))
    patcher.replace(nn.DataParallel, "replicate", replicate)
    patcher.replace(nn.DataParallel, "__call__", _data_parallel_call)
