"""Parameter gradients of replayed backwards: made together, dropped together, reused.

A replayed backward (:mod:`gpemu.replay`) gives the parameters of the module it replays their
gradients itself. Making a tensor wrapper per parameter per step, and dropping it again at
``zero_grad``, would be most of the emulator's own host time for models with hundreds of
parameters, so this module keeps the gradient objects between steps while their memory comes
and goes exactly as torch's would:

* **gradient sets** (:class:`_GradSet`): all new gradients of one backward share one group
  allocation; the optimizer's ``zero_grad()`` (:func:`drop_gradients`) drops such a set in a
  few C-level passes over its parameters and gives its memory back in one tracker call, and the
  next backward (:func:`hand_out`) takes the memory again and hands out the same wrappers;
* **spares**: any other emulated gradient the fast ``zero_grad`` drops and nothing else
  references is pooled by its metadata and handed out again by :func:`store`.

A gradient the program keeps, marks or replaces is never reused; gradients dropped any other way
(``model.zero_grad()``, ``p.grad = None``) free their memory at once as usual.

All of it is per run: :class:`GradientState` (``rt.gradients``, made by the replay component).
``config.tuning.spare_limit = 0`` turns reuse off (benchmarks' A/B runs).
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from itertools import repeat
from operator import attrgetter, eq, is_
from typing import TYPE_CHECKING, Any

import torch

from gpemu.tensor import WRAPPER_ATTRIBUTES, EmuTensor

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.tensor import TensorState

__all__ = ["GradientState"]

_getrefcount = sys.getrefcount
_REQUIRES_GRAD = torch._C.TensorBase.requires_grad.__get__
_gget = torch._C.TensorBase.grad.__get__   # p.grad, callable from map() (C-level loops)
_gset = torch._C.TensorBase.grad.__set__
_get_block = attrgetter("_block")
_get_parent = attrgetter("parent")
_get_shadow = attrgetter("_shadow")
_get_dict = attrgetter("__dict__")


class GradientState:
    """Parameter gradients of replayed backwards in one run (``rt.gradients``)."""

    def __init__(self, tensors: "TensorState", spare_limit: int) -> None:
        self.ts = tensors
        self.spare_limit = spare_limit  # pooled wrappers at most; 0 turns all reuse off
        self.on = True  # False once the run ended: nothing is kept
        # Gradient wrappers handed back by the fast zero_grad (_keep_spare): pooled by their
        # metadata key and handed out again by store().
        self.spare: dict[tuple, list] = {}
        self.spare_count = 0
        # Live gradient sets and a counter bumped whenever one is made or given up, which
        # invalidates the per-optimizer zero_grad plans (_zero_plan).
        self.sets: "weakref.WeakSet[_GradSet]" = weakref.WeakSet()
        self.generation = 0
        self.zero_plans: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()

    def stop(self) -> None:
        """The run ends: nothing is kept."""
        self.on = False
        self.spare = {}
        self.spare_count = 0
        self.sets = weakref.WeakSet()
        self.zero_plans = weakref.WeakKeyDictionary()

    def info(self) -> dict[str, int]:
        """Pooled spare wrappers and live gradient sets (tests, benchmarks)."""
        return {"spares": self.spare_count, "sets": sum(1 for gs in self.sets if gs.alive)}

    def live_sets(self) -> list["_GradSet"]:
        """The gradient sets still in use (tests)."""
        return [gs for gs in self.sets if gs.alive]

    # ------------------------------------------------------------------ handing out
    def hand_out(self, holder: Any) -> bool:
        """Hand ``holder.gradset``'s wrappers out again when it was released by ``zero_grad`` and
        no parameter has a gradient; False when the per-parameter :meth:`store` must decide."""
        gs = holder.gradset
        return gs is not None and gs.spares is not None and self.spare_limit > 0 and _rearm(gs)

    def store(self, holder: Any, params: list, specs: list, needs: "tuple | None", every: bool) -> None:
        """Store the parameter gradients of a replayed backward one parameter at a time (the path
        behind :meth:`hand_out`). ``specs``: each parameter's gradient spec (see
        ``gpemu.fastpaths.replay._grad_spec``); ``needs``: which parameters get one (None: all that
        have none). New gradients share ONE tracker allocation
        (:meth:`gpemu.memory.MemoryTracker.allocate_group`); a parameter that has a gradient is
        accumulated in place (metadata unchanged, its transient is in the backward's touch). When
        ``every`` parameter got a new gradient on one device, they become ``holder.gradset``."""
        if needs is None:
            todo = [(p, spec) for p, spec in zip(params, specs) if p.grad is None]
        else:
            todo = [(p, spec) for p, spec, needed in zip(params, specs, needs) if needed and p.grad is None]
        if len(todo) != len(params):
            # Gradients accumulated in place: their values changed, so known ones (a gradient the
            # program zeroed with zero_grad(set_to_none=False)) are unknown again.
            for p in params:
                g = p.grad
                if g is not None and getattr(g, "_shadow", None) is not None:
                    g._shadow = None
        if not todo:
            return  # accumulation in place: the set (if any) still holds
        if holder.gradset is not None:
            self._give_up(holder.gradset)
            holder.gradset = None
        by_dev: dict[int, list] = {}
        for item in todo:
            by_dev.setdefault(item[1][3], []).append(item)
        spare = self.spare
        wrap = self.ts.wrap
        made: list = []
        parent = None
        for dev, items in by_dev.items():
            blocks = self.ts.memory[dev].allocate_group([spec[6] for _, spec in items], rounded=True)
            for (p, (shape, stride, dtype, _, _, key, _)), block in zip(items, blocks):
                lst = spare.get(key) if spare else None
                if lst:
                    # A wrapper zero_grad dropped and nobody else holds (_keep_spare).
                    g = lst.pop()
                    self.spare_count -= 1
                    g._block = block
                else:
                    g = wrap(shape, stride, 0, dtype, dev, block)
                p.grad = g
                made.append(g)
                if block is not None:
                    parent = block.parent
        if (every and len(todo) == len(params) and len(by_dev) == 1 and parent is not None
                and self.spare_limit > 0 and all(g._block is not None for g in made)):
            holder.gradset = _GradSet(self, params, parent)

    # ------------------------------------------------------------------ dropping
    def drop_gradients(self, param_groups: list, owner: Any = None) -> None:
        """``p.grad = None`` for every parameter of the optimizer's groups (``zero_grad(set_to_none=True)``,
        called by :mod:`gpemu.fastpaths.optimizer` with the optimizer as ``owner``), keeping the
        dropped emulated gradients that nothing else references for the next replayed backward.

        Two levels, both releasing each gradient's memory exactly when torch would:

        * a replayed module's whole **gradient set** (:class:`_GradSet`) is dropped with a few
          C-level passes over its parameters and ONE tracker call, its wrappers kept as they are;
        * any other gradient goes through :meth:`_drop_each`, one parameter at a time.
        """
        sets, others = self._zero_plan(param_groups, owner)
        for gs in sets:
            if not self._release_set(gs):
                self._drop_each(gs.params)
        if others:
            self._drop_each(others)

    def _drop_each(self, params: list) -> None:
        """``p.grad = None`` for each parameter; each dropped emulated gradient that nothing else
        references becomes a spare (:meth:`_keep_spare`)."""
        for p in params:
            g = p.grad
            if g is not None:
                p.grad = None
                self._keep_spare(g, 3)  # g here, the argument, getrefcount's

    def _keep_spare(self, g: Any, refs: int) -> None:
        """Keep a dropped gradient wrapper for the next replayed backward (creating a tensor wrapper
        costs ~1.5 µs per parameter and feeds the garbage collector) when nothing else references it.

        "Nothing else references it" is ``sys.getrefcount(g) == refs``, the references the caller
        knows of (its variables, this call's argument, getrefcount's own): on this torch a C++ holder
        of the tensor (a view's base, an autograd graph, another ``.grad``) also holds a Python
        reference, so the count sees it too.
        Gradients that require grad, carry extra attributes, or are not plain ``EmuTensor`` are left
        alone. A spare's memory is released now, exactly when the dropped gradient's would be."""
        if (self.on and type(g) is EmuTensor and _getrefcount(g) == refs and not _REQUIRES_GRAD(g)
                and len(g.__dict__) == WRAPPER_ATTRIBUTES and self.spare_count < self.spare_limit):
            g._block = None  # frees its memory (the group's block goes when its last share does)
            g._shadow = None
            g._meta = None
            lst = self.spare.get(g._key)
            if lst is None:
                self.spare[g._key] = [g]
            else:
                lst.append(g)
            self.spare_count += 1

    def _give_up(self, gs: "_GradSet") -> None:
        gs.alive = False
        gs.spares = None  # released wrappers die with their group; its memory was already given back
        gs.parent = None
        self.sets.discard(gs)
        self.generation += 1

    def _release_set(self, gs: "_GradSet") -> bool:
        """Drop an armed set's gradients (zero_grad). False when nothing was changed because the
        gradients are not (all) this set's; True once they were dropped."""
        if not gs.alive or gs.spares is not None:
            return False
        parent = gs.parent_ref()
        if parent is None:
            return False
        params = gs.params
        grads = list(map(_gget, params))
        try:
            if not all(map(is_, map(_get_parent, map(_get_block, grads)), repeat(parent))):
                return False
        except AttributeError:  # a missing gradient, or one with a block of its own
            return False
        ts = self.ts
        if gs.flag_gen != ts.flag_generation:  # some emulated tensor's requires_grad was set
            if any(map(_REQUIRES_GRAD, grads)):
                return False
            gs.flag_gen = ts.flag_generation
        if not all(map(eq, map(len, map(_get_dict, grads)), repeat(WRAPPER_ATTRIBUTES))):  # extra attributes
            return False
        deque(map(_gset, params, repeat(None)), 0)
        # 2: the list and getrefcount's argument; more means held elsewhere (see _keep_spare)
        if not all(map(eq, map(_getrefcount, grads), repeat(2))):
            self._give_up(gs)
            for g in grads:
                self._keep_spare(g, 4)  # the list, g here, the argument, getrefcount's
            return True
        if not all(map(is_, map(_get_shadow, grads), repeat(None))):
            for g in grads:
                g._shadow = None  # a reused gradient's values are unknown again
        parent.release()
        gs.parent = parent
        gs.spares = grads
        return True

    def _zero_plan(self, param_groups: list, owner: Any) -> tuple[list, list]:
        """(gradient sets whose parameters all belong to the groups, the groups' other parameters),
        cached per optimizer until its groups or the live sets change."""
        key = (self.generation, tuple((id(g["params"]), len(g["params"])) for g in param_groups))
        if owner is not None:
            hit = self.zero_plans.get(owner)
            if hit is not None and hit[0] == key:
                return hit[1], hit[2]
        params = [p for g in param_groups for p in g["params"]]
        ids = set(map(id, params))
        sets = [gs for gs in list(self.sets) if gs.alive and all(id(p) in ids for p in gs.params)]
        covered = {id(p) for gs in sets for p in gs.params}
        others = [p for p in params if id(p) not in covered]
        if owner is not None:
            try:
                self.zero_plans[owner] = (key, sets, others)
            except TypeError:  # not weak-referenceable
                pass
        return sets, others


class _GradSet:
    """The parameter gradients one replayed backward made together, reused as a whole.

    A replayed backward that gives every parameter of a recording a new gradient allocates them
    as one group (:meth:`gpemu.memory.MemoryTracker.allocate_group`). ``zero_grad`` then drops
    the set in a few C-level passes (read every ``.grad``, check they are this set's, clear them,
    check nothing else holds them) and gives the group's memory back in ONE tracker call
    (:meth:`gpemu.memory.GroupBlock.release`), keeping the wrappers; the next backward takes the
    memory again in one call and hands the same wrappers out. Per parameter that leaves only
    the C-level ``.grad`` reads and writes (~0.5 µs instead of ~2 µs across backward and
    ``zero_grad``; ``benchmarks/step_parts.py``).

    *Armed* (``spares is None``): the parameters hold the wrappers; the set keeps only a weak
    reference to the group, so gradients dropped any other way (``model.zero_grad()``, a loop of
    ``p.grad = None``) die and free their memory as usual. *Released*: ``spares`` holds the
    wrappers, their memory is given back. Anything else (a gradient held elsewhere, replaced,
    partly missing) gives the set up (``GradientState._give_up``) and the per-parameter path takes over."""

    __slots__ = ("params", "parent_ref", "parent", "spares", "alive", "flag_gen", "__weakref__")

    def __init__(self, state: GradientState, params: list, parent: Any) -> None:
        self.params = params
        self.parent_ref = weakref.ref(parent)
        self.parent: Any = None  # strong only while released
        self.spares: list | None = None
        self.alive = True
        self.flag_gen = state.ts.flag_generation
        # One live set per parameter: an older set over these parameters (another recording of
        # the module, e.g. the last smaller batch, or the same recording before hub mode) is
        # given up, so zero_grad never walks a parameter twice.
        ids = set(map(id, params))
        for other in list(state.sets):
            if other.params is params or any(id(p) in ids for p in other.params):
                state._give_up(other)
        state.sets.add(self)
        state.generation += 1


def _rearm(gs: _GradSet) -> bool:
    """Hand a released set's wrappers out again (replayed backward). False when some parameter
    has a gradient (then the per-parameter path decides)."""
    params = gs.params
    if not all(map(is_, map(_gget, params), repeat(None))):
        return False
    gs.parent.reacquire()  # may raise OOM, before anything changed
    deque(map(_gset, params, gs.spares), 0)
    gs.spares = None
    gs.parent = None
    return True
