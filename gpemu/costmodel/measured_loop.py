"""The training loop behind the shipped database's times, and what its "backward" holds besides the
model's backward pass.

The GPEmu artifact's profiler (``profiler/time-compute/gpu_compute_time_profiler.py`` in the
authors' repository, torch 1.7, SGD with momentum 0.9 and weight decay 1e-4) times
``outputs = model(inputs)`` as the forward and, as the backward, everything from the loss to the
optimizer step::

    loss = criterion(outputs, targets)     # cross entropy; GoogLeNet: its main logits only
    optimizer.zero_grad()                  # torch 1.7: every gradient zeroed in place
    loss.backward()                        # gradients added into the zeroed ones
    optimizer.step()                       # SGD, one parameter at a time

So that column holds, per parameter tensor, six memory-bound kernels on top of the model's own
backward (zeroing; accumulating; the weight decay's ``add``; the momentum's ``mul_`` and
``add_``; the update): AlexNet's 61 M parameters make them ~4 GB of traffic, most of its
measured backward at small batch sizes. A program of today (``zero_grad(set_to_none=True)``,
a foreach or fused optimizer) does not run them inside its backward pass, and its optimizer step
is charged on its own; so the fit records them as part of the measured backward
(:func:`record_measured_step`), and a measured model's backward is charged without them
(:func:`parameter_bookkeeping_ops`, priced by the fitted model) — and without the loss the column
also timed (:func:`measured_loss_ops`), which a program's own loss is charged for.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import cache, lru_cache
from typing import Any

import torch
from torch.nn import functional as F

from .classify import OpFeatures
from .record import OpRecorder

__all__ = [
    "SGD_MOMENTUM",
    "SGD_WEIGHT_DECAY",
    "MEASURED_CLASSES",
    "record_measured_step",
    "parameter_bookkeeping_ops",
    "measured_loss_ops",
]

SGD_MOMENTUM = 0.9
SGD_WEIGHT_DECAY = 1e-4
_LR = 0.1
# The measured models are torchvision's ImageNet classifiers: their loss is over 1000 logits.
MEASURED_CLASSES = 1000


def _sgd_update(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
    """torch 1.7's SGD step for one group, one parameter at a time."""
    with torch.no_grad():
        for p, g, buf in zip(params, grads, buffers, strict=False):
            d_p = g.add(p, alpha=SGD_WEIGHT_DECAY)
            buf.mul_(SGD_MOMENTUM).add_(d_p)
            p.add_(d_p, alpha=-_LR)


def record_measured_step(module: Any, inputs: torch.Tensor) -> tuple[list[OpFeatures], list[OpFeatures]]:
    """(forward ops, "backward" ops) of one step of the measured loop for ``module`` (built on the
    meta device, in training mode), past its first step (gradients and momentum buffers exist).
    The backward list holds the loss, the gradients' zeroing and accumulation and the SGD step,
    as the database's backward column timed them."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.empty_like(p)
    buffers = [torch.empty_like(p) for p in params]
    targets = torch.zeros(inputs.shape[0], dtype=torch.long, device=inputs.device)
    # The measurements predate autograd's saved-input clones (see OpRecorder): leave them out.
    forward = OpRecorder(saved_input_clones=False)
    with forward:
        outputs = module(inputs)
    backward = OpRecorder(saved_input_clones=False)
    backward.backward = True
    try:
        with backward:
            logits = outputs[0] if isinstance(outputs, tuple) else outputs
            loss = F.cross_entropy(logits, targets)
            with torch.no_grad():
                for p in params:
                    p.grad.zero_()
            loss.backward()
            _sgd_update(params, [p.grad for p in params], buffers)
    finally:
        for p in params:
            p.grad = None
    return forward.ops, backward.ops


def parameter_bookkeeping_ops(shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32) -> list[OpFeatures]:
    """The kernels the measured loop's backward column holds for parameters of these shapes besides
    the model's backward: each gradient zeroed and accumulated into, and the SGD step (as
    :func:`record_measured_step` records them; the loss's few kernels are not included). They are
    elementwise, so one parameter's recording scaled by each one's size stands for all (recording
    every one on the meta device took 1.5 s for DenseNet-201's 604 tensors)."""
    grads, step = _bookkeeping_template(dtype)
    sizes = [math.prod(s) / _TEMPLATE_SIZE for s in shapes]
    return [replace(op, flops=op.flops * k, nbytes=op.nbytes * k) for k in sizes for op in grads] + [
        replace(op, flops=op.flops * k, nbytes=op.nbytes * k) for k in sizes for op in step
    ]


_TEMPLATE_SIZE = 1024


@lru_cache(maxsize=64)
def measured_loss_ops(batch: int) -> tuple[OpFeatures, ...]:
    """The loss's kernels in the measured loop's backward column at ``batch``: the cross entropy
    over :data:`MEASURED_CLASSES` logits and its gradient, recorded as :func:`record_measured_step`
    records them (every op of the column as backward work). A program's own loss is charged as its
    own ops, so a shipped backward is charged without these too."""
    # (the caller may be under no_grad or inference_mode: a first call at a new batch size in evaluation)
    with _with_autograd():
        logits = torch.empty(batch, MEASURED_CLASSES, device="meta", requires_grad=True)
        targets = torch.zeros(batch, dtype=torch.long, device="meta")
        rec = OpRecorder(saved_input_clones=False)
        rec.backward = True
        with rec:
            F.cross_entropy(logits, targets).backward()
    return tuple(rec.ops)


@contextmanager
def _with_autograd() -> Iterator[None]:
    """Autograd on, whatever the caller's mode: the measured loop's recordings run a backward pass."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


@cache
def _bookkeeping_template(dtype: torch.dtype) -> tuple[tuple[OpFeatures, ...], tuple[OpFeatures, ...]]:
    """(zeroing + accumulation, SGD step) ops of one parameter of ``_TEMPLATE_SIZE`` elements."""
    p = torch.empty(_TEMPLATE_SIZE, dtype=dtype, device="meta")
    g, new, buf = torch.empty_like(p), torch.empty_like(p), torch.empty_like(p)
    rec = OpRecorder()
    rec.backward = True
    with rec, torch.no_grad():
        g.zero_()
        g.add_(new)  # what autograd's AccumulateGrad does with an existing gradient
        n = len(rec.ops)
        _sgd_update([p], [g], [buf])
    return tuple(rec.ops[:n]), tuple(rec.ops[n:])
