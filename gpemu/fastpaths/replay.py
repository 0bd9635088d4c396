"""Module-level record/replay: the fast path that keeps the emulator's own host time small.

:mod:`gpemu.model_time` charges the OUTERMOST module with parameters for its forward and backward
and runs it op by op. This fast path patches ``nn.Module.__call__`` over it:

* **first call** for a given situation (*recording*): the module runs op by op through
  :meth:`gpemu.model_time.ModelTime.run_charged`, which measures the output specs, the memory that
  stays allocated for backward (saved activations), the transient peaks of forward and backward,
  and which parameters receive gradients (a :class:`Recording`).
* **later calls** (*replay*): the whole forward is ONE ``torch.autograd.Function`` whose forward
  builds the outputs from the recorded specs (allocating their memory and the saved-activation
  memory, touching the transient peak) and whose backward returns gradients shaped like the
  inputs/parameters, frees the saved memory and charges the recorded backward time.

The "situation" (cache key) is: the module's and all submodules' training flags, grad mode,
inference mode, autocast state, the TF32 switches, the input specs (shapes/strides/dtypes/devices,
non-tensor arguments), and each parameter's requires_grad/dtype/device.

Fallback (the op-by-op path, time still charged per module; said once per reason):
forward/backward hooks on any submodule (or global module hooks), outputs that are not
tensors in tuples/lists/dicts, outputs that alias inputs or parameters.

The replayed backward stores parameter gradients itself (``p.grad = g``) when the autograd engine
would accumulate them in this backward and no parameter has hooks; otherwise (DDP's
post-accumulate hooks, ``torch.autograd.grad(loss, params)``, ``backward(inputs=[some params])``)
it returns them to autograd. Gradient wrappers that ``zero_grad()`` dropped and nothing else
references are handed out again as the next replayed backward's gradients
(:mod:`gpemu.fastpaths.gradients`). After ``config.tuning.hub_after`` plain backwards, a
recording's replays pass one "hub" leaf to autograd instead of every parameter (see
:class:`Direct`); ``torch.autograd.grad``/``backward(inputs=...)`` are patched to answer for
parameters of such a graph. An ordinary step's ``loss.backward()`` may run without the autograd
engine (:func:`_direct_backward`).

All state is per run: :class:`ReplayState` (``rt.replay``); the patched functions are closures
over it. Off with ``config.replay=False``.

What replay does not reproduce: in-place updates of buffers inside forward (BatchNorm's running
statistics keep their metadata, so nothing observable changes), and Python side effects of the
forward (print, counters) after the first call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from operator import is_
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_unflatten

from gpemu.costmodel.precision import tf32_cudnn, tf32_matmul
from gpemu.device import EmuTensor
from gpemu.model_time import PLAIN_VALUES, CallRecord, ModelTime, emulated_device

from .gradients import GradientState, grad_spec
from .module_tree import ModuleTree, walk
from .shape_class import ShapeClasses, class_call

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime

__all__ = [
    "install",
    "Recording",
    "ReplayState",
    "replay_info",
    "Direct",
    "DirectHead",
    "ReplayFunction",
    "ReplayBackward",
    "replay_backward",
    "charge_recording",
    "functorch_active",
]

_nn_module = torch.nn.modules.module
_weakref = weakref.ref
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass
# The innermost torch.autograd.graph.saved_tensors_hooks in force (None: none); its argument says
# whether to ignore them while torch.compile traces.
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
# Recorded situations kept per module (input shapes, flags): enough for a few batch sizes and
# sequence lengths in train and eval; a program that sends ever new shapes keeps only the last.
_RECORDS_PER_MODULE = 32


def _weakened(sig: Any) -> Any:
    """``sig`` with its objects (anything but the plain values of gpemu.model_time.PLAIN_VALUES,
    keyed by identity) held weakly where they allow it; None when it holds no object. A
    recording's key must not keep a call's object alive (an HF cache holding every layer's keys
    and values: 0.56 GiB of emulated memory for GPT-2 small at 8 x 1024, kept for a step after its
    call). A weak reference compares and hashes as its object while that lives; once dead it
    matches nothing new."""
    out = []
    held = False
    for item in sig:
        if isinstance(item, tuple):
            inner = _weakened(item)
            if inner is not None:
                held = True
                item = inner
        elif not isinstance(item, PLAIN_VALUES):
            held = True
            try:
                ref = _weakref(item)
                hash(ref)
                item = ref
            except TypeError:
                pass
        out.append(item)
    return tuple(out) if held else None


_NEVER = -(1 << 60)


class DirectHead(NamedTuple):
    """A graph head the engine-free backward can start at (a replayed loss's node class)."""

    # ready(node) -> bool: whether this node's backward can run so (no side effects)
    ready: Callable[[Any], bool]
    # run(node, as_tensor) -> charges the node's backward and returns the gradient it makes for
    # its input: its memory block, or (as_tensor) an emulated tensor over it, for torch's nodes
    # between the head and the replayed module to run on
    run: Callable[[Any, bool], Any]


class ReplayState:
    """The module replay fast path of one run (``rt.replay``)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.ts = rt.tensors  # the tensor type's interface (wrap, signature, charge, memory, engine)
        self.model_time: ModelTime = rt.model_time  # runs the calls that are not replayed
        tuning = rt.config.tuning
        self.hub_after = tuning.hub_after  # plain backwards before hub mode; -1 never
        self.direct_enabled = tuning.direct_backward
        self.gradients = GradientState(rt.tensors, tuning.spare_limit)
        self.records: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()
        self.unreplayable: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self.stats = {"recorded": 0, "replayed": 0}
        # Module trees seen as outermost modules (see module_tree.walk); valid while structure_gen holds.
        self.trees: weakref.WeakKeyDictionary[torch.nn.Module, ModuleTree] = weakref.WeakKeyDictionary()
        # Bumped by every Module attribute set/delete, parameter/submodule registration and
        # _apply (model.to/.cuda/.half): whatever may change a module tree's parameters, submodules
        # or training flags.
        self.structure_gen = 0
        # Bumped when any tensor or graph node gets a hook (or retain_grad()): replays re-check
        # their parameters, and graphs built before it leave loss.backward() to the engine.
        self.hook_generation = 0
        # Bumped when any module gets a forward or backward (pre-)hook: cached walks re-check
        # their trees' hook dicts (a handle's remove() bumps nothing: a tree found hooked is
        # re-checked at every call).
        self.module_hook_gen = 0
        # Calls of a module whose object argument was new each time (see _outer_call).
        self.object_misses: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self.hub_used = False  # some replay ran in hub mode (see Direct)
        # Calls without autograd (generation, serving): modules replayed by shape class from now
        # on (gpemu.fastpaths.shape_class), and how many exact-shape recordings each made.
        self.classes = ShapeClasses()
        self.serving = self.model_time.serving  # the token steps of generation loops (gpemu.serving)
        self.by_class: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self.no_grad_keys: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self.no_hub = False  # targeted gradients met a hub graph: no hub mode for this run
        # Graph heads that can hand a replayed module its output's gradient without the engine:
        # node class -> its DirectHead (see register_direct_head).
        self.heads: dict[type, DirectHead] = {}
        # Whether hooks registered on torch's own graph nodes bump hook_generation (the patch of
        # torch.autograd.function._HookMixin._register_hook is in place): only then may the
        # engine-free backward run such nodes between a loss and a replayed module.
        self.node_hooks_seen = False
        # The implicit gradient of a scalar loss (what torch.autograd.backward would make with
        # ones_like), per loss metadata: the GPU time of making it op by op (_implicit_grad).
        self.implicit: dict[tuple, float] = {}

    def info(self) -> dict[str, int]:
        """How many outermost-module calls were recorded, replayed, or ran the fallback path
        (``shape_class``: of the replays, those of calls without autograd replayed by shape class)."""
        return {
            **self.stats,
            "fallback": self.model_time.stats["fallback"],
            "shape_class": self.classes.stats["replayed"],
        }

    def params_of(self, module: torch.nn.Module) -> list | None:
        """The parameters of ``module``'s tree (each once), from the cached walk (None for a
        module that cannot be cached)."""
        try:
            return walk(self.trees, self.structure_gen, self.module_hook_gen, module)[0]
        except TypeError:
            return None

    def register_direct_head(self, node_cls: type, head: DirectHead) -> Any:
        """Let :func:`gpemu.fastpaths.backward._direct_backward` start at nodes of ``node_cls``.
        Returns the function that undoes the registration."""
        self.heads[node_cls] = head
        return lambda: self.heads.pop(node_cls, None)


def replay_info() -> dict[str, int]:
    """How many outermost-module calls of the active run were recorded, replayed, or ran the
    fallback path (empty when replay is off or nothing is patched)."""
    from gpemu.runtime import current

    rt = current()
    if rt is None:
        return {}
    if rt.replay is not None:
        return rt.replay.info()
    # replay off: every call ran op by op
    return {"recorded": 0, "replayed": 0, "fallback": rt.model_time.stats["op_by_op"]}


class Recording(CallRecord):
    """What one recorded forward of a module needs for replay: what its op-by-op call measured
    (:class:`gpemu.model_time.CallRecord`) and the replay's own book-keeping."""

    __slots__ = ("grad_specs", "hook_gen", "direct", "plain", "hub_direct", "state", "param_nodes")

    def __init__(self, state: ReplayState) -> None:
        super().__init__()
        self.state = state
        self.grad_specs: list | None = None
        self.hook_gen = -1  # state.hook_generation when grad_param_list was found to have no hooks
        # Reused between calls: its AccumulateGrad node reference keeps the parameter's
        # accumulator alive, so get_gradient_edge (~3 µs of Python) runs once per recording.
        self.direct: Direct | None = None
        # Consecutive replayed backwards that were plain ``loss.backward()`` calls (every
        # parameter accumulator ran); _NEVER once a targeted one (autograd.grad, inputs=) was seen.
        self.plain = 0
        self.hub_direct: Direct | None = None
        # The parameters' accumulator nodes, looked up (and watched by the gradient sets) once
        # per recording: shared by its plain and hub-mode Direct (see Direct.__init__).
        self.param_nodes: list | None = None


# ----------------------------------------------------------------------------------------------
# the patched Module.__call__
# ----------------------------------------------------------------------------------------------
def _make_call(R: ReplayState, orig_call: Any) -> Any:
    engine = R.ts.engine
    mt = R.model_time
    trees = R.trees

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        local = mt.local
        if getattr(local, "depth", 0):
            mt.note_call(self)
            if not getattr(local, "open", False):
                return orig_call(self, *args, **kwargs)
            # A unit of its own inside an ancestor whose outputs cannot be replayed.
            local.open = False
            try:
                return _unit_call(R, orig_call, self, args, kwargs, trees, engine)
            finally:
                local.open = True
        tree = trees.data.get(_weakref(self)) if trees else None  # type: ignore[attr-defined]  # (the dict itself: faster)
        # The cached walk's first parameter (valid while no Module attribute changed anywhere):
        # the generator behind module.parameters() costs ~5 µs per call.
        first = tree.first if tree is not None and tree.gen == R.structure_gen else None
        dev = emulated_device(self, args, kwargs, first)
        if dev is None:
            return orig_call(self, *args, **kwargs)
        # On a real GPU the forward's first kernel is issued microseconds into the call: the
        # forward's GPU time starts here, before the emulator's own book-keeping for the call.
        t0 = engine.now()
        local.depth = 1
        try:
            out = _outer_call(R, orig_call, self, args, kwargs, dev, t0)
        finally:
            local.depth = 0
        if not torch.is_grad_enabled():  # generation, serving (evaluation: no token ids, not noted)
            R.serving.note(engine, args, kwargs, dev, t0)
        return out

    __call__.__wrapped__ = orig_call  # type: ignore[attr-defined]
    return __call__


def _unit_call(
    R: ReplayState, orig_call: Any, module: torch.nn.Module, args: tuple, kwargs: dict, trees: Any, engine: Any
) -> Any:
    tree = trees.data.get(_weakref(module)) if trees else None
    first = tree.first if tree is not None and tree.gen == R.structure_gen else None
    dev = emulated_device(module, args, kwargs, first)
    if dev is None:
        return orig_call(module, *args, **kwargs)
    return _outer_call(R, orig_call, module, args, kwargs, dev, engine.now(), unit=True)


# Where the input signature sits in a recording's key (_outer_call).
_IN_SIG = 5


def _global_hooks() -> bool:
    return bool(
        _nn_module._global_forward_hooks
        or _nn_module._global_forward_pre_hooks
        or _nn_module._global_backward_hooks
        or _nn_module._global_backward_pre_hooks
    )


def _outer_call(
    R: ReplayState,
    orig_call: Any,
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    dev: int,
    t0: float | None = None,
    unit: bool = False,
) -> Any:
    """An outermost module call: replayed when a recording of the same situation exists, else
    run op by op (recorded when its outputs can be made again). ``unit``: a unit inside an
    op-by-op ancestor."""
    run_charged = R.model_time.run_charged
    params, flags, hooks = walk(R.trees, R.structure_gen, R.module_hook_gen, module)
    if _graph_task() != -1:
        # Called during a backward pass: activation checkpointing recomputes its forward, and
        # torch.utils.checkpoint (non-reentrant) matches the tensors it saves with the first
        # forward's; a replay saves none. Op by op, never recorded.
        return run_charged(orig_call, module, args, kwargs, dev, params, None, None, t0)
    if _saved_tensor_hooks(False) is not None:
        # Saved-tensor hooks (torch.utils.checkpoint, save_on_cpu, activation offloading) see
        # every tensor a forward saves, as on a GPU; a replay saves none. Non-reentrant
        # checkpointing would then recompute the call op by op in the backward and find more
        # saved tensors than its forward had (CheckpointError), and never charge the recompute
        # of a block whose saved tensors all came from replays.
        why = "saved-tensor hooks are active (activation checkpointing or offloading)"
        return run_charged(orig_call, module, args, kwargs, dev, params, None, why, t0, open_children=True)
    hooked = hooks or _global_hooks()
    by_class = not hooked and not torch.is_grad_enabled()
    if by_class and (module in R.by_class or _holds_objects(R, module, args, kwargs)):
        # Generation and serving: calls that change their cache, or whose sizes grow step by step
        return class_call(R, orig_call, module, args, kwargs, dev, params, flags, t0, unit)
    reason = "module hooks are registered" if hooked else R.unreplayable.get(module)
    emus: list = []
    key = None if reason is not None else _call_key(R, args, kwargs, flags, emus)
    if reason is None and key is None:
        reason = "a module argument is not hashable"
    if reason is not None or key is None:
        # Its submodules' calls are units of their own: they may be replayed (an HF model whose
        # output holds a cache object: its layers are replayed).
        return run_charged(orig_call, module, args, kwargs, dev, params, None, reason, t0, open_children=True)
    table = R.records.get(module)
    if table is None:
        table = R.records[module] = {}
    rec = table.get(key)
    if rec is None:
        rec, key = _lookup(R, module, table, key)
        reason = R.unreplayable.get(module)
    if reason is not None:  # (given up just now)
        return run_charged(orig_call, module, args, kwargs, dev, params, None, reason, t0, open_children=True)
    if rec is not None and (
        rec.params is params  # the cached walk's own list: nothing changed
        or (len(rec.params) == len(params) and all(map(is_, rec.params, params)))
    ):
        # A replay runs no user code: an emulator entry (gpemu.time.HostTime.call), its host
        # time is not the program's.
        return R.ts.call(_replay, rec, emus, params, t0)
    if by_class and R.no_grad_keys.get(module, 0) >= 1:
        # a second situation without autograd: sizes that change from call to call
        R.by_class.add(module)
        return class_call(R, orig_call, module, args, kwargs, dev, params, flags, t0, unit)
    rec = Recording(R)
    out = run_charged(orig_call, module, args, kwargs, dev, params, rec, None, t0)
    if not torch.is_grad_enabled():
        R.no_grad_keys[module] = R.no_grad_keys.get(module, 0) + 1
    if rec.out_specs is not None and rec.treespec is not None:
        R.stats["recorded"] += 1
        if len(table) >= _RECORDS_PER_MODULE:
            del table[next(iter(table))]  # the oldest situation goes
        table[key] = rec
    elif rec.not_replayable is not None:
        if torch.is_grad_enabled():
            R.unreplayable[module] = rec.not_replayable
        else:  # (it returns its cache: by shape class)
            R.by_class.add(module)
    return out


def _holds_objects(R: ReplayState, module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call without autograd goes to the shape-class fast path from now on: an object
    among its arguments (a cache it may change), or a module whose outputs cannot be replayed."""
    objects = any(not isinstance(a, _KEYED) for a in args) or any(not isinstance(v, _KEYED) for v in kwargs.values())
    if objects or module in R.unreplayable:
        R.by_class.add(module)
        return True
    return False


# Arguments the exact-shape recordings key by value or by shape (anything else: by shape class)
_KEYED = (torch.Tensor, *PLAIN_VALUES)


def _call_key(R: ReplayState, args: tuple, kwargs: dict, flags: tuple, emus: list) -> tuple | None:
    """The situation a call is recorded under (None: an argument cannot be part of a key). Its
    inputs' signature is at ``_IN_SIG``; ``emus`` gets the emulated tensors among them."""
    sig = R.ts.call_signature
    try:
        in_sig = (sig(args, emus), sig(tuple(kwargs.items()), emus) if kwargs else None)
        # The TF32 switches choose tensor cores or FMA units for fp32 GEMMs and convolutions,
        # so a recording's price holds only under the switches it was recorded with.
        key = (
            flags,
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
            in_sig,
            R.ts.param_generation,
            tf32_matmul(),
            tf32_cudnn(),
        )
        hash(key)
    except TypeError:
        return None
    return key


def _lookup(R: ReplayState, module: torch.nn.Module, table: dict, key: tuple) -> tuple[Recording | None, tuple]:
    """The recording of ``key`` in ``table`` when ``table[key]`` has none (None: none yet), and
    the key it is kept under.

    An argument that is an object (not a tensor or a plain value) is keyed by identity: a new one
    at every call (a KV cache an HF layer updates) never matches, and a replay would skip what
    the call does to it. Such a recording is kept under its objects' weak references; twice new,
    and the module runs op by op from now on (``R.unreplayable``), its submodules as units."""
    weak = _weakened(key[_IN_SIG])
    if weak is None:
        return None, key
    key = key[:_IN_SIG] + (weak,) + key[_IN_SIG + 1 :]
    rec = table.get(key)
    if rec is None:
        misses = R.object_misses.get(module, 0) + 1
        R.object_misses[module] = misses
        if misses >= 2:
            R.unreplayable[module] = "an argument is an object the call may change, new at every call"
            table.clear()  # (its keys hold earlier calls' objects)
    return rec, key


# ----------------------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------------------
def _new_outputs(rec: Recording, dev: int) -> list:
    ts, specs = rec.state.ts, rec.out_specs
    assert specs is not None  # (only a replayable recording is replayed)
    mem, wrap = ts.memory[dev], ts.wrap
    outs = []
    for spec in specs:  # (TensorState.build's new-allocation case, written out: per replayed call)
        if spec.dtype is None:  # a plain value, kept in the shape's place
            outs.append(spec.shape)
        else:
            block = mem.allocate(spec.nbytes) if spec.nbytes else None
            outs.append(wrap(spec.shape, spec.stride, spec.offset, spec.dtype, dev, block))
    return outs


def _replay(rec: Recording, emus: list, params: list, t0: float | None = None) -> Any:
    R = rec.state
    R.stats["replayed"] += 1
    dev = rec.dev
    mem = R.ts.memory[dev]
    if not torch.is_grad_enabled():
        charge_forward(rec, t0)
        mem.touch(rec.fwd_extra)
        outs = _new_outputs(rec, dev)
        if rec.profiled_peak is not None:
            mem.touch(rec.profiled_peak - mem.allocated)
        mem.sample()
        return _unflatten(outs, rec.treespec)
    grad_params = rec.grad_param_list
    direct = None
    if grad_params:
        if rec.hook_gen != R.hook_generation:
            # Re-checked only after some tensor got a hook (Tensor.register_hook & co. bump it).
            hooked = any(p._post_accumulate_grad_hooks is not None or p._backward_hooks for p in grad_params)
            rec.hook_gen = -1 if hooked else R.hook_generation
        if rec.hook_gen == R.hook_generation:
            # No hooks on the parameters: backward may set .grad itself (see ReplayFunction).
            hub_after = R.hub_after
            if hub_after >= 0 and rec.plain >= hub_after and not R.no_hub and not functorch_active():
                direct = rec.hub_direct
                if direct is None or direct.n_inputs != len(emus):
                    hub = R.ts.wrap((0,), (1,), 0, torch.float32, rec.dev, None, requires_grad=True)
                    direct = rec.hub_direct = Direct(rec, len(emus), grad_params, rec.dev, hub)
                R.hub_used = True
                R.stats["hub"] = R.stats.get("hub", 0) + 1
                outs = _apply_replay(rec, direct, t0, *emus, direct.hub)
                return _unflatten(outs, rec.treespec)
            direct = rec.direct
            if direct is None or direct.n_inputs != len(emus):
                direct = rec.direct = Direct(rec, len(emus), grad_params, rec.dev)
    if functorch_active():
        outs = ReplayFunction.apply(rec, direct, t0, *emus, *grad_params)
    else:
        # autograd.Function.apply without its per-argument Python pass (functorch's dead-wrapper
        # unwrapping, only needed under functorch transforms): ~160 arguments per call.
        outs = _apply_replay(rec, direct, t0, *emus, *grad_params)
    return _unflatten(outs, rec.treespec)


functorch_active = torch._C._are_functorch_transforms_active


def _unflatten(outs: Any, treespec: Any) -> Any:
    """The recorded output structure around replayed outputs; a lone tensor (a classifier's
    logits) skips pytree's Python walk (~2 µs)."""
    if treespec.is_leaf():
        return outs[0]
    return tree_unflatten(list(outs), treespec)


class Direct:
    """Lets the replayed backward store parameter gradients directly (``p.grad = g``) instead
    of returning them to autograd, which would run one AccumulateGrad node (and a Python-dispatched
    ``detach``) per parameter: the biggest host cost of an emulated backward. Used only when the
    engine will run ALL the parameters' AccumulateGrad nodes in this backward (``loss.backward()``;
    not ``torch.autograd.grad(..., params)`` nor ``backward(inputs=[some parameters])``) and no
    parameter has hooks. Kept on the :class:`Recording` between calls.

    **Hub mode** (``hub`` set): after ``config.tuning.hub_after`` plain backwards of a recording, its
    replays pass ONE zero-size leaf (the hub) to autograd instead of every parameter: the engine
    then visits one accumulator instead of one per parameter (~1.8 µs each) and ``apply`` builds
    one edge instead of one per parameter (~1 µs each). The backward stores every parameter's
    ``.grad`` when the hub's accumulator runs (a plain backward). Targeted gradients that name
    parameters of such a graph (``torch.autograd.grad``, ``backward(inputs=...)``) are answered
    by the patched functions (:func:`_grad`, :func:`_backward`), and hub mode ends for the run."""

    __slots__ = ("n_inputs", "params", "node", "nodes", "param_nodes", "hub", "pspecs", "param_bytes", "gradset")

    def __init__(self, rec: Recording, n_inputs: int, params: list, dev: int, hub: Any = None) -> None:
        self.n_inputs = n_inputs
        self.params = params
        self.hub = hub
        # The parameters' accumulator nodes, kept alive by these references: the graph uses
        # them unless in hub mode, and gradient sets watch them. Looked up once per recording
        # (get_gradient_edge makes a leaf's accumulator with an emulated view_as: for a model
        # with ~190 parameters, ~10-20 ms of host time at its first replay, and it was paid
        # again when hub mode began).
        param_nodes = rec.param_nodes
        if param_nodes is None or len(param_nodes) != len(params):
            param_nodes = rec.param_nodes = list(map(_accumulator, params))
            rec.state.gradients.watch(params, param_nodes)
        # The accumulator nodes the graph will use.
        self.nodes = [_accumulator(hub)] if hub is not None else param_nodes
        self.node = self.nodes[0]
        self.param_nodes = param_nodes
        self.pspecs = [grad_spec(p, dev) for p in params]
        self.param_bytes = sum(spec.nbytes for spec in self.pspecs)
        self.gradset: Any = None  # gpemu.fastpaths.gradients' set of these parameters' gradients


_will_execute = torch._C._will_engine_execute_node
_NO_PYTHON_DISPATCH = torch._C.DispatchKeySet(torch._C.DispatchKey.Python)


def _accumulator(t: torch.Tensor) -> Any:
    """``get_gradient_edge(t).node``: a leaf's AccumulateGrad node, made if it has none. For an
    emulated leaf, torch's way (``t.view_as(t)``, whose graph node points at the accumulator)
    runs with the Python dispatch key excluded: the view is then a throwaway meta tensor made by
    the meta kernel, not an emulated op (the emulated ``view_as``, through the op cache's slow
    path once per shape, cost ~0.1 ms per parameter at a recording's first replay)."""
    if not isinstance(t, EmuTensor) or t.grad_fn is not None or not t.requires_grad:
        return get_gradient_edge(t).node
    with torch.enable_grad(), torch._C._ExcludeDispatchKeyGuard(_NO_PYTHON_DISPATCH):
        view = t.view_as(t)
    node: Any = view.grad_fn  # (made above: a view of a leaf that requires grad)
    return node.next_functions[0][0]


def charge_forward(rec: Recording, at: float | None) -> None:
    """Charge a replayed forward: a pass from its host's first issue to its GPU's end; captured
    into a CUDA graph, its kernels alone (the graph's replays run them back to back)."""
    ts = rec.state.ts
    engine = ts.engine
    seconds = rec.fwd_seconds
    if engine.captures and engine.capture_here(rec.dev) is not None:
        seconds *= rec.kernel_share
    ts.charge_span(seconds, rec.dev, "forward", rec.label, at, rec.fwd_issue, seconds * rec.kernel_share)


def charge_recording(seconds: float, kind: str, rec: Recording, at: float | None = None) -> None:
    """Charge ``seconds`` of a replayed pass of ``kind`` (``forward``, ``backward``).

    Through the tensor state: inside another model's charge nothing more is charged, and an
    enclosing model priced by its ops counts it. The host pays the recorded calls' modelled
    issue time, as the op-by-op run did, and with a modelled host the GPU runs the pass's
    kernels alone (the rest of it is the host's)."""
    backward = kind == "backward"
    issue = rec.bwd_issue if backward else rec.fwd_issue
    kernels = seconds * (rec.bwd_kernel_share if backward else rec.kernel_share)
    rec.state.ts.charge_span(seconds, rec.dev, kind, rec.label, at, issue, kernels)


class ReplayFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        rec: Recording,
        direct: Direct | None,
        t0: float | None,
        *tensors: torch.Tensor,
    ) -> tuple:
        charge_forward(rec, t0)
        ctx.set_materialize_grads(False)  # the gradients' values are never read (see gpemu.model_time._BackwardStart)
        R = rec.state
        mem = R.ts.memory[rec.dev]
        saved = mem.allocate(rec.saved_bytes) if rec.saved_bytes else None
        mem.touch(rec.fwd_extra)
        outs = _new_outputs(rec, rec.dev)
        if rec.profiled_peak is not None:
            mem.touch(rec.profiled_peak - mem.allocated)
        mem.sample()
        ctx.rec = rec
        ctx.direct = direct
        ctx.saved_block = saved
        ctx.hook_gen = R.hook_generation  # (see _direct_backward)
        specs = rec.grad_specs
        if specs is None or len(specs) != len(tensors):
            specs = rec.grad_specs = [grad_spec(t, rec.dev) for t in tensors]
        ctx.specs = specs
        if not rec.all_diff:
            ctx.mark_non_differentiable(
                *[
                    o
                    for o, rg in zip(outs, rec.out_requires_grad, strict=True)
                    if not rg and isinstance(o, torch.Tensor)
                ]
            )
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        # (the gradients' values are never read: only which inputs need one)
        return replay_backward(ctx, None)


def replay_backward(ctx: Any, plain: bool | None) -> tuple:
    """The replayed backward: charges the module's backward time, makes the inputs' and the
    parameters' gradients (memory and metadata), frees the saved activations. ``plain``: the
    caller knows every parameter accumulator runs (:func:`_direct_backward`); None: ask the
    autograd engine."""
    rec: Recording = ctx.rec
    R = rec.state
    ts = R.ts
    mem = ts.memory[rec.dev]
    if rec.backward_pending:
        # The recording's backward has not run yet (two forwards, then one backward): its time is
        # not known; it is charged when the recording's backward has measured it.
        rec.owed += 1
        ts.engine.note_backward(rec.dev)
    else:
        charge_recording(rec.bwd_seconds, "backward", rec)
    result: list[Any] = [None, None, None]
    needs = ctx.needs_input_grad[3:]
    specs = ctx.specs
    direct: Direct | None = ctx.direct
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
    for spec, needed in zip(specs, needs, strict=False):
        if needed:
            new_bytes += spec.nbytes
    if direct is not None and direct.hub is not None:
        new_bytes += direct.param_bytes  # not among the autograd inputs in hub mode
    mem.touch(rec.bwd_extra - new_bytes)
    first_param = direct.n_inputs if direct is not None else len(specs)
    for i in range(first_param):
        if needs[i]:
            spec = specs[i]
            block = ts.memory[spec.device].allocate(spec.nbytes) if spec.nbytes else None
            result.append(ts.wrap(spec.shape, spec.stride, 0, spec.dtype, spec.device, block))
        else:
            result.append(None)
    if direct is not None:
        every = direct.hub is not None or all(needs[first_param:])
        if not (every and R.gradients.hand_out(direct)):
            R.gradients.store(
                direct, direct.params, direct.pspecs, None if direct.hub is not None else needs[first_param:], every
            )
        result.extend([None] * (len(specs) - first_param))
    ctx.saved_block = None  # saved activations are freed once backward has used them
    mem.sample()
    return tuple(result)


# The graph node class torch makes for ReplayFunction (what a replay's grad_fn is).
ReplayBackward = ReplayFunction._backward_cls

# torch._C._FunctionBase.apply bound to ReplayFunction (see _replay).
_apply_replay = super(torch.autograd.Function, ReplayFunction).apply


# ----------------------------------------------------------------------------------------------
# install
# ----------------------------------------------------------------------------------------------
def _bump_structure(R: ReplayState, orig: Any, swaps: bool = False) -> Any:
    gradients = R.gradients

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if swaps:  # (_apply may swap parameters, their C++ .grad with them: hidden sets go real)
            gradients.materialize_all()
        R.structure_gen += 1
        try:
            return orig(*args, **kwargs)
        finally:
            R.structure_gen += 1  # after too: _apply swaps parameters while it runs

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


def _bump_hooks(R: ReplayState, orig: Any, counter: str = "hook_generation") -> Any:
    """``orig`` that first bumps the replay state's ``counter`` (a hook registration: rare)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        setattr(R, counter, getattr(R, counter) + 1)
        return orig(*args, **kwargs)

    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    return wrapper


_MODULE_HOOK_REGISTRATIONS = (
    "register_forward_pre_hook",
    "register_forward_hook",
    "register_full_backward_pre_hook",
    "register_full_backward_hook",
    "register_backward_hook",
)


def install(rt: Runtime) -> None:
    """Patch nn.Module.__call__ with the record/replay fast path (``config.replay``)."""
    if not rt.config.fast_paths:
        return
    R = rt.replay = ReplayState(rt)
    rt.gradients = R.gradients
    rt.patcher.on_restore(R.gradients.stop)
    p = rt.patcher
    M = torch.nn.Module
    # (over gpemu.model_time's patch: torch's own __call__ runs the module)
    p.replace(M, "__call__", _make_call(R, R.model_time.orig_call))
    # What can change a module tree's parameters, submodules or training flags invalidates the
    # cached walk (ModuleTree): attribute sets/deletes (also `m.training = False`, `m.fc = Linear()`),
    # registrations that write the dicts directly, and _apply (it may swap parameters in place).
    for name in ("__setattr__", "__delattr__", "register_parameter", "register_module", "add_module", "_apply"):
        p.replace(M, name, _bump_structure(R, getattr(M, name), swaps=name == "_apply"))
    # Module hooks (forward/backward, pre and post) are registered only through these in torch
    # (the hook dicts are written elsewhere only by TorchScript and by removals).
    for name in _MODULE_HOOK_REGISTRATIONS:
        p.replace(M, name, _bump_hooks(R, getattr(M, name), "module_hook_gen"))
    # (torch.autograd.grad / backward: gpemu.fastpaths.backward, installed next)
    # Parameter hooks decide whether the replayed backward may store .grad itself.
    T = torch.Tensor
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        if hasattr(T, name):
            p.replace(T, name, _bump_hooks(R, getattr(T, name)))
    # Hooks on graph nodes (grad_fn.register_hook/prehook) end the direct backward for graphs
    # built before them (see gpemu.fastpaths.backward._direct_backward). Custom-Function nodes
    # and torch's own C++ nodes both register through _HookMixin._register_hook, looked up by
    # name at each registration; without it, only custom-Function nodes' own methods are seen.
    mixin = getattr(torch.autograd.function, "_HookMixin", None)
    register = vars(mixin).get("_register_hook") if mixin is not None else None
    if isinstance(register, staticmethod):
        p.replace(mixin, "_register_hook", staticmethod(_bump_hooks(R, register.__func__)))
        R.node_hooks_seen = True
    else:
        B = torch.autograd.function.BackwardCFunction
        for name in ("register_hook", "register_prehook"):
            p.replace(B, name, _bump_hooks(R, getattr(B, name)))
    # retain_grad() on a non-leaf adds a hook to its node in C++, past every Python door above.
    p.replace(T, "retain_grad", _bump_hooks(R, T.retain_grad))
