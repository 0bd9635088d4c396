"""Module-level record/replay: the fast path that keeps the emulator's own host time small.

``nn.Module.__call__`` is patched. The OUTERMOST module with parameters that is called with
emulated inputs or parameters owns the GPU time of its forward and backward (inner modules are
not charged separately):

* **first call** for a given situation (*recording*): the forward runs op by op on emulated
  tensors. Gpemu measures the output specs, the memory that stays allocated for backward (saved
  activations), the transient peaks of forward and backward, and which parameters receive
  gradients. Forward time comes from :func:`gpemu.costs.forward_seconds` (profile database, or an
  estimate for unknown models via :func:`gpemu.costs.estimate_module`); per-op time is not
  charged inside (the outermost module owns it).
* **later calls** (*replay*): the whole forward is ONE ``torch.autograd.Function`` whose forward
  builds the outputs from the recorded specs (allocating their memory and the saved-activation
  memory, touching the transient peak) and whose backward returns gradients shaped like the
  inputs/parameters, frees the saved memory and charges :func:`gpemu.costs.backward_seconds`.

The "situation" (cache key) is: the module's and all submodules' training flags, grad mode,
inference mode, autocast state, the input specs (shapes/strides/dtypes/devices, non-tensor
arguments), and each parameter's requires_grad/dtype/device.

Fallback (the normal op-by-op path, time still charged per module; said once per reason):
forward/backward hooks on any submodule (or global module hooks), outputs that are not
tensors in tuples/lists/dicts, outputs that alias inputs or parameters, ``config.replay=False``.

The replayed backward stores parameter gradients itself (``p.grad = g``) when the autograd engine
would accumulate them in this backward and no parameter has hooks; otherwise (DDP's
post-accumulate hooks, ``torch.autograd.grad(loss, params)``, ``backward(inputs=[some params])``)
it returns them to autograd. Gradient wrappers that ``zero_grad()`` dropped and nothing else
references are handed out again as the next replayed backward's gradients (:mod:`gpemu.gradients`).
After two plain backwards, a recording's replays pass one "hub" leaf to autograd instead of every
parameter (see :class:`_Direct`); ``torch.autograd.grad``/``backward(inputs=...)`` are patched to
answer for parameters of such a graph. The
outermost-call depth is per thread (``nn.DataParallel`` replicas run in threads).

What replay does not reproduce: in-place updates of buffers inside forward (BatchNorm's running
statistics keep their metadata, so nothing observable changes), and Python side effects of the
forward (print, counters) after the first call.
"""

from __future__ import annotations

import threading
import weakref
from operator import is_
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import gradients
from . import tensor as _tensor
from .memory import round_size
from .tensor import EmuTensor, _S, _sig, _wrap

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "Recording", "replay_info", "register_direct_head"]

_nn_module = torch.nn.modules.module


class _ReplayState:
    def __init__(self) -> None:
        self.rt: Any = None
        # Per thread: nn.DataParallel runs replicas in threads, each its own outermost call.
        self.local = threading.local()
        self.enabled = True
        self.records: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self.unreplayable: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        self.stats = {"recorded": 0, "replayed": 0, "fallback": 0}
        # Module trees seen as outermost modules (see _walk); valid while structure_gen holds.
        self.trees: "weakref.WeakKeyDictionary[torch.nn.Module, _Tree]" = weakref.WeakKeyDictionary()
        # Bumped by every Module attribute set/delete, parameter/submodule registration and
        # _apply (model.to/.cuda/.half): whatever may change a module tree's parameters, submodules
        # or training flags.
        self.structure_gen = 0
        self.hub_used = False  # some replay ran in hub mode (see _Direct)
        self.no_hub = False    # targeted gradients met a hub graph: no hub mode for this run


_R = _ReplayState()
_weakref = weakref.ref
_HUB_AFTER = 2        # plain backwards of a recording before its replays use hub mode
_NEVER = -(1 << 60)


def replay_info() -> dict[str, int]:
    """How many outermost-module calls were recorded, replayed, or ran the fallback path."""
    return dict(_R.stats)


class Recording:
    """What one recorded forward of a module needs for replay."""

    __slots__ = ("out_specs", "treespec", "out_requires_grad", "saved_bytes", "fwd_extra", "bwd_extra",
                 "fwd_seconds", "bwd_seconds", "label", "params", "grad_params", "batch", "ident",
                 "dev", "grad_specs", "profiled_peak", "grad_param_list", "hook_gen", "direct", "plain", "hub_direct",
                 "all_diff", "__weakref__")

    def __init__(self) -> None:
        self.out_specs: list = []
        self.treespec: Any = None
        self.out_requires_grad: list[bool] = []
        self.all_diff = True  # every output requires grad (none to mark non-differentiable)
        self.saved_bytes = 0
        self.fwd_extra = 0
        self.bwd_extra = 0
        self.fwd_seconds = 0.0
        self.bwd_seconds = 0.0
        self.label = ""
        self.params: list = []
        self.grad_params: list[bool] = []
        self.batch = 1
        self.ident: Any = None
        self.dev = 0
        self.grad_specs: list | None = None
        self.profiled_peak: int | None = None  # memory='profiled': the database's peak (bytes)
        self.grad_param_list: list = []  # the parameters that receive gradients
        self.hook_gen = -1  # _S.hook_generation when grad_param_list was found to have no hooks
        # Reused between calls: its AccumulateGrad node reference keeps the parameter's
        # accumulator alive, so get_gradient_edge (~3 µs of Python) runs once per recording.
        self.direct: "_Direct | None" = None
        # Consecutive replayed backwards that were plain ``loss.backward()`` calls (every
        # parameter accumulator ran); _NEVER once a targeted one (autograd.grad, inputs=) was seen.
        self.plain = 0
        self.hub_direct: "_Direct | None" = None


# ----------------------------------------------------------------------------------------------
# the patched Module.__call__
# ----------------------------------------------------------------------------------------------
def _make_call(orig_call: Any) -> Any:
    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        local = _R.local
        if getattr(local, "depth", 0) or _R.rt is None:
            return orig_call(self, *args, **kwargs)
        dev = _emulated_device(self, args, kwargs)
        if dev is None:
            return orig_call(self, *args, **kwargs)
        # On a real GPU the forward's first kernel is issued microseconds into the call: the
        # forward's GPU time starts here, before the emulator's own book-keeping for the call.
        engine = _tensor._S.engine
        t0 = engine.now() if engine is not None else None
        local.depth = 1
        try:
            return _outer_call(orig_call, self, args, kwargs, dev, t0)
        finally:
            local.depth = 0
    return __call__


def _emulated_device(module: torch.nn.Module, args: tuple, kwargs: dict) -> int | None:
    """Device of an emulated call of a module that has parameters, else None."""
    tree = _R.trees.data.get(_weakref(module)) if _R.trees else None
    if tree is not None and tree.gen == _R.structure_gen and tree.first is not None:
        # The cached walk's first parameter (valid while no Module attribute changed anywhere):
        # the generator behind module.parameters() costs ~5 µs per call.
        first = tree.first
    else:
        first = None
        for p in module.parameters():
            first = p
            break
    if first is None:
        return None  # parameterless modules (losses, activations) run op by op
    if isinstance(first, EmuTensor):
        return first._dev
    for a in args:
        if isinstance(a, EmuTensor):
            return a._dev
    for a in kwargs.values():
        if isinstance(a, EmuTensor):
            return a._dev
    return None


class _Tree:
    """A module tree's parameters and training flags, cached between calls. Valid while no
    Module attribute was set anywhere (``_R.structure_gen``) and its ``_parameters``/``_modules``
    dicts kept their sizes; hooks are re-checked on every call (one C-level ``any``)."""

    __slots__ = ("gen", "params", "flags", "hook_dicts", "dicts", "lens", "first")


def _walk(module: torch.nn.Module) -> tuple[list, tuple, bool]:
    """(parameters, training flags, any hooks) of a module tree (cached, see :class:`_Tree`)."""
    tree = _R.trees.get(module)
    if tree is not None and tree.gen == _R.structure_gen and list(map(len, tree.dicts)) == tree.lens:
        return tree.params, tree.flags, any(tree.hook_dicts)
    gen = _R.structure_gen
    params, flags, hooks, mods = _walk_tree(module)
    tree = _Tree()
    tree.gen, tree.params, tree.flags = gen, params, flags
    tree.first = next(module.parameters(), None)  # in parameters() order (see _emulated_device)
    tree.hook_dicts = [d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                                 m._backward_pre_hooks)]
    tree.dicts = [m._parameters for m in mods] + [m._modules for m in mods]
    tree.lens = list(map(len, tree.dicts))
    try:
        _R.trees[module] = tree
    except TypeError:  # not weak-referenceable: no caching
        pass
    return params, flags, hooks


def _walk_tree(module: torch.nn.Module) -> tuple[list, tuple, bool, list]:
    """(parameters, training flags, any hooks, modules) in one pass over the module tree."""
    mods: list = []
    params: list = []
    seen: set[int] = set()
    flags: list[bool] = []
    hooks = False
    stack = [module]
    while stack:
        m = stack.pop()
        mods.append(m)
        flags.append(m.training)
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            hooks = True
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for c in m._modules.values():
            if c is not None:
                stack.append(c)
    return params, tuple(flags), hooks, mods


def _global_hooks() -> bool:
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks)


def _outer_call(orig_call: Any, module: torch.nn.Module, args: tuple, kwargs: dict, dev: int,
                t0: float | None = None) -> Any:
    rt = _R.rt
    params, flags, hooks = _walk(module)
    reason = None
    if not rt.config.replay:
        reason = "replay is off (config.replay=False)"
    elif hooks or _global_hooks():
        reason = "module hooks are registered"
    else:
        reason = _R.unreplayable.get(module)
    if reason is not None:
        return _run_charged(orig_call, module, args, kwargs, dev, params, None, reason, t0)
    emus: list = []
    try:
        in_sig = (_sig(args, emus, True), _sig(tuple(kwargs.items()), emus, True) if kwargs else None)
        key = (flags, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), in_sig,
               _S.param_generation)
        hash(key)
    except TypeError:
        return _run_charged(orig_call, module, args, kwargs, dev, params, None,
                            "a module argument is not hashable", t0)
    table = _R.records.get(module)
    if table is None:
        table = _R.records[module] = {}
    rec = table.get(key)
    if rec is not None and (rec.params is params  # the cached walk's own list: nothing changed
                            or (len(rec.params) == len(params) and all(map(is_, rec.params, params)))):
        return _replay(rec, emus, params, t0)
    rec = Recording()
    out = _run_charged(orig_call, module, args, kwargs, dev, params, rec, None, t0)
    if rec.out_specs is not None and rec.treespec is not None:
        table[key] = rec
    return out


# ----------------------------------------------------------------------------------------------
# recording (and the fallback path, which is recording without keeping the result)
# ----------------------------------------------------------------------------------------------
def _identity(rt: "Runtime", module: torch.nn.Module) -> Any:
    try:
        from .identify import identify
    except ImportError:
        return None
    return identify(rt, module)


def _batch_size(args: tuple, kwargs: dict) -> int:
    for x in tree_flatten((args, kwargs))[0]:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return 1


def _model_times(rt: "Runtime", module: torch.nn.Module, ident: Any, args: tuple, kwargs: dict, batch: int,
                 dev: int) -> tuple[float, float]:
    if ident is None:
        return 0.0, 0.0
    try:
        from . import costs
    except ImportError:
        return 0.0, 0.0
    if ident.name is None and not ident.parts and ident.source == "estimated":
        try:
            costs.estimate_module(rt, ident, module, args, kwargs, dev)
        except Exception:  # estimate_module never raises by contract; stay safe anyway
            pass
    fwd, _ = costs.forward_seconds(rt, ident, batch, dev)
    bwd, _ = costs.backward_seconds(rt, ident, batch, dev)
    return float(fwd), float(bwd)


def _profiled_peak(rt: "Runtime", ident: Any, batch: int, dev: int) -> int | None:
    if rt.config.memory != "profiled" or ident is None or ident.name is None:
        return None
    try:
        found = rt.db.lookup(rt.gpus[dev].name, ident.name, batch, "peak_memory")
    except Exception as exc:
        rt.say_once(f"memory=profiled: no peak memory for {ident.name} ({exc}); tracking allocations instead")
        return None
    return int(found.value)


def _run_charged(orig_call: Any, module: torch.nn.Module, args: tuple, kwargs: dict, dev: int, params: list,
                 rec: Recording | None, fallback_reason: str | None, t0: float | None = None) -> Any:
    rt = _R.rt
    if fallback_reason is not None:
        _R.stats["fallback"] += 1
        rt.say_once(f"replay off for {type(module).__name__}: {fallback_reason}; running op by op "
                    "(slower host side, same GPU time)")
    engine = rt.state.get("engine")
    mem = _S.memory[dev]
    ident = _identity(rt, module)
    batch = _batch_size(args, kwargs)
    fwd_s, bwd_s = _model_times(rt, module, ident, args, kwargs, batch, dev)
    label = ident.label if ident is not None else type(module).__name__
    if engine is not None and fwd_s > 0:
        # Issued when the call started (t0), not after the op-by-op forward's host time.
        engine.stream(dev).enqueue(fwd_s, "forward", label, at=t0)
    before = mem.allocated
    with mem.peak_scope() as scope:
        if engine is not None:
            with engine.charged_scope():
                out = orig_call(module, *args, **kwargs)
        else:
            out = orig_call(module, *args, **kwargs)
    fwd_peak = scope.peak
    peak = _profiled_peak(rt, ident, batch, dev)
    if peak is not None:
        mem.touch(peak - mem.allocated)
    mem.sample()

    leaves, treespec = tree_flatten(out)
    ok = bool(leaves) and all(isinstance(x, EmuTensor) for x in leaves)
    input_blocks = {id(t._block) for t in tree_flatten((args, kwargs))[0] if isinstance(t, EmuTensor)}
    input_blocks.update(id(p._block) for p in params if isinstance(p, EmuTensor))
    if ok and any(id(x._block) in input_blocks for x in leaves if x._block is not None):
        ok = False
        if rec is not None:
            _R.unreplayable[module] = "its outputs alias its inputs or parameters"
    elif not ok and rec is not None:
        _R.unreplayable[module] = "its outputs are not (tuples/lists/dicts of) emulated tensors"
    if rec is not None and ok:
        _R.stats["recorded"] += 1
        out_blocks: dict[int, int] = {}
        for x in leaves:
            if x._block is not None:
                out_blocks[id(x._block)] = x._block.size
        rec.out_specs = [(x.shape, x.stride(), x.storage_offset(), x.dtype, x._block.size if x._block else 0)
                         for x in leaves]
        rec.out_requires_grad = [x.requires_grad for x in leaves]
        rec.all_diff = all(rec.out_requires_grad)
        rec.treespec = treespec
        rec.saved_bytes = max(0, mem.allocated - before - sum(out_blocks.values()))
        rec.fwd_extra = max(0, fwd_peak - mem.allocated)
        rec.fwd_seconds, rec.bwd_seconds = fwd_s, bwd_s
        rec.label = label
        rec.params = params
        rec.batch = batch
        rec.ident = ident
        rec.dev = dev
        rec.profiled_peak = peak
        reached = _params_reached(leaves)
        rec.grad_params = [id(p) in reached for p in params]
        rec.grad_param_list = [p for p, g in zip(params, rec.grad_params) if g]
        for x in leaves:  # replayed outputs carry no host shadow; the recorded ones must not either
            x._shadow = None
    elif rec is not None:
        rec.out_specs = None  # type: ignore[assignment]
        rec.treespec = None
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
        grads = [x for x in leaves if isinstance(x, EmuTensor) and x.requires_grad]
        if grads:
            marked = _BackwardStart.apply(_BackwardInfo(rec if ok else None, bwd_s, label, dev), *grads)
            it = iter(marked)
            leaves = [next(it) if isinstance(x, EmuTensor) and x.requires_grad else x for x in leaves]
            out = tree_unflatten(leaves, treespec)
    return out


def _graph_nodes(roots: list) -> Any:
    """Each autograd node reachable from ``roots`` (nodes or None), once."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        yield fn
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)


def _params_reached(outputs: list) -> set[int]:
    """ids of the leaf tensors (parameters) the outputs' autograd graph reaches."""
    reached: set[int] = set()
    for fn in _graph_nodes([x.grad_fn for x in outputs if isinstance(x, torch.Tensor)]):
        var = getattr(fn, "variable", None)
        if var is not None:
            reached.add(id(var))
    return reached


class _BackwardInfo:
    __slots__ = ("rec", "bwd_seconds", "label", "dev")

    def __init__(self, rec: Recording | None, bwd_seconds: float, label: str, dev: int) -> None:
        self.rec, self.bwd_seconds, self.label, self.dev = rec, bwd_seconds, label, dev


class _BackwardStart(torch.autograd.Function):
    """Marks where the op-by-op backward of a recorded/fallback module starts: charges the
    module's backward time, stops per-op charging, and measures the backward's peak memory until
    the whole backward pass ends."""

    @staticmethod
    def forward(ctx: Any, info: _BackwardInfo, *outs: torch.Tensor) -> tuple:  # type: ignore[override]
        ctx.info = info
        # An output the loss does not use (GoogLeNet's auxiliary logits) gets no gradient, as in
        # torch: autograd would otherwise make zeros from the wrapper's metadata, i.e. PLAIN meta
        # tensors, and run that branch's backward on them (its parameters got meta gradients).
        ctx.set_materialize_grads(False)
        # New wrappers over the same memory block, not autograd views: the user may modify the
        # outputs in place (``logits /= T``), which autograd forbids on views made in a Function.
        return tuple(_wrap(o.shape, o.stride(), o.storage_offset(), o.dtype, o._dev, o._block) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        info: _BackwardInfo = ctx.info
        rt = _R.rt
        if rt is None:
            return (None, *grads)
        engine = rt.state.get("engine")
        mem = _S.memory[info.dev]
        if engine is not None and info.bwd_seconds > 0:
            engine.stream(info.dev).enqueue(info.bwd_seconds, "backward", info.label)
        start = mem.allocated
        outer_peak = mem.peak_allocated
        mem.peak_allocated = start
        if engine is not None:
            engine._local.scope = getattr(engine._local, "scope", 0) + 1

        def done() -> None:
            if engine is not None:
                engine._local.scope = max(0, getattr(engine._local, "scope", 1) - 1)
            if info.rec is not None:
                info.rec.bwd_extra = max(0, mem.peak_allocated - start)
            mem.peak_allocated = max(outer_peak, mem.peak_allocated)
            mem.sample()

        torch.autograd.Variable._execution_engine.queue_callback(done)
        return (None, *grads)


# ----------------------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------------------
def _new_outputs(rec: Recording, dev: int) -> list:
    mem = _S.memory[dev]
    outs = []
    for shape, stride, offset, dtype, nbytes in rec.out_specs:
        outs.append(_wrap(shape, stride, offset, dtype, dev, mem.allocate(nbytes) if nbytes else None))
    return outs


def _replay(rec: Recording, emus: list, params: list, t0: float | None = None) -> Any:
    _R.stats["replayed"] += 1
    dev = rec.dev
    mem = _S.memory[dev]
    if not torch.is_grad_enabled():
        _charge(rec.fwd_seconds, "forward", rec, t0)
        mem.touch(rec.fwd_extra)
        outs = _new_outputs(rec, dev)
        if rec.profiled_peak is not None:
            mem.touch(rec.profiled_peak - mem.allocated)
        mem.sample()
        return _unflatten(outs, rec.treespec)
    grad_params = rec.grad_param_list
    direct = None
    if grad_params:
        if rec.hook_gen != _S.hook_generation:
            # Re-checked only after some tensor got a hook (Tensor.register_hook & co. bump it).
            hooked = any(p._post_accumulate_grad_hooks is not None or p._backward_hooks for p in grad_params)
            rec.hook_gen = -1 if hooked else _S.hook_generation
        if rec.hook_gen == _S.hook_generation:
            # No hooks on the parameters: backward may set .grad itself (see _ReplayFunction).
            if rec.plain >= _HUB_AFTER and not _R.no_hub and _HUB_AFTER >= 0 and not _functorch_active():
                direct = rec.hub_direct
                if direct is None or direct.n_inputs != len(emus):
                    hub = _wrap((0,), (1,), 0, torch.float32, rec.dev, None, requires_grad=True)
                    direct = rec.hub_direct = _Direct(len(emus), grad_params, rec.dev, hub)
                _R.hub_used = True
                _R.stats["hub"] = _R.stats.get("hub", 0) + 1
                outs = _apply_replay(rec, direct, t0, *emus, direct.hub)
                return _unflatten(outs, rec.treespec)
            direct = rec.direct
            if direct is None or direct.n_inputs != len(emus):
                direct = rec.direct = _Direct(len(emus), grad_params, rec.dev)
    if _functorch_active():
        outs = _ReplayFunction.apply(rec, direct, t0, *emus, *grad_params)
    else:
        # autograd.Function.apply without its per-argument Python pass (functorch's dead-wrapper
        # unwrapping, only needed under functorch transforms): ~160 arguments per call.
        outs = _apply_replay(rec, direct, t0, *emus, *grad_params)
    return _unflatten(outs, rec.treespec)


_functorch_active = torch._C._are_functorch_transforms_active


def _unflatten(outs: Any, treespec: Any) -> Any:
    """The recorded output structure around replayed outputs; a lone tensor (a classifier's
    logits) skips pytree's Python walk (~2 µs)."""
    if treespec.is_leaf():
        return outs[0]
    return tree_unflatten(list(outs), treespec)


class _Direct:
    """Lets the replayed backward store parameter gradients directly (``p.grad = g``) instead
    of returning them to autograd, which would run one AccumulateGrad node (and a Python-dispatched
    ``detach``) per parameter: the biggest host cost of an emulated backward. Used only when the
    engine will run ALL the parameters' AccumulateGrad nodes in this backward (``loss.backward()``;
    not ``torch.autograd.grad(..., params)`` nor ``backward(inputs=[some parameters])``) and no
    parameter has hooks. Kept on the :class:`Recording` between calls.

    **Hub mode** (``hub`` set): after :data:`_HUB_AFTER` plain backwards of a recording, its
    replays pass ONE zero-size leaf (the hub) to autograd instead of every parameter: the engine
    then visits one accumulator instead of one per parameter (~1.8 µs each) and ``apply`` builds
    one edge instead of one per parameter (~1 µs each). The backward stores every parameter's
    ``.grad`` when the hub's accumulator runs (a plain backward). Targeted gradients that name
    parameters of such a graph (``torch.autograd.grad``, ``backward(inputs=...)``) are answered
    by the patched functions (:func:`_grad`, :func:`_backward`), and hub mode ends for the run."""

    __slots__ = ("n_inputs", "params", "node", "nodes", "hub", "pspecs", "param_bytes", "gradset")

    def __init__(self, n_inputs: int, params: list, dev: int, hub: Any = None) -> None:
        self.n_inputs = n_inputs
        self.params = params
        self.hub = hub
        # The accumulator nodes the graph will use (kept alive by these references).
        self.nodes = [get_gradient_edge(t).node for t in ([hub] if hub is not None else params)]
        self.node = self.nodes[0]
        self.pspecs = [_grad_spec(p, dev) for p in params]
        self.param_bytes = sum(spec[4] for spec in self.pspecs)
        self.gradset: Any = None  # gpemu.gradients' set of these parameters' gradients


_will_execute = torch._C._will_engine_execute_node


def _charge(seconds: float, kind: str, rec: Recording, at: float | None = None) -> None:
    engine = _S.engine
    if engine is not None and seconds > 0:
        engine.stream(rec.dev).enqueue(seconds, kind, rec.label, 0, at)


def _grad_spec(t: torch.Tensor, dev: int) -> tuple:
    """(shape, contiguous strides, dtype, device, bytes, wrapper key, allocator-rounded bytes) of
    the gradient of ``t``."""
    stride = torch.empty(t.shape, device="meta").stride() if t.dim() else ()
    gdev = t._dev if isinstance(t, EmuTensor) else dev
    nbytes = t.numel() * t.element_size()
    return (t.shape, stride, t.dtype, gdev, nbytes, (tuple(t.shape), tuple(stride), 0, t.dtype, gdev),
            round_size(nbytes) if nbytes else 0)


class _ReplayFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rec: Recording, direct: "_Direct | None", t0: float | None,  # type: ignore[override]
                *tensors: torch.Tensor) -> tuple:
        _charge(rec.fwd_seconds, "forward", rec, t0)
        ctx.set_materialize_grads(False)  # the gradients' values are never read (see _BackwardStart)
        mem = _S.memory[rec.dev]
        saved = mem.allocate(rec.saved_bytes) if rec.saved_bytes else None
        mem.touch(rec.fwd_extra)
        outs = _new_outputs(rec, rec.dev)
        if rec.profiled_peak is not None:
            mem.touch(rec.profiled_peak - mem.allocated)
        mem.sample()
        ctx.rec = rec
        ctx.direct = direct
        ctx.saved_block = saved
        ctx.hook_gen = _S.hook_generation  # (see _direct_backward)
        specs = rec.grad_specs
        if specs is None or len(specs) != len(tensors):
            specs = rec.grad_specs = [_grad_spec(t, rec.dev) for t in tensors]
        ctx.specs = specs
        if not rec.all_diff:
            ctx.mark_non_differentiable(*[o for o, rg in zip(outs, rec.out_requires_grad) if not rg])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        # (the gradients' values are never read: only which inputs need one)
        return _replay_backward(ctx, None)


def _replay_backward(ctx: Any, plain: bool | None) -> tuple:
    """The replayed backward: charges the module's backward time, makes the inputs' and the
    parameters' gradients (memory and metadata), frees the saved activations. ``plain``: the
    caller knows every parameter accumulator runs (:func:`_direct_backward`); None: ask the
    autograd engine."""
    rec: Recording = ctx.rec
    mem = _S.memory[rec.dev]
    _charge(rec.bwd_seconds, "backward", rec)
    result: list[Any] = [None, None, None]
    needs = ctx.needs_input_grad[3:]
    specs = ctx.specs
    direct: _Direct | None = ctx.direct
    if direct is not None:
        if plain is not None:
            runs = plain
        else:
            try:
                # every accumulator, not just one: backward(inputs=[...]) may name only some
                runs = _will_execute(direct.node) and all(map(_will_execute, direct.nodes))
            except RuntimeError:  # raised for leaves while torch.autograd.grad() runs
                runs = False
        if not runs:
            # e.g. torch.autograd.grad(loss, params): return the gradients, and keep every
            # parameter an autograd input from now on (no hub mode for this recording)
            rec.plain = _NEVER
            direct = None
        elif direct.hub is None:
            rec.plain += 1
    new_bytes = 0
    for spec, needed in zip(specs, needs):
        if needed:
            new_bytes += spec[4]
    if direct is not None and direct.hub is not None:
        new_bytes += direct.param_bytes  # not among the autograd inputs in hub mode
    mem.touch(rec.bwd_extra - new_bytes)
    first_param = direct.n_inputs if direct is not None else len(specs)
    for i in range(first_param):
        if needs[i]:
            shape, stride, dtype, dev, nbytes, _, _ = specs[i]
            result.append(_wrap(shape, stride, 0, dtype, dev, _S.memory[dev].allocate(nbytes) if nbytes else None))
        else:
            result.append(None)
    if direct is not None:
        every = direct.hub is not None or all(needs[first_param:])
        if not (every and gradients.hand_out(direct)):
            gradients.store(direct, direct.params, direct.pspecs,
                            None if direct.hub is not None else needs[first_param:], every)
        result.extend([None] * (len(specs) - first_param))
    ctx.saved_block = None  # saved activations are freed once backward has used them
    mem.sample()
    return tuple(result)


# torch._C._FunctionBase.apply bound to _ReplayFunction (see _replay).
_apply_replay = super(torch.autograd.Function, _ReplayFunction).apply


# ----------------------------------------------------------------------------------------------
# targeted gradients through a hub-mode graph (see _Direct)
# ----------------------------------------------------------------------------------------------
def _hub_nodes(roots: Any) -> list:
    """The hub-mode replay nodes in the autograd graph of ``roots`` (tensor or sequence)."""
    items = [roots] if isinstance(roots, (torch.Tensor, GradientEdge)) else list(roots)
    # tensors and GradientEdges (torch.autograd.graph.get_gradient_edge) as roots
    found = []
    for fn in _graph_nodes([t.grad_fn if isinstance(t, torch.Tensor) else getattr(t, "node", None) for t in items]):
        direct = getattr(fn, "direct", None)
        if isinstance(direct, _Direct) and direct.hub is not None:
            found.append(fn)
    return found


def _placeholder_grad(t: torch.Tensor) -> EmuTensor:
    shape, stride, dtype, dev, nbytes, _, _ = _grad_spec(t, t._dev)
    return _wrap(shape, stride, 0, dtype, dev, _S.memory[dev].allocate(nbytes) if nbytes else None)


def _targeted(roots: Any, inputs: Any) -> tuple[list, set[int], list] | None:
    """(inputs as a list, ids of those a hub-mode graph holds, its nodes), or None when the call
    can go to torch unchanged. Ends hub mode for the run once such a graph is met."""
    if not _R.hub_used or inputs is None:
        return None
    nodes = _hub_nodes(roots)
    if not nodes:
        return None
    _R.no_hub = True  # the program asks for targeted gradients: keep every parameter an input
    if isinstance(inputs, dict):
        inputs = list(inputs.values())
    ins = [inputs] if isinstance(inputs, (torch.Tensor, GradientEdge)) else list(inputs)
    covered = {id(p) for fn in nodes for p in fn.direct.params}
    if not any(id(t) in covered for t in ins):
        return None
    return ins, covered, nodes


def _charge_skipped(nodes: list) -> None:
    """Backward time of hub-mode replays whose backward autograd will not run."""
    for fn in nodes:
        _charge(fn.rec.bwd_seconds, "backward", fn.rec)


def _make_grad(orig: Any) -> Any:
    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(inputs, dict) and _R.hub_used:  # named inputs: the same, as a dict
            values = grad(outputs, list(inputs.values()), *args, **kwargs)
            return dict(zip(inputs.keys(), values))
        found = _targeted(outputs, inputs)
        if found is None:
            return orig(outputs, inputs, *args, **kwargs)
        ins, covered, nodes = found
        others = [t for t in ins if id(t) not in covered]
        if others:
            got = iter(orig(outputs, others, *args, **kwargs))
        else:
            got = iter(())
            _charge_skipped(nodes)
        # the parameters a hub graph holds get placeholder gradients (shape/dtype/device and
        # memory are all an emulated gradient has)
        return tuple(_placeholder_grad(t) if id(t) in covered else next(got) for t in ins)
    grad.__wrapped__ = orig  # type: ignore[attr-defined]
    return grad


# ----------------------------------------------------------------------------------------------
# loss.backward() without the autograd engine, for the graph every training step builds
# ----------------------------------------------------------------------------------------------
# Graph heads that can hand a replayed module its output's gradient without the engine:
# node class -> (ready(node) -> bool, without side effects; run(node) -> the memory block of the
# gradient it makes for its input), registered by gpemu.loss_fastpath for the replayed loss.
_HEADS: dict[type, tuple[Any, Any]] = {}
_DIRECT = True  # benchmarks/step_parts.py --compare-direct turns it off for A/B runs
_ReplayBackward = _ReplayFunction._backward_cls
_anomaly_on = torch.is_anomaly_enabled
_profiler_on = torch.autograd._profiler_enabled  # a profiler records the engine's nodes: let it


def register_direct_head(node_cls: type, ready: Any, run: Any) -> Any:
    """Let :func:`_direct_backward` start at nodes of ``node_cls``: ``ready(node)`` says whether
    it can (no side effects), ``run(node)`` charges the node's backward and returns its input
    gradient's memory block. Returns the function that undoes the registration."""
    _HEADS[node_cls] = (ready, run)
    return lambda: _HEADS.pop(node_cls, None)


def _direct_backward(loss: EmuTensor) -> bool:
    """``loss.backward()`` for the graph of an ordinary training step, run without the autograd
    engine: a replayed loss (a registered head) on an output of a hub-mode replayed module whose
    other inputs need no gradient. The engine would call exactly the two nodes' backward
    functions and an accumulator that receives nothing, so they are called here directly, with
    the same charges, memory (the implicit gradient and the loss's input gradient are held while
    the engine would hold them) and gradients; its C++ and per-node Python glue cost ~12 µs per
    step. Any other graph, hooks registered anywhere since the graph was built, anomaly mode, a
    recording profiler or a functorch transform: False, and the engine runs as usual."""
    lnode = loss.grad_fn
    head = _HEADS.get(type(lnode))
    if (head is None or not _DIRECT or _anomaly_on() or _functorch_active() or _profiler_on()
            or not head[0](lnode)):
        return False
    gen = _S.hook_generation
    if getattr(lnode, "hook_gen", None) != gen:
        return False
    rnode = None
    for fn, _ in lnode.next_functions:
        if fn is None:
            continue
        if rnode is not None or type(fn) is not _ReplayBackward:
            return False
        rnode = fn
    if rnode is None or rnode.hook_gen != gen:
        return False
    direct = rnode.direct
    if direct is None or direct.hub is None or rnode.rec.hub_direct is not direct:
        return False
    edges = rnode.next_functions
    if edges[-1][0] is not direct.node or any(fn is not None for fn, _ in edges[:-1]):
        return False  # an input of the module needs a gradient: the engine's business
    cost = _IMPLICIT.get(loss._key)
    if cost is None:
        return False  # the implicit gradient's cost is measured on the engine path first
    dev = loss._dev
    _tensor.charge_op(cost, dev, "ones_like.default")
    # torch.autograd.backward holds the implicit gradient until the whole backward has run
    implicit = _S.memory[dev].allocate(loss.element_size())
    with torch.no_grad():  # as the engine runs backward without create_graph
        grad_block = head[1](lnode)
        _replay_backward(rnode, True)
        del grad_block  # the engine frees the module's incoming gradient after its node ran
    del implicit
    _R.stats["direct_backward"] = _R.stats.get("direct_backward", 0) + 1
    return True


# torch.autograd.backward's own engine entry (logging hooks, context for device threads).
_run_engine = getattr(torch.autograd.graph, "_engine_run_backward", None)


# The implicit gradient of a scalar loss (what torch.autograd.backward would make with
# ones_like), per loss metadata: (GPU time of making it, op by op). Built directly afterwards,
# it skips a dispatch and torch's checks (~8 us of each training step's host time).
_IMPLICIT: dict[tuple, float] = {}


def _implicit_grad(t: EmuTensor) -> EmuTensor:
    cost = _IMPLICIT.get(t._key)
    if cost is None:
        with _tensor.OpCostTap() as tap:
            g = torch.ones_like(t, memory_format=torch.preserve_format)
        _IMPLICIT[t._key] = tap.seconds
        return g
    dev = t._dev
    _tensor.charge_op(cost, dev, "ones_like.default")
    nbytes = t.element_size()
    return _wrap((), (), 0, t.dtype, dev, _S.memory[dev].allocate(nbytes))


def _make_backward(orig: Any) -> Any:
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if (type(tensors) is EmuTensor and args and args[0] is None and not tensors._key[0]
                and tensors._shadow is None and tensors.requires_grad and "grad_variables" not in kwargs):
            # loss.backward(): a scalar's implicit gradient (placeholder values: no shadow to keep)
            defaults = len(args) == 3 and args[2] is False and kwargs.get("inputs") is None and len(kwargs) <= 1
            if defaults and _direct_backward(tensors):
                return None
            grad = _implicit_grad(tensors)
            if defaults and _run_engine is not None and not _functorch_active():
                # Tensor.backward()'s own call with its defaults: one tensor, its gradient made
                # above, no inputs, no create_graph. torch.autograd.backward's argument handling
                # (~8 µs) has nothing to decide here; its engine call is made as it would make it.
                _run_engine((tensors,), (grad,), bool(args[1]), False, (),
                            allow_unreachable=True, accumulate_grad=True)
                return None
            args = (grad,) + args[1:]
        # inputs: keyword (Tensor.backward passes it so) or the sixth positional argument
        inputs = kwargs.get("inputs", args[4] if len(args) > 4 else None)
        found = _targeted(tensors, inputs)
        if found is None:
            return orig(tensors, *args, **kwargs)
        ins, covered, nodes = found
        for t in ins:
            if id(t) in covered and t.grad is None:
                t.grad = _placeholder_grad(t)  # an existing gradient accumulates in place
        others = [t for t in ins if id(t) not in covered]
        if others:
            if len(args) > 4:
                args = args[:4] + (others,) + args[5:]
            else:
                kwargs["inputs"] = others
            return orig(tensors, *args, **kwargs)
        _charge_skipped(nodes)
        return None
    backward.__wrapped__ = orig  # type: ignore[attr-defined]
    return backward


# ----------------------------------------------------------------------------------------------
# install
# ----------------------------------------------------------------------------------------------
def _bump_structure(orig: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _R.structure_gen += 1
        try:
            return orig(*args, **kwargs)
        finally:
            _R.structure_gen += 1  # after too: _apply swaps parameters while it runs
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _bump_hooks(orig: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _S.hook_generation += 1
        return orig(*args, **kwargs)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def install(rt: "Runtime") -> None:
    """Patch nn.Module.__call__ with the record/replay fast path."""
    _R.rt = rt
    _R.local = threading.local()
    _R.records = weakref.WeakKeyDictionary()
    _R.unreplayable = weakref.WeakKeyDictionary()
    _R.stats = {"recorded": 0, "replayed": 0, "fallback": 0}
    _R.trees = weakref.WeakKeyDictionary()
    _R.hub_used = False
    _R.no_hub = False
    gradients.start()
    rt.patcher.on_restore(gradients.stop)

    def reset() -> None:
        _IMPLICIT.clear()
        _R.rt = None
        _R.hub_used = False
        _R.no_hub = False
        _R.records = weakref.WeakKeyDictionary()
        _R.unreplayable = weakref.WeakKeyDictionary()
        _R.trees = weakref.WeakKeyDictionary()

    rt.patcher.on_restore(reset)
    M = torch.nn.Module
    rt.patcher.replace(M, "__call__", _make_call(M.__call__))
    # What can change a module tree's parameters, submodules or training flags invalidates the
    # cached walk (_Tree): attribute sets/deletes (also `m.training = False`, `m.fc = Linear()`),
    # registrations that write the dicts directly, and _apply (it may swap parameters in place).
    for name in ("__setattr__", "__delattr__", "register_parameter", "register_module", "add_module", "_apply"):
        rt.patcher.replace(M, name, _bump_structure(getattr(M, name)))
    # Targeted gradients through a hub-mode replay are answered here (see _Direct).
    rt.patcher.replace(torch.autograd, "grad", _make_grad(torch.autograd.grad))
    rt.patcher.replace(torch.autograd, "backward", _make_backward(torch.autograd.backward))
    # Parameter hooks decide whether the replayed backward may store .grad itself.
    T = torch.Tensor
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        if hasattr(T, name):
            rt.patcher.replace(T, name, _bump_hooks(getattr(T, name)))
    # Hooks on custom-Function graph nodes (grad_fn.register_hook/prehook) end the direct
    # backward for graphs built before them (see _direct_backward).
    B = torch.autograd.function.BackwardCFunction
    for name in ("register_hook", "register_prehook"):
        rt.patcher.replace(B, name, _bump_hooks(getattr(B, name)))
