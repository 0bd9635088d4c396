"""The backward fast path: ``loss.backward()`` of an ordinary training step without the autograd
engine, and targeted gradients (``torch.autograd.grad``, ``backward(inputs=...)``) through a
hub-mode replay (:class:`gpemu.fastpaths.replay.Direct`), whose parameters are not autograd
inputs of the graph. Component ``gpemu.fastpaths.backward``; installed with the replay fast path.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge

from gpemu.device import EmuTensor, TensorState
from gpemu.model_time import graph_nodes

from .gradients import grad_spec
from .replay import Direct, ReplayBackward, ReplayState, charge_recording, functorch_active, replay_backward

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime

__all__ = ["install"]


# ----------------------------------------------------------------------------------------------
# targeted gradients through a hub-mode graph (see Direct)
# ----------------------------------------------------------------------------------------------
def _hub_nodes(roots: Any) -> list:
    """The hub-mode replay nodes in the autograd graph of ``roots`` (tensor or sequence)."""
    items = [roots] if isinstance(roots, (torch.Tensor, GradientEdge)) else list(roots)
    # tensors and GradientEdges (torch.autograd.graph.get_gradient_edge) as roots
    found = []
    for fn in graph_nodes([t.grad_fn if isinstance(t, torch.Tensor) else getattr(t, "node", None) for t in items]):
        direct = getattr(fn, "direct", None)
        if isinstance(direct, Direct) and direct.hub is not None:
            found.append(fn)
    return found


def _placeholder_grad(R: ReplayState, t: EmuTensor) -> EmuTensor:
    spec = grad_spec(t, t.emu_device)
    ts = R.ts
    block = ts.memory[spec.device].allocate(spec.nbytes) if spec.nbytes else None
    return ts.wrap(spec.shape, spec.stride, 0, spec.dtype, spec.device, block)


def _targeted(R: ReplayState, roots: Any, inputs: Any) -> tuple[list, set[int], list] | None:
    """(inputs as a list, ids of those a hub-mode graph holds, its nodes), or None when the call
    can go to torch unchanged. Ends hub mode for the run once such a graph is met."""
    if not R.hub_used or inputs is None:
        return None
    nodes = _hub_nodes(roots)
    if not nodes:
        return None
    R.no_hub = True  # the program asks for targeted gradients: keep every parameter an input
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
        charge_recording(fn.rec.bwd_seconds, "backward", fn.rec)


def _make_grad(R: ReplayState, orig: Any) -> Any:
    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(inputs, dict) and R.hub_used:  # named inputs: the same, as a dict
            values = grad(outputs, list(inputs.values()), *args, **kwargs)
            return dict(zip(inputs.keys(), values, strict=False))
        found = _targeted(R, outputs, inputs)
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
        return tuple(_placeholder_grad(R, t) if id(t) in covered else next(got) for t in ins)

    grad.__wrapped__ = orig  # type: ignore[attr-defined]
    return grad


# ----------------------------------------------------------------------------------------------
# loss.backward() without the autograd engine, for the graph every training step builds
# ----------------------------------------------------------------------------------------------
_anomaly_on = torch.is_anomaly_enabled
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_profiler_on = torch.autograd._profiler_enabled  # a profiler records the engine's nodes: let it


def _direct_backward(R: ReplayState, loss: EmuTensor) -> bool:
    """``loss.backward()`` for the graph of an ordinary training step, run without the autograd
    engine: a replayed loss (a registered head) on an output of a hub-mode replayed module whose
    other inputs need no gradient, maybe through a few of torch's own nodes that keep no tensors
    (the logits flattened or cast for the loss: see :func:`_plain_chain`). The engine would call
    exactly these nodes' backward functions and an accumulator that receives nothing, so they
    are called here directly, with the same charges, memory (the implicit gradient and each
    node's incoming gradient are held while the engine would hold them) and gradients; its C++
    and per-node Python glue cost ~12 µs per step, ~60 µs with a reshape between loss and
    module. Any other graph, hooks registered anywhere since the graph was built, anomaly mode,
    a recording profiler or a functorch transform: False, and the engine runs as usual."""
    lnode: Any = loss.grad_fn
    head = R.heads.get(type(lnode))
    if (
        head is None
        or not R.direct_enabled
        or _anomaly_on()
        or functorch_active()
        or _profiler_on()
        or not head.ready(lnode)
    ):
        return False
    gen = R.hook_generation
    if getattr(lnode, "hook_gen", None) != gen:
        return False
    first: Any = None
    for fn, _ in lnode.next_functions:
        if fn is None:
            continue
        if first is not None:
            return False
        first = fn
    if first is None:
        return False
    rnode: Any
    chain: list | None
    if type(first) is ReplayBackward:
        rnode, chain = first, None
    else:
        found = _plain_chain(R, first)
        if found is None:
            return False
        rnode, chain = found
    # (a hook on a chain node, made after the replay, bumped the generation past rnode's)
    if rnode.hook_gen != gen:
        return False
    direct = rnode.direct
    if direct is None or direct.hub is None or rnode.rec.hub_direct is not direct:
        return False
    edges = rnode.next_functions
    if edges[-1][0] is not direct.node or any(fn is not None for fn, _ in edges[:-1]):
        return False  # an input of the module needs a gradient: the engine's business
    cost = R.implicit.get(loss.emu_key)
    if cost is None:
        return False  # the implicit gradient's cost is measured on the engine path first
    dev = loss.emu_device
    ts = R.ts
    ts.charge(cost, dev, "ones_like.default")
    # torch.autograd.backward holds the implicit gradient until the whole backward has run
    implicit = ts.memory[dev].allocate(loss.element_size())
    # Grad mode off, as the engine runs backward without create_graph (torch.no_grad's own
    # switch: the context manager's Python costs ~1.4 µs of every step here).
    grad_was = _grad_enabled()
    _set_grad_enabled(False)
    try:
        if chain is None:
            grad: Any = head.run(lnode, False)
        else:
            grad = head.run(lnode, True)
            grad = _run_chain(ts, chain, grad)
        replay_backward(rnode, True)
        del grad  # the engine frees the module's incoming gradient after its node ran
    finally:
        _set_grad_enabled(grad_was)
    del implicit
    R.stats["direct_backward"] = R.stats.get("direct_backward", 0) + 1
    return True


# Note: a training step often reshapes or casts a model's output for its loss
# (``logits.view(-1, vocab)``, ``.flatten(0, 1).float()``), so torch's own nodes stand between
# the loss's node and the replayed module's. Such a node is called here as the engine calls it
# (its backward formula, on the gradient the head made) when it has one input edge and keeps no
# tensors: the engine, after running a node, releases the tensors it saved, and a node called
# directly would keep them (memory the engine path frees). Generated derivative nodes name
# their saved tensors ``_raw_saved_*``; other nodes (C++ custom functions, which keep tensors
# where this cannot see them) are left to the engine.
_PLAIN_NODE = re.compile(r"Backward\d+$")
_MAX_CHAIN = 8  # nodes between loss and module (a reshape and a cast are two)


@functools.cache
def _plain_node_type(cls: type) -> bool:
    """Whether nodes of ``cls`` are generated derivative nodes of torch's that keep no tensors."""
    return (
        not issubclass(cls, BackwardCFunction)
        and _PLAIN_NODE.search(cls.__name__) is not None
        and not any(name.startswith("_raw_saved_") for name in dir(cls))
    )


def _plain_chain(R: ReplayState, first: Any) -> tuple[Any, list] | None:
    """(the replayed module's node, the nodes from ``first`` down to it) when ``first`` starts a
    short chain of plain nodes (see the note above) that ends at a replay node, else None."""
    if not R.node_hooks_seen:
        return None  # a hook on torch's own nodes could go unseen
    chain: list = []
    fn = first
    while type(fn) is not ReplayBackward:
        if fn is None or len(chain) == _MAX_CHAIN or not _plain_node_type(fn.__class__):
            return None
        edges = fn.next_functions
        if len(edges) != 1:
            return None
        chain.append(fn)
        fn = edges[0][0]
    return fn, chain


def _run_chain(ts: TensorState, chain: list, grad: Any) -> Any:
    """``grad`` through the chain's nodes, as the engine would run them: each node's incoming
    gradient freed once it ran, its ops priced as backward work."""
    host = ts.local.host
    host.direct_backward = True
    try:
        for node in chain:
            grad = node(grad)  # (a node with one edge returns its one gradient, not a tuple)
            if grad is None:  # (no gradient flows on; the module's node still runs, as in the engine)
                break
    finally:
        host.direct_backward = False
    return grad


# torch.autograd.backward's own engine entry (logging hooks, context for device threads).
_run_engine = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _implicit_grad(R: ReplayState, t: EmuTensor) -> torch.Tensor:
    """The implicit gradient of scalar loss ``t``: op by op the first time for its metadata (its
    GPU time measured), built directly afterwards with the same charge and memory, skipping a
    dispatch and torch's checks (~8 us of each training step's host time)."""
    ts = R.ts
    cost = R.implicit.get(t.emu_key)
    if cost is None:
        with ts.cost_tap() as tap:
            g = torch.ones_like(t, memory_format=torch.preserve_format)
        R.implicit[t.emu_key] = tap.seconds
        return g
    dev = t.emu_device
    ts.charge(cost, dev, "ones_like.default")
    nbytes = t.element_size()
    return ts.wrap((), (), 0, t.dtype, dev, ts.memory[dev].allocate(nbytes))


def _make_backward(R: ReplayState, orig: Any) -> Any:
    engine = R.ts.engine

    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            type(tensors) is EmuTensor
            and args
            and args[0] is None
            and not tensors.emu_key[0]
            and tensors.emu_shadow is None
            and tensors.requires_grad
            and "grad_variables" not in kwargs
        ):
            # loss.backward(): a scalar's implicit gradient (placeholder values: no shadow to keep)
            defaults = len(args) == 3 and args[2] is False and kwargs.get("inputs") is None and len(kwargs) <= 1
            # (the engine-free backward runs no user code: an emulator entry)
            if defaults and engine.call(_direct_backward, R, tensors):
                return None
            grad = _implicit_grad(R, tensors)
            if defaults and _run_engine is not None and not functorch_active():
                # Tensor.backward()'s own call with its defaults: one tensor, its gradient made
                # above, no inputs, no create_graph. torch.autograd.backward's argument handling
                # (~8 µs) has nothing to decide here; its engine call is made as it would make it.
                _run_engine((tensors,), (grad,), bool(args[1]), False, (), allow_unreachable=True, accumulate_grad=True)
                return None
            args = (grad,) + args[1:]
        # inputs: keyword (Tensor.backward passes it so) or the sixth positional argument
        inputs = kwargs.get("inputs", args[4] if len(args) > 4 else None)
        found = _targeted(R, tensors, inputs)
        if found is None:
            return orig(tensors, *args, **kwargs)
        ins, covered, nodes = found
        for t in ins:
            if id(t) in covered and t.grad is None:
                t.grad = _placeholder_grad(R, t)  # an existing gradient accumulates in place
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


def install(rt: Runtime) -> None:
    """Patch ``torch.autograd.grad`` and ``torch.autograd.backward`` for the replay fast path's
    graphs (``config.replay``)."""
    R = rt.replay
    if R is None:
        return
    rt.patcher.replace(torch.autograd, "grad", _make_grad(R, torch.autograd.grad))
    rt.patcher.replace(torch.autograd, "backward", _make_backward(R, torch.autograd.backward))
