"""Decode steps replayed by shape class: calls that change the state they are given (a KV cache)
and whose shapes differ only along one line (the cache length) are one unit.

A model called without autograd with a cache object (transformers' ``DynamicCache`` or
``StaticCache``, a server's own cache class) or with sizes that grow step by step cannot be
replayed by :mod:`gpemu.fastpaths.replay`'s exact-shape recordings: every decode step has a new
cache length, and a replay that skipped the call would skip what the call does to its cache
(append the new keys and values, advance a counter). This fast path records such calls op by op
and describes what each did (:class:`StepRecord`, over :mod:`gpemu.fastpaths.callstate`'s paths):

* the **plan**: which paths of its arguments it set, each to a tensor it made (new memory, or a
  view of an argument's memory), to another argument's tensor or object, to a number or a plain
  value; the known values it advanced (``cumulative_length += 1``); what it returned;
* the **numbers**: every size, stride, offset and Python int of its entry state and of that plan.

Two recordings with the same structure and plan whose numbers differ give a line: a third call
whose entry numbers lie on it, ``b + m x (b - a)`` for a whole ``m``, is predicted (sizes of the
tensors it makes, values it writes) and, once one more recording confirmed a prediction, replayed:
its outputs and state written from the plan at ``m``, memory allocated as the call would (an OOM
raises before anything changes), its time **priced by the cost model at its real sizes**: the
ops whose features change along the line (attention over the cache, the cache's copy) are an
affine :class:`gpemu.costmodel.table.OpTable` priced at ``m``, the others keep their recorded
price. Identical calls (a static cache: every step the same shapes) are a line of slope zero.

Only calls without autograd (generation and serving), without module hooks, of parameters that
are the recorded ones. A structure that gives no line after ``_GIVE_UP`` recordings runs op by
op from then on (said once).
"""

from __future__ import annotations

import weakref
from itertools import repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from gpemu import costs
from gpemu.costmodel.precision import tf32_cudnn, tf32_matmul
from gpemu.costmodel.table import affine_table
from gpemu.device import EmuTensor
from gpemu.memory import round_size
from gpemu.model_time import CallRecord

from .callstate import NUMBER, OBJECT, OPAQUE, PLAIN, TENSOR, CallShape, Leaf, Template, assign, scan

if TYPE_CHECKING:  # pragma: no cover
    from .replay import ReplayState

__all__ = ["ShapeClasses", "StepRecord", "ShapeClass", "class_call"]

_RECENT = 4  # recordings of one structure kept to find a line
_CLASSES = 8  # lines kept per structure (batch sizes of a server)
_GIVE_UP = 8  # recordings of one structure without a line: op by op from then on
_SAME_TIME = 1e-6  # relative: a prediction's price against the recording's


class StepRecord:
    """What one recorded call did (see the module docstring)."""

    __slots__ = ("shape", "plan", "numbers", "treespec", "ops", "fwd_seconds", "fwd_extra", "label", "params", "unit")

    def __init__(self, shape: CallShape, plan: tuple, numbers: list[int], treespec: Any) -> None:
        self.shape = shape
        self.plan = plan
        self.numbers = numbers
        self.treespec = treespec
        self.ops: list = []  # (GPU seconds, host seconds, OpFeatures | None) per op, in order
        self.fwd_seconds = 0.0
        self.fwd_extra = 0
        self.label = ""
        self.params: list = []
        self.unit = False  # a unit inside an op-by-op ancestor: priced by its kernels alone


class ShapeClass:
    """A line through two recordings ``a`` (at 0) and ``b`` (at 1): a call ``m`` steps past ``b``
    has entry numbers ``b + m (b - a)``, makes what the plan says at those numbers, and costs what
    its ops cost there."""

    __slots__ = ("a", "b", "entry", "entry_slope", "first", "plan", "plan_slope", "program", "_price", "_seconds")

    def __init__(self, a: StepRecord, b: StepRecord) -> None:
        self.a, self.b = a, b
        self.entry = np.array(b.shape.numbers, dtype=np.int64)
        self.entry_slope = self.entry - np.array(a.shape.numbers, dtype=np.int64)
        moving = np.flatnonzero(self.entry_slope)
        self.first = int(moving[0]) if len(moving) else -1  # a number that moves along the line
        self.plan = np.array(b.numbers, dtype=np.int64)
        self.plan_slope = self.plan - np.array(a.numbers, dtype=np.int64)
        self.program: _Program | None = None
        self._price: Any = None
        self._seconds: dict[int, float] = {}

    def step_of(self, numbers: list[int]) -> int | None:
        """``m`` for a call with these entry numbers, or None when they are not on the line."""
        base = self.b.shape.numbers
        if len(numbers) != len(base):
            return None
        if self.first < 0:
            return 0 if numbers == base else None
        m, r = divmod(numbers[self.first] - base[self.first], int(self.entry_slope[self.first]))
        if r or numbers != (self.entry + m * self.entry_slope).tolist():
            return None
        return m

    def numbers_at(self, m: int) -> list[int]:
        if not m:
            return self.b.numbers
        return (self.plan + m * self.plan_slope).tolist()

    def extra_at(self, m: int) -> int:
        return max(0, self.b.fwd_extra + m * (self.b.fwd_extra - self.a.fwd_extra))

    def seconds_at(self, rt: Any, dev: int, m: int) -> float:
        """The forward's GPU time ``m`` steps past ``b``: ``b``'s, plus what its varying ops cost
        more (or less) at their sizes there."""
        hit = self._seconds.get(m)
        if hit is not None:
            return hit
        if self._price is None:
            self._price = _Pricing(rt, dev, self.a, self.b)
        seconds = max(0.0, self.b.fwd_seconds + self._price.at(1 + m) - self._price.at(1))
        if len(self._seconds) > 4096:
            self._seconds.clear()
        self._seconds[m] = seconds
        return seconds

    def issue_seconds(self, rt: Any, dev: int) -> float:
        """The modelled host's time to issue the forward's ops (0 without a host model: the
        recorded host times are then the calibration hosts', priced in the pass)."""
        if not rt.engine.op_issue_s:
            return 0.0
        if self._price is None:
            self._price = _Pricing(rt, dev, self.a, self.b)
        return self._price.issue

    def kernel_seconds_at(self, rt: Any, dev: int, m: int) -> float:
        """The forward's kernels alone, back to back (a CUDA graph's replay: no launch gaps)."""
        if self._price is None:
            self._price = _Pricing(rt, dev, self.a, self.b)
        return float(self._price.kernels(1 + m).sum())


class _Pricing:
    """The ops of two recordings as GPU and host seconds at any point of their line: the ops
    whose features differ are an affine table priced by the cost model, the rest as recorded."""

    def __init__(self, rt: Any, dev: int, a: StepRecord, b: StepRecord) -> None:
        self.unit = b.unit
        self.g = np.array([op[0] for op in b.ops], dtype=float)
        self.h = np.array([op[1] for op in b.ops], dtype=float)
        self.issue = float(self.h.sum())
        self.ga = np.array([op[0] for op in a.ops], dtype=float)
        var = [i for i, (x, y) in enumerate(zip(a.ops, b.ops, strict=True)) if x[2] != y[2] or x[0] != y[0]]
        priced = [i for i in var if a.ops[i][2] is not None and b.ops[i][2] is not None]
        self.linear = np.array([i for i in var if i not in set(priced)], dtype=int)  # (no features: linear)
        self.priced = np.array(priced, dtype=int)
        self.table_at = None
        if priced:
            table = affine_table([a.ops[i][2] for i in priced], 0, [b.ops[i][2] for i in priced], 1)
            self.table_at = costs.table_pricer(rt, dev, table)

    def kernels(self, s: float) -> np.ndarray:
        """Each op's GPU seconds at ``s``."""
        g = self.g.copy()
        if len(self.linear):
            g[self.linear] = self.ga[self.linear] + s * (self.g[self.linear] - self.ga[self.linear])
        if self.table_at is not None:
            g[self.priced] = self.table_at(s)[0]
        return g

    def at(self, s: float) -> float:
        g = self.kernels(s)
        if self.unit or not len(g):
            return float(g.sum())
        # the ops as one queue (host issue, GPU in order): max over i of (host up to i + GPU from i)
        tail = np.cumsum(g[::-1])[::-1]
        return float(np.max(np.cumsum(self.h) + tail))


class _Structure:
    """The recordings and lines of one structure of a module's calls."""

    __slots__ = ("recent", "classes", "recorded", "gave_up")

    def __init__(self) -> None:
        self.recent: list[StepRecord] = []
        self.classes: list[ShapeClass] = []
        self.recorded = 0
        self.gave_up = False


class ShapeClasses:
    """The shape-class fast path of one run (``rt.replay.classes``)."""

    def __init__(self) -> None:
        self.modules: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()
        self.stats = {"recorded": 0, "replayed": 0, "lines": 0}
        # per module, its last call's walk and the structure it found: a decode loop's next call
        # reads its cache along the same walk and finds its structure without hashing it
        self.templates: weakref.WeakKeyDictionary[torch.nn.Module, Template] = weakref.WeakKeyDictionary()
        self.last: weakref.WeakKeyDictionary[torch.nn.Module, _Last] = weakref.WeakKeyDictionary()

    def read(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> CallShape | None:
        """The call's state: along the module's last walk when the structure is the same."""
        template = self.templates.get(module)
        shape = template.rescan(args, kwargs) if template is not None else None
        if shape is None:
            shape = scan(args, kwargs)
            if shape is not None and shape.template is not None:
                self.templates[module] = shape.template
        return shape

    def structure(self, module: torch.nn.Module, shape: CallShape, situation: tuple) -> _Structure | None:
        """The recordings and lines of this structure in this situation (None: not hashable)."""
        last = self.last.get(module)
        if last is not None and last.structure is shape.structure and last.situation == situation:
            return last.found
        key = (shape.structure, situation)
        try:
            hash(key)
        except TypeError:
            return None
        table = self.modules.get(module)
        if table is None:
            table = self.modules[module] = {}
        st = table.get(key)
        if st is None:
            if len(table) >= 64:
                table.clear()
            st = table[key] = _Structure()
        self.last[module] = _Last(shape.structure, situation, st)
        return st


class _Last(NamedTuple):
    """A module's last structure and situation, and what they found."""

    structure: tuple
    situation: tuple
    found: _Structure


def _situation(R: ReplayState, flags: tuple, dev: int, unit: bool) -> tuple:
    return (
        flags,
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        R.ts.param_generation,
        tf32_matmul(),
        tf32_cudnn(),
        dev,
        unit,
    )


def class_call(
    R: ReplayState,
    orig_call: Any,
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    dev: int,
    params: list,
    flags: tuple,
    t0: float | None,
    unit: bool,
) -> Any:
    """A call without autograd: replayed from its shape class when it lies on a confirmed line,
    else run op by op and recorded."""
    C = R.classes
    shape = C.read(module, args, kwargs)
    st = None if shape is None else C.structure(module, shape, _situation(R, flags, dev, unit))
    mt = R.model_time
    if st is None or shape is None:
        return mt.run_charged(orig_call, module, args, kwargs, dev, params, None, None, t0, open_children=True)
    for i, cls in enumerate(st.classes):
        m = cls.step_of(shape.numbers)
        if m is not None and _same_params(cls.b.params, params):
            if i:
                st.classes.insert(0, st.classes.pop(i))  # (the line in use first)
            return R.ts.call(_replay_step, R, cls, m, shape.values, dev, t0, not unit)
    if st.gave_up:
        return mt.run_charged(orig_call, module, args, kwargs, dev, params, None, None, t0, open_children=True)
    out, rec = _record(R, orig_call, module, args, kwargs, dev, params, t0, unit, shape)
    if rec is not None:
        _learn(R, st, rec, dev)
    return out


def _same_params(recorded: list, params: list) -> bool:
    return recorded is params or (len(recorded) == len(params) and all(map(is_, recorded, params)))


def _learn(R: ReplayState, st: _Structure, c: StepRecord, dev: int) -> None:
    """Keep recording ``c``; a line through two earlier recordings that predicts it is confirmed
    (kept as the line through the last of them and ``c``)."""
    C = R.classes
    C.stats["recorded"] += 1
    st.recorded += 1
    for b in reversed(st.recent):
        for a in [b, *st.recent]:
            if a.plan != c.plan or b.plan != c.plan or a.treespec != c.treespec:
                continue
            if a is not b and a.shape.numbers == b.shape.numbers:
                continue
            if _predicts(R, ShapeClass(a, b), c, dev):
                st.classes.insert(0, ShapeClass(b, c))
                del st.classes[_CLASSES:]
                st.recent.clear()
                C.stats["lines"] += 1
                R.rt.say_once(
                    f"{c.label}: calls without autograd that differ only along one line of sizes (a "
                    "KV cache's length) replayed as one shape class, priced at each call's sizes"
                )
                return
    st.recent.append(c)
    del st.recent[:-_RECENT]
    if st.recorded >= _GIVE_UP and not st.classes:
        st.gave_up = True
        R.rt.say_once(
            f"replay off for {c.label}: its calls without autograd change shape without a pattern "
            f"({_GIVE_UP} recordings, no line of sizes); running op by op (slower host side, same GPU time)"
        )


def _predicts(R: ReplayState, cls: ShapeClass, c: StepRecord, dev: int) -> bool:
    """Whether the line predicts recording ``c``: its entry on the line, the same plan numbers
    and sizes, its price within rounding."""
    if cls.a is cls.b:  # identical calls: the same again
        return c.shape.numbers == cls.b.shape.numbers and c.numbers == cls.b.numbers and _close(cls.b, c, 0, cls)
    if len(cls.a.ops) != len(c.ops) or len(cls.b.ops) != len(c.ops):
        return False
    if any(x[2] is None and (y[2] is not None) for x, y in zip(cls.a.ops, cls.b.ops, strict=True)):
        return False
    m = cls.step_of(c.shape.numbers)
    if m is None or cls.numbers_at(m) != c.numbers:
        return False
    try:
        return _close(cls.b, c, m, cls, R, dev)
    except ValueError:  # (the op sequences differ)
        return False


def _close(b: StepRecord, c: StepRecord, m: int, cls: ShapeClass, R: Any = None, dev: int = 0) -> bool:
    if [op[2] is None for op in b.ops] != [op[2] is None for op in c.ops]:
        return False
    if m == 0 or R is None:
        predicted = b.fwd_seconds
    else:
        predicted = cls.seconds_at(R.rt, dev, m)
    extra = cls.extra_at(m) if R is not None else b.fwd_extra
    return abs(predicted - c.fwd_seconds) <= _SAME_TIME * max(c.fwd_seconds, 1e-9) and abs(extra - c.fwd_extra) <= max(
        2048, c.fwd_extra // 100
    )


# ----------------------------------------------------------------------------------------------
# recording
# ----------------------------------------------------------------------------------------------
def _record(
    R: ReplayState,
    orig_call: Any,
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    dev: int,
    params: list,
    t0: float | None,
    unit: bool,
    shape: CallShape,
) -> tuple[Any, StepRecord | None]:
    """Run the call op by op; describe what it did (None when it cannot be replayed)."""
    ts = R.ts
    entry = shape.leaves
    shadows = {
        leaf.path: leaf.value.emu_shadow.clone()
        for leaf in entry
        if leaf.kind == TENSOR and isinstance(leaf.value, EmuTensor) and leaf.value.emu_shadow is not None
    }
    call = CallRecord()
    tap = ts.open_tap()
    tap.ops = []
    try:
        out = R.model_time.run_charged(orig_call, module, args, kwargs, dev, params, call, None, t0)
    finally:
        ts.close_tap(tap)
    leaves, treespec = tree_flatten(out)
    for x in leaves:  # (replayed outputs carry no known value; recorded ones must not either)
        if isinstance(x, EmuTensor):
            ts.forget_value(x)
    exit_state = scan(args, kwargs)
    if exit_state is None or call.label == "":
        return out, None
    described = _describe(entry, shadows, exit_state.leaves, leaves)
    if isinstance(described, str):
        return out, None
    plan, numbers = described
    # (without its leaves: a recording must not keep a call's cache alive)
    rec = StepRecord(CallShape([], shape.structure, shape.numbers), plan, numbers, treespec)
    rec.ops = tap.ops
    rec.fwd_seconds, rec.fwd_extra, rec.label = call.fwd_seconds, call.fwd_extra, call.label
    rec.params, rec.unit = params, unit
    return out, rec


class _Refs:
    """How the tensors a call left (in its arguments, in its outputs) come about: an argument's
    own tensor, a view of an argument's memory, or new memory (numbers appended as met)."""

    def __init__(self, entry: list[Leaf]) -> None:
        self.ids: dict[int, tuple] = {}
        self.blocks: dict[int, tuple] = {}
        for path, kind, v in entry:
            if kind in (TENSOR, OBJECT, OPAQUE):
                self.ids.setdefault(id(v), path)
            if kind == TENSOR and isinstance(v, EmuTensor) and v.emu_block is not None:
                self.blocks.setdefault(id(v.emu_block), path)
        self.new_tensors: dict[int, int] = {}
        self.new_blocks: dict[int, int] = {}
        self.numbers: list[int] = []

    def tensor(self, v: Any) -> tuple | None:
        path = self.ids.get(id(v))
        if path is not None:
            return ("entry", path)
        j = self.new_tensors.get(id(v))
        if j is not None:
            return ("same", j)
        if not isinstance(v, EmuTensor) or v.requires_grad:
            return None
        shape, stride, offset, dtype, _ = v.emu_key
        blk = v.emu_block
        if blk is None:
            base: tuple = ("none",)
        elif id(blk) in self.blocks:
            base = ("view", self.blocks[id(blk)])
        else:
            b = self.new_blocks.get(id(blk))
            if b is None:
                b = self.new_blocks[id(blk)] = len(self.new_blocks)
                self.numbers.append(_request(v))
            base = ("block", b)
        self.numbers.extend(shape)
        self.numbers.extend(stride)
        self.numbers.append(int(offset))
        j = self.new_tensors[id(v)] = len(self.new_tensors)
        return ("tensor", j, base, len(shape), dtype)

    def value(self, kind: int, v: Any) -> tuple | None:
        if kind == TENSOR:
            return self.tensor(v)
        if kind == NUMBER:
            self.numbers.append(v)
            return ("number",)
        if kind == PLAIN:
            return ("plain", v)
        path = self.ids.get(id(v))
        return ("entry", path) if path is not None else None


def _request(t: EmuTensor) -> int:
    """The bytes the op that made ``t``'s memory asked for, as far as ``t`` tells (its extent,
    when that rounds to its block's size; else the block's size)."""
    size = t.emu_block.size
    if t.numel() == 0:
        return size
    extent = (int(t.storage_offset()) + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * (
        t.dtype.itemsize
    )
    return extent if round_size(extent) == size else size


def _kind_of(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return TENSOR
    if x.__class__ is int:
        return NUMBER
    return PLAIN if isinstance(x, (bool, float, str, bytes, type(None), torch.dtype, torch.device)) else OBJECT


def _describe(entry: list[Leaf], shadows: dict, exit_state: list[Leaf], outs: list) -> tuple[tuple, list[int]] | str:
    """The plan and numbers of a recorded call (a reason when it cannot be replayed)."""
    refs = _Refs(entry)
    at = {leaf.path: leaf for leaf in entry}
    writes: list = []
    moved: list[tuple] = []  # paths of objects set whole (their insides are theirs)
    left = set()
    for path, kind, v in exit_state:
        left.add(path)
        if any(path[: len(p)] == p for p in moved):
            continue
        e = at.get(path)
        if e is not None and e.kind == kind and _same(kind, e.value, v):
            if kind == TENSOR and isinstance(v, EmuTensor):
                change = _value_change(path, shadows.get(path), v.emu_shadow)
                if change is not None:
                    writes.append(change)
            continue
        ref = refs.value(kind, v)
        if ref is None:
            return "the call leaves a new object or a tensor that needs a gradient in its arguments"
        writes.append(("set", path, ref))
        if kind == OBJECT:
            moved.append(path)
    if any(leaf.path not in left and not any(leaf.path[: len(p)] == p for p in moved) for leaf in entry):
        return "the call takes something out of its arguments"
    returned = [refs.value(_kind_of(x), x) for x in outs]
    if any(r is None for r in returned):
        return "the call returns an object it was not given"
    return (tuple(writes), tuple(returned)), refs.numbers


def _same(kind: int, a: Any, b: Any) -> bool:
    if kind in (TENSOR, OBJECT, OPAQUE):
        return a is b
    return a.__class__ is b.__class__ and a == b


def _value_change(path: tuple, before: torch.Tensor | None, after: Any) -> tuple | None:
    """How the call changed an argument tensor's known value: forgot it, made it known, or
    advanced it by a constant (``cumulative_length.add_(1)``)."""
    if before is None and after is None:
        return None
    if after is None:
        return ("forget", path)
    values = tuple(after.flatten().tolist())
    if before is None:
        return ("know", path, values)
    if torch.equal(before, after):
        return None
    if after.dtype.is_floating_point or after.dtype == torch.bool or after.dtype.is_complex:
        return ("know", path, values)
    return ("shift", path, tuple((after - before).flatten().tolist()))


# ----------------------------------------------------------------------------------------------
# replay
# ----------------------------------------------------------------------------------------------
def _replay_step(
    R: ReplayState, cls: ShapeClass, m: int, entry: list, dev: int, t0: float | None, outermost: bool
) -> Any:
    """The call ``m`` steps past its line's last recording (``entry``: its state's values, in its
    structure's order): its memory, its time, what it writes into its arguments and what it
    returns (``outermost``: the serving log's, which is told the bytes its cache holds)."""
    b = cls.b
    ts = R.ts
    program = cls.program
    if program is None:
        program = cls.program = _Program(b.plan, b.shape.structure)
    made = program.make(ts, entry, cls.numbers_at(m), dev)  # (all memory first: an OOM changes nothing)
    mem = ts.memory[dev]
    mem.touch(cls.extra_at(m))
    R.classes.stats["replayed"] += 1
    R.stats["replayed"] += 1
    # (captured into a CUDA graph: its kernels, which the graph's replays run back to back)
    captured = ts.engine.capture_here(dev) is not None
    seconds = cls.kernel_seconds_at(R.rt, dev, m) if captured else cls.seconds_at(R.rt, dev, m)
    if captured or not ts.engine.op_issue_s:
        ts.charge_span(seconds, dev, "forward", b.label, t0)
    else:  # (a modelled host issues its ops, the GPU runs its kernels: gpemu.time.engine.enqueue_pass)
        kernels = min(seconds, cls.kernel_seconds_at(R.rt, dev, m))
        ts.charge_span(seconds, dev, "forward", b.label, t0, cls.issue_seconds(R.rt, dev), kernels)
    program.write(entry, made)
    for i, change in program.changes:
        _change_value(ts, entry[i] if i >= 0 else None, change)
    mem.sample()
    if outermost:
        R.serving.held = program.held_bytes(entry, made)
    return tree_unflatten([made[ref] for ref in program.returned], b.treespec)


class _Program:
    """A plan compiled for replay against its structure (an entry value by its index there): the
    tensors to make (in the order the plan's numbers were recorded), then what to write where and
    what to return, as indices into what was made."""

    def __init__(self, plan: tuple, structure: tuple) -> None:
        writes, returned = plan
        self.index = {e[0]: i for i, e in enumerate(structure)}  # an entry path's index
        self.makes: list[tuple] = []  # (kind, block or view index, ndim, dtype, first number, new block)
        self.values: list[tuple] = []  # what each index of ``made`` is: ("make", i) / ("entry", i) / ...
        self.refs: dict[Any, int] = {}
        self.count = 0  # numbers read so far
        sets = [(self.index[w[1][:-1]], w[1][-1], self._ref(w[2])) for w in writes if w[0] == "set"]
        # attributes set with setattr (an object's ".name"), items through assign (in order)
        self.attrs = [(i, step[1:], ref) for i, step, ref in sets if isinstance(step, str) and step.startswith(".")]
        self.items = [w for w in sets if not (isinstance(w[1], str) and w[1].startswith("."))]
        self.attr_objects = [i for i, _, _ in self.attrs]
        self.attr_names = [name for _, name, _ in self.attrs]
        self.attr_refs = [ref for _, _, ref in self.attrs]
        self.changes = [(self.index.get(w[1], -1), w) for w in writes if w[0] != "set"]
        self.returned = [self._ref(r) for r in returned]
        # entry tensors inside object arguments the call left, and what it put there
        written = [w[1] for w in writes if w[0] == "set"]
        self.kept = [
            i
            for i, e in enumerate(structure)
            if e[1] == TENSOR and len(e[0]) > 2 and not any(e[0][: len(w)] == w for w in written)
        ]
        self.stored = [ref for i, _, ref in sets if len(structure[i][0]) >= 2]
        self.only_made = self.values == [("make", j) for j in range(len(self.makes))]
        self.plains = [value[1] for value in self.values if value[0] == "plain"]
        plain = iter(range(len(self.plains)))
        self.sources = [(v[0], next(plain) if v[0] == "plain" else v[1]) for v in self.values]
        self.places: list[int] | None = None  # each value's place in make's pool

    def write(self, entry: list, made: list) -> None:
        """Set what the call set in its arguments."""
        objects = map(entry.__getitem__, self.attr_objects)
        for _ in map(setattr, objects, self.attr_names, map(made.__getitem__, self.attr_refs)):
            pass  # (setattr over the lists in C: a KV cache sets two attributes per layer)
        for i, step, ref in self.items:
            assign(entry[i], step, made[ref])

    def held_bytes(self, entry: list, made: list) -> int:
        """Bytes of the memory blocks the call's object arguments (its KV cache) hold after it:
        the tensors it left there and those it wrote (``gpemu.token_steps``'s walk,
        from the plan)."""
        held = [*map(entry.__getitem__, self.kept), *map(made.__getitem__, self.stored)]
        # each block once (blocks hash by identity): an EmuTensor's block, None for anything else
        blocks = set(map(getattr, held, repeat("emu_block", len(held)), repeat(None, len(held))))
        blocks.discard(None)
        return sum(map(_SIZE, blocks))

    def _ref(self, ref: tuple) -> int:
        what = ref[0]
        if what == "same":
            return self.refs[("tensor", ref[1])]
        if what == "number":
            value: tuple = ("number", self.count)
            self.count += 1
        elif what == "tensor":
            _, j, base, ndim, dtype = ref
            new_block = base[0] == "block" and not any(mk[0] == "block" and mk[1] == base[1] for mk in self.makes)
            if new_block:
                self.count += 1
            where = None if len(base) < 2 else self.index[base[1]] if base[0] == "view" else base[1]
            self.makes.append((base[0], where, ndim, dtype, self.count, new_block))
            self.count += 2 * ndim + 1
            value = ("make", len(self.makes) - 1)
            self.refs[("tensor", j)] = len(self.values)
        elif what == "entry":
            value = ("entry", self.index[ref[1]])
        else:
            value = ref
        self.values.append(value)
        return len(self.values) - 1

    def make(self, ts: Any, entry: list, numbers: list[int], dev: int) -> list:
        """Everything the plan refers to, by index (new memory allocated first)."""
        allocate = ts.memory[dev].allocate
        wrap = ts.wrap
        blocks: dict[Any, Any] = {}
        tensors: list[Any] = []
        add = tensors.append
        for kind, base, ndim, dtype, i, new_block in self.makes:
            j = i + ndim
            if kind == "block":
                blk = blocks[base] = allocate(numbers[i - 1]) if new_block else blocks[base]
                add(wrap(tuple(numbers[i:j]), tuple(numbers[j : j + ndim]), numbers[j + ndim], dtype, dev, blk))
            elif kind == "view":
                add(ts.view(entry[base], tuple(numbers[i:j]), tuple(numbers[j : j + ndim]), numbers[j + ndim], dtype))
            else:
                add(wrap(tuple(numbers[i:j]), tuple(numbers[j : j + ndim]), numbers[j + ndim], dtype, dev, None))
        if self.only_made:  # (what the call returns and sets is all new tensors, in order)
            return tensors
        # one list holding every source, read at precomputed places (a C-level pass, not a loop)
        pool = tensors + self.plains + numbers + entry
        if self.places is None:
            start = {"make": 0, "plain": len(tensors), "number": len(tensors) + len(self.plains)}
            start["entry"] = start["number"] + len(numbers)
            self.places = [start[what] + at for what, at in self.sources]
        return list(map(pool.__getitem__, self.places))


_SIZE = attrgetter("size")


def _change_value(ts: Any, t: Any, w: tuple) -> None:
    if not isinstance(t, EmuTensor):
        return
    if w[0] == "forget":
        ts.forget_value(t)
    elif w[0] == "know":
        ts.set_known_value(t, torch.tensor(w[2], dtype=t.dtype).reshape(t.shape))
    elif w[0] == "shift" and t.emu_shadow is not None:
        # in place, as the recorded call's in-place op did: the views that share this host value
        # see the change too (replacing it would part them)
        t.emu_shadow.add_(torch.tensor(w[2], dtype=t.dtype).reshape(t.shape))
