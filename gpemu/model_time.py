"""Forward and backward time of the user's model (component ``gpemu.model_time``).

``nn.Module.__call__`` is patched. The OUTERMOST module with parameters that is called with
emulated inputs or parameters owns the GPU time of its forward and backward (inner modules are
not charged separately):

* a model the profile database knows (:mod:`gpemu.identify`): its measured forward time
  (:func:`gpemu.costs.forward_seconds`) is enqueued when the call starts, and the forward runs op
  by op with per-op charging off (the module's charge covers its ops); its outputs are marked
  (:class:`_BackwardStart`): when autograd reaches them, the measured backward time is enqueued
  and per-op charging stays off until the backward pass ends;
* any other model is priced by what it runs: each op its forward and backward dispatch is charged
  as it runs (:func:`gpemu.costs.op_seconds`), and the sums are the call's forward and backward
  time (kept for replays and for :func:`gpemu.costs.forward_seconds`). User code runs once, as on a
  GPU: nothing is re-run on another device to estimate it.

Either way the backward's peak memory is measured when the backward pass ends.

The module replay fast path (:mod:`gpemu.fastpaths.replay`) replaces this patch with its own,
which replays recorded calls and uses :meth:`ModelTime.run_charged` for the calls it records
(with a :class:`CallRecord` to fill) and for those it cannot replay. The outermost-call depth is
per thread (``nn.DataParallel`` replicas run in threads).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextlib import nullcontext as _nothing
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import costs
from .device import EmuTensor, OutputSpec, OwnNodes
from .identify import confirm_parts, identify
from .model_pricing import (
    charge_issue_gaps,
    charge_pass,
    kernel_share,
    pass_seconds,
    price_ratio,
    say_estimated,
    say_measured,
)
from .reference import measured_on
from .token_steps import ServingLog

_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass
_next_node = torch._C._autograd._get_sequence_nr  # the next autograd node's number on this thread

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "ModelTime", "CallRecord", "graph_nodes", "emulated_device", "PLAIN_VALUES"]

# Values a replay can give back as they are (immutable, compared by value).
PLAIN_VALUES = (
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
    torch.memory_format,
    torch.layout,
    slice,
    type(Ellipsis),
)


class CallRecord:
    """What one op-by-op call of an outermost module measured (filled by
    :meth:`ModelTime.run_charged` when given one; the replay fast path keeps them)."""

    __slots__ = (
        "out_specs",
        "treespec",
        "out_requires_grad",
        "all_diff",
        "saved_bytes",
        "fwd_extra",
        "bwd_extra",
        "fwd_seconds",
        "kernel_share",
        "bwd_seconds",
        "bwd_kernel_share",
        "fwd_issue",
        "bwd_issue",
        "label",
        "params",
        "grad_params",
        "grad_param_list",
        "batch",
        "ident",
        "dev",
        "profiled_peak",
        "not_replayable",
        "backward_pending",
        "owed",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.out_specs: list[OutputSpec] | None = []  # per output (a new allocation); None: unusable
        self.treespec: Any = None
        self.out_requires_grad: list[bool] = []
        self.all_diff = True  # every output requires grad (none to mark non-differentiable)
        self.saved_bytes = 0  # kept from forward until backward (saved activations)
        self.fwd_extra = 0  # used for a moment during forward, above what it ends with
        self.bwd_extra = 0  # used for a moment during backward (set when the backward ends)
        self.fwd_seconds = 0.0
        # of the forward's time, its kernels' (the rest: gaps while the host issued them, which a
        # CUDA graph's replay does not have)
        self.kernel_share = 1.0
        self.bwd_seconds = 0.0
        self.bwd_kernel_share = 1.0  # (the same for the backward)
        # The modelled host's issue time of the forward's and the backward's ops (gpemu.time.launch):
        # a replay charges it as the op-by-op call did.
        self.fwd_issue = 0.0
        self.bwd_issue = 0.0
        self.label = ""
        self.params: list = []
        self.grad_params: list[bool] = []  # per parameter: does the outputs' graph reach it
        self.grad_param_list: list = []  # the parameters that receive gradients
        self.batch = 1
        self.ident: Any = None
        self.dev = 0
        self.profiled_peak: int | None = None  # memory='profiled': the database's peak (bytes)
        self.not_replayable: str | None = None  # why the outputs cannot be rebuilt from specs
        # True while a recorded call's backward has not run yet: its backward time and memory are
        # measured then. Backward charges owed meanwhile (a replay's backward that ran first, e.g.
        # two forwards then one backward) are counted in ``owed`` and charged once it is known.
        self.backward_pending = False
        self.owed = 0


class ModelTime:
    """The model-time component of one run (``rt.model_time``)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.ts = rt.tensors
        # Per thread: nn.DataParallel runs replicas in threads, each its own outermost call.
        self.local = threading.local()
        # Outermost calls run op by op: all of them, and those not recorded for a replay.
        self.stats = {"op_by_op": 0, "fallback": 0}
        # Where each model's time comes from, per (model, device): the summary's "model time"
        # (model, gpu, forward / backward provenance, uncertainty, how).
        self.sources: dict[tuple[str, int], dict[str, Any]] = {}
        self.orig_call: Any = torch.nn.Module.__call__  # torch's own (set at install)
        # The token steps of generation and serving loops (gpemu.serving), replayed or not.
        self.serving = ServingLog()

    def outermost(self) -> bool:
        """True when the calling thread is not already inside an outermost module call."""
        return not getattr(self.local, "depth", 0)

    def children_open(self) -> bool:
        """True inside a call run with ``open_children``: a submodule called now is a unit of its
        own (its ancestor's outputs could not be replayed, its own may)."""
        return getattr(self.local, "open", False)

    def note_call(self, module: torch.nn.Module) -> None:
        """A module called inside an outermost call: noted while a wrapper's first forward finds
        out which of its identified submodules it calls (see ``_forward``)."""
        watch = getattr(self.local, "watch", None)
        if watch is not None:
            watch.append(id(module))

    def enter(self) -> None:
        self.local.depth = 1

    def leave(self) -> None:
        self.local.depth = 0

    def run_charged(
        self,
        orig_call: Any,
        module: torch.nn.Module,
        args: tuple,
        kwargs: dict,
        dev: int,
        params: list,
        record: CallRecord | None = None,
        fallback_reason: str | None = None,
        t0: float | None = None,
        open_children: bool = False,
    ) -> Any:
        """Call ``module`` op by op with its forward time charged and its backward marked.
        ``record``: filled with what the call measured (see :class:`CallRecord`);
        ``fallback_reason``: why a fast path could not replay the call (said once);
        ``t0``: the host time the call started (its forward's GPU work is issued then);
        ``open_children``: its submodules' calls may be charged and replayed as units of their own
        (:meth:`children_open`; a fast path uses it when this module's own outputs cannot be
        replayed)."""
        rt = self.rt
        self.stats["op_by_op"] += 1
        if fallback_reason is not None:
            self.stats["fallback"] += 1
            rt.say_once(
                f"replay off for {type(module).__name__}: {fallback_reason}; running op by op "
                "(slower host side, same GPU time)"
            )
        mem = self.ts.memory[dev]
        level = getattr(self.local, "level", 0)  # > 0: a unit inside an ancestor's call
        ident = identify(rt, module, quiet=level > 0)
        call = _Call(ident, _batch_size(args, kwargs), dev, level, t0, mem.allocated)
        ends = _mark_backward_end(self, args, kwargs)
        if ends is not None:
            args, kwargs = ends[0], ends[1]
        first_node = _next_node()  # the call's own autograd nodes are numbered from here
        out = self._forward(call, orig_call, module, args, kwargs, open_children)
        peak = _profiled_peak(rt, ident, call.batch, dev)
        if peak is not None:
            mem.touch(peak - mem.allocated)
        mem.sample()
        leaves, treespec = tree_flatten(out)
        ok = _replayable(leaves, args, kwargs, params, record)
        # (a call recorded for replay whose outputs cannot be replayed runs op by op from now on with
        # its submodules as units, priced by their kernels: no gaps; one without autograd, a prefill,
        # goes to the shape-class replays, which charge whole passes: its gaps are charged too)
        if call.gaps > 0 and (record is None or ok or not torch.is_grad_enabled()):
            charge_issue_gaps(rt.engine, dev, call.gaps, call.ident.label, "forward")
        if record is not None:
            _fill_times(record, call, params, mem.allocated, peak)
            if ok:
                _fill_record(record, call, leaves, treespec, params, mem.allocated)
            else:
                record.out_specs = None
                record.treespec = None
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
            out = self._mark_backward(call, record if ok else None, ok, out, leaves, treespec, first_node, params, ends)
        return out

    def _mark_backward(
        self,
        call: _Call,
        record: CallRecord | None,
        replayable: bool,
        out: Any,
        leaves: list,
        treespec: Any,
        first_node: int,
        params: list,
        ends: tuple | None,
    ) -> Any:
        """The call's outputs marked so that its backward is charged when autograd reaches them
        (``record``: the replayable call's record, its backward to be measured; ``replayable``:
        whether its outputs can be made again, recorded or not)."""
        grads = [x for x in leaves if isinstance(x, EmuTensor) and x.requires_grad]
        if not grads:
            return out
        if record is not None:
            record.backward_pending = True
        ident = call.ident  # (a wrapper's, confirmed by its forward: see _forward)
        info = _BackwardInfo(
            self,
            record,
            call.bwd_s,
            ident.label,
            call.dev,
            ident if call.times is None else None,
            call.batch,
            None if call.times is None else (call.times, ident),
        )
        info.in_pass = call.level > 0
        # (not for a call inside a backward pass: a checkpointed block's recompute is part of the
        # enclosing backward's window, whose pass covers its ops)
        info.gaps = replayable and call.times is None and _graph_task() == -1
        info.own = OwnNodes(first_node, _next_node(), params)
        if ends is not None:
            ends[2].info = info  # the backward window closes at the inputs' gradients
        marked = _BackwardStart.apply(info, *grads)
        it = iter(marked)
        leaves = [next(it) if isinstance(x, EmuTensor) and x.requires_grad else x for x in leaves]
        return tree_unflatten(leaves, treespec)

    def _forward(
        self, call: _Call, orig_call: Any, module: torch.nn.Module, args: tuple, kwargs: dict, open_children: bool
    ) -> Any:
        """Run the call's forward op by op and charge it: by its ops (``call.times`` None), or
        as the database's measurement carried to this GPU and precision by the ratio of the ops
        it dispatches (they run anyway, uncharged: the measurement covers them)."""
        rt, ts = self.rt, self.ts
        engine = rt.engine
        mem = ts.memory[call.dev]
        unit = call.level > 0
        call.times = costs.model_times(rt, call.ident, call.batch, call.dev)
        was_open = getattr(self.local, "open", False)
        self.local.open = open_children
        self.local.level = call.level + 1
        in_backward = _graph_task() != -1
        # (a module's forward run again inside a backward pass is forward work: see _forward_again)
        again = _forward_again(ts) if in_backward else _nothing()
        if call.times is None:
            # (uncharged during a backward pass: a checkpointed block recomputed inside a measured
            # model's backward is charged by its ops all the same)
            scope_of_charges = engine.uncharged() if in_backward else _nothing()
        else:
            scope_of_charges = engine.charged_scope()
        # A wrapper known by the identified submodules it holds: which its forward calls decides
        # (the modules called inside are noted in ``watch``: see note_call).
        watch: list[int] | None = [] if call.ident.candidates else None
        outer_watch = getattr(self.local, "watch", None)
        self.local.watch = watch
        tap = ts.open_tap()
        try:
            with mem.peak_scope() as scope, scope_of_charges, again:
                out = orig_call(module, *args, **kwargs)
        finally:
            ts.close_tap(tap)
            self.local.open = was_open
            self.local.level = call.level
            self.local.watch = outer_watch
        call.fwd_peak = scope.peak
        call.kernel_share = kernel_share(tap, unit)
        call.fwd_issue = tap.issue
        uncharged = call.times is not None  # its ops ran under the measured time's cover
        if watch is not None:
            call.ident = confirm_parts(rt, module, call.ident, watch)
            if uncharged:
                call.times = costs.model_times(rt, call.ident, call.batch, call.dev)
        if call.times is None:
            call.fwd_s = pass_seconds(tap, unit)
            call.ident.estimates[("forward", call.batch, call.dev)] = call.fwd_s
            say_estimated(self, call.ident, call.dev, tap.mix, tap.precisions, quiet=unit or call.ident.quiet)
            call.bwd_s = None  # measured when the backward runs
            if uncharged and call.fwd_s > 0:  # (a wrapper that called none of its measured parts)
                charge_pass(engine, call.dev, call.fwd_s, tap, "forward", call.ident.label, call.t0)
            elif not unit and not in_backward and not open_children:
                # (its ops charged themselves; the pass's issue gaps are charged once its outputs
                # are known. Not for a call whose submodules are units of their own: a replayed
                # unit is charged by its kernels, so its pass depends on which units replayed)
                call.gaps = tap.pass_seconds - tap.seconds
        else:
            ratio = price_ratio(tap)
            call.fwd_s, call.bwd_s = call.times.forward * ratio, call.times.backward * ratio
            say_measured(
                self,
                call.ident,
                call.dev,
                call.times,
                ratio,
                "forward",
                tap.mix,
                tap.precisions,
                quiet=unit or call.ident.quiet,
            )
            if call.fwd_s > 0:
                # Issued when the call started (t0), not after the op-by-op forward's host time.
                charge_pass(engine, call.dev, call.fwd_s, tap, "forward", call.ident.label, call.t0)
        return out


class _Call:
    """One op-by-op call of :meth:`ModelTime.run_charged`, as its parts fill it in."""

    __slots__ = (
        "ident",
        "batch",
        "dev",
        "level",
        "t0",
        "before",
        "times",
        "fwd_s",
        "bwd_s",
        "fwd_peak",
        "kernel_share",
        "fwd_issue",
        "gaps",
    )

    def __init__(self, ident: Any, batch: int, dev: int, level: int, t0: float | None, before: int) -> None:
        self.ident = ident
        self.batch = batch
        self.dev = dev
        self.level = level  # > 0: a unit inside an ancestor's call
        self.t0 = t0  # the host time the call started
        self.before = before  # the device's allocated bytes before the call
        self.times: Any = None  # the database's model times (None: priced by the ops it runs)
        self.fwd_s = 0.0
        self.bwd_s: float | None = None  # None: measured when the backward runs
        self.fwd_peak = 0
        self.kernel_share = 1.0  # its kernels' share of the forward's time (see CallRecord)
        self.fwd_issue = 0.0  # the modelled host's issue time of the forward's ops
        self.gaps = 0.0  # its forward's pass less its kernels (see charge_issue_gaps)


def _replayable(leaves: list, args: tuple, kwargs: dict, params: list, record: CallRecord | None) -> bool:
    """Whether a call's outputs can be made again from specs: plain values among them (None for
    attention weights not returned, flags) are replayed as they are; anything else (a cache
    object), or an output on an input's or parameter's memory, makes the call unreplayable
    (``record.not_replayable`` says why)."""
    ok = any(isinstance(x, EmuTensor) for x in leaves) and all(
        isinstance(x, EmuTensor) or isinstance(x, PLAIN_VALUES) for x in leaves
    )
    if not ok:
        if record is not None:
            record.not_replayable = (
                "its outputs are not (tuples/lists/dicts of) emulated tensors and plain values"
                if leaves
                else "it returns no tensor"
            )
        return False
    input_blocks = {id(t.emu_block) for t in tree_flatten((args, kwargs))[0] if isinstance(t, EmuTensor)}
    input_blocks.update(id(p.emu_block) for p in params if isinstance(p, EmuTensor))
    if any(id(x.emu_block) in input_blocks for x in leaves if isinstance(x, EmuTensor) and x.emu_block is not None):
        if record is not None:
            record.not_replayable = "its outputs alias its inputs or parameters"
        return False
    return True


def _fill_times(record: CallRecord, call: _Call, params: list, allocated: int, peak: int | None) -> None:
    """What the call cost and who it was (filled whether or not its outputs can be replayed)."""
    record.fwd_extra = max(0, call.fwd_peak - allocated)
    record.fwd_seconds, record.bwd_seconds = call.fwd_s, call.bwd_s or 0.0
    record.kernel_share = call.kernel_share
    record.fwd_issue = call.fwd_issue
    record.label = call.ident.label
    record.params = params
    record.batch = call.batch
    record.ident = call.ident
    record.dev = call.dev
    record.profiled_peak = peak


def _fill_record(record: CallRecord, call: _Call, leaves: list, treespec: Any, params: list, allocated: int) -> None:
    """What a replay of the call needs (its outputs, memory, parameters)."""
    out_blocks: dict[int, int] = {}
    for x in leaves:
        if isinstance(x, EmuTensor) and x.emu_block is not None:
            out_blocks[id(x.emu_block)] = x.emu_block.size
    record.out_specs = [
        OutputSpec(
            x.shape, x.stride(), x.storage_offset(), x.dtype, x.emu_block.size if x.emu_block else 0, None, False
        )
        if isinstance(x, EmuTensor)
        else OutputSpec(x, None, 0, None, 0, None, None)
        for x in leaves
    ]
    record.out_requires_grad = [isinstance(x, EmuTensor) and x.requires_grad for x in leaves]
    record.all_diff = all(record.out_requires_grad)
    record.treespec = treespec
    record.saved_bytes = max(0, allocated - call.before - sum(out_blocks.values()))
    reached = _params_reached(leaves)
    record.grad_params = [id(p) in reached for p in params]
    record.grad_param_list = [p for p, g in zip(params, record.grad_params, strict=True) if g]
    for x in leaves:  # replayed outputs carry no host shadow; the recorded ones must not either
        if isinstance(x, EmuTensor) and x.emu_state.values is None:  # (real values: no replays)
            x.emu_state.forget_value(x)


# ----------------------------------------------------------------------------------------------
# what a call costs
# ----------------------------------------------------------------------------------------------
def _batch_size(args: tuple, kwargs: dict) -> int:
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 1


@contextmanager
def _forward_again(ts: Any) -> Iterator[None]:
    """A module's forward recomputed inside a backward pass (activation checkpointing): its ops
    are forward work, priced with the forward curves (``gpemu.device.backward_pass``)."""
    r = ts.recompute
    r.depth = getattr(r, "depth", 0) + 1
    try:
        yield
    finally:
        r.depth -= 1


def _profiled_peak(rt: Runtime, ident: Any, batch: int, dev: int) -> int | None:
    if rt.config.memory != "profiled" or ident is None or ident.name is None:
        return None
    try:
        # a GPU without its own rows takes its reference GPU's (gpemu.reference), as measured there
        own = rt.gpus[dev]
        spec = measured_on(rt.db, (own, costs.reference_gpu(rt, dev)), ident.name, "peak_memory") or own
        found = rt.db.lookup(spec.name, ident.name, batch, "peak_memory")
    except Exception as exc:
        rt.say_once(f"memory=profiled: no peak memory for {ident.name} ({exc}); tracking allocations instead")
        return None
    return int(found.value)


def graph_nodes(roots: list) -> Iterator[Any]:
    """Each autograd node reachable from ``roots`` (nodes or None), once.

    ``seen`` holds the nodes themselves, not only their ids: torch hands out a C++ node's Python
    object on demand and (torch 2.11) frees it when nothing holds it, so a later node's object
    can take a freed one's id and be skipped as seen; held, a node keeps its one Python object."""
    seen: dict[int, Any] = {}
    stack = list(roots)
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        yield fn
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)


def _params_reached(outputs: list) -> set[int]:
    """ids of the leaf tensors (parameters) the outputs' autograd graph reaches."""
    reached: set[int] = set()
    for fn in graph_nodes([x.grad_fn for x in outputs if isinstance(x, torch.Tensor)]):
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
    return reached


# ----------------------------------------------------------------------------------------------
# where the backward starts
# ----------------------------------------------------------------------------------------------
class _BackwardInfo:
    __slots__ = (
        "owner",
        "rec",
        "bwd_seconds",
        "label",
        "dev",
        "ident",
        "batch",
        "times",
        "close",
        "in_pass",
        "own",
        "gaps",
    )

    def __init__(
        self,
        owner: ModelTime,
        rec: CallRecord | None,
        bwd_seconds: float | None,
        label: str,
        dev: int,
        ident: Any = None,
        batch: int = 1,
        times: tuple[costs.ModelTimes, Any] | None = None,
    ) -> None:
        self.owner, self.rec, self.bwd_seconds, self.label, self.dev = owner, rec, bwd_seconds, label, dev
        self.ident, self.batch = ident, batch  # ident: priced by its ops (bwd_seconds None)
        # A measured model: the database's times and its identity (bwd_seconds is their backward
        # at the forward's ratio, until the backward's own ops give its ratio)
        self.times = times
        self.close: Any = None  # ends the backward window (set when the backward starts)
        self.in_pass = False  # a unit inside an op-by-op ancestor (priced behind queued work)
        self.gaps = False  # a replayable call priced by its ops: its pass's issue gaps are charged
        self.own: OwnNodes | None = None  # the call's autograd nodes (its backward's own ops)


class _BackwardStart(torch.autograd.Function):
    """Marks where the op-by-op backward of an outermost module starts: charges the module's
    measured backward time and stops per-op charging (a model the database knows), or sums the
    backward's ops as they are charged (any other model); measures the backward's peak memory until
    the whole backward pass ends."""

    @staticmethod
    def forward(ctx: Any, info: _BackwardInfo, *outs: EmuTensor) -> tuple:
        ctx.info = info
        # An output the loss does not use (GoogLeNet's auxiliary logits) gets no gradient, as in
        # torch: autograd would otherwise make zeros from the wrapper's metadata, i.e. PLAIN meta
        # tensors, and run that branch's backward on them (its parameters got meta gradients).
        ctx.set_materialize_grads(False)
        # New wrappers over the same memory block, not autograd views: the user may modify the
        # outputs in place (``logits /= T``), which autograd forbids on views made in a Function.
        alias = info.owner.ts.alias
        return tuple(alias(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        info: _BackwardInfo = ctx.info
        ts = info.owner.ts
        engine = ts.engine
        mem = ts.memory[info.dev]
        by_ops = info.bwd_seconds is None
        # By ops: the backward's ops are its price. Measured: what is charged besides the measured
        # time (a checkpointed block's recomputed forward) is part of this backward too.
        tap = ts.open_tap()
        if info.own is not None:
            info.own.task = _graph_task()
            tap.own = info.own
        issued = None
        engine.note_backward(info.dev)  # an iteration has a backward (see end_iteration)
        if not by_ops:
            # The database's backward time is charged when the window closes (its ratio is that
            # of the ops the backward dispatched), issued now.
            issued = engine.now()
            engine.enter_charged()
        start = mem.allocated
        outer_peak = mem.peak_allocated
        mem.peak_allocated = start

        def done() -> None:
            rec = info.rec
            ts.close_tap(tap)
            if by_ops:
                bwd = pass_seconds(tap, info.in_pass)
                info.ident.estimates[("backward", info.batch, info.dev)] = bwd
                if info.gaps and not info.in_pass:
                    charge_issue_gaps(engine, info.dev, tap.pass_seconds - tap.seconds, info.label, "backward")
                if rec is not None:
                    rec.bwd_seconds = bwd
                    rec.bwd_kernel_share = kernel_share(tap, info.in_pass)
                    rec.bwd_issue = tap.issue
            else:
                bwd = info.bwd_seconds or 0.0
                if info.times is not None:
                    times, ident = info.times
                    ratio = price_ratio(tap)
                    bwd = times.backward * ratio
                    say_measured(
                        info.owner, ident, info.dev, times, ratio, "backward", tap.mix, tap.precisions, ident.quiet
                    )
                engine.exit_charged()
                if bwd > 0:
                    charge_pass(engine, info.dev, bwd, tap, "backward", info.label, issued)
                if rec is not None:
                    rec.bwd_seconds = bwd + tap.charged
                    kernels = bwd * kernel_share(tap, False) + tap.charged
                    rec.bwd_kernel_share = kernels / rec.bwd_seconds if rec.bwd_seconds > 0 else 1.0
                    rec.bwd_issue = tap.issue
            if rec is not None:
                rec.bwd_extra = max(0, mem.peak_allocated - start)
                rec.backward_pending = False
                if rec.owed and rec.bwd_seconds > 0:
                    for _ in range(rec.owed):
                        engine.stream(info.dev).enqueue(rec.bwd_seconds, "backward", info.label)
                rec.owed = 0
            mem.peak_allocated = max(outer_peak, mem.peak_allocated)
            mem.sample()

        info.close = _once(done)
        # The window ends when the module's inputs have their gradients (_BackwardEnd), or at the
        # end of the backward pass when no input needs one.
        torch.autograd.Variable._execution_engine.queue_callback(info.close)
        return (None, *grads)


def _once(fn: Any) -> Any:
    done: list[bool] = []

    def call() -> None:
        if not done:
            done.append(True)
            fn()

    return call


class _EndHolder:
    __slots__ = ("info",)

    def __init__(self) -> None:
        self.info: _BackwardInfo | None = None


class _BackwardEnd(torch.autograd.Function):
    """On a module's inputs: its backward runs once the module's backward has given the inputs
    their gradients, and closes the module's backward window there (time and peak memory of THIS
    module's backward, not of what the backward pass does after it)."""

    @staticmethod
    def forward(ctx: Any, holder: _EndHolder, *inputs: EmuTensor) -> tuple:
        ctx.holder = holder
        ctx.set_materialize_grads(False)
        ts = inputs[0].emu_state
        return tuple(ts.alias(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        info = ctx.holder.info
        if info is not None and info.close is not None:
            info.close()
        return (None, *grads)


def _mark_backward_end(owner: ModelTime, args: tuple, kwargs: dict) -> tuple | None:
    """(args, kwargs, holder) with the inputs that need a gradient passed through
    :class:`_BackwardEnd`; None when none does (or grad mode is off)."""
    if not torch.is_grad_enabled():
        return None
    idx = [i for i, a in enumerate(args) if isinstance(a, EmuTensor) and a.requires_grad]
    keys = [k for k, v in kwargs.items() if isinstance(v, EmuTensor) and v.requires_grad]
    if not idx and not keys:
        return None
    holder = _EndHolder()
    marked = _BackwardEnd.apply(holder, *[args[i] for i in idx], *[kwargs[k] for k in keys])
    new_args = list(args)
    for i, t in zip(idx, marked, strict=False):
        new_args[i] = t
    new_kwargs = dict(kwargs)
    for k, t in zip(keys, marked[len(idx) :], strict=False):
        new_kwargs[k] = t
    return tuple(new_args), new_kwargs, holder


# ----------------------------------------------------------------------------------------------
# the patched Module.__call__ (without a fast path)
# ----------------------------------------------------------------------------------------------
def emulated_device(module: torch.nn.Module, args: tuple, kwargs: dict, first: Any = None) -> int | None:
    """Device of an emulated call of a module that has parameters, else None. ``first``: the
    module's first parameter when the caller knows it (a cached walk)."""
    if first is None:
        for p in module.parameters():
            first = p
            break
    if first is None:
        return None  # parameterless modules (losses, activations) run op by op
    if isinstance(first, EmuTensor):
        return first.emu_device
    for a in args:
        if isinstance(a, EmuTensor):
            return a.emu_device
    for a in kwargs.values():
        if isinstance(a, EmuTensor):
            return a.emu_device
    return None


def _make_call(mt: ModelTime, orig_call: Any) -> Any:
    engine = mt.ts.engine

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not mt.outermost():
            mt.note_call(self)
            return orig_call(self, *args, **kwargs)
        dev = emulated_device(self, args, kwargs)
        if dev is None:
            return orig_call(self, *args, **kwargs)
        t0 = engine.now()
        mt.enter()
        try:
            out = mt.run_charged(orig_call, self, args, kwargs, dev, list(self.parameters()), t0=t0)
        finally:
            mt.leave()
        if not torch.is_grad_enabled():  # generation, serving (see gpemu.token_steps)
            mt.serving.note(engine, args, kwargs, dev, t0)
        return out

    __call__.__wrapped__ = orig_call  # type: ignore[attr-defined]
    return __call__


def install(rt: Runtime) -> None:
    """Patch ``nn.Module.__call__`` to charge outermost modules (the replay fast path, when on,
    patches over it)."""
    mt = rt.model_time = ModelTime(rt)
    rt.tensors.in_model = lambda: not mt.outermost()
    M = torch.nn.Module
    mt.orig_call = M.__call__
    rt.patcher.replace(M, "__call__", _make_call(mt, M.__call__))
