"""``torch.compile`` on emulated GPUs (component ``gpemu.compiled``).

Inductor cannot generate kernels for emulated tensors (and the CPU build of torch cannot compile
for CUDA at all), so compiled code runs its eager ops on emulated tensors, and is priced as the
kernels Inductor would emit for them (:mod:`gpemu.fusion`): the ops a compiled call dispatches are
grouped as Inductor fuses them (pointwise chains, reductions with their prologue and epilogue,
views free) and each group is charged as one kernel of its boundary bytes, one launch; matrix
products, convolutions and attention stay extern kernels priced as in eager mode. Its backward
(the autograd nodes the compiled forward made) is grouped the same way. What the mode changes:

* the default, ``max-autotune-no-cudagraphs`` and ``max-autotune`` modes (inductor): fused kernels;
* ``mode="reduce-overhead"`` and ``"max-autotune"`` (inductor with ``triton.cudagraphs``): fused
  kernels run as CUDA graphs (torch's cudagraph trees), and ``backend="cudagraphs"``: eager
  kernels run so. The returned callable keeps their life cycle per input signature: the first call
  warms up (its kernels launched one by one), every later call is a graph replay: the inputs that
  are not static (anything but parameters and buffers) are copied into the graph's static input
  buffers, and the call's kernels are issued together at the call's start, so they run back to
  back with no launch gaps. The emulator re-runs the eager code to make the call's outputs (and
  their autograd graph); that host time is its own (a replay costs the host microseconds), as for
  any emulated op. A backward pass through the outputs runs as autograd issues it;
* other backends (``eager``, ``aot_eager``, a function), ``disable=True``: the model or function
  itself is returned (said once): eager ops.

Graph breaks: ``torch._dynamo.graph_break()`` ends the graph there (the open fused group is
charged), and a function under ``torch.compiler.disable`` runs eagerly inside a compiled call
(its ops charged one by one), as Dynamo runs the code it cannot capture.

A module comes back wrapped as torch wraps it (``_orig_mod``, its state dict keys prefixed so);
``Module.compile(...)`` makes the module's own calls compiled ones.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .device import EmuTensor, OwnNodes
from .fusion import FusionRegion
from .runtime import current

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = [
    "install",
    "uses_cuda_graphs",
    "compile_kind",
    "CompileKind",
    "GraphReplays",
    "CompiledModule",
    "CompiledFunction",
    "mark_step_begin",
    "graph_break",
    "disable",
    "EagerPart",
]

_next_node = torch._C._autograd._get_sequence_nr  # the next autograd node's number on this thread
_graph_task = torch._C._current_graph_task_id

_EAGER_NOTE = (
    "torch.compile with backend {backend!r} on emulated GPUs: the model runs eagerly (no fused kernels are priced)"
)
_FUSED_NOTE = (
    "torch.compile on emulated GPUs: priced as Inductor's kernels (fused pointwise/reduction groups "
    "by the bytes at their boundaries, one launch each; matrix products and attention as extern kernels)"
)
_GRAPHS_NOTE = (
    "torch.compile(mode={mode!r}) on emulated GPUs: the {kernels} kernels run as CUDA graph replays "
    "(one warm-up call per input shape, then each call's kernels issued together, no launch gaps)"
)
_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class CompileKind(NamedTuple):
    """What ``torch.compile``'s settings make of the code on a GPU."""

    fused: bool  # Inductor's generated kernels (fused groups) instead of eager ops
    graphs: bool  # run as CUDA graphs (cudagraph trees)


def uses_cuda_graphs(backend: Any = None, mode: str | None = None, options: dict | None = None) -> bool:
    """Whether ``torch.compile`` with these settings runs the compiled code as CUDA graphs."""
    if backend == "cudagraphs":
        return True
    if backend not in (None, "inductor"):
        return False
    return mode in _GRAPH_MODES or bool((options or {}).get("triton.cudagraphs"))


def compile_kind(settings: dict) -> CompileKind:
    """:class:`CompileKind` of ``torch.compile``'s keyword settings."""
    if settings.get("disable"):
        return CompileKind(False, False)
    backend = settings.get("backend")
    return CompileKind(
        backend in (None, "inductor"), uses_cuda_graphs(backend, settings.get("mode"), settings.get("options"))
    )


# ---------------------------------------------------------------------------------- fused regions
@contextmanager
def _forward_region(rt: Runtime) -> Iterator[None]:
    """The ops dispatched inside as one compiled graph's forward (inside another compiled call's:
    part of that graph)."""
    ts = rt.tensors
    if ts.fusion is not None:
        yield
        return
    region = ts.fusion = FusionRegion(rt)
    try:
        yield
        rt.engine.call(region.flush)  # (the emulator's own work: forgiven)
    finally:
        ts.fusion = None


class _Backward:
    """What a compiled call's backward region needs: the run and the forward's autograd nodes."""

    __slots__ = ("rt", "own")

    def __init__(self, rt: Runtime, own: OwnNodes) -> None:
        self.rt = rt
        self.own = own


class _BackwardRegion(torch.autograd.Function):
    """On a compiled call's outputs: when autograd reaches them, the call's backward ops (those of
    its own nodes) are grouped as Inductor fuses a backward graph, until the backward pass ends."""

    @staticmethod
    def forward(ctx: Any, info: _Backward, *outs: EmuTensor) -> tuple:
        ctx.info = info
        ctx.set_materialize_grads(False)
        alias = info.rt.tensors.alias  # (new wrappers, not views: outputs may be changed in place)
        return tuple(alias(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        info: _Backward = ctx.info
        ts = info.rt.tensors
        if ts.fusion is None:
            info.own.task = _graph_task()
            region = ts.fusion = FusionRegion(info.rt, info.own)

            def end() -> None:
                if ts.fusion is region:
                    ts.engine.call(region.flush)
                    ts.fusion = None

            torch.autograd.Variable._execution_engine.queue_callback(end)
        return (None, *grads)


def _mark_backward(rt: Runtime, out: Any, first_node: int) -> Any:
    """``out`` with its tensors that need a gradient passed through :class:`_BackwardRegion`."""
    if not torch.is_grad_enabled():
        return out
    leaves, spec = tree_flatten(out)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, EmuTensor) and x.requires_grad]
    if not idx:
        return out
    # (no parameters: their AccumulateGrad nodes run outside the compiled backward graph, eagerly)
    info = _Backward(rt, OwnNodes(first_node, _next_node(), []))
    marked = _BackwardRegion.apply(info, *[leaves[i] for i in idx])
    for i, t in zip(idx, marked, strict=True):
        leaves[i] = t
    return tree_unflatten(leaves, spec)


class CompiledFunction:
    """A function compiled by Inductor: each call's ops (forward and backward) priced as fused
    kernels."""

    def __init__(self, rt: Runtime, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)  # (first: it copies the wrapped object's __dict__)
        self.rt = rt
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rt = self.rt
        if rt.tensors.fusion is not None:  # (called inside a compiled call: part of its graph)
            return self.fn(*args, **kwargs)
        first = _next_node()
        with _forward_region(rt):
            out = self.fn(*args, **kwargs)
        return rt.engine.call(_mark_backward, rt, out, first)


# ---------------------------------------------------------------------------------- CUDA graphs
class _Graph:
    """One input signature's graph: its static input buffers (made at the recording call)."""

    __slots__ = ("statics",)

    def __init__(self) -> None:
        self.statics: list[torch.Tensor] | None = None


class GraphReplays:
    """A compiled function (or a module's call) run as CUDA graph replays: what
    ``torch.compile(fn, mode="reduce-overhead")`` returns for a function."""

    def __init__(self, rt: Runtime, fn: Callable[..., Any], module: torch.nn.Module | None = None) -> None:
        functools.update_wrapper(self, fn)  # (first: it copies the wrapped object's __dict__)
        self.rt = rt
        self.fn = fn
        self.module = module
        self.graphs: dict[tuple, _Graph] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves = tree_flatten((args, kwargs))[0]
        key = self._signature(leaves)
        graph = self.graphs.get(key)
        if graph is None:  # the warm-up call: eager launches
            self.graphs[key] = _Graph()
            return self.fn(*args, **kwargs)
        engine = self.rt.engine
        engine.charge_host(engine.launch_seconds(1))  # (cudaGraphLaunch: one launch's host time)
        engine.enter()  # one launch: the host's time stands at the call's start until it returns
        try:
            with engine.one_launch():
                self._copy_inputs(graph, leaves)
                return self.fn(*args, **kwargs)
        finally:
            engine.leave()

    def _signature(self, leaves: list) -> tuple:
        parts: list[Any] = [torch.is_grad_enabled(), self.module.training if self.module is not None else None]
        for x in leaves:
            if isinstance(x, torch.Tensor):
                parts.append((tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad))
            else:
                try:
                    hash(x)
                    parts.append(x)
                except TypeError:
                    parts.append(type(x))
        return tuple(parts)

    def _copy_inputs(self, graph: _Graph, leaves: list) -> None:
        """Inputs other than parameters and buffers are copied into the graph's static buffers,
        as torch's cudagraph trees copy them before each replay."""
        inputs = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda and not self._static(x)]
        if graph.statics is None:
            graph.statics = [torch.empty_like(x) for x in inputs]
        with torch.no_grad():
            for static, x in zip(graph.statics, inputs, strict=True):
                static.copy_(x)

    def _static(self, x: torch.Tensor) -> bool:
        if isinstance(x, torch.nn.Parameter):
            return True
        module = self.module
        return module is not None and any(x is b for b in module.buffers())


# ---------------------------------------------------------------------------------- modules
class CompiledModule(torch.nn.Module):
    """What ``torch.compile(module)`` returns: the module under ``_orig_mod`` (as torch's
    ``OptimizedModule``); its calls are compiled calls (fused kernels, and/or graph replays).
    The outermost module the emulator charges and replays is this wrapper, so its recorded and
    replayed passes are the compiled kernels."""

    def __init__(self, rt: Runtime, module: torch.nn.Module, kind: CompileKind) -> None:
        super().__init__()
        self._orig_mod = module
        self.__dict__["_rt"] = rt
        self.__dict__["_kind"] = kind
        self.__dict__["_replays"] = GraphReplays(rt, self._plain_call, self) if kind.graphs else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        replays = self.__dict__["_replays"]
        if replays is not None:
            return replays(*args, **kwargs)
        return self._plain_call(*args, **kwargs)

    def _plain_call(self, *args: Any, **kwargs: Any) -> Any:
        # (torch.nn.Module.__call__ looked up now: the emulator's patched call, which charges
        # and replays this wrapper as the outermost module)
        if not self.__dict__["_kind"].fused:
            return torch.nn.Module.__call__(self, *args, **kwargs)
        rt = self.__dict__["_rt"]
        first = _next_node()
        out = torch.nn.Module.__call__(self, *args, **kwargs)
        # (marked outside the emulator's own marks, so that the backward region's last kernels are
        # charged before the module's backward window closes)
        return rt.engine.call(_mark_backward, rt, out, first)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.__dict__["_kind"].fused:
            return self._orig_mod(*args, **kwargs)
        with _forward_region(self.__dict__["_rt"]):
            return self._orig_mod(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def _say(rt: Runtime, settings: dict, kind: CompileKind) -> None:
    if kind.graphs:
        kernels = "fused" if kind.fused else "eager"
        rt.say_once(_GRAPHS_NOTE.format(mode=settings.get("mode") or "default, cudagraphs", kernels=kernels))
    elif kind.fused:
        rt.say_once(_FUSED_NOTE)
    else:
        rt.say_once(_EAGER_NOTE.format(backend=settings.get("backend")))


def _make_compile(rt: Runtime, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as a decorator factory: @torch.compile(mode=...)
            return lambda fn: compile(fn, **kwargs)
        kind = compile_kind(kwargs)
        _say(rt, kwargs, kind)
        if not kind.fused and not kind.graphs:
            return model
        if isinstance(model, torch.nn.Module):
            return CompiledModule(rt, model, kind)
        fn = CompiledFunction(rt, model) if kind.fused else model
        return GraphReplays(rt, fn) if kind.graphs else fn

    return compile


def _make_module_compile(rt: Runtime) -> Callable:
    def compile(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        """``Module.compile``: the module's own calls become compiled calls (torch calls
        ``_compiled_call_impl`` inside ``Module.__call__``)."""
        kind = compile_kind(kwargs)
        _say(rt, kwargs, kind)
        call: Callable[..., Any] = self._call_impl
        if kind.fused:
            call = CompiledFunction(rt, call)
        if kind.graphs:
            call = GraphReplays(rt, call, self)
        if kind.fused or kind.graphs:
            self._compiled_call_impl = call

    return compile


def mark_step_begin() -> None:
    """``torch.compiler.cudagraph_mark_step_begin()``: a new iteration begins, so torch may
    overwrite the previous one's graph outputs. The emulated replays make new outputs each call,
    so there is nothing to mark (torch's own imports CUDA-only parts of the C extension)."""


def graph_break() -> None:
    """``torch._dynamo.graph_break()``: inside a compiled call, the graph ends here (its open
    fused group is charged); eager code does nothing."""
    rt = current()
    if rt is not None and rt.tensors.fusion is not None:
        rt.engine.call(rt.tensors.fusion.flush)


class EagerPart:
    """A function under ``torch.compiler.disable``: Dynamo does not capture it, so inside a
    compiled call it runs eagerly, its ops charged one by one (the graph breaks around it)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)  # (first: it copies the wrapped object's __dict__)
        self.fn = fn

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        # A method decorated in a class body binds as the function it replaces does.
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (the active run's: a function decorated while patched outlives the run)
        rt = current()
        region = rt.tensors.fusion if rt is not None else None
        if rt is None or region is None:
            return self.fn(*args, **kwargs)
        ts = rt.tensors
        rt.engine.call(region.flush)
        ts.fusion = None
        try:
            return self.fn(*args, **kwargs)
        finally:
            ts.fusion = region


def disable(fn: Any = None, recursive: bool = True, **kwargs: Any) -> Any:
    """``torch.compiler.disable``: ``fn`` runs eagerly inside compiled calls (:class:`EagerPart`)."""
    if fn is None:
        return lambda f: disable(f, recursive, **kwargs)
    return EagerPart(fn)


def install(rt: Runtime) -> None:
    """Replace ``torch.compile``, ``nn.Module.compile``, ``torch.compiler.cudagraph_mark_step_begin``,
    ``torch.compiler.disable`` and ``torch._dynamo.graph_break`` (through ``rt.patcher``)."""
    rt.patcher.replace(torch, "compile", _make_compile(rt, torch.compile))
    if hasattr(torch.nn.Module, "compile"):
        rt.patcher.replace(torch.nn.Module, "compile", _make_module_compile(rt))
    if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        rt.patcher.replace(torch.compiler, "cudagraph_mark_step_begin", mark_step_begin)
    if hasattr(torch.compiler, "disable"):
        rt.patcher.replace(torch.compiler, "disable", disable)

    def dynamo(module: Any) -> None:
        # (not torch._dynamo.disable: torch's own kernels call it, through torch._disable_dynamo)
        rt.patcher.replace(module, "graph_break", graph_break)

    rt.patcher.after_import("torch._dynamo", dynamo)
