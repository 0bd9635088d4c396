"""``nn.DataParallel``'s replicas as mirrors of device 0's call.

``DataParallel`` replicates the module every step (new module objects holding broadcast copies of
the parameters) and runs them in threads. While gpemu is patched, ``replicate`` is deferred
(:func:`replicate` returns :class:`DeferredReplicas`) to ``parallel_apply``, which knows the
inputs: device 0 runs the ORIGINAL module on its chunk (so the replay fast path and the model's
measured or recorded time apply), and when that call was charged as whole-module work each other
replica is a :class:`Mirror` of it on its own device (see :mod:`.data_parallel`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn as nn
from torch.nn.parallel.replicate import replicate as torch_replicate

from ..device import from_meta

if TYPE_CHECKING:  # pragma: no cover
    from .run_parts import RunParts

__all__ = ["ReplicaOutput", "MirrorPlan", "Mirror", "DeferredReplicas", "replicate", "has_hooks", "leaf_spec"]


class ReplicaOutput(NamedTuple):
    """One output tensor of device 0's call, as a replica makes it again."""

    shape: tuple
    stride: tuple
    offset: int | torch.SymInt
    dtype: torch.dtype
    nbytes: int
    requires_grad: bool


@dataclass(eq=False)
class MirrorPlan:
    """What device 0's call of the original module did, to be done again on device ``dev``."""

    parts: RunParts
    dev: int
    dev0: int
    spans: list  # (kind, name, seconds) of device 0's spans of the call
    since: int  # index of the recorder's first span after device 0's call
    out_specs: list[ReplicaOutput]  # each output tensor of the call
    saved: int  # bytes of saved activations device 0's call left allocated
    progress: dict  # device -> index of the recorder's spans its mirrored backward reached
    names: set = field(init=False)

    def __post_init__(self) -> None:
        self.names = {name for _, name, _ in self.spans}

    def charge_backward(self, issued: float) -> None:
        """At the end of the backward pass: device 0's backward spans of this call (since the
        last mirrored backward) on this device, from when the replica's backward was issued."""
        spans, done = self.parts.rt.recorder.spans, self.progress
        first = max(self.since, done.get(self.dev, 0))
        stream = self.parts.engine.stream(self.dev)
        for i in range(first, len(spans)):
            s = spans[i]
            if s.device == self.dev0 and s.kind == "backward" and s.name in self.names:
                stream.enqueue(s.end - s.start, s.kind, s.name, 0, issued)
        done[self.dev] = len(spans)


class Mirror(torch.autograd.Function):
    """One replica of ``nn.DataParallel`` on device ``plan.dev``: the same GPU work as device 0's
    call of the original module (replicas are identical copies on equal chunks), charged on its
    own device without running the replica on the host. Its backward charges device 0's backward
    spans of that call at the end of the backward pass (when they are known), on its own device,
    from the time the replica's backward was issued."""

    @staticmethod
    def forward(ctx: Any, plan: MirrorPlan, *tensors: torch.Tensor) -> Any:
        parts = plan.parts
        stream = parts.engine.stream(plan.dev)
        for kind, name, seconds in plan.spans:
            stream.enqueue(seconds, kind, name)
        mem = parts.rt.memory[plan.dev]
        ctx.plan = plan
        ctx.saved = mem.allocate(plan.saved) if plan.saved > 0 else None  # its saved activations
        ctx.shapes = [(t.shape, t.dtype) for t in tensors]
        ts = parts.tensors
        outs = []
        for spec in plan.out_specs:
            block = mem.allocate(spec.nbytes) if spec.nbytes else None
            outs.append(ts.wrap(spec.shape, spec.stride, spec.offset, spec.dtype, plan.dev, block))
        ctx.mark_non_differentiable(
            *[o for o, spec in zip(outs, plan.out_specs, strict=True) if not spec.requires_grad]
        )
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        plan = ctx.plan
        ctx.saved = None  # the saved activations are freed by the backward
        parts = plan.parts
        issued = parts.engine.now()
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(plan.charge_backward, issued))
        out: list[torch.Tensor | None] = [None]
        for (shape, dtype), needed in zip(ctx.shapes, ctx.needs_input_grad[1:], strict=False):
            meta = torch.empty(shape, dtype=dtype, device="meta")
            out.append(from_meta(parts.tensors, meta, plan.dev) if needed else None)
        return tuple(out)


class DeferredReplicas(list):
    """What ``DataParallel.replicate`` returns while gpemu is patched: the module itself for the
    first device and placeholders for the others, until ``parallel_apply`` decides how the
    replicas run (torch's replicas, made then, or mirrors of device 0)."""

    def __init__(self, module: nn.Module, devices: list, detach: bool) -> None:
        super().__init__([module] + [None] * (len(devices) - 1))
        self.module, self.devices, self.detach = module, devices, detach


def replicate(self: nn.DataParallel, module: nn.Module, device_ids: Any) -> list:
    """``DataParallel.replicate`` while patched."""
    if type(self).parallel_apply is not nn.DataParallel.parallel_apply:
        return torch_replicate(module, device_ids, not torch.is_grad_enabled())  # a subclass's own apply
    # Deferred to parallel_apply, which knows the inputs: it decides between running the
    # replicas and mirroring device 0 (no replica modules are made then).
    return DeferredReplicas(module, list(device_ids), not torch.is_grad_enabled())


def has_hooks(module: nn.Module) -> bool:
    """Whether module hooks would fire for ``module``'s call (once, not once per replica)."""
    g = torch.nn.modules.module
    if (
        g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
    ):
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks for m in module.modules()
    )


def leaf_spec(x: Any) -> Any:
    """What a replica's argument must match device 0's in for a mirror to stand for it."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.requires_grad)
    return x if isinstance(x, (int, float, bool, str, type(None))) else type(x)
