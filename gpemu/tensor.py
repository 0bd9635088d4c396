"""The emulated CUDA tensor: a meta-backed wrapper that says it lives on ``cuda:N``.

:class:`EmuTensor` is a ``torch.Tensor`` wrapper subclass whose real device stays ``meta`` (a
wrapper whose real device is ``cuda`` aborts inside autograd on the CPU build); ``.device``,
``.is_cuda`` and ``.get_device()`` report the emulated GPU. Every aten op reaches
``__torch_dispatch__``, which works out the outputs' shapes/strides/dtypes on the meta device
and re-wraps them. No arithmetic happens.

Speed: meta kernels are slow (many are Python). The output metadata of an op depends only on
the op, its inputs' shapes/strides/dtypes/devices and its non-tensor arguments, so the first
call of each such signature runs the meta kernel and stores an :class:`_Entry` (output specs,
which outputs alias which inputs, and the op's estimated GPU time); later calls build outputs
from the entry (a few microseconds). Python floats enter the key by type only (an optimizer's
changing step size must not miss the cache), except for the few ops where a float decides a
shape (``arange``, ``linspace``, interpolation scales).

Memory: each storage holds one :class:`gpemu.memory.Block`; views and in-place results share
their input's block (found on the meta device: an output whose storage is an input's storage).

Ways in: ``Tensor.cuda``/``Tensor.to``/``Tensor.type``, factories with ``device='cuda'``,
``torch.set_default_device('cuda')`` and ``with torch.device('cuda')``, ``Module.cuda/.to``.
Ways back and data-dependent shapes follow :mod:`gpemu.placeholders`.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import placeholders
from .placeholders import SHADOW_MAX_ELEMENTS

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = [
    "EmuTensor", "to_emulated", "to_host", "empty_emulated", "is_emulated", "device_index",
    "install", "cache_info", "host_shadow", "set_host_shadow",
]

aten = torch.ops.aten
_make_wrapper = torch.Tensor._make_wrapper_subclass
_DEVICES = [torch.device("cuda", i) for i in range(64)]
_META = torch.device("meta")
_CPU = torch.device("cpu")


class _Float:
    """Key token standing for "some Python float" (value not part of the op's metadata)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<float>"


_FLOAT = _Float()


class _State:
    """Per-run state the hot path reads (one runtime at a time)."""

    def __init__(self) -> None:
        self.rt: Runtime | None = None
        self.engine: Any = None
        self.memory: list = []
        self.cache: dict = {}
        self.local = threading.local()  # .moving_model: per-tensor copies are not charged
        self.warned: set[str] = set()
        self.param_generation = 0  # bumped when a parameter's dtype/device/requires_grad changes
        self.hook_generation = 0   # bumped when any tensor gets a (post-accumulate) grad hook
        self.flag_generation = 0   # bumped when any emulated tensor's requires_grad is set

    def say_once(self, message: str) -> None:
        if self.rt is not None:
            self.rt.say_once(message)


_S = _State()
_REQUIRES_GRAD = torch._C.TensorBase.requires_grad
_CACHE_LIMIT = 200_000


def cache_info() -> dict[str, int]:
    """How many op signatures the metadata cache holds (for benchmarks)."""
    return {"entries": len(_S.cache)}


# ----------------------------------------------------------------------------------------------
# the tensor type
# ----------------------------------------------------------------------------------------------
class EmuTensor(torch.Tensor):
    """A tensor on an emulated GPU: shape, dtype, strides, autograd; no data."""

    _dev: int
    _block: Any
    _meta: torch.Tensor | None
    _shadow: torch.Tensor | None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: int = 0, requires_grad: bool = False) -> "EmuTensor":
        """Wrap a meta tensor as a new allocation on emulated device ``device``."""
        if meta.device.type != "meta":
            raise ValueError(f"EmuTensor wraps a meta tensor, got one on {meta.device}; use to_emulated() for data")
        return _from_meta(meta, device, requires_grad=requires_grad)

    # -- where it lives ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _DEVICES[self._dev]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:  # type: ignore[override]
        return self._dev

    def data_ptr(self) -> int:  # type: ignore[override]
        block = self._block
        base = block.address if block is not None else 0
        return base + self.storage_offset() * self.element_size()

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return self.detach()

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # ``param.data = x`` swaps the TensorImpl's metadata in C++; the Python-side state
        # (device index, memory block, shadow) must follow or the accounting goes wrong.
        torch._C.TensorBase.data.__set__(self, new)
        _S.param_generation += 1
        if isinstance(new, EmuTensor):
            self._dev = new._dev
            self._block = new._block
            self._meta = new._meta
            self._shadow = new._shadow
            self._key = new._key

    # requires_grad changes of parameters invalidate replay recordings (gpemu.replay keys on a
    # generation counter instead of reading every parameter's flag on every call).
    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return _REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _REQUIRES_GRAD.__set__(self, value)
        _S.flag_generation += 1
        if getattr(self, "_is_param", False):
            _S.param_generation += 1

    def requires_grad_(self, requires_grad: bool = True) -> "EmuTensor":  # type: ignore[override]
        _REQUIRES_GRAD.__set__(self, requires_grad)
        _S.flag_generation += 1
        if self.__dict__.get("_is_param", False):
            _S.param_generation += 1
        return self

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        """No-op: emulated blocks are freed when the last tensor dies; stream-ordered reuse
        is not modelled."""

    def new_tensor(self, data: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False,
                   **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        idx = self._dev if device is None else device_index(device)
        host = torch.as_tensor(data.cpu() if isinstance(data, torch.Tensor) else data,
                               dtype=dtype or self.dtype).clone()
        out = host if idx is None else to_emulated(host, idx)
        return out.requires_grad_(requires_grad) if requires_grad else out

    # -- ways back ---------------------------------------------------------------------------
    def tolist(self) -> Any:  # type: ignore[override]
        return to_host(self, reason="tolist").tolist()

    def numpy(self, *, force: bool = False) -> Any:  # type: ignore[override]
        if force:
            return to_host(self, reason="numpy").numpy()
        raise TypeError(
            f"can't convert cuda:{self._dev} device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return self.numpy()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        values = to_host(self, reason="print")
        import torch._tensor_str as ts

        contents = tensor_contents
        if contents is None:
            with torch.no_grad():
                contents = ts._tensor_str(values, len("tensor(")) if values.numel() or values.dim() else "[]"
        prefix = "Parameter containing:\n" if self.__dict__.get("_is_param", False) else ""
        try:
            # On a detached alias: torch would print a subclass parameter as "Parameter(EmuTensor(".
            text = ts._str_intern(self.detach(), tensor_contents=contents)
            text = "tensor(" + text[len(type(self).__name__) + 1:-1]
            if self.grad_fn is not None:
                text += f", grad_fn=<{type(self.grad_fn).__name__}>"
            elif self.requires_grad:
                text += ", requires_grad=True"
            return prefix + text + ")"
        except Exception:  # e.g. torch.cuda.current_device() not available yet
            extra = f", device='cuda:{self._dev}'"
            if self.dtype not in (torch.get_default_dtype(), torch.int64, torch.bool):
                extra += f", dtype={self.dtype}"
            if self.grad_fn is not None:
                extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
            elif self.requires_grad:
                extra += ", requires_grad=True"
            return f"{prefix}tensor({contents}{extra})"

    def __reduce_ex__(self, protocol: int) -> Any:
        from .serialization import reduce_emulated

        return reduce_emulated(self, protocol)

    def __deepcopy__(self, memo: dict) -> "EmuTensor":
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone(memory_format=torch.preserve_format)
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True  # type: ignore[attr-defined]
        memo[id(self)] = new
        if self.grad is not None:
            import copy

            new.grad = copy.deepcopy(self.grad, memo)
        return new

    # -- dispatch ----------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        # Ops are keyed by id(): OpOverload.__hash__ is a Python method, and ops are singletons.
        fid = id(func)
        special = _SPECIAL.get(fid)
        if special is not None:
            return special(func, args, kwargs or {})
        emus: list[EmuTensor] = []
        try:
            if fid in _FLOAT_SENSITIVE:
                key = (fid, _sig(args, emus, True), _sig_kw(kwargs, emus, True) if kwargs else None)
            else:
                key = (fid, _sig(args, emus, False), _sig_kw(kwargs, emus, False) if kwargs else None)
            entry = _S.cache.get(key)
        except TypeError:  # an unhashable argument: no caching for this call
            key = None
            entry = None
        if entry is None:
            return _slow_path(func, args, kwargs or {}, key)
        return _fast_path(entry, func, args, kwargs, emus)


def is_emulated(t: Any) -> bool:
    return isinstance(t, EmuTensor)


def host_shadow(t: Any) -> torch.Tensor | None:
    """The known host value of a small emulated tensor (see :mod:`gpemu.placeholders`), or None
    when its value is unknown or ``t`` is not emulated."""
    if isinstance(t, EmuTensor):
        value = t._shadow
        return value if isinstance(value, torch.Tensor) else None
    return None


def set_host_shadow(t: Any, value: torch.Tensor | None) -> bool:
    """Make ``value`` the known host value of emulated tensor ``t`` (None: unknown). A value that
    does not fit (other element count, or more than SHADOW_MAX_ELEMENTS elements) makes it
    unknown instead. Returns whether a value is now known."""
    if not isinstance(t, EmuTensor):
        return False
    if value is None or not isinstance(value, torch.Tensor) or value.numel() != t.numel() \
            or t.numel() > SHADOW_MAX_ELEMENTS:
        t._shadow = None
        return False
    t._shadow = value.detach().to("cpu", t.dtype).reshape(t.shape).clone()
    return True


# ----------------------------------------------------------------------------------------------
# building tensors
# ----------------------------------------------------------------------------------------------
def _storage_nbytes(shape: tuple, stride: tuple, offset: int, itemsize: int) -> int:
    if 0 in shape:
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    return (offset + extent) * itemsize


def _wrap(shape: Any, stride: Any, offset: int, dtype: torch.dtype, dev: int, block: Any,
          requires_grad: bool = False) -> EmuTensor:
    t = _make_wrapper(EmuTensor, shape, strides=stride, storage_offset=offset, dtype=dtype, device=_META,
                      requires_grad=requires_grad)
    t._dev = dev
    t._block = block
    t._meta = None
    t._shadow = None
    # The op-cache signature of this tensor, fixed at creation (wrapper metadata never changes;
    # ``.data = x`` refreshes it): reading it is one attribute lookup instead of three C calls.
    t._key = (tuple(shape), tuple(stride), offset, dtype, dev)
    return t


def _from_meta(meta: torch.Tensor, dev: int, block: Any = None, requires_grad: bool = False) -> EmuTensor:
    if block is None:
        nbytes = meta.untyped_storage().nbytes()
        block = _S.memory[dev].allocate(nbytes) if nbytes else None
    t = _wrap(meta.shape, meta.stride(), meta.storage_offset(), meta.dtype, dev, block, requires_grad)
    t._meta = meta
    return t


def _meta_of(t: EmuTensor) -> torch.Tensor:
    """The meta tensor the op runs on (created lazily: cache hits never need one)."""
    m = t._meta
    if m is None:
        shape, stride, offset = t.shape, t.stride(), t.storage_offset()
        size = _storage_nbytes(tuple(shape), stride, offset, 1)
        base = torch.empty((max(size, offset),), dtype=t.dtype, device=_META)
        m = base.as_strided(shape, stride, offset)
        t._meta = m
    return m


def empty_emulated(shape: Any, dtype: torch.dtype, device: int, requires_grad: bool = False) -> EmuTensor:
    """A new, contiguous emulated tensor (counts its memory)."""
    return _from_meta(torch.empty(shape, dtype=dtype, device=_META), device, requires_grad=requires_grad)


# ----------------------------------------------------------------------------------------------
# op signatures (cache keys)
# ----------------------------------------------------------------------------------------------
def _sig(args: Any, emus: list, exact: bool) -> tuple:
    out = []
    for a in args:
        c = a.__class__
        if c is EmuTensor:
            emus.append(a)
            out.append(a._key)
        elif c is float:
            out.append(a if exact else _FLOAT)
        elif c is list or c is tuple:
            out.append(_sig(a, emus, exact))
        elif isinstance(a, torch.Tensor):
            if isinstance(a, EmuTensor):  # a subclass of ours (rare)
                emus.append(a)
                out.append(a._key)
            else:
                out.append(("host", a.device.type, a.shape, a.stride(), a.dtype))
        else:
            out.append(a)
    return tuple(out)


def _sig_kw(kwargs: dict, emus: list, exact: bool) -> tuple:
    return tuple((k, _sig((v,), emus, exact)) for k, v in kwargs.items())


def _float_sensitive() -> set:
    ops = set()
    for name in ("arange", "linspace", "logspace", "range", "upsample_nearest1d", "upsample_nearest2d",
                 "upsample_nearest3d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_linear1d",
                 "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                 "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
                 "affine_grid_generator"):
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            ops.add(id(getattr(packet, overload)))
    return ops


_FLOAT_SENSITIVE = _float_sensitive()


# ----------------------------------------------------------------------------------------------
# the cache entry and the two paths
# ----------------------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("kind", "specs", "treespec", "cost", "name", "out_dev", "random")

    def __init__(self) -> None:
        self.kind = 0          # 0: one tensor, 1: list/tuple of tensors, 2: None, 3: other tree
        self.specs: list = []  # per output leaf: (shape, stride, offset, dtype, nbytes, alias, write)
        self.treespec: Any = None
        self.cost = 0.0
        self.name = ""
        self.out_dev: int | None = None
        self.random = False


def _build_leaf(spec: tuple, emus: list, dev: int) -> Any:
    shape, stride, offset, dtype, nbytes, alias, write = spec
    if alias is None:
        if dtype is None:  # a non-tensor leaf (e.g. an int), stored as is in `shape`
            return shape
        block = _S.memory[dev].allocate(nbytes) if nbytes else None
        return _wrap(shape, stride, offset, dtype, dev, block)
    src = emus[alias]
    if write:
        return src
    return _wrap(shape, stride, offset, dtype, src._dev, src._block)


def _fast_path(entry: _Entry, func: Any, args: tuple, kwargs: dict | None, emus: list) -> Any:
    dev = entry.out_dev if entry.out_dev is not None else emus[0]._dev
    kind = entry.kind
    if kind == 0:
        out = _build_leaf(entry.specs[0], emus, dev)
    elif kind == 2:
        out = None
    else:
        leaves = [_build_leaf(s, emus, dev) for s in entry.specs]
        out = tree_unflatten(leaves, entry.treespec) if kind == 3 else entry.treespec(leaves)
    _charge(entry, dev)
    for e in emus:
        if e._shadow is not None:
            _propagate_shadow(func, args, kwargs or {}, emus, out, entry.random)
            break
    return out


def _charge(entry: _Entry, dev: int) -> None:
    cost = entry.cost
    if cost:
        engine = _S.engine
        if engine is not None and not engine.in_charged_scope:
            engine.stream(dev).enqueue(cost, "op", entry.name)


def charge_op(seconds: float, dev: int, name: str) -> None:
    """Charge ``seconds`` of GPU work named ``name`` on ``dev``'s current stream, unless a
    whole-module or optimizer charge already covers it (fast paths that replay several ops as
    one charge)."""
    if seconds > 0:
        engine = _S.engine
        if engine is not None and not engine.in_charged_scope:
            engine.stream(dev).enqueue(seconds, "op", name)


class OpCostTap:
    """``with OpCostTap() as tap:`` sums in ``tap.seconds`` the GPU time of the ops charged
    inside (they are still charged). Fast paths use it while recording what a call costs op by op;
    it replaces the module's ``_charge``, so it is for short, rare recordings."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._orig: Callable | None = None

    def __enter__(self) -> "OpCostTap":
        global _charge
        orig = self._orig = _charge

        def charge(entry: _Entry, dev: int) -> None:
            self.seconds += entry.cost
            orig(entry, dev)

        _charge = charge
        return self

    def __exit__(self, *exc: Any) -> None:
        global _charge
        _charge = self._orig


def _same_device_error(a: str, b: str) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!"
    )


# Ops where a host (CPU) tensor that is not a 0-dim scalar is fine next to emulated tensors,
# as on CUDA (copies; indexing with CPU index tensors).
_HOST_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default,
            aten._to_copy.default, aten.copy_.default, aten.lift_fresh.default}


def _meta_conv(a: Any, func: Any, emus: list, dev_holder: list) -> Any:
    # A module-level function, not a recursive closure: a closure that refers to itself forms a
    # reference cycle that would keep the op's inputs (and their memory) alive until gc runs.
    if isinstance(a, EmuTensor):
        emus.append(a)
        if dev_holder and a._dev != dev_holder[0]:
            raise _same_device_error(f"cuda:{dev_holder[0]}", f"cuda:{a._dev}")
        if not dev_holder:
            dev_holder.append(a._dev)
        return _meta_of(a)
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


def _to_meta_args(func: Any, args: Any, kwargs: dict) -> tuple[Any, Any, list, int | None]:
    """Replace emulated tensors by their meta tensors; check devices like CUDA does."""
    emus: list[EmuTensor] = []
    dev_holder: list[int] = []
    margs = _meta_conv(list(args), func, emus, dev_holder)
    mkw = {k: _meta_conv(v, func, emus, dev_holder) for k, v in kwargs.items()}
    out_dev = None
    d = kwargs.get("device")
    if d is not None:
        idx = device_index(d)
        if idx is not None:
            out_dev = idx
    return margs, mkw, emus, out_dev


def _slow_path(func: Any, args: tuple, kwargs: dict, key: Any) -> Any:
    margs, mkw, emus, out_dev = _to_meta_args(func, args, kwargs)
    if not emus and out_dev is None:
        return func(*args, **kwargs)
    dev = out_dev if out_dev is not None else emus[0]._dev
    if out_dev is not None and (kwargs.get("device") is not None):
        mkw["device"] = _META
    try:
        mout = func(*margs, **mkw)
    except (NotImplementedError, RuntimeError) as exc:
        policy = _DATA_DEPENDENT.get(func.overloadpacket)
        if policy is None:
            if "data-dependent" in str(exc) or "DataDependentOutputException" in type(exc).__name__:
                raise NotImplementedError(
                    f"gpemu: {func} has a data-dependent output shape and no emulation policy "
                    f"({placeholders.POLICY})") from exc
            raise
        return policy(func, args, kwargs, emus, dev)

    # Map outputs back: same object as an input meta -> in-place (return the input itself);
    # same storage as an input -> a view sharing its block; otherwise a new allocation.
    in_metas = [_meta_of(e) for e in emus]
    storages = {}
    for i, m in enumerate(in_metas):
        try:
            storages.setdefault(m.untyped_storage()._cdata, i)
        except Exception:
            pass
    leaves, treespec = tree_flatten(mout)
    entry = _Entry()
    entry.name = getattr(func, "__name__", str(func))
    entry.out_dev = out_dev
    entry.random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    cacheable = key is not None
    out_leaves = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type != "meta":  # e.g. new_zeros(device='cpu'): a real host tensor
                cacheable = False
                out_leaves.append(leaf)
                entry.specs.append(None)
                continue
            alias = write = None
            for i, m in enumerate(in_metas):
                if leaf is m:
                    alias, write = i, True
                    break
            if write and (leaf.shape != emus[alias].shape or leaf.stride() != emus[alias].stride()):
                raise NotImplementedError(
                    f"gpemu: {func} changes a tensor's shape in place, which emulated tensors do not "
                    "support; use the out-of-place form (e.g. x = x.unsqueeze(0) instead of x.unsqueeze_(0))")
            if alias is None:
                alias = storages.get(leaf.untyped_storage()._cdata)
                write = False
            nbytes = 0 if alias is not None else leaf.untyped_storage().nbytes()
            spec = (leaf.shape, leaf.stride(), leaf.storage_offset(), leaf.dtype, nbytes, alias, write)
            entry.specs.append(spec)
            if alias is None:
                t = _from_meta(leaf, dev)
            elif write:
                t = emus[alias]
            else:
                t = _wrap(leaf.shape, leaf.stride(), leaf.storage_offset(), leaf.dtype, emus[alias]._dev,
                          emus[alias]._block)
                t._meta = leaf
            out_leaves.append(t)
        else:
            try:
                hash(leaf)
            except TypeError:
                cacheable = False
            entry.specs.append((leaf, None, None, None, 0, None, None))
            out_leaves.append(leaf)
    if mout is None:
        entry.kind = 2
        out = None
    elif isinstance(mout, torch.Tensor):
        entry.kind = 0
        out = out_leaves[0]
    elif type(mout) in (list, tuple) and all(isinstance(x, torch.Tensor) for x in mout):
        entry.kind = 1
        entry.treespec = type(mout)
        out = type(mout)(out_leaves)
    else:
        entry.kind = 3
        entry.treespec = treespec
        out = tree_unflatten(out_leaves, treespec)
    entry.cost = _op_cost(func, margs, mkw, mout, dev)
    if cacheable:
        if len(_S.cache) >= _CACHE_LIMIT:
            _S.cache.clear()
        _S.cache[key] = entry
    _charge(entry, dev)
    if any(e._shadow is not None for e in emus):
        _propagate_shadow(func, args, kwargs, emus, out, entry.random)
    return out


def _op_cost(func: Any, margs: Any, mkw: dict, mout: Any, dev: int) -> float:
    """Estimated GPU seconds of one op (computed once per signature, then cached)."""
    rt = _S.rt
    if rt is None:
        return 0.0
    try:
        from .costs import op_seconds
    except ImportError:
        return 0.0
    engine = _S.engine
    # op_seconds answers 0 inside a charged scope; the cache needs the op's own cost.
    scope = getattr(engine._local, "scope", 0) if engine is not None else 0
    try:
        if scope and engine is not None:
            engine._set_scope(0)
        return float(op_seconds(rt, func, margs, mkw, mout, dev))
    except Exception as exc:  # a cost model gap must not break the user's op
        _S.say_once(f"no GPU-time estimate for {func} ({exc!r}); counted as 0")
        return 0.0
    finally:
        if scope and engine is not None:
            engine._set_scope(scope)


# ----------------------------------------------------------------------------------------------
# host shadows (known small values)
# ----------------------------------------------------------------------------------------------
def _propagate_shadow(func: Any, args: tuple, kwargs: dict, emus: list, out: Any, random: bool) -> None:
    if random or any(e._shadow is None for e in emus):
        # Unknown inputs: any tensor written in place loses its known value.
        _drop_written_shadows(out, emus)
        return

    outs = tree_flatten(out)[0]
    if not any(isinstance(o, EmuTensor) and o.numel() <= SHADOW_MAX_ELEMENTS for o in outs):
        # Only large results (e.g. small.repeat(1000, 1000)): not worth computing on the host.
        for o in outs:
            if isinstance(o, EmuTensor):
                o._shadow = None
        return
    sargs = _shadow_conv(list(args))
    skw = {k: _shadow_conv(v) for k, v in kwargs.items()}
    try:
        with torch.no_grad():
            sout = func(*sargs, **skw)
    except Exception:
        _drop_written_shadows(out, emus)
        return
    souts, _ = tree_flatten(sout)
    if len(outs) != len(souts):
        return
    for o, s in zip(outs, souts):
        if isinstance(o, EmuTensor) and isinstance(s, torch.Tensor):
            if s.shape == o.shape and s.numel() <= SHADOW_MAX_ELEMENTS and s.dtype == o.dtype:
                o._shadow = s
            else:
                o._shadow = None


def _drop_written_shadows(out: Any, emus: list) -> None:
    ids = {id(e) for e in emus}
    for o in tree_flatten(out)[0]:
        if isinstance(o, EmuTensor) and id(o) in ids:
            o._shadow = None


def _small_shadow(t: torch.Tensor) -> torch.Tensor | None:
    if t.numel() <= SHADOW_MAX_ELEMENTS and t.device.type == "cpu":
        return t.detach().clone(memory_format=torch.preserve_format)
    return None


# ----------------------------------------------------------------------------------------------
# special ops: item, device changes, copies, data-dependent shapes
# ----------------------------------------------------------------------------------------------
def _sync(dev: int, reason: str) -> None:
    engine = _S.engine
    if engine is not None:
        engine.synchronize(dev, reason)


def _local_scalar_dense(func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    _sync(t._dev, "item")
    if t.numel() != 1:
        raise RuntimeError(f"a Tensor with {t.numel()} elements cannot be converted to Scalar")
    value = placeholders.scalar_value(t.dtype, t._shadow)
    _settle()
    return value


def _settle() -> None:
    # The host time between the sync's wait and returning to the program was the emulator's.
    engine = _S.engine
    if engine is not None:
        engine.settle()


def to_host(t: EmuTensor, reason: str = "cpu") -> torch.Tensor:
    """Bring an emulated tensor back: wait for its device, charge the copy, give placeholder
    values (its shadow when known, else zeros; see :mod:`gpemu.placeholders`)."""
    _sync(t._dev, reason)
    rt = _S.rt
    if rt is not None and reason == "cpu":
        try:
            from .transfers import copy_to_host
        except ImportError:
            copy_to_host = None
        if copy_to_host is not None:
            copy_to_host(rt, t, t._dev)
            values = placeholders.host_values(t.shape, t.dtype, t._shadow)
            _settle()
            return values
    values = placeholders.host_values(t.shape, t.dtype, t._shadow)
    _settle()
    return values


def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    if not isinstance(t, EmuTensor):  # host tensor to an emulated device (e.g. autograd backward)
        idx = device_index(kwargs.get("device"))
        if idx is None:
            return func(*args, **kwargs)
        dtype = kwargs.get("dtype") or t.dtype
        return to_emulated(t.to(dtype), idx, bool(kwargs.get("non_blocking", False)))
    d = kwargs.get("device")
    if d is not None and torch.device(d).type == "cpu":
        values = to_host(t, reason="cpu")
        dtype = kwargs.get("dtype")
        if dtype is not None and dtype != values.dtype:
            values = values.to(dtype)
        if kwargs.get("pin_memory"):
            values = values.pin_memory()
        return values
    idx = device_index(d) if d is not None else None
    kw = dict(kwargs)
    kw.pop("device", None)
    out = _generic(func, args, kw)
    if idx is not None and idx != out._dev:
        return _peer_copy(out, idx)
    return out


def _generic(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` through the normal cached path (used by special handlers)."""
    emus: list = []
    try:
        key = (id(func), _sig(args, emus, False), _sig_kw(kwargs, emus, False) if kwargs else None)
        entry = _S.cache.get(key)
    except TypeError:
        key, entry = None, None
    if entry is None:
        return _slow_path(func, args, kwargs, key)
    return _fast_path(entry, func, args, kwargs, emus)


def _copy_(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if not isinstance(dst, EmuTensor):
        # device -> host copy into an existing CPU tensor: a sync point with placeholder values.
        values = to_host(src, reason="cpu")
        with torch.no_grad():
            dst.copy_(values)
        return dst
    if not isinstance(src, EmuTensor):
        if isinstance(src, torch.Tensor) and src.dim() > 0 and src.device.type == "cpu":
            _charge_h2d(src, dst._dev, bool(kwargs.get("non_blocking", False) or (len(args) > 2 and args[2])))
        new_shadow = None
        if dst.numel() <= SHADOW_MAX_ELEMENTS:
            base = dst._shadow if dst._shadow is not None else torch.zeros(dst.shape, dtype=dst.dtype)
            try:
                with torch.no_grad():
                    base.copy_(src if isinstance(src, torch.Tensor) else torch.tensor(src))
                new_shadow = base
            except Exception:
                new_shadow = None
        dst._shadow = new_shadow
        return dst
    if src._dev != dst._dev:
        # Peer copy between emulated GPUs: allowed by CUDA; metadata of dst is unchanged.
        if dst.numel() <= SHADOW_MAX_ELEMENTS and src._shadow is not None:
            base = dst._shadow if dst._shadow is not None else torch.zeros(dst.shape, dtype=dst.dtype)
            with torch.no_grad():
                base.copy_(src._shadow)
            dst._shadow = base
        else:
            dst._shadow = None
        return dst
    if dst._shadow is None and src._shadow is not None and dst.numel() <= SHADOW_MAX_ELEMENTS:
        dst._shadow = torch.zeros(dst.shape, dtype=dst.dtype)
    return _generic(func, args, kwargs)


def _say_policy(name: str) -> None:
    if name not in _S.warned:
        _S.warned.add(name)
        _S.say_once(f"{name} has a data-dependent output shape; emulated as if every element is selected "
                    "(see docs/device.md, 'Ways back')")


def _all_shadowed(ts: list) -> bool:
    return bool(ts) and all(t._shadow is not None for t in ts)


def _from_host_result(result: Any, dev: int) -> Any:
    """Emulated tensors (with shadows) from a real CPU computation on shadows."""
    leaves, spec = tree_flatten(result)
    return tree_unflatten([_host_to_emu(x, dev) for x in leaves], spec)


def _host_to_emu(x: Any, dev: int) -> Any:
    if isinstance(x, torch.Tensor):
        e = _from_meta(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META), dev)
        e._shadow = _small_shadow(x)
        return e
    return x


def _shadow_conv(a: Any) -> Any:
    if isinstance(a, EmuTensor):
        return a._shadow
    if isinstance(a, (list, tuple)):
        return type(a)(_shadow_conv(x) for x in a)
    if isinstance(a, torch.device) and a.type in ("cuda", "meta"):
        return _CPU
    return a


def _run_on_shadows(func: Any, args: tuple, kwargs: dict) -> Any:
    return func(*_shadow_conv(list(args)), **{k: _shadow_conv(v) for k, v in kwargs.items()})


def _policy_nonzero(func: Any, args: tuple, kwargs: dict, emus: list, dev: int) -> Any:
    if _all_shadowed(emus):
        return _from_host_result(_run_on_shadows(func, args, kwargs), dev)
    _say_policy(str(func.overloadpacket))
    x = args[0]
    return _from_meta(torch.empty((x.numel(), x.dim()), dtype=torch.int64, device=_META), dev)


def _policy_masked_select(func: Any, args: tuple, kwargs: dict, emus: list, dev: int) -> Any:
    if _all_shadowed(emus):
        return _from_host_result(_run_on_shadows(func, args, kwargs), dev)
    _say_policy("masked_select")
    x, mask = args[0], args[1]
    n = torch.broadcast_shapes(x.shape, mask.shape).numel()
    return _from_meta(torch.empty((n,), dtype=x.dtype, device=_META), dev)


def _policy_unique(func: Any, args: tuple, kwargs: dict, emus: list, dev: int) -> Any:
    if _all_shadowed(emus):
        return _from_host_result(_run_on_shadows(func, args, kwargs), dev)
    _say_policy("unique")
    x = args[0]
    name = func.overloadpacket.__name__
    n = x.numel()
    flat = torch.empty((n,), dtype=x.dtype, device=_META)
    inverse = torch.empty(x.shape if name != "unique_dim" else (x.shape[args[1]],), dtype=torch.int64,
                          device=_META)
    counts = torch.empty((n,), dtype=torch.int64, device=_META)
    if name == "unique_dim":
        flat = torch.empty(x.shape, dtype=x.dtype, device=_META)
        counts = torch.empty((x.shape[args[1]],), dtype=torch.int64, device=_META)
    if name == "_unique":
        return (_from_meta(flat, dev), _from_meta(inverse, dev))
    return (_from_meta(flat, dev), _from_meta(inverse, dev), _from_meta(counts, dev))


def _policy_index(func: Any, args: tuple, kwargs: dict, emus: list, dev: int) -> Any:
    x, indices = args[0], args[1]
    if _all_shadowed(emus) and all(not isinstance(i, torch.Tensor) or isinstance(i, EmuTensor) or
                                  i.device.type == "cpu" for i in indices if i is not None):
        return _from_host_result(_run_on_shadows(func, args, kwargs), dev)
    _say_policy("boolean-mask indexing")
    # Replace each boolean mask by "all of its positions" (integer index tensors of full size).
    new_idx: list = []
    for i in indices:
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            n = i.numel()
            for _ in range(i.dim()):
                new_idx.append(torch.empty((n,), dtype=torch.int64, device=_META))
        elif isinstance(i, EmuTensor):
            new_idx.append(_meta_of(i))
        elif isinstance(i, torch.Tensor):
            new_idx.append(torch.empty_strided(i.shape, i.stride(), dtype=i.dtype, device=_META))
        else:
            new_idx.append(i)
    mout = func(_meta_of(x), new_idx)
    return _from_meta(mout, dev)


def _policy_index_put(func: Any, args: tuple, kwargs: dict, emus: list, dev: int) -> Any:
    _say_policy("boolean-mask assignment")
    x = args[0]
    x._shadow = None
    if func.overloadpacket.__name__.endswith("_"):
        return x
    return _from_meta(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META), dev)


def _policy_repeat_interleave(func: Any, args: tuple, kwargs: dict, emus: list, dev: int) -> Any:
    if _all_shadowed(emus):
        return _from_host_result(_run_on_shadows(func, args, kwargs), dev)
    _say_policy("repeat_interleave")
    rep = args[0]
    return _from_meta(torch.empty((rep.numel(),), dtype=torch.int64, device=_META), dev)


_DATA_DEPENDENT: dict[Any, Callable] = {
    aten.nonzero: _policy_nonzero,
    aten.argwhere: _policy_nonzero,
    aten.masked_select: _policy_masked_select,
    aten._unique: _policy_unique,
    aten._unique2: _policy_unique,
    aten.unique_dim: _policy_unique,
    aten.unique_consecutive: _policy_unique,
    aten.index: _policy_index,
    aten.index_put_: _policy_index_put,
    aten.index_put: _policy_index_put,
    aten._index_put_impl_: _policy_index_put,
    aten.repeat_interleave: _policy_repeat_interleave,
}


def _non_finite_check(func: Any, args: tuple, kwargs: dict) -> Any:
    # Policy: emulated gradients are finite, found_inf keeps its value (see placeholders).
    return None


def _amp_update_scale(func: Any, args: tuple, kwargs: dict) -> Any:
    scale = args[0]
    emus = [a for a in args if isinstance(a, EmuTensor)]
    if _all_shadowed(emus):
        _run_on_shadows(func, args, kwargs)
    else:
        for e in emus:
            if e is scale or e is args[1]:
                e._shadow = None
    return scale


def _detach(func: Any, args: tuple, kwargs: dict) -> Any:
    # Hot (autograd detaches every gradient it stores): an alias with the same metadata.
    t = args[0]
    k = t._key
    out = _make_wrapper(EmuTensor, k[0], strides=k[1], storage_offset=k[2], dtype=k[3], device=_META)
    out._dev = t._dev
    out._block = t._block
    out._shadow = t._shadow
    out._meta = t._meta
    out._key = k
    return out


_SPECIAL: dict[int, Callable] = {id(op): handler for op, handler in {
    aten.detach.default: _detach,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._amp_foreach_non_finite_check_and_unscale_.default: _non_finite_check,
    aten._amp_update_scale_.default: _amp_update_scale,
}.items()}


# ----------------------------------------------------------------------------------------------
# ways in
# ----------------------------------------------------------------------------------------------
def _check(idx: int) -> int:
    rt = _S.rt
    if rt is None:
        raise RuntimeError("gpemu is not patched: call gpemu.patch() before using emulated GPUs")
    return rt.check_device(idx)


def device_index(device: Any) -> int | None:
    """Emulated device index for a CUDA device given as int/str/torch.device; None if not CUDA."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise ValueError(f"a device must be an int, a string or a torch.device, got {device!r}")
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        if not device.startswith("cuda"):
            return None
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        if device.index is not None:
            return device.index
        rt = _S.rt
        return rt.current_device if rt is not None else 0
    return None


_copy_to_device: Callable | None = None  # gpemu.transfers.copy_to_device, imported on first use


def _charge_h2d(t: torch.Tensor, dev: int, non_blocking: bool, issued_at: float | None = None) -> None:
    global _copy_to_device
    rt = _S.rt
    if rt is None or getattr(_S.local, "moving_model", False):
        return
    if _copy_to_device is None:  # (transfers imports this module: no top-level import)
        from .transfers import copy_to_device
        _copy_to_device = copy_to_device
    _copy_to_device(rt, t, dev, non_blocking, issued_at)


def _emulate_plain(t: torch.Tensor, dev: int, non_blocking: bool) -> EmuTensor:
    if t.is_contiguous() or _non_overlapping_dense(t):
        stride = t.stride()
    else:
        stride = torch.empty(t.shape, device=_META).stride()
    engine = _S.engine
    # The copy is issued when the program asked for it, not after the emulator's book-keeping.
    issued_at = engine.now() if engine is not None else None
    nbytes = t.numel() * t.element_size()
    block = _S.memory[dev].allocate(nbytes) if nbytes else None
    moving = getattr(_S.local, "moving_model", False)
    if engine is not None:
        engine.forget_wait()  # only a wait for THIS copy may be forgiven below
    _charge_h2d(t, dev, non_blocking, issued_at)
    e = _wrap(t.shape, stride, 0, t.dtype, dev, block)
    if not moving:
        # Model parameters/buffers get no shadows: their values are not what host code reads
        # back, and a shadow would add a host op to every step of the optimizer.
        e._shadow = _small_shadow(t)
    # A pageable copy returns when the copy ends; building the wrapper after that wait is the
    # emulator's time, not the program's (as for .item()).
    _settle()
    return e


def _non_overlapping_dense(t: torch.Tensor) -> bool:
    try:
        return torch._C._is_non_overlapping_and_dense(t)  # type: ignore[attr-defined]
    except Exception:
        return False


class _ToDevice(torch.autograd.Function):
    """Host -> emulated copy that keeps autograd (grads flow back as host placeholders)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, dev: int, non_blocking: bool) -> EmuTensor:  # type: ignore[override]
        ctx.host_dtype = t.dtype
        return _emulate_plain(t.detach(), dev, non_blocking)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        host = to_host(grad) if isinstance(grad, EmuTensor) else grad
        return host.to(ctx.host_dtype), None, None


def _peer_copy(t: EmuTensor, idx: int) -> EmuTensor:
    """A copy of ``t`` on another emulated GPU (counted there). GPU-to-GPU copy time is not
    charged (documented limitation)."""
    idx = _check(idx)
    nbytes = t.numel() * t.element_size()
    stride = t.stride() if (t.is_contiguous() or _non_overlapping_dense(t)) else \
        torch.empty(t.shape, device=_META).stride()
    out = _wrap(t.shape, stride, 0, t.dtype, idx, _S.memory[idx].allocate(nbytes) if nbytes else None)
    if t._shadow is not None:
        out._shadow = t._shadow.clone()
    return out


class _PeerCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: EmuTensor, idx: int) -> EmuTensor:  # type: ignore[override]
        ctx.src = t._dev
        return _peer_copy(t, idx)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        return _peer_copy(grad, ctx.src), None


def to_emulated(t: torch.Tensor, device: int, non_blocking: bool = False) -> EmuTensor:
    """Copy a host tensor onto emulated GPU ``device``: counts memory, charges transfer time,
    keeps a shadow of small values. Keeps autograd when ``t`` requires grad."""
    dev = _check(device)
    if isinstance(t, EmuTensor):
        return t if t._dev == dev else _peer_copy(t, dev)
    if t.requires_grad and torch.is_grad_enabled():
        return _ToDevice.apply(t, dev, non_blocking)
    return _emulate_plain(t.detach() if t.requires_grad else t, dev, non_blocking)


# -- Tensor.to / .cuda / .type -----------------------------------------------------------------
_TYPE_NAMES = {
    "FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _TYPE_NAMES.items()}


def _parse_to(args: tuple, kwargs: dict) -> tuple[Any, Any, bool, bool, Any]:
    """(device, dtype, non_blocking, copy, memory_format) of a Tensor.to / Module.to call."""
    kwargs = dict(kwargs)
    copy = bool(kwargs.pop("copy", False))
    args = list(args)
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        # .to(0): the CPU build cannot parse an int device in C; an int means cuda:N.
        kwargs.setdefault("device", torch.device("cuda", args.pop(0)))
    elif "device" in kwargs and isinstance(kwargs["device"], int) and not isinstance(kwargs["device"], bool):
        kwargs["device"] = torch.device("cuda", kwargs["device"])
    if args and isinstance(args[0], torch.Tensor):
        other = args.pop(0)
        kwargs.setdefault("device", other.device)
        kwargs.setdefault("dtype", other.dtype)
    if len(args) >= 4:  # (device, dtype, non_blocking, copy)
        copy = bool(args.pop(3))
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype, bool(non_blocking), copy, memory_format


def _make_tensor_to(orig_to: Callable) -> Callable:
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        device, dtype, non_blocking, copy, memory_format = _parse_to(args, kwargs)
        idx = device_index(device)
        if idx is None:
            call: dict[str, Any] = {"non_blocking": non_blocking, "copy": copy}
            if device is not None:
                call["device"] = device
            if dtype is not None:
                call["dtype"] = dtype
            if memory_format is not None:
                call["memory_format"] = memory_format
            return orig_to(self, **call)
        idx = _check(idx)
        if isinstance(self, EmuTensor):
            if idx == self._dev and (dtype is None or dtype == self.dtype) and not copy:
                return self
            # torch's C++ .to() initialises CUDA for a cuda target: convert here instead.
            out = self
            if dtype is not None and dtype != self.dtype:
                out = orig_to(self, dtype=dtype, non_blocking=non_blocking)
            elif copy and idx == self._dev:
                out = self.clone()
            if idx != out._dev:
                out = _PeerCopy.apply(out, idx) if out.requires_grad and torch.is_grad_enabled() \
                    else _peer_copy(out, idx)
            return out
        host = self if dtype is None or dtype == self.dtype else orig_to(self, dtype=dtype)
        return to_emulated(host, idx, non_blocking)
    return to


def _make_tensor_cuda(orig_cuda: Callable) -> Callable:
    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
             memory_format: Any = torch.preserve_format) -> torch.Tensor:
        rt = _S.rt
        idx = rt.current_device if device is None else device_index(device)
        if idx is None:
            raise ValueError(f"Invalid device, must be cuda device, got {device!r}")
        idx = _check(idx)
        if isinstance(self, EmuTensor):
            return self if self._dev == idx else self.to(_DEVICES[idx], non_blocking=non_blocking)
        return to_emulated(self, idx, non_blocking)
    return cuda


def _make_tensor_type(orig_type: Callable) -> Callable:
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            if isinstance(self, EmuTensor):
                return f"torch.cuda.{_DTYPE_NAMES.get(self.dtype, 'Tensor')}"
            return orig_type(self)
        if isinstance(dtype, str):
            if dtype.startswith("torch.cuda."):
                name = dtype[len("torch.cuda."):]
                if name not in _TYPE_NAMES:
                    raise ValueError(f"invalid type: {dtype!r}; valid CUDA types: "
                                     + ", ".join(f"torch.cuda.{n}" for n in _TYPE_NAMES))
                idx = self._dev if isinstance(self, EmuTensor) else _S.rt.current_device
                return self.to(device=_DEVICES[idx], dtype=_TYPE_NAMES[name], non_blocking=non_blocking)
            if isinstance(self, EmuTensor) and dtype.startswith("torch.") and dtype[6:] in _TYPE_NAMES:
                return self.to(device="cpu", dtype=_TYPE_NAMES[dtype[6:]])
        if isinstance(self, EmuTensor) and isinstance(dtype, torch.dtype):
            return self.to(dtype=dtype)
        return orig_type(self, dtype, non_blocking, **kwargs)
    return type_


# -- factories -----------------------------------------------------------------------------------
_DATA_FACTORIES = {"tensor", "as_tensor", "asarray", "scalar_tensor"}
_RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
                     "empty", "empty_like", "empty_strided", "empty_permuted"}
_FACTORIES = ("empty", "empty_strided", "empty_permuted", "zeros", "ones", "full", "rand", "randn", "randint",
              "randperm", "arange", "range", "linspace", "logspace", "eye", "tensor", "as_tensor", "asarray",
              "scalar_tensor", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
              "randint_like", "tril_indices", "triu_indices", "normal")


def _emulated_factory(orig: Callable, name: str, args: tuple, kwargs: dict, idx: int) -> torch.Tensor:
    dev = _check(idx)
    kw = dict(kwargs)
    kw.pop("device", None)
    kw.pop("pin_memory", None)
    requires_grad = bool(kw.pop("requires_grad", False))
    if args and isinstance(args[0], EmuTensor):
        # *_like / as_tensor of an emulated tensor: runs through dispatch on its device.
        out = orig(*args, **kw) if name not in ("tensor",) else args[0].detach().clone()
        if out._dev != dev:
            out = out.to(_DEVICES[dev])
    elif name in _DATA_FACTORIES:
        host = orig(*args, **kw)
        out = _emulate_plain(host, dev, False)
    else:
        meta = orig(*args, device=_META, **kw)
        out = _from_meta(meta, dev)
        if meta.numel() <= SHADOW_MAX_ELEMENTS:
            if name in _RANDOM_FACTORIES:
                if name.startswith("empty"):
                    out._shadow = torch.zeros(meta.shape, dtype=meta.dtype)
            else:
                host_args = tuple(_host_like(a) for a in args)
                out._shadow = orig(*host_args, device=_CPU, **kw)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _host_like(a: Any) -> Any:
    if isinstance(a, EmuTensor):
        return placeholders.host_values(a.shape, a.dtype, a._shadow)
    return a


def _make_factory(orig: Callable, name: str) -> Callable:
    @functools.wraps(orig)
    def factory(*args: Any, **kwargs: Any) -> Any:
        d = kwargs.get("device")
        if d is not None:
            idx = device_index(d)
            if idx is not None:
                return _emulated_factory(orig, name, args, kwargs, idx)
        return orig(*args, **kwargs)
    return factory


def _make_tensor_new(orig: Callable) -> Callable:
    """``t.new_zeros(..., device='cuda')`` and friends (the C++ path would initialise CUDA)."""
    @functools.wraps(orig)
    def new(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        d = kwargs.get("device")
        idx = device_index(d) if d is not None else None
        if idx is None:
            return orig(self, *args, **kwargs)
        idx = _check(idx)
        kw = dict(kwargs)
        kw["device"] = _META
        kw.pop("pin_memory", None)
        requires_grad = bool(kw.pop("requires_grad", False))
        kw.setdefault("dtype", self.dtype)
        meta_self = torch.empty((), dtype=self.dtype, device=_META)
        out = _from_meta(orig(meta_self, *args, **kw), idx)
        return out.requires_grad_(True) if requires_grad else out
    return new


def _make_device_context_tf(orig_tf: Callable) -> Callable:
    """``torch.set_default_device('cuda')`` / ``with torch.device('cuda')``: torch's DeviceContext
    mode adds ``device='cuda'`` to factories; route those to emulated factories."""
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()

    def __torch_function__(self: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.device.type == "cuda" and _S.rt is not None and func in constructors:
            d = kwargs.get("device")
            idx = device_index(self.device if d is None else d)
            if idx is not None:
                return _emulated_factory(func, getattr(func, "__name__", ""), args, kwargs, idx)
        return orig_tf(self, func, types, args, kwargs)
    return __torch_function__


# -- modules -------------------------------------------------------------------------------------
def _make_module_to(orig_to: Callable) -> Callable:
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, non_blocking, _copy, memory_format = _parse_to(args, kwargs)
        idx = device_index(device)
        call: dict[str, Any] = {"non_blocking": non_blocking}
        if dtype is not None:
            call["dtype"] = dtype
        if memory_format is not None:
            call["memory_format"] = memory_format
        if idx is None:
            if device is not None:
                call["device"] = device
            return orig_to(self, **call)
        idx = _check(idx)
        call["device"] = _DEVICES[idx]
        return _move_module(self, idx, lambda: orig_to(self, **call))
    return to


def _make_module_cuda(orig_cuda: Callable) -> Callable:
    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        idx = _S.rt.current_device if device is None else device_index(device)
        if idx is None:
            raise ValueError(f"Invalid device, must be cuda device, got {device!r}")
        idx = _check(idx)
        return _move_module(self, idx, lambda: orig_cuda(self, idx))
    return cuda


def _move_module(module: torch.nn.Module, idx: int, move: Callable[[], Any]) -> Any:
    """Move a module's tensors; the model-transfer time is charged once for the whole module
    (gpemu.transfers.model_to_device) instead of per tensor."""
    from_host = any(not isinstance(t, EmuTensor) and t.device.type == "cpu"
                    for t in _module_tensors(module))
    local = _S.local
    prev = getattr(local, "moving_model", False)
    local.moving_model = True
    try:
        result = move()
    finally:
        local.moving_model = prev
    if from_host and not prev and _S.rt is not None:
        try:
            from .transfers import model_to_device
        except ImportError:
            model_to_device = None
        if model_to_device is not None:
            model_to_device(_S.rt, module, idx)
    return result


def _module_tensors(module: torch.nn.Module) -> Any:
    yield from module.parameters()
    yield from module.buffers()


_COMPILE_NOTE = ("torch.compile is not applied on emulated GPUs: the model runs eagerly (GPU time "
                 "still comes from the profile database or the per-op estimate)")


def _make_compile(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        _S.say_once(_COMPILE_NOTE)
        if model is None:  # used as a decorator factory: @torch.compile(mode=...)
            return lambda fn: fn
        return model
    return compile


# ----------------------------------------------------------------------------------------------
# install
# ----------------------------------------------------------------------------------------------
def install(rt: "Runtime") -> None:
    """Patch the ways in (Tensor.to/.cuda/.type, factories, default device, Module.to/.cuda)
    and let optimizers take their foreach path over emulated tensors."""
    p = rt.patcher
    _S.rt = rt
    _S.engine = rt.state.get("engine")
    _S.memory = rt.state["memory"]
    _S.cache = {}
    _S.warned = set()

    def reset() -> None:
        _S.rt = None
        _S.engine = None
        _S.memory = []
        _S.cache = {}

    p.on_restore(reset)
    T = torch.Tensor
    p.replace(T, "to", _make_tensor_to(T.to))
    p.replace(T, "cuda", _make_tensor_cuda(T.cuda))
    p.replace(T, "type", _make_tensor_type(T.type))
    for name in ("new_empty", "new_zeros", "new_ones", "new_full"):
        p.replace(T, name, _make_tensor_new(getattr(T, name)))
    from torch.utils._device import DeviceContext, _device_constructors

    _device_constructors()  # fill its cache with torch's own functions before ours replace them
    p.replace(DeviceContext, "__torch_function__", _make_device_context_tf(DeviceContext.__torch_function__))
    for name in _FACTORIES:
        orig = getattr(torch, name, None)
        if orig is not None:
            p.replace(torch, name, _make_factory(orig, name))
    # torch.compile cannot trace meta-backed wrapper tensors; emulated GPU time comes from
    # profiles of eager runs anyway, so compiled models run eagerly (said once).
    p.replace(torch, "compile", _make_compile(torch.compile))
    M = torch.nn.Module
    p.replace(M, "to", _make_module_to(M.to))
    if hasattr(M, "compile"):
        p.replace(M, "compile", lambda self, *a, **k: _S.say_once(_COMPILE_NOTE))
    p.replace(M, "cuda", _make_module_cuda(M.cuda))
    # Optimizers choose their foreach (multi-tensor) path only for listed tensor types.
    import torch.optim.optimizer as opt_mod
    import torch.utils._foreach_utils as fe_mod

    for mod in (opt_mod, fe_mod):
        types = getattr(mod, "_foreach_supported_types", None)
        if isinstance(types, list) and EmuTensor not in types:
            p.replace(mod, "_foreach_supported_types", types + [EmuTensor])
