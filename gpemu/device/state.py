"""The emulated tensor type's per-run state (:class:`TensorState`, ``rt.tensors``): building
emulated tensors, charging their ops' GPU time, cost taps, and the doors other modules use.

Every emulated tensor points to the state of the run that made it (as a fake tensor points to its
mode), so dispatch finds its run from its inputs without any module-level state. Other modules
read an emulated tensor's public fields (``emu_device``, ``emu_block``, ``emu_shadow``,
``emu_key``, ``emu_state``; see :class:`gpemu.device.emutensor.EmuTensor`) and change them only
through this class's methods (:meth:`TensorState.forget_value`, :meth:`TensorState.set_block`,
:meth:`TensorState.release`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..devices import cuda_index
from ..hostvalues import SHADOW_MAX_ELEMENTS
from ..runtime import current
from .emutensor import EmuTensor
from .signature import call_signature as _call_signature
from .signature import signature as _signature
from .values import ValueMode

if TYPE_CHECKING:  # pragma: no cover
    from ..memory import MemoryTracker
    from ..runtime import Runtime
    from ..time import TimeEngine
    from .ops import OpEntry

__all__ = [
    "TensorState",
    "CostTap",
    "OwnNodes",
    "OutputSpec",
    "backward_pass",
    "contiguous_stride",
    "current_state",
    "cache_info",
    "device_index",
    "from_meta",
    "meta_of",
    "as_meta",
]

_make_wrapper = torch.Tensor._make_wrapper_subclass
_META = torch.device("meta")
_inference_mode = torch.is_inference_mode_enabled


class OutputSpec(NamedTuple):
    """One output of an op, as the op cache keeps it (:meth:`TensorState.build` makes it again):
    a new allocation of ``nbytes`` (``alias`` None), a view of input ``alias``, or that input
    itself (``write``: in place). A non-tensor output is kept as is in ``shape`` (dtype None)."""

    shape: Any
    stride: Any
    offset: int | torch.SymInt
    dtype: torch.dtype | None
    nbytes: int
    alias: int | None
    write: bool | None


class CostTap:
    """What :meth:`TensorState.cost_tap` yields: ``seconds``, the GPU time of the ops dispatched
    inside (each op's own cost, also where a whole-module charge covers it), and ``charged``, the
    part of it that was charged on its own (outside any such cover).

    It also runs the cost model's pass arithmetic over the same ops (:class:`gpemu.costs.OpPrice`):
    ``pass_seconds``, the ops as one pass of a real program started on an idle GPU (each op issued
    after the host time the calibration hosts took for it, the GPU running them in order: host and
    GPU overlapped; how the database timed a model's forward and backward),
    and ``reference_seconds``, the same pass priced as the profile database measured (fp32 on the
    device's reference GPU, each op issued after the calibration hosts' time even when a host is
    modelled: the database's times hold that host) — their ratio carries a measured model's time to
    this GPU, precision and host.
    Work charged as a span (a replayed unit) counts as GPU time at both prices. ``mix``: GPU
    seconds per kind of work of the priced ops, ``precisions``: per dtype (the cost model's
    uncertainty depends on both). With a host model (:mod:`gpemu.time.launch`) each op is issued
    after the modelled host's issue time instead of the calibration hosts', and ``issue`` sums
    it: what a charge standing for these ops (a replay, a measured module) costs the host
    (``issue_paid``: the part ops charged on their own have paid already)."""

    __slots__ = (
        "seconds",
        "charged",
        "mix",
        "precisions",
        "issue",
        "issue_paid",
        "_host",
        "_host_ref",
        "_finish",
        "_finish_ref",
        "own",
        "ops",
    )

    def __init__(self) -> None:
        # When a list: each op as (GPU seconds, host seconds, its priced OpFeatures or None), in
        # order (a recording that prices the same ops again at other sizes).
        self.ops: list | None = None
        # ``own``: for a module's backward window, which ops are its own (:class:`OwnNodes`);
        # None: every op charged while the tap is open.
        self.own: OwnNodes | None = None
        self.seconds = 0.0
        self.charged = 0.0
        self.mix: dict[str, float] = {}
        self.precisions: dict[str, float] = {}  # GPU seconds per dtype of the priced ops
        self._host = 0.0  # host issue time so far (the queue's host side)
        self._host_ref = 0.0  # the same at the calibration hosts' issue times (the reference pass)
        # The modelled host's issue time of the priced ops (gpemu.time.launch; 0 without one):
        # what a charge standing for them costs the program's host.
        self.issue = 0.0
        self.issue_paid = 0.0  # the part of it already charged (ops charged on their own)
        self._finish = 0.0  # when the pass's GPU work ends, at this GPU and precision
        self._finish_ref = 0.0  # the same at the reference price

    def add(self, gpu: float, host: float, reference: float, reference_host: float) -> None:
        """One op of ``gpu`` kernel seconds, issued after ``host`` seconds of host work;
        ``reference``: its kernel seconds at the reference price, issued after ``reference_host``
        (the calibration hosts' time: how the database measured it, whatever host is modelled)."""
        self._host = h = self._host + host
        self._finish = (h if h > self._finish else self._finish) + gpu
        self._host_ref = h = self._host_ref + reference_host
        self._finish_ref = (h if h > self._finish_ref else self._finish_ref) + reference

    @property
    def pass_seconds(self) -> float:
        return self._finish

    @property
    def reference_seconds(self) -> float:
        return self._finish_ref


def issue_seconds(engine: Any, price: Any) -> float:
    """The modelled host's time to issue an op priced ``price`` (0 without a host model): an op
    of a backward pass is issued by autograd's engine, at the host's backward figure."""
    issue = engine.op_issue_s  # (0.0 without a host model: the usual case, decided first)
    if issue and price is not None and price.op is not None and price.op.backward:
        return engine.backward_issue_s
    return issue


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
    pass on this thread (or the engine-free backward of gpemu.fastpaths.backward runs torch's
    nodes itself), and it is not a module's forward recomputed inside it. The cost model was
    calibrated so (gpemu.costmodel.record marks every op of ``loss.backward()``), and its
    ``.bwd`` curves price such ops whatever their name (autograd's ``mm``, ``add``, ``clone``)."""
    return (_current_task() != -1 or ts.local.host.direct_backward) and not getattr(ts.recompute, "depth", 0)


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


def _never() -> bool:
    return False


class TensorState:
    """The emulated tensor type's per-run state (``rt.tensors``), and the fast paths' interface
    to it: :meth:`wrap`, :meth:`new`, :meth:`signature`, :meth:`build`, :meth:`charge`, :meth:`cost_tap`, the
    run's ``memory`` trackers and ``engine``, and the generation counters below."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.engine: TimeEngine = rt.engine
        # The engine's per-thread state (``.host``), clock and emulator entries (gpemu.time.host).
        self.local = rt.engine.local
        self.read_clock = rt.engine.read_clock
        self.leave = rt.engine.leave
        self.call = rt.engine.call
        self.ordinals = frozenset(range(rt.num_devices))  # valid device indices (ints)
        self.memory: list[MemoryTracker] = rt.memory
        self.cache: dict = {}  # op signature and pass (see backward_pass) -> OpEntry
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
        # Whether the calling thread is inside a model's forward (set by gpemu.model_time): the
        # program's own logic on placeholders runs outside it (gpemu.device.shadows).
        self.in_model: Callable[[], bool] = _never
        # Value mode (gpemu.device.values): every tensor's values, however large; None with
        # placeholder values, where only small known values are kept (gpemu.hostvalues).
        self.values: ValueMode | None = ValueMode(rt) if rt.config.real_values else None
        self.shadow_limit = sys.maxsize if self.values is not None else SHADOW_MAX_ELEMENTS
        # Host results of ops over large placeholders (zeros stand in), by op, shapes and known
        # values: the same every time (gpemu.device.shadows).
        self.placeholder_results: dict[tuple, list] = {}
        # A compiled region's op receiver (gpemu.fusion.FusionRegion) while torch.compile'd code
        # runs: ``op(entry, dev, args, out)`` charges cached ops as the compiler's fused kernels
        # instead of one by one. None: every op charged as it runs.
        self.fusion: Any = None

    # -------------------------------------------------------------- building
    def wrap(
        self,
        shape: Any,
        stride: Any,
        offset: int | torch.SymInt,
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
            "emu_device": dev,
            "emu_block": block,
            "emu_meta": None,
            "emu_shadow": None,
            "emu_key": (tuple(shape), tuple(stride), offset, dtype, dev),
            "emu_state": self,
        }
        return t

    def alias(self, t: EmuTensor) -> EmuTensor:
        """A new wrapper over ``t``'s memory with its metadata and its values (not an autograd
        view: a custom Function's output the program may modify in place)."""
        out = self.wrap(t.shape, t.stride(), t.storage_offset(), t.dtype, t.emu_device, t.emu_block)
        out.emu_shadow = t.emu_shadow
        return out

    def new(self, shape: tuple, dtype: torch.dtype, dev: int) -> EmuTensor:
        """A new contiguous emulated tensor of ``shape`` with its memory allocated on ``dev`` (a
        kernel's output or gradient the emulator makes itself)."""
        numel = 1
        for n in shape:
            numel *= n
        block = self.memory[dev].allocate(numel * dtype.itemsize)
        return self.wrap(shape, contiguous_stride(shape), 0, dtype, dev, block)

    def build(self, spec: OutputSpec, emus: list, dev: int) -> Any:
        """An op output from its cached :class:`OutputSpec`: a new allocation, a view of input
        ``emus[spec.alias]``, or that input itself (in place)."""
        shape, stride, offset, dtype, nbytes, alias, write = spec
        if alias is None:
            if dtype is None:
                return shape
            block = self.memory[dev].allocate(nbytes) if nbytes else None
            return self.wrap(shape, stride, offset, dtype, dev, block)
        src = emus[alias]
        if write:
            return src
        if _inference_mode():  # (see view; outside inference mode it is the wrap below)
            return self.view(src, shape, stride, offset, src.dtype if dtype is None else dtype)
        return self.wrap(shape, stride, offset, src.dtype if dtype is None else dtype, src.emu_device, src.emu_block)

    def view(
        self, src: EmuTensor, shape: Any, stride: Any, offset: int | torch.SymInt, dtype: torch.dtype
    ) -> EmuTensor:
        """A view of ``src`` (its memory block, this metadata).

        Inside ``inference_mode`` a view of a tensor made outside it is a normal tensor sharing its
        base's version counter (a CUDA view's TensorImpl inherits its base's keys); a wrapper made
        there would be an inference tensor, which autograd's view bookkeeping refuses."""
        if _inference_mode() and not src.is_inference():
            with torch.inference_mode(False):
                return self.wrap(shape, stride, offset, dtype, src.emu_device, src.emu_block)
        return self.wrap(shape, stride, offset, dtype, src.emu_device, src.emu_block)

    @staticmethod
    def spec_of(t: EmuTensor) -> OutputSpec:
        """``t``'s metadata as an output spec for :meth:`build` (a new allocation of its size)."""
        return OutputSpec(
            tuple(t.shape),
            t.stride(),
            t.storage_offset(),
            t.dtype,
            t.emu_block.size if t.emu_block is not None else 0,
            None,
            False,
        )

    @staticmethod
    def signature(args: Any, emus: list, exact: bool) -> tuple:
        """The op-cache signature of ``args`` (a tuple); appends each emulated tensor met to
        ``emus``; ``exact``: floats by value, not by type. Raises TypeError for arguments that
        cannot be part of a key."""
        return _signature(args, emus, exact)

    # :meth:`signature` (floats by value) for a module call: emulated tensors by shape, strides,
    # dtype and device, not by where they sit in their storage (``source[i:i+35]`` batches of one
    # long tensor are the same call). The function itself: one call level less per module call.
    call_signature = staticmethod(_call_signature)

    # -------------------------------------------------------------- charging
    def charge(self, seconds: float, dev: int, name: str, price: Any = None) -> None:
        """Charge ``seconds`` of GPU work named ``name`` on ``dev``'s current stream, unless a
        whole-module or optimizer charge already covers it (fast paths that replay several ops as
        one charge). Open cost taps of this thread count it (``price``: its
        :class:`gpemu.costs.OpPrice` when it is one op the cost model priced)."""
        if seconds > 0:
            engine = self.engine
            charged = not engine.in_charged_scope
            if self._taps:
                self._tap(seconds, charged, price)
            if charged:
                issue = engine.op_issue_s and issue_seconds(engine, price)  # (0.0 without a host model)
                engine.stream(dev).enqueue(seconds, "op", name, 0, None, issue)

    def charge_span(
        self,
        seconds: float,
        dev: int,
        kind: str,
        name: str,
        at: float | None = None,
        issue: float = 0.0,
        kernels: float | None = None,
    ) -> None:
        """:meth:`charge` as a span of ``kind`` (``forward``, ``backward``): a replayed module's
        recorded time. ``at``: the host time it was issued, when earlier than now. ``issue``: the
        modelled host seconds of issuing the ops it stands for (the span's queue arithmetic
        already overlaps them with its kernels): the host spends them after the span starts.
        ``kernels``: the GPU's part of ``seconds`` (default all of it); with a modelled host the
        GPU runs only that (:meth:`gpemu.time.engine.TimeEngine.enqueue_pass`)."""
        if seconds > 0:
            engine = self.engine
            charged = not engine.in_charged_scope
            if self._taps:
                self._tap(seconds, charged, None)
                if issue and self._tap_owner == threading.get_ident():
                    for tap in self._taps:
                        tap.issue += issue
                        tap.issue_paid += issue if charged else 0.0
            if not charged:
                return
            if issue or engine.op_issue_s:
                engine.enqueue_pass(dev, seconds, seconds if kernels is None else kernels, kind, name, at, issue)
            else:  # (no modelled host and nothing to issue: the span is the whole pass, as enqueue_pass makes it)
                engine.stream(dev).enqueue(seconds, kind, name, 0, at)

    def charge_entry(self, entry: OpEntry, dev: int) -> None:
        """:meth:`charge` for a cached op (its cost and price kept on the entry)."""
        cost = entry.cost
        if cost:
            engine = self.engine
            charged = not engine.in_charged_scope
            if self._taps:
                self._tap(cost, charged, entry.price)
            if charged:
                issue = engine.op_issue_s and issue_seconds(engine, entry.price)  # (0.0 without a host model)
                engine.stream(dev).enqueue(cost, "op", entry.name, 0, None, issue)

    def _tap(self, cost: float, charged: bool, price: Any) -> None:
        if self._tap_owner == threading.get_ident():
            host, reference = (price.host, price.reference) if price is not None else (0.0, cost)
            reference_host = host  # (the reference pass: as the database measured, on its hosts)
            issue = issue_seconds(self.engine, price) if price is not None else 0.0
            if issue:  # (a modelled host issues it, not the cost model's calibration hosts)
                host = issue
            for tap in self._taps:
                if tap.own is not None and not tap.own.running():
                    continue
                tap.seconds += cost
                if charged:
                    tap.charged += cost
                tap.add(cost, host, reference, reference_host)
                if issue:
                    tap.issue += issue
                    if charged:
                        tap.issue_paid += issue
                if tap.ops is not None:
                    tap.ops.append((cost, host, price.op if price is not None else None))
                if price is not None:
                    tap.mix[price.mix] = tap.mix.get(price.mix, 0.0) + cost
                    tap.precisions[price.precision] = tap.precisions.get(price.precision, 0.0) + cost

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

    # -------------------------------------------------------------- changing a tensor
    @staticmethod
    def forget_value(t: EmuTensor) -> None:
        """``t``'s values are unknown from now on (written by a kernel whose inputs were unknown)."""
        t.emu_shadow = None

    @staticmethod
    def set_known_value(t: EmuTensor, value: torch.Tensor | None) -> None:
        """``t``'s known host value is ``value`` (a host tensor of its shape and dtype, made by the
        caller), or unknown (None). :func:`gpemu.device.set_host_shadow` converts and checks."""
        t.emu_shadow = value

    @staticmethod
    def set_block(t: EmuTensor, block: Any) -> None:
        """``t`` now lives in memory ``block`` (a gradient given a share of a group's block)."""
        t.emu_block = block

    def resize_block(self, t: EmuTensor, nbytes: int) -> None:
        """``t``'s storage resized to ``nbytes`` (:class:`gpemu.device.storage.EmuStorage`): its
        block (shared by its views) freed or allocated anew; a tensor without one gets one."""
        block = t.emu_block
        if block is not None:
            block.resize(nbytes)
        elif nbytes > 0:
            t.emu_block = self.memory[t.emu_device].allocate(nbytes)

    @staticmethod
    def release(t: EmuTensor) -> None:
        """``t`` lets go of its memory and values (a wrapper kept for reuse)."""
        t.emu_block = None
        t.emu_shadow = None
        t.emu_meta = None

    # -------------------------------------------------------------- misc
    def say_once(self, message: str) -> None:
        self.rt.say_once(message)

    def check(self, idx: int) -> int:
        return self.rt.check_device(idx)

    def device_index(self, device: Any) -> int | None:
        """CUDA index of a device argument (current device for ``'cuda'``), None if not CUDA."""
        return cuda_index(device, self.rt.current_device)


def current_state() -> TensorState:
    """The active run's tensor state (public entry points that get no emulated tensor)."""
    rt = current()
    if rt is None:
        raise RuntimeError("gpemu is not patched: call gpemu.patch() before using emulated GPUs")
    return rt.tensors


def cache_info() -> dict[str, int]:
    """How many op signatures the active run's metadata cache holds (for benchmarks)."""
    return {"entries": len(current_state().cache)}


def device_index(device: Any) -> int | None:
    """Emulated device index for a CUDA device given as int/str/torch.device (the active run's
    current device for ``'cuda'``); None if it names no CUDA device."""
    rt = current()
    return cuda_index(device, rt.current_device if rt is not None else 0)


def storage_nbytes(shape: tuple, stride: tuple, offset: int | torch.SymInt, itemsize: int) -> int:
    if 0 in shape:
        return 0
    extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return int(offset + extent) * itemsize


def from_meta(
    ts: TensorState, meta: torch.Tensor, dev: int, block: Any = None, requires_grad: bool = False
) -> EmuTensor:
    """A new emulated tensor with ``meta``'s metadata on ``dev``: a new allocation of its
    storage's size unless ``block`` is given."""
    if block is None:
        nbytes = meta.untyped_storage().nbytes()
        block = ts.memory[dev].allocate(nbytes) if nbytes else None
    t = ts.wrap(meta.shape, meta.stride(), meta.storage_offset(), meta.dtype, dev, block, requires_grad)
    t.emu_meta = meta
    return t


def as_meta(t: EmuTensor) -> torch.Tensor:
    """A new meta tensor with ``t``'s shape, strides and dtype: what a GPU tensor's ``.to("meta")``
    or ``empty_like(t, device="meta")`` gives (no memory). Only the program's explicit requests
    come here: torch itself names the wrapper's own device, meta, for "the same device"."""
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=_META)


def meta_of(t: EmuTensor) -> torch.Tensor:
    """The meta tensor an op runs on (created lazily: cache hits never need one)."""
    m = t.emu_meta
    if m is None:
        shape, stride, offset = t.shape, t.stride(), t.storage_offset()
        size = storage_nbytes(tuple(shape), stride, offset, 1)
        base = torch.empty((max(size, offset),), dtype=t.dtype, device=_META)
        m = base.as_strided(shape, stride, offset)
        t.emu_meta = m
    return m
