"""Recording a module's ops: a ``TorchDispatchMode`` that classifies every aten op it sees.

A training step's GPU work is the sequence of aten ops its forward and backward dispatch. Running
the module once on the **meta** device under :class:`OpRecorder` yields that sequence with shapes
and dtypes but no arithmetic (milliseconds even for DenseNet-201), which is all the cost model
needs. :func:`record_step` does it for a module without touching the module itself: its
parameters and buffers are swapped for meta copies through ``torch.func.functional_call``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .classify import OpClass, OpFeatures, classify

__all__ = ["OpRecorder", "StepOps", "record_step"]


class OpRecorder(TorchDispatchMode):
    """Runs each op and appends its :class:`OpFeatures` to ``ops`` (free ops are skipped unless
    ``keep_free``). ``backward`` marks what is recorded next as backward work.

    ``saved_input_clones=False`` leaves out the copy autograd makes of an in-place activation's
    input when its backward needs the input (torch 2.13 does this for ``hardtanh_`` (ReLU6) and
    ``hardswish_``: a ``clone`` immediately followed by the in-place op on the same tensor).
    The database's measurements were taken with a torch that did not: pricing those copies
    over-estimated MobileNetV2's forward by a third.
    """

    def __init__(self, keep_free: bool = False, saved_input_clones: bool = True) -> None:
        super().__init__()
        self.ops: list[OpFeatures] = []
        self.backward = False
        self.keep_free = keep_free
        self.saved_input_clones = saved_input_clones
        self._pending: tuple[OpFeatures, Any] | None = None  # a clone waiting for its next op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        feat = classify(func, args, kwargs, out, backward=self.backward or None)
        if self._pending is not None:
            clone, source = self._pending
            self._pending = None
            inplace_on_source = (
                getattr(func, "_schema", None) is not None
                and func._schema.is_mutable
                and len(args) > 0
                and args[0] is source
            )
            if not inplace_on_source:
                self.ops.append(clone)
        if not self.saved_input_clones and feat.name == "clone" and args and isinstance(args[0], torch.Tensor):
            self._pending = (feat, args[0])
        elif self.keep_free or feat.op_class is not OpClass.FREE:
            self.ops.append(feat)
        return out

    def __exit__(self, *exc):
        if self._pending is not None:  # a clone that was the last op: keep it
            self.ops.append(self._pending[0])
            self._pending = None
        return super().__exit__(*exc)


@dataclass
class StepOps:
    """The ops of one training step: the module's forward, the loss, and the backward."""

    forward: list[OpFeatures] = field(default_factory=list)
    loss: list[OpFeatures] = field(default_factory=list)
    backward: list[OpFeatures] = field(default_factory=list)


def _sum_loss(out: Any) -> torch.Tensor | None:
    leaves = [
        t
        for t in torch.utils._pytree.tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    if not leaves:
        return None
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


def record_step(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    backward: bool = True,
    loss_fn: Callable[[Any], torch.Tensor | None] = _sum_loss,
    dtype: torch.dtype | None = None,
    saved_input_clones: bool = True,
) -> StepOps:
    """Record one forward (and backward) of ``module(*args, **kwargs)`` on the meta device.

    The module keeps its own parameters and mode (call ``module.train()`` first for a training
    step: batch norm and dropout record differently). ``dtype`` casts floating parameters and
    inputs first (native half precision). The loss is ``loss_fn(output)`` (default: the sum of
    every differentiable output, so auxiliary heads get gradients) and its own ops are kept apart
    in ``StepOps.loss``; backward runs to the parameters only. ``saved_input_clones``: see
    :class:`OpRecorder`.
    """

    def meta(x: Any, grad: bool | None = None) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        dt = dtype if (dtype is not None and x.is_floating_point()) else x.dtype
        req = x.requires_grad if grad is None else grad
        return torch.empty(tuple(x.shape), dtype=dt, device="meta", requires_grad=req and dt.is_floating_point)

    state = {n: meta(p, p.requires_grad) for n, p in module.named_parameters()}
    state.update({n: meta(b, False) for n, b in module.named_buffers()})
    margs = torch.utils._pytree.tree_map(meta, tuple(args))
    mkwargs = torch.utils._pytree.tree_map(meta, dict(kwargs or {}))
    steps = StepOps()
    rec = OpRecorder(saved_input_clones=saved_input_clones)
    with rec:
        out = torch.func.functional_call(module, state, margs, mkwargs)
    steps.forward = rec.ops
    if not backward:
        return steps
    rec_loss = OpRecorder()
    with rec_loss:
        loss = loss_fn(out)
    steps.loss = rec_loss.ops
    inputs = [p for p in state.values() if isinstance(p, torch.Tensor) and p.requires_grad]
    if loss is None or not inputs:
        return steps
    rec_b = OpRecorder(saved_input_clones=saved_input_clones)
    rec_b.backward = True
    with rec_b:
        torch.autograd.grad([loss], inputs, allow_unused=True)
    steps.backward = rec_b.ops
    return steps
