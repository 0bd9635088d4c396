"""The emulated CUDA tensor: a meta-backed wrapper that says it lives on ``cuda:N``.

:class:`EmuTensor` is a ``torch.Tensor`` wrapper subclass whose real device stays ``meta`` (a
wrapper whose real device is ``cuda`` aborts inside autograd on the CPU build); ``.device``,
``.is_cuda`` and ``.get_device()`` report the emulated GPU. Every aten op reaches
``__torch_dispatch__``, which works out the outputs' shapes/strides/dtypes on the meta device
and re-wraps them. No arithmetic happens.

Per-run state lives in one :class:`TensorState` (``rt.tensors``); every emulated tensor points to
the state of the run that made it (as a fake tensor points to its mode), so dispatch finds its
run from its inputs without any module-level state.

Speed: meta kernels are slow (many are Python). The output metadata of an op depends only on
the op, its inputs' shapes/strides/dtypes/devices and its non-tensor arguments, so the first
call of each such signature runs the meta kernel and stores an :class:`_Entry` (output specs,
which outputs alias which inputs, and the op's estimated GPU time); later calls build outputs
from the entry (a few microseconds). The key also holds the pass and PyTorch's TF32 switches
(they change the price, not the outputs). Python floats enter the key by type only (an
optimizer's changing step size must not miss the cache), except for the few ops where a float
decides a shape (``arange``, ``linspace``, interpolation scales).

Memory: each storage holds one :class:`gpemu.memory.Block`; views and in-place results share
their input's block (found on the meta device: an output whose storage is an input's storage).

Values: what host code reads back follows :mod:`gpemu.hostvalues` (small known values are kept
as host *shadows* and propagated here; the rest reads as zeros). The ways in (``.cuda()``,
factories, ``Module.to``) are :mod:`gpemu.ways_in`.

The fast paths (:mod:`gpemu.fastpaths`) build and charge emulated tensors without dispatch
through :class:`TensorState`'s methods (``wrap``, ``signature``, ``build``, ``charge``,
``cost_tap``): that class is their whole interface to this module.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import hostvalues
from .costmodel.precision import tf32_cudnn, tf32_matmul
from .devices import cuda_index
from .hostvalues import SHADOW_MAX_ELEMENTS
from .runtime import current

if TYPE_CHECKING:  # pragma: no cover
    from .memory import MemoryTracker
    from .runtime import Runtime
    from .time import TimeEngine

__all__ = [
    "EmuTensor",
    "unhide_grad",
    "TensorState",
    "CostTap",
    "to_emulated",
    "to_host",
    "empty_emulated",
    "is_emulated",
    "device_index",
    "install",
    "cache_info",
    "host_shadow",
    "set_host_shadow",
    "peer_copy",
    "PeerCopy",
    "DTYPE_NAMES",
    "TYPE_NAMES",
]

aten = torch.ops.aten
_make_wrapper = torch.Tensor._make_wrapper_subclass
_DEVICES = [torch.device("cuda", i) for i in range(64)]
_META = torch.device("meta")
_CPU = torch.device("cpu")
_REQUIRES_GRAD = torch._C.TensorBase.requires_grad
_REQUIRES_GRAD_METHOD = torch._C.TensorBase.requires_grad_
_CACHE_LIMIT = 200_000
# Attributes every emulated tensor carries (see TensorState.wrap); a gradient with more was
# marked by the program and is never reused by the fast paths.
WRAPPER_ATTRIBUTES = 6


class _Float:
    """Key token standing for "some Python float" (value not part of the op's metadata)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<float>"


_FLOAT = _Float()


# ----------------------------------------------------------------------------------------------
# per-run state, and the interface the fast paths use
# ----------------------------------------------------------------------------------------------
class CostTap:
    """What :meth:`TensorState.cost_tap` yields: ``seconds``, the GPU time of the ops dispatched
    inside (each op's own cost, also where a whole-module charge covers it), and ``charged``, the
    part of it that was charged on its own (outside any such cover).

    It also runs the cost model's pass arithmetic over the same ops (:class:`gpemu.costs.OpPrice`):
    ``pass_seconds``, the ops as one pass of a real program started on an idle GPU (each op issued
    after the host time the calibration hosts took for it, the GPU running them in order: host and
    GPU overlapped; how the database timed a model's forward and backward),
    and ``reference_seconds``, the same pass priced as the profile database measured (fp32 on the
    device's reference GPU) — their ratio carries a measured model's time to this GPU and precision.
    Work charged as a span (a replayed unit) counts as GPU time at both prices. ``mix``: GPU
    seconds per kind of work of the priced ops (the cost model's uncertainty depends on it)."""

    __slots__ = ("seconds", "charged", "mix", "_host", "_finish", "_finish_ref", "own")

    def __init__(self) -> None:
        # ``own``: for a module's backward window, which ops are its own (:class:`OwnNodes`);
        # None: every op charged while the tap is open.
        self.own: OwnNodes | None = None
        self.seconds = 0.0
        self.charged = 0.0
        self.mix: dict[str, float] = {}
        self._host = 0.0  # host issue time so far (the queue's host side)
        self._finish = 0.0  # when the pass's GPU work ends, at this GPU and precision
        self._finish_ref = 0.0  # the same at the reference price

    def add(self, gpu: float, host: float, reference: float) -> None:
        """One op of ``gpu`` kernel seconds, issued after ``host`` seconds of host work;
        ``reference``: its kernel seconds at the reference price."""
        self._host = h = self._host + host
        self._finish = (h if h > self._finish else self._finish) + gpu
        self._finish_ref = (h if h > self._finish_ref else self._finish_ref) + reference

    @property
    def pass_seconds(self) -> float:
        return self._finish

    @property
    def reference_seconds(self) -> float:
        return self._finish_ref


def contiguous_stride(shape: Any) -> tuple:
    """Contiguous strides of ``shape``, as torch makes them (a size-0 or -1 dimension counts
    as 1), without making a meta tensor (~20 us each)."""
    out = []
    acc = 1
    for n in reversed(shape):
        out.append(acc)
        if n > 1:
            acc *= n
    return tuple(reversed(out))


_current_node = torch._C._current_autograd_node
_current_task = torch._C._current_graph_task_id
_ACCUMULATE_SEQ = 2**64 - 1  # AccumulateGrad nodes' sequence number


def backward_pass(ts: TensorState) -> bool:
    """Whether an op dispatched now is backward work: the autograd engine is running a backward
    pass on this thread, and it is not a module's forward recomputed inside it. The cost model
    was calibrated so (gpemu.costmodel.record marks every op of ``loss.backward()``), and its
    ``.bwd`` curves price such ops whatever their name (autograd's ``mm``, ``add``, ``clone``)."""
    return _current_task() != -1 and not getattr(ts.recompute, "depth", 0)


class OwnNodes:
    """The autograd nodes one module call made: sequence numbers ``lo <= n < hi`` (numbered in
    creation order on the forward's thread) and its parameters' AccumulateGrad nodes.

    A module's backward window (from its outputs' gradients to its inputs') also runs other
    nodes the engine finds ready: the engine runs ready nodes newest first, and the node that
    closes the window was made before the module's own, so a branch created later (a block's
    cast weights, a sibling's weight gradients) runs inside the window. A cost tap with an
    ``OwnNodes`` counts only ops run by the module's nodes, by a nested backward they start
    (reentrant checkpointing), or outside any node."""

    __slots__ = ("lo", "hi", "params", "_ids", "task")

    def __init__(self, lo: int, hi: int, params: Any) -> None:
        self.lo, self.hi = lo, hi
        # (made for every op-by-op call with a backward: the id set waits for an AccumulateGrad)
        self.params = params
        self._ids: frozenset | None = None
        self.task = -1  # the graph task of the window (set when the backward starts)

    def running(self) -> bool:
        """True when the op being charged belongs to the module's backward."""
        node = _current_node()
        if node is None or _current_task() != self.task:
            return True
        seq = node._sequence_nr()
        if self.lo <= seq < self.hi:
            return True
        if seq != _ACCUMULATE_SEQ:
            return False
        if self._ids is None:
            self._ids = frozenset(id(p) for p in self.params)
        return id(getattr(node, "variable", None)) in self._ids


class TensorState:
    """The emulated tensor type's per-run state (``rt.tensors``), and the fast paths' interface
    to it: :meth:`wrap`, :meth:`new`, :meth:`signature`, :meth:`build`, :meth:`charge`, :meth:`cost_tap`, the
    run's ``memory`` trackers and ``engine``, and the generation counters below."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.engine: TimeEngine | None = rt.engine
        # The engine's per-thread state (``.host``) and clock (emulator entries, see TimeEngine.enter).
        self.local = rt.engine.local if rt.engine is not None else None
        self.read_clock = rt.engine.read_clock if rt.engine is not None else None
        self.leave = rt.engine.leave if rt.engine is not None else None
        self.ordinals = frozenset(range(rt.num_devices))  # valid device indices (ints)
        self.memory: list[MemoryTracker] = rt.memory
        self.cache: dict = {}  # op signature and pass (see backward_pass) -> _Entry
        # Per thread: > 0 while a module's forward runs again inside a backward pass (activation
        # checkpointing's recomputation, gpemu.model_time): its ops are forward work.
        self.recompute = threading.local()
        self.warned: set[str] = set()
        # Bumped when a parameter's dtype/device/requires_grad changes (gpemu.fastpaths.replay
        # keys recordings on it instead of reading every parameter on every call).
        self.param_generation = 0
        # Bumped when any emulated tensor's requires_grad is set (gradient sets re-check then).
        self.flag_generation = 0
        # Bumped when an existing emulated tensor may have got a known value (an in-place op on
        # known values, a copy into it, .data, set_host_shadow): the optimizer fast path looks
        # at its parameters' values only then.
        self.shadow_writes = 0
        self._taps: list[CostTap] = []  # open cost taps, innermost last (see cost_tap)
        self._tap_owner: int | None = None
        # Ops another component emulates itself, by id(op) (gpemu.distributed: torch's functional
        # collectives): ``handler(func, args, kwargs)`` returns the op's result. Never cached.
        self.op_handlers: dict[int, Callable[[Any, tuple, dict], Any]] = {}

    # -------------------------------------------------------------- building
    def wrap(
        self,
        shape: Any,
        stride: Any,
        offset: int,
        dtype: torch.dtype,
        dev: int,
        block: Any,
        requires_grad: bool = False,
    ) -> EmuTensor:
        """A new emulated tensor with this metadata over memory ``block`` (None: no storage)."""
        if requires_grad:
            t = _make_wrapper(
                EmuTensor, shape, strides=stride, storage_offset=offset, dtype=dtype, device=_META, requires_grad=True
            )
        elif offset:
            t = _make_wrapper(EmuTensor, shape, strides=stride, storage_offset=offset, dtype=dtype, device=_META)
        else:  # (each keyword argument costs the argument parser ~0.5 us here)
            t = _make_wrapper(EmuTensor, shape, strides=stride, dtype=dtype, device=_META)
        # The instance dict in one assignment (six attribute stores cost twice as much). _key:
        # the op-cache signature of this tensor, fixed at creation (wrapper metadata never
        # changes; ``.data = x`` refreshes it): one attribute lookup instead of three C calls.
        t.__dict__ = {
            "_dev": dev,
            "_block": block,
            "_meta": None,
            "_shadow": None,
            "_key": (tuple(shape), tuple(stride), offset, dtype, dev),
            "_ts": self,
        }
        return t

    def new(self, shape: tuple, dtype: torch.dtype, dev: int) -> EmuTensor:
        """A new contiguous emulated tensor of ``shape`` with its memory allocated on ``dev`` (a
        kernel's output or gradient the emulator makes itself)."""
        numel = 1
        for n in shape:
            numel *= n
        block = self.memory[dev].allocate(numel * dtype.itemsize)
        return self.wrap(shape, contiguous_stride(shape), 0, dtype, dev, block)

    def build(self, spec: tuple, emus: list, dev: int) -> Any:
        """An op output from its cached spec ``(shape, stride, offset, dtype, nbytes, alias,
        write)``: a new allocation, a view of input ``emus[alias]``, or that input itself (in
        place). A non-tensor output is stored as is in ``shape`` (dtype None)."""
        shape, stride, offset, dtype, nbytes, alias, write = spec
        if alias is None:
            if dtype is None:
                return shape
            block = self.memory[dev].allocate(nbytes) if nbytes else None
            return self.wrap(shape, stride, offset, dtype, dev, block)
        src = emus[alias]
        if write:
            return src
        return self.wrap(shape, stride, offset, dtype, src._dev, src._block)

    @staticmethod
    def spec_of(t: EmuTensor) -> tuple:
        """``t``'s metadata as an output spec for :meth:`build` (a new allocation of its size)."""
        return (
            tuple(t.shape),
            t.stride(),
            t.storage_offset(),
            t.dtype,
            t._block.size if t._block is not None else 0,
            None,
            False,
        )

    @staticmethod
    def signature(args: Any, emus: list, exact: bool) -> tuple:
        """The op-cache signature of ``args`` (a tuple); appends each emulated tensor met to
        ``emus``; ``exact``: floats by value, not by type. Raises TypeError for arguments that
        cannot be part of a key."""
        return _sig(args, emus, exact)

    @staticmethod
    def call_signature(args: Any, emus: list) -> tuple:
        """:meth:`signature` (floats by value) for a module call: emulated tensors by shape,
        strides, dtype and device, not by where they sit in their storage (``source[i:i+35]``
        batches of one long tensor are the same call)."""
        return _call_sig(args, emus)

    # -------------------------------------------------------------- charging
    def charge(self, seconds: float, dev: int, name: str, price: Any = None) -> None:
        """Charge ``seconds`` of GPU work named ``name`` on ``dev``'s current stream, unless a
        whole-module or optimizer charge already covers it (fast paths that replay several ops as
        one charge). Open cost taps of this thread count it (``price``: its
        :class:`gpemu.costs.OpPrice` when it is one op the cost model priced)."""
        if seconds > 0:
            engine = self.engine
            charged = engine is not None and not engine.in_charged_scope
            if self._taps:
                self._tap(seconds, charged, price)
            if charged:
                engine.stream(dev).enqueue(seconds, "op", name)

    def charge_span(self, seconds: float, dev: int, kind: str, name: str, at: float | None = None) -> None:
        """:meth:`charge` as a span of ``kind`` (``forward``, ``backward``): a replayed module's
        recorded time. ``at``: the host time it was issued, when earlier than now."""
        if seconds > 0:
            engine = self.engine
            charged = engine is not None and not engine.in_charged_scope
            if self._taps:
                self._tap(seconds, charged, None)
            if charged:
                engine.stream(dev).enqueue(seconds, kind, name, 0, at)

    def _charge_entry(self, entry: _Entry, dev: int) -> None:
        cost = entry.cost
        if cost:
            engine = self.engine
            charged = engine is not None and not engine.in_charged_scope
            if self._taps:
                self._tap(cost, charged, entry.price)
            if charged:
                engine.stream(dev).enqueue(cost, "op", entry.name)

    def _tap(self, cost: float, charged: bool, price: Any) -> None:
        if self._tap_owner == threading.get_ident():
            host, reference = (price.host, price.reference) if price is not None else (0.0, cost)
            for tap in self._taps:
                if tap.own is not None and not tap.own.running():
                    continue
                tap.seconds += cost
                if charged:
                    tap.charged += cost
                tap.add(cost, host, reference)
                if price is not None:
                    tap.mix[price.mix] = tap.mix.get(price.mix, 0.0) + cost

    def open_tap(self) -> CostTap:
        """Start summing the GPU time of the ops this thread charges from now on (they are still
        charged) until :meth:`close_tap`: how a call's cost is measured op by op while it runs
        (also across callbacks, e.g. a whole backward pass). Taps nest."""
        me = threading.get_ident()
        if self._taps and self._tap_owner != me:
            raise RuntimeError(
                "gpemu: cost taps of two threads at once (a fast path recorded in a thread while another was recording)"
            )
        tap = CostTap()
        self._tap_owner = me
        self._taps.append(tap)
        return tap

    def close_tap(self, tap: CostTap) -> float:
        """Stop a tap of :meth:`open_tap`; returns its seconds."""
        try:
            self._taps.remove(tap)
        except ValueError:
            pass
        if not self._taps:
            self._tap_owner = None
        return tap.seconds

    @contextmanager
    def cost_tap(self) -> Iterator[CostTap]:
        """``with rt.tensors.cost_tap() as tap:``: :meth:`open_tap` ... :meth:`close_tap`."""
        tap = self.open_tap()
        try:
            yield tap
        finally:
            self.close_tap(tap)

    # -------------------------------------------------------------- misc
    def say_once(self, message: str) -> None:
        self.rt.say_once(message)

    def check(self, idx: int) -> int:
        return self.rt.check_device(idx)

    def device_index(self, device: Any) -> int | None:
        """CUDA index of a device argument (current device for ``'cuda'``), None if not CUDA."""
        return cuda_index(device, self.rt.current_device)


def _state() -> TensorState:
    """The active run's tensor state (public entry points that get no emulated tensor)."""
    rt = current()
    if rt is None or rt.tensors is None:
        raise RuntimeError("gpemu is not patched: call gpemu.patch() before using emulated GPUs")
    return rt.tensors


def cache_info() -> dict[str, int]:
    """How many op signatures the active run's metadata cache holds (for benchmarks)."""
    return {"entries": len(_state().cache)}


# ----------------------------------------------------------------------------------------------
# the tensor type
# ----------------------------------------------------------------------------------------------
class EmuTensor(torch.Tensor):
    """A tensor on an emulated GPU: shape, dtype, strides, autograd; no data."""

    _dev: int
    _block: Any
    _meta: torch.Tensor | None
    _shadow: torch.Tensor | None
    _ts: TensorState

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: int = 0, requires_grad: bool = False) -> EmuTensor:
        """Wrap a meta tensor as a new allocation on emulated device ``device``."""
        if meta.device.type != "meta":
            raise ValueError(f"EmuTensor wraps a meta tensor, got one on {meta.device}; use to_emulated() for data")
        return _from_meta(_state(), meta, device, requires_grad=requires_grad)

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
        unhide_grad(self)
        torch._C.TensorBase.data.__set__(self, new)
        self._ts.param_generation += 1
        self._ts.shadow_writes += 1
        if isinstance(new, EmuTensor):
            self._dev = new._dev
            self._block = new._block
            self._meta = new._meta
            self._shadow = new._shadow
            self._key = new._key

    # requires_grad changes of parameters invalidate replay recordings (gpemu.fastpaths.replay
    # keys on a generation counter instead of reading every parameter's flag on every call).
    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return _REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _REQUIRES_GRAD.__set__(self, value)
        ts = self._ts
        ts.flag_generation += 1
        if getattr(self, "_is_param", False):
            ts.param_generation += 1

    def requires_grad_(self, requires_grad: bool = True) -> EmuTensor:  # type: ignore[override]
        # torch's method, not the property: on a non-leaf that requires grad, requires_grad_(True)
        # is allowed (HF's gradient checkpointing calls it on embedding outputs).
        _REQUIRES_GRAD_METHOD(self, requires_grad)
        ts = self._ts
        ts.flag_generation += 1
        if self.__dict__.get("_is_param", False):
            ts.param_generation += 1
        return self

    # .grad through Python: a gradient set given back by zero_grad keeps its wrappers attached
    # to their parameters and reads as None (gpemu.fastpaths.gradients; the group's flags live
    # on its memory block, see gpemu.memory.GroupBlock). Anything that hands a gradient to
    # Python code marks its group exposed; setting a parameter's gradient detaches a hidden
    # group for real first.
    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        g = _GRAD_GET(self)
        if g is not None:
            block = g.__dict__.get("_block")
            group = block.parent if block is not None else None
            if group is not None:
                if group.hidden:
                    return None
                group.exposed = True
        return g

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        unhide_grad(self)
        _GRAD_SET(self, value)

    @grad.deleter
    def grad(self) -> None:
        unhide_grad(self)
        _GRAD_SET(self, None)

    _grad = grad  # (torch's alias, as its C property)

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        """No-op: emulated blocks are freed when the last tensor dies; stream-ordered reuse
        is not modelled."""

    def new_tensor(
        self, data: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False, **kwargs: Any
    ) -> torch.Tensor:  # type: ignore[override]
        idx = self._dev if device is None else self._ts.device_index(device)
        host = torch.as_tensor(
            data.cpu() if isinstance(data, torch.Tensor) else data, dtype=dtype or self.dtype
        ).clone()
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
            text = "tensor(" + text[len(type(self).__name__) + 1 : -1]
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
        # gpemu.serialization installs the real reduction for its run (torch.save of emulated
        # tensors); without it an emulated tensor has nothing to pickle.
        raise TypeError(
            "an emulated GPU tensor can only be pickled while gpemu is patched "
            "(torch.save writes its placeholder values)"
        )

    def __deepcopy__(self, memo: dict) -> EmuTensor:
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
        # An emulated op is the emulator's own host work (see TimeEngine.enter): the host's
        # emulated time is frozen from here to the op's return.
        fid = id(func)
        if fid == _DETACH:  # (hot inside autograd; a few attribute copies)
            return _detach(func, args, kwargs)
        special = _SPECIAL.get(fid)
        if special is not None:
            ts = _owner(args)
            host = ts.local.host if ts is not None and ts.local is not None else None
            if host is None or host.depth:
                return special(func, args, kwargs or {})
            host.entry = ts.read_clock()
            host.depth = 1
            try:
                return special(func, args, kwargs or {})
            finally:
                ts.leave()
        emus: list[EmuTensor] = []
        exact = fid in _FLOAT_SENSITIVE
        arg_sig = _sig(args, emus, exact)
        kw_sig = _sig_kw(kwargs, emus, exact) if kwargs else None
        ts = emus[0]._ts if emus else _state()
        # (one op's price differs between the passes: see backward_pass; and with the TF32 switches)
        key = (fid, arg_sig, kw_sig, _current_task() != -1 and backward_pass(ts), tf32_matmul(), tf32_cudnn())
        local = ts.local
        host = local.host if local is not None else None
        if host is None or host.depth:
            return _dispatch(ts, key, func, args, kwargs, emus)
        host.entry = ts.read_clock()
        host.depth = 1
        try:
            return _dispatch(ts, key, func, args, kwargs, emus)
        finally:
            ts.leave()


def _owner(args: tuple) -> TensorState | None:
    """The tensor state of the first emulated tensor among the first two arguments (a copy's
    source or destination), else the active run's (None when nothing is patched)."""
    for a in args[:2]:
        if isinstance(a, EmuTensor):
            return a._ts
    rt = current()
    return rt.tensors if rt is not None else None


def _dispatch(ts: TensorState, key: Any, func: Any, args: tuple, kwargs: dict | None, emus: list) -> Any:
    """One emulated op: output metadata from the cache, or the meta kernel the first time."""
    try:
        entry = ts.cache.get(key)
    except TypeError:  # an unhashable argument: no caching for this call
        key = entry = None
    if entry is None:
        return _slow_path(ts, func, args, kwargs or {}, key)
    return _fast_path(ts, entry, func, args, kwargs, emus)


_GRAD_GET = torch._C.TensorBase.grad.__get__
_GRAD_SET = torch._C.TensorBase.grad.__set__


def unhide_grad(t: torch.Tensor) -> None:
    """Before ``t``'s gradient changes: if it is a share of a hidden group (see EmuTensor.grad),
    detach the whole group for real; if of a live one, mark the group exposed."""
    g = _GRAD_GET(t)
    if g is not None:
        block = g.__dict__.get("_block")
        group = block.parent if block is not None else None
        if group is not None:
            if group.hidden:
                owner = group.owner() if group.owner is not None else None
                if owner is not None:
                    owner.materialize()
            else:
                group.exposed = True


def is_emulated(t: Any) -> bool:
    return isinstance(t, EmuTensor)


def device_index(device: Any) -> int | None:
    """Emulated device index for a CUDA device given as int/str/torch.device (the active run's
    current device for ``'cuda'``); None if it names no CUDA device."""
    rt = current()
    return cuda_index(device, rt.current_device if rt is not None else 0)


# ----------------------------------------------------------------------------------------------
# building tensors
# ----------------------------------------------------------------------------------------------
def _storage_nbytes(shape: tuple, stride: tuple, offset: int, itemsize: int) -> int:
    if 0 in shape:
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=False))
    return (offset + extent) * itemsize


def _from_meta(
    ts: TensorState, meta: torch.Tensor, dev: int, block: Any = None, requires_grad: bool = False
) -> EmuTensor:
    if block is None:
        nbytes = meta.untyped_storage().nbytes()
        block = ts.memory[dev].allocate(nbytes) if nbytes else None
    t = ts.wrap(meta.shape, meta.stride(), meta.storage_offset(), meta.dtype, dev, block, requires_grad)
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
    """A new, contiguous emulated tensor on the active run's ``device`` (counts its memory)."""
    ts = _state()
    return _from_meta(ts, torch.empty(shape, dtype=dtype, device=_META), ts.check(device), requires_grad=requires_grad)


def from_meta(ts: TensorState, meta: torch.Tensor, dev: int) -> EmuTensor:
    """A new emulated allocation with ``meta``'s metadata (ways in: emulated factories)."""
    return _from_meta(ts, meta, dev)


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


def _call_sig(args: Any, emus: list) -> tuple:
    out = []
    for a in args:
        c = a.__class__
        if c is EmuTensor:
            emus.append(a)
            k = a._key
            out.append((k[0], k[1], k[3], k[4]))  # (shape, stride, dtype, device): no offset
        elif c is list or c is tuple:
            out.append(_call_sig(a, emus))
        elif isinstance(a, torch.Tensor):
            if isinstance(a, EmuTensor):  # a subclass of ours (rare)
                emus.append(a)
                k = a._key
                out.append((k[0], k[1], k[3], k[4]))
            else:
                out.append(("host", a.device.type, a.shape, a.stride(), a.dtype))
        else:
            out.append(a)
    return tuple(out)


def _sig_kw(kwargs: dict, emus: list, exact: bool) -> tuple:
    return tuple((k, _sig((v,), emus, exact)) for k, v in kwargs.items())


def _float_sensitive() -> set:
    ops = set()
    for name in (
        "arange",
        "linspace",
        "logspace",
        "range",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "upsample_bilinear2d",
        "upsample_bicubic2d",
        "upsample_linear1d",
        "upsample_trilinear3d",
        "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d",
        "_upsample_bilinear2d_aa",
        "_upsample_bicubic2d_aa",
        "affine_grid_generator",
    ):
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            ops.add(id(getattr(packet, overload)))
    return ops


_FLOAT_SENSITIVE = _float_sensitive()  # a per-process constant: ids of torch's op singletons


# ----------------------------------------------------------------------------------------------
# the cache entry and the two paths
# ----------------------------------------------------------------------------------------------
# How an op's result values relate to its inputs' (_Entry.values; see gpemu.hostvalues).
_FROM_INPUTS, _RANDOM, _INDEPENDENT = 0, 1, 2


class _Entry:
    __slots__ = ("kind", "specs", "treespec", "cost", "price", "name", "out_dev", "values")

    def __init__(self) -> None:
        self.kind = 0  # 0: one tensor, 1: list/tuple of tensors, 2: None, 3: other tree
        self.specs: list = []  # per output leaf: (shape, stride, offset, dtype, nbytes, alias, write)
        self.treespec: Any = None
        self.cost = 0.0  # GPU seconds (price.gpu)
        self.price: Any = None  # gpemu.costs.OpPrice (None: cost only)
        self.name = ""
        self.out_dev: int | None = None
        self.values = _FROM_INPUTS


def _fast_path(ts: TensorState, entry: _Entry, func: Any, args: tuple, kwargs: dict | None, emus: list) -> Any:
    dev = entry.out_dev if entry.out_dev is not None else emus[0]._dev
    kind = entry.kind
    if kind == 0:
        out = ts.build(entry.specs[0], emus, dev)
    elif kind == 2:
        out = None
    else:
        leaves = [ts.build(s, emus, dev) for s in entry.specs]
        out = tree_unflatten(leaves, entry.treespec) if kind == 3 else entry.treespec(leaves)
    ts._charge_entry(entry, dev)
    if entry.values == _INDEPENDENT:
        _propagate_shadow(func, args, kwargs or {}, emus, out, _INDEPENDENT)
    else:
        for e in emus:
            if e._shadow is not None:
                _propagate_shadow(func, args, kwargs or {}, emus, out, entry.values)
                break
    return out


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


def _slow_path(ts: TensorState, func: Any, args: tuple, kwargs: dict, key: Any) -> Any:
    handler = ts.op_handlers.get(id(func)) if ts.op_handlers else None
    if handler is not None:
        # Another component's emulation (a collective meeting other ranks): its time counts.
        engine = ts.engine
        depth = engine.suspend() if engine is not None else 0
        try:
            return handler(func, args, kwargs)
        finally:
            if depth:
                engine.resume(depth)
    margs, mkw, emus, out_dev = _to_meta_args(ts, func, args, kwargs)
    if not emus and out_dev is None:
        return func(*args, **kwargs)
    dev = out_dev if out_dev is not None else emus[0]._dev
    if out_dev is not None and (kwargs.get("device") is not None):
        mkw["device"] = _META
    try:
        mout = func(*margs, **mkw)
    except (NotImplementedError, RuntimeError) as exc:
        # A composite op reaches dispatch undecomposed when called below autograd (inside another
        # tensor subclass's dispatch, e.g. DTensor's): its parts know what to do (is_nonzero -> item).
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return _data_dependent(ts, func, args, kwargs, margs, mkw, emus, dev, exc)

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
    if func in hostvalues.VALUE_INDEPENDENT_OPS:
        entry.values = _INDEPENDENT
    elif torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        entry.values = _RANDOM
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
                    "support; use the out-of-place form (e.g. x = x.unsqueeze(0) instead of x.unsqueeze_(0))"
                )
            if alias is None:
                alias = storages.get(leaf.untyped_storage()._cdata)
                write = False
            nbytes = 0 if alias is not None else leaf.untyped_storage().nbytes()
            spec = (leaf.shape, leaf.stride(), leaf.storage_offset(), leaf.dtype, nbytes, alias, write)
            entry.specs.append(spec)
            if alias is None:
                t = _from_meta(ts, leaf, dev)
            elif write:
                t = emus[alias]
            else:
                t = ts.wrap(
                    leaf.shape, leaf.stride(), leaf.storage_offset(), leaf.dtype, emus[alias]._dev, emus[alias]._block
                )
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
    entry.price = _op_price(ts, func, margs, mkw, mout, dev)
    entry.cost = entry.price.gpu if entry.price is not None else 0.0
    if cacheable:
        if len(ts.cache) >= _CACHE_LIMIT:
            ts.cache.clear()
        ts.cache[key] = entry
    ts._charge_entry(entry, dev)
    if entry.values == _INDEPENDENT or any(e._shadow is not None for e in emus):
        _propagate_shadow(func, args, kwargs, emus, out, entry.values)
    return out


def _op_price(ts: TensorState, func: Any, margs: Any, mkw: dict, mout: Any, dev: int) -> Any:
    """What one op costs (:class:`gpemu.costs.OpPrice`; computed once per signature, then cached),
    None when nothing prices it."""
    from .costs import op_price

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
    known = bool(emus) and all(e._shadow is not None for e in emus)
    host_args = _shadow_conv(list(args)) if known else None
    host_kw = {k: _shadow_conv(v) for k, v in kwargs.items()} if known else None
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
        return tree_unflatten([_host_to_emu(ts, x, dev) for x in leaves], spec)
    name = how.split(":", 1)[1]
    if name not in ts.warned:
        ts.warned.add(name)
        ts.say_once(
            f"{name} has a data-dependent output shape; emulated as if every element is selected "
            "(see docs/device.md, 'Ways back')"
        )
    if name == "boolean-mask assignment":
        emus[0]._shadow = None  # some of its values were overwritten by unknown ones
        if result is margs[0]:
            return emus[0]  # in place
    leaves, spec = tree_flatten(result)
    return tree_unflatten([_from_meta(ts, m, dev) if isinstance(m, torch.Tensor) else m for m in leaves], spec)


# ----------------------------------------------------------------------------------------------
# host shadows (known small values): the mechanics behind gpemu.hostvalues' policy
# ----------------------------------------------------------------------------------------------
def host_shadow(t: Any) -> torch.Tensor | None:
    """The known host value of a small emulated tensor (see :mod:`gpemu.hostvalues`), or None
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
    if (
        value is None
        or not isinstance(value, torch.Tensor)
        or value.numel() != t.numel()
        or t.numel() > SHADOW_MAX_ELEMENTS
    ):
        t._shadow = None
        return False
    t._shadow = value.detach().to("cpu", t.dtype).reshape(t.shape).clone()
    t._ts.shadow_writes += 1
    return True


def _propagate_shadow(func: Any, args: tuple, kwargs: dict, emus: list, out: Any, values: int) -> None:
    """Give the op's emulated outputs their values computed on the host from the inputs' known
    values (``values``: how the result relates to the inputs, see ``_Entry``)."""
    independent = values == _INDEPENDENT
    if values == _RANDOM or (not independent and any(e._shadow is None for e in emus)):
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
    conv = _zeros_conv if independent else _shadow_conv
    sargs = conv(list(args))
    skw = {k: conv(v) for k, v in kwargs.items()}
    try:
        with torch.no_grad():
            sout = func(*sargs, **skw)
    except Exception:
        _drop_written_shadows(out, emus)
        return
    souts, _ = tree_flatten(sout)
    if len(outs) != len(souts):
        return
    for o, s in zip(outs, souts, strict=False):
        if isinstance(o, EmuTensor) and isinstance(s, torch.Tensor):
            if s.shape == o.shape and s.numel() <= SHADOW_MAX_ELEMENTS and s.dtype == o.dtype:
                o._shadow = s
                if any(o is e for e in emus):  # an input got it (in place)
                    o._ts.shadow_writes += 1
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


def _host_to_emu(ts: TensorState, x: Any, dev: int) -> Any:
    """An emulated tensor (with its shadow) from a real CPU result computed on shadows."""
    if isinstance(x, torch.Tensor):
        e = _from_meta(ts, torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META), dev)
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


def _zeros_conv(a: Any) -> Any:
    """As :func:`_shadow_conv`, with an unknown value as zeros (for ops that do not read values)."""
    if isinstance(a, EmuTensor):
        return hostvalues.host_values(a.shape, a.dtype, a._shadow)
    if isinstance(a, (list, tuple)):
        return type(a)(_zeros_conv(x) for x in a)
    if isinstance(a, torch.device) and a.type in ("cuda", "meta"):
        return _CPU
    return a


def host_args(args: tuple) -> tuple:
    """``args`` with each emulated tensor replaced by its known values, or zeros when unknown
    (what a factory computing on emulated inputs sees on the host)."""
    return tuple(hostvalues.host_values(a.shape, a.dtype, a._shadow) if isinstance(a, EmuTensor) else a for a in args)


# ----------------------------------------------------------------------------------------------
# special ops: item, device changes, copies
# ----------------------------------------------------------------------------------------------
def _sync(ts: TensorState, dev: int, reason: str) -> None:
    engine = ts.engine
    if engine is not None:
        engine.synchronize(dev, reason)


def _settle(ts: TensorState) -> None:
    # The host time between the sync's wait and returning to the program was the emulator's.
    engine = ts.engine
    if engine is not None:
        engine.settle()


def _local_scalar_dense(func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    ts = t._ts
    _sync(ts, t._dev, "item")
    if t.numel() != 1:
        raise RuntimeError(f"a Tensor with {t.numel()} elements cannot be converted to Scalar")
    value = hostvalues.scalar_value(t.dtype, t._shadow)
    _settle(ts)
    return value


def to_host(t: EmuTensor, reason: str = "cpu") -> torch.Tensor:
    """Bring an emulated tensor back: wait for its device, charge the copy, give placeholder
    values (its shadow when known, else zeros; see :mod:`gpemu.hostvalues`)."""
    ts = t._ts
    _sync(ts, t._dev, reason)
    transfers = ts.rt.transfers
    if transfers is not None and reason == "cpu":
        transfers.copy_to_host(t, t._dev)
    values = hostvalues.host_values(t.shape, t.dtype, t._shadow)
    _settle(ts)
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
    ts = t._ts
    idx = ts.device_index(d) if d is not None else None
    kw = dict(kwargs)
    kw.pop("device", None)
    out = _generic(ts, func, args, kw)
    if idx is not None and idx != out._dev:
        return peer_copy(out, idx)
    return out


def _generic(ts: TensorState, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` through the normal cached path (used by special handlers)."""
    emus: list = []
    try:
        key = (
            id(func),
            _sig(args, emus, False),
            _sig_kw(kwargs, emus, False) if kwargs else None,
            backward_pass(ts),
            tf32_matmul(),
            tf32_cudnn(),
        )
        entry = ts.cache.get(key)
    except TypeError:
        key, entry = None, None
    if entry is None:
        return _slow_path(ts, func, args, kwargs, key)
    return _fast_path(ts, entry, func, args, kwargs, emus)


def _copy_(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if not isinstance(dst, EmuTensor):
        # device -> host copy into an existing CPU tensor: a sync point with placeholder values.
        values = to_host(src, reason="cpu")
        with torch.no_grad():
            dst.copy_(values)
        return dst
    ts = dst._ts
    ts.shadow_writes += 1  # (dst's value may become known below)
    if not isinstance(src, EmuTensor):
        if isinstance(src, torch.Tensor) and src.dim() > 0 and src.device.type == "cpu":
            _charge_h2d(ts, src, dst._dev, bool(kwargs.get("non_blocking", False) or (len(args) > 2 and args[2])))
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
    return _generic(ts, func, args, kwargs)


def _non_finite_check(func: Any, args: tuple, kwargs: dict) -> Any:
    # Policy: emulated gradients are finite, found_inf keeps its value (see hostvalues).
    return None


def _amp_update_scale(func: Any, args: tuple, kwargs: dict) -> Any:
    scale = args[0]
    emus = [a for a in args if isinstance(a, EmuTensor)]
    if emus and all(e._shadow is not None for e in emus):
        func(*_shadow_conv(list(args)), **{k: _shadow_conv(v) for k, v in kwargs.items()})
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
    out._ts = t._ts
    return out


_DETACH = id(aten.detach.default)
_SPECIAL: dict[int, Callable] = {
    id(op): handler
    for op, handler in {
        aten._local_scalar_dense.default: _local_scalar_dense,
        aten._to_copy.default: _to_copy,
        aten.copy_.default: _copy_,
        aten._amp_foreach_non_finite_check_and_unscale_.default: _non_finite_check,
        aten._amp_update_scale_.default: _amp_update_scale,
    }.items()
}


# ----------------------------------------------------------------------------------------------
# host <-> emulated device copies
# ----------------------------------------------------------------------------------------------
def _charge_h2d(ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool, issued_at: float | None = None) -> None:
    transfers = ts.rt.transfers
    if transfers is not None:
        transfers.copy_to_device(t, dev, non_blocking, issued_at)


def _emulate_plain(ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool) -> EmuTensor:
    """``t`` (a host tensor that needs no gradient) copied onto emulated device ``dev``: an
    emulator entry (the copy is issued when the program asked for it; the emulator's own time
    around it, before and after the wait of a pageable copy, is forgiven)."""
    local = ts.local
    host = local.host if local is not None else None
    if host is None or host.depth:
        return _copy_in(ts, t, dev, non_blocking)
    host.entry = ts.read_clock()
    host.depth = 1
    try:
        return _copy_in(ts, t, dev, non_blocking)
    finally:
        ts.leave()


def _copy_in(ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool) -> EmuTensor:
    transfers = ts.rt.transfers
    if transfers is None or transfers.moving_model or t.is_meta:
        # Part of a whole-model move (charged once for the model), no transfers component, or
        # a meta tensor: autograd's zeros for an unused output of a custom Function are made on
        # the meta device (an emulated tensor's C++ device), where a real GPU would make them
        # on the device itself: moving one onto the device copies nothing.
        # Model parameters/buffers get no shadows: their values are not what host code reads
        # back, and a shadow would add a host op to every step of the optimizer.
        if t.is_contiguous() or _non_overlapping_dense(t):
            stride = t.stride()
        else:
            stride = torch.empty(t.shape, device=_META).stride()
        nbytes = t.numel() * t.element_size()
        block = ts.memory[dev].allocate(nbytes) if nbytes else None
        e = ts.wrap(t.shape, stride, 0, t.dtype, dev, block)
        if transfers is None:
            e._shadow = _small_shadow(t)
        return e
    plan = transfers.copy_plan(t, dev, non_blocking)
    nbytes = plan.nbytes
    block = ts.memory[dev].allocate(nbytes) if nbytes else None  # (an OOM changes nothing)
    if nbytes:  # (torch copies nothing for an empty tensor: no transfer, no wait)
        transfers.charge(plan, dev)
    e = ts.wrap(plan.shape, plan.stride, 0, plan.dtype, dev, block)
    if plan.host and plan.numel <= SHADOW_MAX_ELEMENTS:
        e._shadow = t.detach().clone()  # the copy's values, known on the host (gpemu.hostvalues)
    return e


def _non_overlapping_dense(t: torch.Tensor) -> bool:
    try:
        return torch._C._is_non_overlapping_and_dense(t)  # type: ignore[attr-defined]
    except Exception:
        return False


class _ToDevice(torch.autograd.Function):
    """Host -> emulated copy that keeps autograd (grads flow back as host placeholders)."""

    @staticmethod
    def forward(ctx: Any, ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool) -> EmuTensor:  # type: ignore[override]
        ctx.host_dtype = t.dtype
        return _emulate_plain(ts, t.detach(), dev, non_blocking)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        host = to_host(grad) if isinstance(grad, EmuTensor) else grad
        return None, host.to(ctx.host_dtype), None, None


def to_emulated(t: torch.Tensor, device: int, non_blocking: bool = False) -> EmuTensor:
    """Copy a host tensor onto the active run's emulated GPU ``device``: counts memory, charges
    transfer time, keeps a shadow of small values. Keeps autograd when ``t`` requires grad."""
    ts = t._ts if isinstance(t, EmuTensor) else _state()
    dev = device if device.__class__ is int and device in ts.ordinals else ts.check(device)
    if isinstance(t, EmuTensor):
        return t if t._dev == dev else peer_copy(t, dev)
    if t.requires_grad and torch.is_grad_enabled():
        return _ToDevice.apply(ts, t, dev, non_blocking)
    return _emulate_plain(ts, t.detach() if t.requires_grad else t, dev, non_blocking)


def peer_copy(t: EmuTensor, idx: int) -> EmuTensor:
    """A copy of ``t`` on another emulated GPU (counted there). GPU-to-GPU copy time is not
    charged (documented limitation)."""
    ts = t._ts
    idx = ts.check(idx)
    nbytes = t.numel() * t.element_size()
    stride = (
        t.stride() if (t.is_contiguous() or _non_overlapping_dense(t)) else torch.empty(t.shape, device=_META).stride()
    )
    out = ts.wrap(t.shape, stride, 0, t.dtype, idx, ts.memory[idx].allocate(nbytes) if nbytes else None)
    if t._shadow is not None:
        out._shadow = t._shadow.clone()
    return out


class PeerCopy(torch.autograd.Function):
    """:func:`peer_copy` that keeps autograd (the gradient goes back to the source device)."""

    @staticmethod
    def forward(ctx: Any, t: EmuTensor, idx: int) -> EmuTensor:  # type: ignore[override]
        ctx.src = t._dev
        return peer_copy(t, idx)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:  # type: ignore[override]
        return peer_copy(grad, ctx.src), None


# torch's legacy type names (``x.type()`` -> "torch.cuda.FloatTensor").
TYPE_NAMES = {
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "LongTensor": torch.int64,
    "IntTensor": torch.int32,
    "ShortTensor": torch.int16,
    "CharTensor": torch.int8,
    "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TYPE_NAMES.items()}


# ----------------------------------------------------------------------------------------------
# install
# ----------------------------------------------------------------------------------------------
def install(rt: Runtime) -> None:
    """The run's tensor state (``rt.tensors``). The ways in that hand out emulated tensors are
    :mod:`gpemu.ways_in`."""
    rt.tensors = TensorState(rt)
