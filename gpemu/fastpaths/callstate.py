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

__all__ = ["Leaf", "TENSOR", "NUMBER", "PLAIN", "OBJECT", "OPAQUE", "scan", "CallShape", "assign", "TooLarge"]

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


class CallShape(NamedTuple):
    """A call's state: its ``leaves``; the ``structure`` that must match exactly between calls of
    one class (paths, kinds, dtypes, devices, ranks, plain values, object types) and the
    ``numbers`` that may vary (tensor sizes, strides and offsets, Python ints)."""

    leaves: list[Leaf]
    structure: tuple
    numbers: list[int]


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
    return CallShape(scanner.leaves, tuple(scanner.structure), scanner.numbers)


class _Scanner:
    __slots__ = ("leaves", "structure", "numbers", "seen")

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.structure: list = []
        self.numbers: list[int] = []
        self.seen: set[int] = set()

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


def assign(parent: Any, step: Any, value: Any) -> None:
    """Set ``parent``'s leaf ``step`` (an attribute ".name", a list index, a dict key) to
    ``value``; an index one past a list's end appends."""
    if isinstance(step, str) and step.startswith("."):
        setattr(parent, step[1:], value)
    elif isinstance(parent, list) and step == len(parent):
        parent.append(value)
    else:
        parent[step] = value
