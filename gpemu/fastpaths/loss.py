"""Cross-entropy as one emulated GPU op: the loss fast path.

``F.cross_entropy`` (also what ``nn.CrossEntropyLoss`` calls) runs as ``_log_softmax`` +
``nll_loss_forward`` and, in backward, ``nll_loss_backward`` + ``_log_softmax_backward_data``:
four dispatches and two autograd nodes, about 65-90 µs of host time per training step here, the
largest piece of the emulator's own time left after the model's forward/backward replay.

On a new signature (input/target/weight metadata, the loss options, grad mode) the loss runs op
by op once, inside an ``autograd.Function``, and that first call records what it did:
the GPU time its ops charged, its output's metadata, the memory it kept for backward and used for
a moment, and, when its backward runs, the same for backward. Later calls with that signature
replay the record: one charge, one output, one autograd node. GPU time and memory are those of
the op-by-op run, so the fast path changes only the host time.

Falls back to the original function (op by op, exactly as before) when the fast path could change
a result:
- an argument is not an emulated tensor, or the input has a known host value (its shadow; the
  loss value would then be computed, see :mod:`gpemu.hostvalues`);
- the target or weight requires grad (their gradients are not recorded);
- autocast is on (its emulation decides the loss's dtype), a ``TorchFunctionMode`` is active
  (user modes), or the call is inside a replayed module's charged scope (its time is already
  covered);
- legacy ``size_average``/``reduce`` arguments are given;
- replay is off (``config.replay=False``).
Double backward through a fast-path loss is not supported (as for replayed modules).

All state is per run: :class:`LossState` (``rt.loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gpemu.device import EmuTensor, OutputSpec, TensorState

from .replay import DirectHead

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime

    from .replay import ReplayState

__all__ = ["install", "loss_info", "LossState"]

_len_tf_stack = torch._C._len_torch_function_stack
_autocast_on = torch.is_autocast_enabled


class LossState:
    """The loss fast path of one run (``rt.loss``)."""

    def __init__(self, ts: TensorState, replay: ReplayState) -> None:
        self.ts = ts
        self.replay = replay
        self.stats = {"recorded": 0, "replayed": 0}
        self.records: dict[tuple, _Record] = {}  # loss signature -> what its op-by-op run did


class _Record:
    """What the op-by-op run of one loss signature did."""

    __slots__ = (
        "out_spec",
        "fwd_seconds",
        "saved_bytes",
        "fwd_extra",
        "grad_spec",
        "bwd_seconds",
        "bwd_extra",
        "dev",
        "state",
    )

    def __init__(self, state: LossState, dev: int) -> None:
        self.state = state
        self.dev = dev
        self.out_spec: OutputSpec | None = None  # the loss's output, as the op cache keeps one
        self.fwd_seconds = 0.0
        self.saved_bytes = 0  # kept from forward until backward (log-probabilities)
        self.fwd_extra = 0  # used for a moment on top (peak above the end state)
        self.grad_spec: OutputSpec | None = None  # its input's gradient: set when the recording's backward has run
        self.bwd_seconds = 0.0
        self.bwd_extra = 0


def loss_info() -> dict[str, int]:
    """How many loss signatures of the active run were recorded and how many calls replayed."""
    from gpemu.runtime import current

    rt = current()
    return dict(rt.loss.stats) if rt is not None and rt.loss is not None else {"recorded": 0, "replayed": 0}


class _FusedLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        rec: _Record,
        orig: Callable,
        options: tuple,
        input: EmuTensor,
        target: EmuTensor,
        weight: EmuTensor | None,
    ) -> EmuTensor:
        ctx.rec = rec
        dev = rec.dev
        state = rec.state
        ts = state.ts
        mem = ts.memory[dev]
        out_spec = rec.out_spec
        if rec.grad_spec is not None and out_spec is not None:  # replay
            state.stats["replayed"] += 1
            out = ts.build(out_spec, [], dev)
            ctx.saved_block = mem.allocate(rec.saved_bytes) if rec.saved_bytes else None
            mem.touch(rec.fwd_extra)
            ts.charge(rec.fwd_seconds, dev, "cross_entropy")
            ctx.inner = None
            ctx.hook_gen = state.replay.hook_generation  # (see gpemu.fastpaths.backward._direct_backward)
            return out
        # Record: run the ops one by one on a leaf of our own, keep its graph for backward.
        before = mem.allocated
        with torch.enable_grad():
            leaf = input.detach().requires_grad_(input.requires_grad)
            with ts.cost_tap() as tap, mem.peak_scope() as scope:
                inner = orig(leaf, target, weight, None, options[0], None, options[1], options[2])
        spec = rec.out_spec = ts.spec_of(inner)
        rec.fwd_seconds = tap.seconds
        rec.saved_bytes = max(0, mem.allocated - before - spec.nbytes)
        rec.fwd_extra = max(0, scope.peak - mem.allocated)
        ctx.inner = (leaf, inner)
        ctx.saved_block = None
        # A new wrapper on the same memory (not a view of an intermediate: autograd treats views
        # returned from a Function specially).
        return ts.wrap(spec.shape, spec.stride, spec.offset, inner.dtype, dev, inner.emu_block)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        rec: _Record = ctx.rec
        dev = rec.dev
        ts = rec.state.ts
        mem = ts.memory[dev]
        if ctx.inner is None:  # replay (a recording's backward has run: its gradient is known)
            _replayed_backward(ctx)
            assert rec.grad_spec is not None
            out = ts.build(rec.grad_spec, [], dev)
            mem.touch(rec.bwd_extra)
            return None, None, None, out, None, None
        leaf, inner = ctx.inner
        ctx.inner = None
        with ts.cost_tap() as tap, mem.peak_scope() as scope:
            (gx,) = torch.autograd.grad(inner, leaf, grad)
        if isinstance(gx, EmuTensor):
            rec.grad_spec = ts.spec_of(gx)
            rec.bwd_seconds = tap.seconds
            rec.bwd_extra = max(0, scope.peak - mem.allocated)
            rec.state.stats["recorded"] += 1
        return None, None, None, gx, None, None


def _replayed_backward(ctx: Any) -> None:
    rec: _Record = ctx.rec
    rec.state.ts.charge(rec.bwd_seconds, rec.dev, "cross_entropy backward")
    # The recording's peak is measured above its end state: the saved log-probabilities freed
    # by autograd, the input's gradient made (by the caller).
    ctx.saved_block = None


def _direct_ready(node: Any) -> bool:
    """A replayed loss node (not the recording one, whose backward runs op by op) whose record
    knows its backward."""
    return node.inner is None and node.rec.grad_spec is not None


def _direct_run(node: Any, as_tensor: bool) -> Any:
    """The replayed loss backward for :func:`gpemu.fastpaths.backward._direct_backward`: its input
    gradient as a memory block (a replayed module never reads its values), or as the tensor the
    engine path's backward returns (for torch's own nodes between the loss and the module)."""
    _replayed_backward(node)
    rec: _Record = node.rec
    ts = rec.state.ts
    mem = ts.memory[rec.dev]
    assert rec.grad_spec is not None  # (see _direct_ready)
    if as_tensor:
        out = ts.build(rec.grad_spec, [], rec.dev)
        mem.touch(rec.bwd_extra)
        return out
    nbytes = rec.grad_spec.nbytes
    block = mem.allocate(nbytes) if nbytes else None
    mem.touch(rec.bwd_extra)
    return block


_functorch_active = torch._C._are_functorch_transforms_active
_apply_fused = super(torch.autograd.Function, _FusedLoss).apply  # torch._C._FunctionBase.apply


def _make_cross_entropy(state: LossState, orig: Callable) -> Callable:
    records = state.records
    engine = state.ts.engine

    def cross_entropy(
        input: Any,
        target: Any,
        weight: Any = None,
        size_average: Any = None,
        ignore_index: int = -100,
        reduce: Any = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> Any:
        if (
            type(input) is not EmuTensor
            or type(target) is not EmuTensor
            or input.emu_shadow is not None
            or size_average is not None
            or reduce is not None
            or _len_tf_stack()
            or _autocast_on("cuda")
            or target.requires_grad
            or (weight is not None and (type(weight) is not EmuTensor or weight.requires_grad))
        ):
            return orig(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        if engine.in_charged_scope:
            return orig(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        grad = torch.is_grad_enabled() and input.requires_grad
        try:
            key = (
                input.emu_key,
                target.emu_key,
                weight.emu_key if weight is not None else None,
                ignore_index,
                reduction,
                float(label_smoothing),
                grad,
                torch.is_inference_mode_enabled(),
            )
            hash(key)
        except TypeError:  # e.g. a tensor-valued option: not ours to cache
            return orig(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        if not grad:  # evaluation: nothing to save for backward; op by op is cheap enough
            return orig(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        rec = records.get(key)
        if rec is None or rec.grad_spec is None:
            # first call of this signature, or its recording never ran backward: (re)record
            rec = records[key] = _Record(state, input.emu_device)
        if _functorch_active():
            return _FusedLoss.apply(rec, orig, (ignore_index, reduction, label_smoothing), input, target, weight)
        # Function.apply without its per-argument functorch pass (as gpemu.replay does). A
        # replayed loss runs no user code: an emulator entry (gpemu.time.HostTime.call); a
        # recording runs the loss's ops, each its own entry.
        options = (ignore_index, reduction, label_smoothing)
        if rec.grad_spec is None:
            return _apply_fused(rec, orig, options, input, target, weight)
        return engine.call(_apply_fused, rec, orig, options, input, target, weight)

    cross_entropy.__wrapped__ = orig  # type: ignore[attr-defined]
    return cross_entropy


def install(rt: Runtime) -> None:
    """Replace ``torch.nn.functional.cross_entropy`` (restored by unpatch) and let the replay fast
    path's engine-free backward start at a replayed loss (``config.replay``)."""
    if not rt.config.fast_paths or rt.replay is None:
        return
    state = rt.loss = LossState(rt.tensors, rt.replay)
    F = torch.nn.functional
    rt.patcher.replace(F, "cross_entropy", _make_cross_entropy(state, F.cross_entropy))
    head = DirectHead(ready=_direct_ready, run=_direct_run)
    rt.patcher.on_restore(rt.replay.register_direct_head(_FusedLoss._backward_cls, head))
