"""``torch.compile`` on emulated GPUs (component ``gpemu.compiled``).

Inductor cannot generate kernels for emulated tensors (and the CPU build of torch cannot compile
for CUDA at all), so compiled code runs its eager ops, priced as eager ops; what changes with the
mode is how their GPU work is issued:

* the default and ``max-autotune-no-cudagraphs`` modes, other backends, ``disable=True``: the model
  or function itself is returned (said once);
* ``mode="reduce-overhead"`` and ``"max-autotune"`` (inductor with ``triton.cudagraphs``), and
  ``backend="cudagraphs"``: torch runs the compiled code as CUDA graphs (its cudagraph trees).
  The returned callable keeps their life cycle per input signature: the first call warms up (its
  kernels launched one by one, as eager ones), every later call is a graph replay: the inputs that
  are not static (anything but parameters and buffers) are copied into the graph's static input
  buffers, and the call's kernels are issued together at the call's start, so they run back to
  back with no launch gaps. The emulator re-runs the eager code to make the call's outputs (and
  their autograd graph); that host time is its own (a replay costs the host microseconds), as for
  any emulated op. A backward pass through the outputs runs as autograd issues it.

A module comes back wrapped as torch wraps it (``_orig_mod``, its state dict keys prefixed so);
``Module.compile(mode="reduce-overhead")`` makes the module's own calls replays.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "uses_cuda_graphs", "GraphReplays", "CompiledModule", "mark_step_begin"]

_COMPILE_NOTE = (
    "torch.compile is not applied on emulated GPUs: the model runs eagerly (GPU time "
    "still comes from the profile database or the per-op estimate)"
)
_GRAPHS_NOTE = (
    "torch.compile(mode={mode!r}) on emulated GPUs: the eager kernels run as CUDA graph replays "
    "(one warm-up call per input shape, then each call's kernels issued together, no launch gaps)"
)
_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(backend: Any = None, mode: str | None = None, options: dict | None = None) -> bool:
    """Whether ``torch.compile`` with these settings runs the compiled code as CUDA graphs."""
    if backend == "cudagraphs":
        return True
    if backend not in (None, "inductor"):
        return False
    return mode in _GRAPH_MODES or bool((options or {}).get("triton.cudagraphs"))


class _Graph:
    """One input signature's graph: its static input buffers (made at the recording call)."""

    __slots__ = ("statics",)

    def __init__(self) -> None:
        self.statics: list[torch.Tensor] | None = None


class GraphReplays:
    """A compiled function (or a module's call) run as CUDA graph replays: what
    ``torch.compile(fn, mode="reduce-overhead")`` returns for a function."""

    def __init__(self, rt: Runtime, fn: Callable[..., Any], module: torch.nn.Module | None = None) -> None:
        self.rt = rt
        self.fn = fn
        self.module = module
        self.graphs: dict[tuple, _Graph] = {}
        functools.update_wrapper(self, fn)

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


class CompiledModule(torch.nn.Module):
    """What ``torch.compile(module, mode="reduce-overhead")`` returns: the module under
    ``_orig_mod`` (as torch's ``OptimizedModule``), its calls run as graph replays."""

    def __init__(self, rt: Runtime, module: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = module
        self.__dict__["_replays"] = GraphReplays(rt, module, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_replays"](*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def _make_compile(rt: Runtime, orig: Callable) -> Callable:
    @functools.wraps(orig)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as a decorator factory: @torch.compile(mode=...)
            return lambda fn: compile(fn, **kwargs)
        mode = kwargs.get("mode")
        if kwargs.get("disable") or not uses_cuda_graphs(kwargs.get("backend"), mode, kwargs.get("options")):
            rt.say_once(_COMPILE_NOTE)
            return model
        rt.say_once(_GRAPHS_NOTE.format(mode=mode or "default, cudagraphs"))
        if isinstance(model, torch.nn.Module):
            return CompiledModule(rt, model)
        return GraphReplays(rt, model)

    return compile


def _make_module_compile(rt: Runtime) -> Callable:
    def compile(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        """``Module.compile``: with CUDA graphs, the module's own calls become replays."""
        if kwargs.get("disable") or not uses_cuda_graphs(
            kwargs.get("backend"), kwargs.get("mode"), kwargs.get("options")
        ):
            rt.say_once(_COMPILE_NOTE)
            return
        rt.say_once(_GRAPHS_NOTE.format(mode=kwargs.get("mode") or "default, cudagraphs"))
        self._compiled_call_impl = GraphReplays(rt, self._call_impl, self)

    return compile


def mark_step_begin() -> None:
    """``torch.compiler.cudagraph_mark_step_begin()``: a new iteration begins, so torch may
    overwrite the previous one's graph outputs. The emulated replays make new outputs each call,
    so there is nothing to mark (torch's own imports CUDA-only parts of the C extension)."""


def install(rt: Runtime) -> None:
    """Replace ``torch.compile``, ``nn.Module.compile`` and ``torch.compiler.cudagraph_mark_step_begin``
    (through ``rt.patcher``)."""
    rt.patcher.replace(torch, "compile", _make_compile(rt, torch.compile))
    if hasattr(torch.nn.Module, "compile"):
        rt.patcher.replace(torch.nn.Module, "compile", _make_module_compile(rt))
    if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
        rt.patcher.replace(torch.compiler, "cudagraph_mark_step_begin", mark_step_begin)
