"""What a module call reads and leaves behind, as paths: its arguments' tensors, numbers and the
objects it may change (an HF ``Cache``, a server's own cache class holding key and value tensors).

A decode step is a call whose arguments include state the call updates (a KV cache grows by the
new tokens, a counter advances); :mod:`gpemu.fastpaths.shape_class` replays such calls from what
their recordings did to that state. This module only describes a call's state: :func:`scan`
lists every leaf under the arguments (tensors, numbers, other plain values, objects) with the
path that reaches it, split into what must match exactly (the structure: paths, kinds, dtypes,
plain values, object types) and the numbers that may vary (tensor sizes, strides and offsets,
Python ints); :func:`assign` writes a value at a path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from gpemu.device import EmuTensor, host_shadow
from gpemu.model_time import PLAIN_VALUES

__all__ = [
    "Leaf",
    "TENSOR",
    "NUMBER",
    "PLAIN",
    "OBJECT",
    "OPAQUE",
    "scan",
    "CallShape",
    "Template",
    "assign",
    "TooLarge",
]

# Leaf kinds
TENSOR, NUMBER, PLAIN, OBJECT, OPAQUE = 0, 1, 2, 3, 4

# How deep and how wide a call's state is followed: an HF cache of 80 layers is ~250 leaves.
_MAX_DEPTH = 6
_MAX_LEAVES = 4096


class Leaf(NamedTuple):
    """One thing a call's arguments reach: ``path`` (("arg", 0), ("kw", "past_key_values"),
    then attribute names and indices), its ``kind`` and the ``value`` itself."""

    path: tuple
    kind: int
    value: Any


class CallShape:
    """A call's state: the ``values`` of its leaves; the ``structure`` that must match exactly
    between calls of one class (per leaf its path and kind first, then dtypes, devices, ranks,
    plain values, object types) and the ``numbers`` that may vary (tensor sizes, strides and
    offsets, Python ints). ``leaves`` (path, kind, value) are made from them when asked for: a
    replayed call reads its values by their index in the structure."""

    __slots__ = ("values", "structure", "numbers", "template", "_leaves")

    def __init__(
        self,
        values: list,
        structure: tuple,
        numbers: list[int],
        template: Template | None = None,
        leaves: list[Leaf] | None = None,
    ) -> None:
        self.values = values
        self.structure = structure
        self.numbers = numbers
        self.template = template  # how to read the next call of this structure quickly
        self._leaves = leaves

    @property
    def leaves(self) -> list[Leaf]:
        if self._leaves is None:
            self._leaves = [Leaf(e[0], e[1], v) for e, v in zip(self.structure, self.values, strict=True)]
        return self._leaves


class TooLarge(Exception):
    """The arguments reach more than _MAX_LEAVES leaves, or a dict with keys that are not names."""


def scan(args: tuple, kwargs: dict) -> CallShape | None:
    """A call's state (None: too large to follow). Tuples, lists and dicts are followed by index
    and key; other objects by their attributes (``vars``), except modules, types and functions
    (kept by identity: OPAQUE). An object is its type (two calls with two caches of one kind are
    alike); a tensor's sizes, strides and offset are numbers, its dtype, device, rank, whether it
    needs a gradient and whether its value is known are structure."""
    scanner = _Scanner()
    try:
        scanner.visit(args, ("arg",), 0)
        scanner.visit(kwargs, ("kw",), 0)
    except TooLarge:
        return None
    structure = tuple(scanner.structure)
    values = [leaf.value for leaf in scanner.leaves]
    return CallShape(values, structure, scanner.numbers, Template(scanner, structure), scanner.leaves)


class _Scanner:
    __slots__ = ("leaves", "structure", "numbers", "seen", "repeats")

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.structure: list = []
        self.numbers: list[int] = []
        self.seen: set[int] = set()
        self.repeats: set[int] = set()  # leaves that are an object met before (kept by identity)

    def visit(self, x: Any, path: tuple, depth: int) -> None:
        leaves, structure = self.leaves, self.structure
        if len(leaves) >= _MAX_LEAVES:
            raise TooLarge
        c = x.__class__
        if c is EmuTensor:
            leaves.append(_leaf(Leaf, (path, TENSOR, x)))
            k = x.emu_key  # (shape, stride, offset, dtype, device)
            structure.append((path, TENSOR, k[3], k[4], len(k[0]), _requires_grad(x), x.emu_shadow is not None))
            numbers = self.numbers
            numbers += k[0]
            numbers += k[1]
            numbers.append(int(k[2]))
        elif c is int:
            leaves.append(_leaf(Leaf, (path, NUMBER, x)))
            structure.append((path, NUMBER))
            self.numbers.append(x)
        elif c in _PLAIN or isinstance(x, PLAIN_VALUES):
            leaves.append(_leaf(Leaf, (path, PLAIN, x)))
            structure.append((path, PLAIN, x))
        elif isinstance(x, torch.Tensor):  # a host tensor (or another subclass): as it is
            leaves.append(Leaf(path, TENSOR, x))
            structure.append((path, TENSOR, "host", x.dtype, tuple(x.shape), x.stride(), host_shadow(x) is not None))
        else:
            self._container(x, c, path, depth)

    def _container(self, x: Any, c: type, path: tuple, depth: int) -> None:
        if depth >= _MAX_DEPTH or id(x) in self.seen:
            if depth < _MAX_DEPTH:
                self.repeats.add(len(self.leaves))
            self._opaque(x, path)
            return
        visit = self.visit
        depth += 1
        if c is list or c is tuple or isinstance(x, (tuple, list)):
            self._open(x, c, path, len(x) if c is list else None)
            for i, v in enumerate(x):
                visit(v, (*path, i), depth)
        elif isinstance(x, dict):
            self._open(x, c, path, None)
            for k, v in x.items():
                if not isinstance(k, (str, int)):
                    raise TooLarge  # (a key that is not a name: not followed)
                visit(v, (*path, k), depth)
        else:
            attrs = getattr(x, "__dict__", None)
            if attrs is None or isinstance(x, (torch.nn.Module, type)) or callable(x):
                self._opaque(x, path)
                return
            self._open(x, c, path, None)
            for k, v in list(attrs.items()):
                visit(v, (*path, "." + k), depth)

    def _open(self, x: Any, c: type, path: tuple, size: int | None) -> None:
        self.leaves.append(_leaf(Leaf, (path, OBJECT, x)))
        self.structure.append((path, OBJECT, c, size))
        self.seen.add(id(x))

    def _opaque(self, x: Any, path: tuple) -> None:
        self.leaves.append(Leaf(path, OPAQUE, x))
        self.structure.append((path, OPAQUE, x.__class__))


# Exact classes of the plain values (isinstance over PLAIN_VALUES for their subclasses)
_PLAIN = frozenset(PLAIN_VALUES)
_leaf = tuple.__new__  # (a NamedTuple made without its Python-level __new__: per leaf, per call)
# (EmuTensor's property, without it; torch's stubs type the descriptor as the bool it gives)
_requires_grad: Callable[[torch.Tensor], bool] = torch._C.TensorBase.requires_grad.__get__  # type: ignore[attr-defined]


# How a template reads a leaf again (see Template.rescan)
_EMU, _HOST, _NUM, _PLAIN_V, _SEQ, _MAP, _OBJ, _OPQ, _REPEAT = range(9)


class Template:
    """A scan's walk kept to read the next call of the same structure without walking it again:
    per leaf, where it sits (its parent leaf, an attribute or an item) and what must hold for the
    structure to be the same (its class, a tensor's dtype and rank, a container's keys). A decode
    loop calls its model with the same cache object, grown: :meth:`rescan` reads its new sizes
    in one flat pass instead of building every path and structure entry again."""

    __slots__ = ("structure", "nodes")

    def __init__(self, scanner: _Scanner, structure: tuple) -> None:
        self.structure = structure
        index = {leaf.path: i for i, leaf in enumerate(scanner.leaves)}
        self.nodes: list[tuple] = []
        for i, (path, kind, x) in enumerate(scanner.leaves):
            if len(path) == 1:  # the arguments' tuple (0) and the keyword arguments' dict (1)
                parent, attr, step = -1, False, 0 if path[0] == "arg" else 1
            else:
                parent = index[path[:-1]]
                attr = self.nodes[parent][3] == _OBJ  # (an object's attribute ".name"; else an item)
                step = path[-1][1:] if attr else path[-1]
            self.nodes.append((parent, attr, step, _how(kind, x, i in scanner.repeats), x.__class__, _check(kind, x)))

    def rescan(self, args: tuple, kwargs: dict) -> CallShape | None:
        """The call's state when its structure is this template's (None: it is not; scan it)."""
        roots: tuple[Any, Any] = (args, kwargs)
        values: list = []
        numbers: list[int] = []
        seen: set[int] = set()
        add = values.append
        try:
            for parent, attr, step, how, cls, check in self.nodes:
                if attr:  # (most leaves of a cache are an object's attributes)
                    x = values[parent].__dict__[step]
                elif parent >= 0:
                    x = values[parent][step]
                else:
                    x = roots[step]
                if x is check:  # (a plain value, the same object: True, a device; no other check is one)
                    add(x)
                    continue
                if x.__class__ is not cls:
                    return None
                # (the kinds in the order an HF cache has most of them: plain values, tensors, objects)
                if how == _PLAIN_V:
                    if x != check:
                        return None
                elif how == _EMU:
                    k = x.emu_key  # (shape, stride, offset, dtype, device)
                    if (k[3], k[4], len(k[0]), _requires_grad(x), x.emu_shadow is not None) != check:
                        return None
                    numbers += k[0]
                    numbers += k[1]
                    numbers.append(int(k[2]))
                elif how == _OBJ:
                    if id(x) in seen or tuple(x.__dict__) != check:
                        return None
                    seen.add(id(x))
                elif how == _NUM:
                    numbers.append(x)
                elif how == _SEQ or how == _MAP:
                    if id(x) in seen or _keys(how, x) != check:
                        return None
                    seen.add(id(x))
                elif how == _HOST:
                    if _host_check(x) != check:
                        return None
                elif how == _REPEAT and id(x) not in seen:
                    return None
                add(x)
        except (KeyError, IndexError, AttributeError, TypeError):
            return None
        return CallShape(values, self.structure, numbers, self)


def _how(kind: int, x: Any, repeat: bool) -> int:
    if kind == TENSOR:
        return _EMU if x.__class__ is EmuTensor else _HOST
    if kind == NUMBER:
        return _NUM
    if kind == PLAIN:
        return _PLAIN_V
    if kind == OPAQUE:
        return _REPEAT if repeat else _OPQ
    if isinstance(x, (tuple, list)):
        return _SEQ
    return _MAP if isinstance(x, dict) else _OBJ


def _check(kind: int, x: Any) -> Any:
    if kind == TENSOR:
        if x.__class__ is EmuTensor:
            k = x.emu_key
            return (k[3], k[4], len(k[0]), _requires_grad(x), x.emu_shadow is not None)
        return _host_check(x)
    if kind == PLAIN:
        return x
    if kind == OBJECT:
        how = _how(kind, x, False)
        return _keys(how, x)
    return None


def _keys(how: int, x: Any) -> Any:
    """What a container's structure holds of it: its length, or its keys in order."""
    if how == _SEQ:
        return len(x)
    return tuple(x) if how == _MAP else tuple(x.__dict__)


def _host_check(x: torch.Tensor) -> tuple:
    return (x.dtype, tuple(x.shape), x.stride(), host_shadow(x) is not None)


def assign(parent: Any, step: Any, value: Any) -> None:
    """Set ``parent``'s leaf ``step`` (an attribute ".name", a list index, a dict key) to
    ``value``; an index one past a list's end appends."""
    if isinstance(step, str) and step.startswith("."):
        setattr(parent, step[1:], value)
    elif isinstance(parent, list) and step == len(parent):
        parent.append(value)
    else:
        parent[step] = value
