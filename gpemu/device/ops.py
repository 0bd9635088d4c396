"""The op cache: an emulated op's outputs and GPU time, from the meta kernel the first time a
signature is seen (the slow path) and from the cached :class:`OpEntry` after (the fast path).

Speed: meta kernels are slow (many are Python), so the first call of each signature
(:mod:`gpemu.device.signature`) runs the meta kernel and stores an entry (output specs, which
outputs alias which inputs, the op's estimated GPU time); later calls build outputs from the
entry (a few microseconds). The key also holds the pass and PyTorch's TF32 switches (they change
the price, not the outputs).

Memory: each storage holds one :class:`gpemu.memory.Block`; views and in-place results share
their input's block (found on the meta device: an output whose storage is an input's storage).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import hostvalues
from ..costmodel.precision import tf32_cudnn, tf32_matmul
from .emutensor import EmuTensor
from .shadows import FROM_INPUTS, INDEPENDENT, RANDOM, host_to_emu, propagate_shadow, shadow_conv
from .signature import keyword_signature, signature
from .state import OutputSpec, TensorState, backward_pass, from_meta, meta_of

__all__ = ["OpEntry", "cached_op", "run_op", "current_task"]

aten = torch.ops.aten
current_task = torch._C._current_graph_task_id
_META = torch.device("meta")
_CACHE_LIMIT = 200_000


class OpEntry:
    """What the op cache keeps of one op signature."""

    __slots__ = ("kind", "specs", "treespec", "cost", "price", "name", "out_dev", "values")

    def __init__(self) -> None:
        self.kind = 0  # 0: one tensor, 1: list/tuple of tensors, 2: None, 3: other tree
        self.specs: list[OutputSpec | None] = []  # per output leaf
        self.treespec: Any = None
        self.cost = 0.0  # GPU seconds (price.gpu)
        self.price: Any = None  # gpemu.costs.OpPrice (None: cost only)
        self.name = ""
        self.out_dev: int | None = None
        self.values = FROM_INPUTS  # how the outputs' values relate to the inputs' (gpemu.device.shadows)


def cached_op(ts: TensorState, key: Any, func: Any, args: tuple, kwargs: dict | None, emus: list) -> Any:
    """One emulated op: output metadata from the cache, or the meta kernel the first time."""
    try:
        entry = ts.cache.get(key)
    except TypeError:  # an unhashable argument: no caching for this call
        key = entry = None
    if entry is None:
        return slow_path(ts, func, args, kwargs or {}, key)
    return fast_path(ts, entry, func, args, kwargs, emus)


def run_op(ts: TensorState, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` through the normal cached path (for the special ops' handlers)."""
    emus: list = []
    try:
        key = (
            id(func),
            signature(args, emus, False),
            keyword_signature(kwargs, emus, False) if kwargs else None,
            backward_pass(ts),
            tf32_matmul(),
            tf32_cudnn(),
        )
        entry = ts.cache.get(key)
    except TypeError:
        key, entry = None, None
    if entry is None:
        return slow_path(ts, func, args, kwargs, key)
    return fast_path(ts, entry, func, args, kwargs, emus)


def fast_path(ts: TensorState, entry: OpEntry, func: Any, args: tuple, kwargs: dict | None, emus: list) -> Any:
    dev = entry.out_dev if entry.out_dev is not None else emus[0].emu_device
    kind = entry.kind
    if kind == 0:
        out = ts.build(entry.specs[0], emus, dev)  # type: ignore[arg-type]
    elif kind == 2:
        out = None
    else:
        leaves = [ts.build(s, emus, dev) for s in entry.specs]  # type: ignore[arg-type]
        out = tree_unflatten(leaves, entry.treespec) if kind == 3 else entry.treespec(leaves)
    if ts.fusion is None:
        ts.charge_entry(entry, dev)
    else:  # (a compiled region: its kernels are priced as the compiler fuses them)
        ts.fusion.op(entry, dev, args, out)
    if entry.values == INDEPENDENT or ts.values is not None:
        propagate_shadow(func, args, kwargs or {}, emus, out, entry.values)
    else:
        for e in emus:
            if e.emu_shadow is not None:
                propagate_shadow(func, args, kwargs or {}, emus, out, entry.values)
                break
    return out


_COMPOSITE: dict[int, bool] = {}  # id(op) -> has a CompositeImplicitAutograd kernel (per process)


def composite(func: Any) -> bool:
    """Whether ``func`` has a composite (CompositeImplicitAutograd) kernel: it is made of other ops."""
    known = _COMPOSITE.get(id(func))
    if known is None:
        name = getattr(func, "name", None)
        known = _COMPOSITE[id(func)] = callable(name) and torch._C._dispatch_has_kernel_for_dispatch_key(
            name(), "CompositeImplicitAutograd"
        )
    return known


def _same_device_error(a: str, b: str) -> RuntimeError:
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!")


# Ops where a host (CPU) tensor that is not a 0-dim scalar is fine next to emulated tensors,
# as on CUDA (copies; indexing with CPU index tensors).
_HOST_OK = {
    aten.index.Tensor,
    aten.index_put_.default,
    aten.index_put.default,
    aten._index_put_impl_.default,
    aten._to_copy.default,
    aten.copy_.default,
    aten.lift_fresh.default,
}


def _meta_conv(a: Any, func: Any, emus: list, dev_holder: list) -> Any:
    # A module-level function, not a recursive closure: a closure that refers to itself forms a
    # reference cycle that would keep the op's inputs (and their memory) alive until gc runs.
    if isinstance(a, EmuTensor):
        emus.append(a)
        if dev_holder and a.emu_device != dev_holder[0]:
            raise _same_device_error(f"cuda:{dev_holder[0]}", f"cuda:{a.emu_device}")
        if not dev_holder:
            dev_holder.append(a.emu_device)
        return meta_of(a)
    if isinstance(a, torch.Tensor):
        if a.device.type == "meta":
            return a
        if a.dim() != 0 and func not in _HOST_OK:
            first = f"cuda:{dev_holder[0]}" if dev_holder else "cuda:0"
            raise _same_device_error(first, str(a.device))
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=_META)
    if isinstance(a, (list, tuple)):
        return type(a)(_meta_conv(x, func, emus, dev_holder) for x in a)
    if isinstance(a, torch.device) and a.type == "cuda":
        return _META
    return a


def _to_meta_args(ts: TensorState, func: Any, args: Any, kwargs: dict) -> tuple[Any, Any, list, int | None]:
    """Replace emulated tensors by their meta tensors; check devices like CUDA does."""
    emus: list[EmuTensor] = []
    dev_holder: list[int] = []
    margs = _meta_conv(list(args), func, emus, dev_holder)
    mkw = {k: _meta_conv(v, func, emus, dev_holder) for k, v in kwargs.items()}
    out_dev = None
    d = kwargs.get("device")
    if d is not None:
        idx = ts.device_index(d)
        if idx is not None:
            out_dev = idx
    return margs, mkw, emus, out_dev


def slow_path(ts: TensorState, func: Any, args: tuple, kwargs: dict, key: Any) -> Any:
    """The first call of a signature (or one that cannot be cached): run the meta kernel, wrap
    its outputs, price the op, keep the entry, charge it."""
    handler = ts.op_handlers.get(id(func)) if ts.op_handlers else None
    if handler is not None:
        # Another component's emulation (a collective meeting other ranks): its time counts. A
        # handler that only checks the op (gpemu.float8) declines: the op runs, and is cached, here.
        engine = ts.engine
        depth = engine.suspend()
        try:
            handled = handler(func, args, kwargs)
        finally:
            if depth:
                engine.resume(depth)
        if handled is not NotImplemented:
            return handled
    if composite(func):
        # Below autograd (inference_mode excludes its keys; another subclass's dispatch) an op
        # with a composite kernel arrives whole; on a CUDA tensor it runs as its parts (conv2d ->
        # convolution, batch_norm -> native_batch_norm, to -> _to_copy), priced and charged so.
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    margs, mkw, emus, out_dev = _to_meta_args(ts, func, args, kwargs)
    if not emus and out_dev is None:
        return func(*args, **kwargs)
    dev = out_dev if out_dev is not None else emus[0].emu_device
    if out_dev is not None and (kwargs.get("device") is not None):
        mkw["device"] = _META
    try:
        mout = func(*margs, **mkw)
    except (NotImplementedError, RuntimeError) as exc:
        return _data_dependent(ts, func, args, kwargs, margs, mkw, emus, dev, exc)
    entry = OpEntry()
    entry.name = getattr(func, "__name__", str(func))
    entry.out_dev = out_dev
    if func in hostvalues.VALUE_INDEPENDENT_OPS:
        entry.values = INDEPENDENT
    elif torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        entry.values = RANDOM
    out, cacheable = _outputs(ts, func, entry, mout, emus, dev)
    entry.price = _op_price(ts, func, margs, mkw, mout, dev)
    entry.cost = entry.price.gpu if entry.price is not None else 0.0
    if cacheable and key is not None:
        if len(ts.cache) >= _CACHE_LIMIT:
            ts.cache.clear()
        ts.cache[key] = entry
    if ts.fusion is None:
        ts.charge_entry(entry, dev)
    else:
        ts.fusion.op(entry, dev, args, out)
    if entry.values == INDEPENDENT or ts.values is not None or any(e.emu_shadow is not None for e in emus):
        propagate_shadow(func, args, kwargs, emus, out, entry.values)
    return out


def _outputs(ts: TensorState, func: Any, entry: OpEntry, mout: Any, emus: list, dev: int) -> tuple[Any, bool]:
    """The op's emulated outputs from its meta outputs, their specs added to ``entry``; and
    whether the entry may be cached. An output that is an input's meta tensor is that input (in
    place); one on an input's storage is a view sharing its block; others are new allocations."""
    in_metas = [meta_of(e) for e in emus]
    storages: dict[int, int] = {}  # an input's storage -> its index
    for i, m in enumerate(in_metas):
        try:
            storages.setdefault(m.untyped_storage()._cdata, i)
        except Exception:
            pass
    leaves, treespec = tree_flatten(mout)
    cacheable = True
    out_leaves = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            try:
                hash(leaf)
            except TypeError:
                cacheable = False
            entry.specs.append(OutputSpec(leaf, None, 0, None, 0, None, None))
            out_leaves.append(leaf)
        elif leaf.device.type != "meta":  # e.g. new_zeros(device='cpu'): a real host tensor
            cacheable = False
            out_leaves.append(leaf)
            entry.specs.append(None)
        else:
            spec = _tensor_spec(func, leaf, in_metas, storages, emus)
            entry.specs.append(spec)
            out_leaves.append(_tensor_output(ts, spec, leaf, emus, dev))
    if mout is None:
        entry.kind = 2
        return None, cacheable
    if isinstance(mout, torch.Tensor):
        entry.kind = 0
        return out_leaves[0], cacheable
    if type(mout) in (list, tuple) and all(isinstance(x, torch.Tensor) for x in mout):
        entry.kind = 1
        entry.treespec = type(mout)
        return type(mout)(out_leaves), cacheable
    entry.kind = 3
    entry.treespec = treespec
    return tree_unflatten(out_leaves, treespec), cacheable


def _tensor_spec(func: Any, leaf: torch.Tensor, in_metas: list, storages: dict, emus: list) -> OutputSpec:
    alias: int | None = None
    write: bool | None = None
    for i, m in enumerate(in_metas):
        if leaf is m:
            alias, write = i, True
            break
    if write and alias is not None and (leaf.shape != emus[alias].shape or leaf.stride() != emus[alias].stride()):
        raise NotImplementedError(
            f"gpemu: {func} changes a tensor's shape in place, which emulated tensors do not "
            "support; use the out-of-place form (e.g. x = x.unsqueeze(0) instead of x.unsqueeze_(0))"
        )
    if alias is None:
        alias = storages.get(leaf.untyped_storage()._cdata)
        write = False
    nbytes = 0 if alias is not None else leaf.untyped_storage().nbytes()
    return OutputSpec(leaf.shape, leaf.stride(), leaf.storage_offset(), leaf.dtype, nbytes, alias, write)


def _tensor_output(ts: TensorState, spec: OutputSpec, leaf: torch.Tensor, emus: list, dev: int) -> EmuTensor:
    if spec.alias is None:
        return from_meta(ts, leaf, dev)
    src = emus[spec.alias]
    if spec.write:
        return src
    t = ts.view(src, leaf.shape, leaf.stride(), leaf.storage_offset(), leaf.dtype)
    t.emu_meta = leaf
    return t


def _op_price(ts: TensorState, func: Any, margs: Any, mkw: dict, mout: Any, dev: int) -> Any:
    """What one op costs (:class:`gpemu.costs.OpPrice`; computed once per signature, then cached),
    None when nothing prices it."""
    from ..costs import op_price

    try:
        # The cache needs the op's own cost, also inside a charged scope (where nothing is charged).
        return op_price(ts.rt, func, margs, mkw, mout, dev, backward=backward_pass(ts) or None)
    except Exception as exc:  # a cost model gap must not break the user's op
        ts.say_once(f"no GPU-time estimate for {func} ({exc!r}); counted as 0")
        return None


def _data_dependent(
    ts: TensorState,
    func: Any,
    args: tuple,
    kwargs: dict,
    margs: list,
    mkw: dict,
    emus: list,
    dev: int,
    exc: BaseException,
) -> Any:
    """An op whose meta kernel refused (a data-dependent output shape): the host-values policy
    decides (:func:`gpemu.hostvalues.data_dependent_shape`); the result is wrapped here."""
    known = bool(emus) and all(e.emu_shadow is not None for e in emus)
    host_args = shadow_conv(list(args)) if known else None
    host_kw = {k: shadow_conv(v) for k, v in kwargs.items()} if known else None
    decided = hostvalues.data_dependent_shape(func, margs, mkw, host_args, host_kw)
    if decided is None:
        if "data-dependent" in str(exc) or "DataDependentOutputException" in type(exc).__name__:
            raise NotImplementedError(
                f"gpemu: {func} has a data-dependent output shape and no emulation policy ({hostvalues.POLICY})"
            ) from exc
        raise exc
    how, result = decided
    if how == "host":
        leaves, spec = tree_flatten(result)
        return tree_unflatten([host_to_emu(ts, x, dev) for x in leaves], spec)
    name = how.split(":", 1)[1]
    if name not in ts.warned:
        ts.warned.add(name)
        ts.say_once(
            f"{name} has a data-dependent output shape; emulated as if every element is selected "
            "(see docs/device.md, 'Ways back')"
        )
    if name == "boolean-mask assignment":
        ts.forget_value(emus[0])  # some of its values were overwritten by unknown ones
        if result is margs[0]:
            return emus[0]  # in place
    leaves, spec = tree_flatten(result)
    return tree_unflatten([from_meta(ts, m, dev) if isinstance(m, torch.Tensor) else m for m in leaves], spec)
