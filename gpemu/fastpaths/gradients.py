"""Parameter gradients of replayed backwards: made together, dropped together, reused.

A replayed backward (:mod:`gpemu.fastpaths.replay`) gives the parameters of the module it
replays their gradients itself. Making a tensor wrapper per parameter per step, and dropping it
again at ``zero_grad``, would be most of the emulator's own host time for models with hundreds
of parameters (reading or writing one ``.grad`` costs ~1-3k instructions of torch's C
argument and subclass checks), so this module keeps the gradient objects between steps while
their memory comes and goes exactly as torch's would:

* **gradient sets** (:class:`_GradSet`): all new gradients of one backward share one group
  allocation. ``zero_grad()`` (the optimizer's, or the module's, see
  :mod:`gpemu.fastpaths.optimizer`) gives the group's memory back in one tracker call and
  *hides* the set: its wrappers stay attached to their parameters, and every way the program
  can read a parameter's ``.grad`` says None (the emulated tensor's ``grad`` property; autograd's
  accumulator nodes of these parameters have a pre-hook). The next replayed backward takes the
  memory again and un-hides the set. Both are O(1): no per-parameter work in a steady training
  loop. Whatever could observe the difference first makes the set real (:meth:`_GradSet.materialize`:
  every ``.grad`` set to None for real, the wrappers kept as spares): setting a parameter's
  gradient or its ``.data``, autograd about to accumulate into one, ``Module._apply``
  (``.to()``, ``.half()``, parameter swaps), the end of the run.
* **checks only when something looked**: a set is hidden without a look at its gradients only
  while nothing handed one of them to Python code (the ``grad`` property marks the set
  *exposed*; so do a setter and autograd's accumulator). An exposed set is checked as before
  (C-level passes: the gradients are the set's, carry no attribute of yours, need no gradient,
  nothing else holds them) before it is hidden, or given up.
* **spares**: any other emulated gradient the fast ``zero_grad`` drops and nothing else
  references is pooled by its metadata and handed out again by :meth:`GradientState.store`.

A gradient the program keeps, marks or replaces is never reused; gradients dropped any other way
(a loop of ``p.grad = None``) free their memory at once as usual.

All of it is per run: :class:`GradientState` (``rt.gradients``, made by the replay component).
``config.tuning.spare_limit = 0`` turns reuse off (benchmarks' A/B runs).
"""

from __future__ import annotations

import sys
import weakref
from collections import deque
from itertools import repeat
from operator import attrgetter, eq, is_
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from gpemu import costs
from gpemu.device import WRAPPER_ATTRIBUTES, EmuTensor, contiguous_stride, unhide_grad
from gpemu.memory import round_size

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.device import TensorState

__all__ = ["GradientState"]

_getrefcount = sys.getrefcount
_TENSOR_BASE: Any = torch._C.TensorBase  # (its stubs type the C-level descriptors as values)
_REQUIRES_GRAD = _TENSOR_BASE.requires_grad.__get__
_gget = _TENSOR_BASE.grad.__get__  # p.grad as torch stores it (C-level; map() loops)
_gset = _TENSOR_BASE.grad.__set__


class GradSpec(NamedTuple):
    """The gradient of one tensor as the replayed backward makes it: contiguous, on the tensor's
    device, ``nbytes`` (``rounded``: as the caching allocator rounds it), ``key`` its wrapper's
    op-cache signature (a spare wrapper with that key can be reused)."""

    shape: Any
    stride: tuple
    dtype: torch.dtype
    device: int
    nbytes: int
    key: tuple
    rounded: int


def grad_spec(t: torch.Tensor, dev: int) -> GradSpec:
    """The :class:`GradSpec` of ``t``'s gradient (``dev``: its device when ``t`` is not emulated)."""
    stride = contiguous_stride(t.shape)
    gdev = t.emu_device if isinstance(t, EmuTensor) else dev
    nbytes = t.numel() * t.element_size()
    key = (tuple(t.shape), tuple(stride), 0, t.dtype, gdev)
    return GradSpec(t.shape, stride, t.dtype, gdev, nbytes, key, round_size(nbytes) if nbytes else 0)


_get_block = attrgetter("emu_block")
_get_parent = attrgetter("parent")
_get_shadow = attrgetter("emu_shadow")
_get_dict = attrgetter("__dict__")

# _GradSet states
ARMED = "armed"  # the parameters hold the wrappers, the memory is held
HIDDEN = "hidden"  # given back by zero_grad: attached but read as None, memory given back
RELEASED = "released"  # given back for real: .grad is None, the wrappers kept as spares
DEAD = "dead"  # given up (the per-parameter path takes over)


class GradientState:
    """Parameter gradients of replayed backwards in one run (``rt.gradients``)."""

    def __init__(self, tensors: TensorState, spare_limit: int) -> None:
        self.ts = tensors
        self.spare_limit = spare_limit  # pooled wrappers at most; 0 turns all reuse off
        self.on = True  # False once the run ended: nothing is kept
        # Gradient wrappers handed back by the fast zero_grad (_keep_spare): pooled by their
        # metadata key and handed out again by store().
        self.spare: dict[tuple, list] = {}
        self.spare_count = 0
        # Live gradient sets and a counter bumped whenever one is made or given up, which
        # invalidates the per-optimizer zero_grad plans (_zero_plan).
        self.sets: weakref.WeakSet[_GradSet] = weakref.WeakSet()
        self.generation = 0
        self.zero_plans: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
        self.hidden = 0  # sets hidden now (materialize_all has nothing to do at 0)
        self.stats = {"hidden": 0, "checked": 0, "unhidden": 0, "materialized": 0}

    def stop(self) -> None:
        """The run ends: hidden sets are made real, nothing is kept."""
        self.materialize_all()
        self.on = False
        self.spare = {}
        self.spare_count = 0
        self.sets = weakref.WeakSet()
        self.zero_plans = weakref.WeakKeyDictionary()

    def info(self) -> dict[str, int]:
        """Pooled spare wrappers and live gradient sets (tests, benchmarks)."""
        return {"spares": self.spare_count, "sets": sum(1 for gs in self.sets if gs.alive), **self.stats}

    def live_sets(self) -> list[_GradSet]:
        """The gradient sets still in use (tests)."""
        return [gs for gs in self.sets if gs.alive]

    def materialize_all(self) -> None:
        """Make every hidden set real (before something that reads or swaps parameters'
        gradients behind the ``grad`` property: ``Module._apply``, the end of the run)."""
        if self.hidden:
            for gs in list(self.sets):
                if gs.state is HIDDEN:
                    gs.materialize()

    def watch(self, params: list, nodes: list) -> None:
        """Pre-hooks on the autograd accumulator nodes of ``params`` (``nodes``, kept alive by
        the caller): autograd about to accumulate into a gradient of a set makes a hidden set
        real first and marks a live one exposed (the engine reads and writes ``.grad`` in C++,
        past the ``grad`` property)."""
        for p, node in zip(params, nodes, strict=False):
            node.register_prehook(_accumulator_hook(p))

    # ------------------------------------------------------------------ handing out
    def hand_out(self, holder: Any) -> bool:
        """Hand ``holder.gradset``'s wrappers out again when it was given back by ``zero_grad``
        (hidden: O(1); released: one C-level pass) and no parameter has a gradient; False when
        the per-parameter :meth:`store` must decide."""
        gs = holder.gradset
        if gs is None or self.spare_limit <= 0:
            return False
        state = gs.state
        if state is HIDDEN:
            group = gs.parent
            group.reacquire()  # may raise OOM, before anything changed
            group.hidden = False
            group.exposed = False
            gs.state = ARMED
            gs.parent = None
            self.hidden -= 1
            self.stats["unhidden"] += 1
            return True
        return state is RELEASED and _rearm(gs)

    def _charge_accumulation(self, params: list, specs: list, needs: tuple | None) -> None:
        """Each parameter that already had a gradient: autograd's ``grad += new``, a kernel and a
        launch as in the op-by-op backward (a loop accumulating over micro-batches, or one that
        never zeroes its gradients)."""
        ts = self.ts
        for i, (p, spec) in enumerate(zip(params, specs, strict=False)):
            if (needs is None or needs[i]) and _gget(p) is not None:
                price = costs.accumulate_price(ts.rt, spec.device, spec.nbytes, spec.dtype)
                ts.charge(price.gpu, spec.device, "add_ (gradient accumulation)", price)

    def store(self, holder: Any, params: list, specs: list, needs: tuple | None, every: bool) -> None:
        """Store the parameter gradients of a replayed backward one parameter at a time (the path
        behind :meth:`hand_out`). ``specs``: each parameter's gradient spec (see
        :func:`grad_spec`); ``needs``: which parameters get one (None: all that
        have none). New gradients share ONE tracker allocation
        (:meth:`gpemu.memory.MemoryTracker.allocate_group`); a parameter that has a gradient is
        accumulated in place (metadata unchanged, its transient is in the backward's touch). When
        ``every`` parameter got a new gradient on one device, they become ``holder.gradset``."""
        self.materialize_all()  # (the C-level .grad reads below must see what the program sees)
        if needs is None:
            todo = [(p, spec) for p, spec in zip(params, specs, strict=False) if _gget(p) is None]
        else:
            todo = [
                (p, spec) for p, spec, needed in zip(params, specs, needs, strict=True) if needed and _gget(p) is None
            ]
        if len(todo) != len(params):
            # Gradients accumulated in place: their values changed, so known ones (a gradient the
            # program zeroed with zero_grad(set_to_none=False)) are unknown again.
            for p in params:
                g = _gget(p)
                if g is not None and getattr(g, "emu_shadow", None) is not None:
                    self.ts.forget_value(g)
            self._charge_accumulation(params, specs, needs)
        if not todo:
            return  # accumulation in place: the set (if any) still holds
        if holder.gradset is not None:
            self._give_up(holder.gradset)
            holder.gradset = None
        by_dev: dict[int, list] = {}
        for item in todo:
            by_dev.setdefault(item[1].device, []).append(item)
        spare = self.spare
        wrap, set_block = self.ts.wrap, self.ts.set_block
        made: list = []
        parent = None
        for dev, items in by_dev.items():
            blocks = self.ts.memory[dev].allocate_group([spec.rounded for _, spec in items], rounded=True)
            for (p, (shape, stride, dtype, _, _, key, _)), block in zip(items, blocks, strict=False):
                lst = spare.get(key) if spare else None
                if lst:
                    # A wrapper zero_grad dropped and nobody else holds (_keep_spare).
                    g = lst.pop()
                    self.spare_count -= 1
                    set_block(g, block)
                else:
                    g = wrap(shape, stride, 0, dtype, dev, block)
                _gset(p, g)
                made.append(g)
                if block is not None:
                    parent = block.parent
        if (
            every
            and len(todo) == len(params)
            and len(by_dev) == 1
            and parent is not None
            and self.spare_limit > 0
            and all(g.emu_block is not None for g in made)
        ):
            holder.gradset = _GradSet(self, params, parent)

    # ------------------------------------------------------------------ dropping
    def drop_gradients(self, param_groups: list, owner: Any = None) -> None:
        """``p.grad = None`` for every parameter of the groups (``zero_grad(set_to_none=True)``
        of an optimizer, or of a module with its parameters as one group; ``owner``: the
        optimizer or module, whose plan is cached), keeping the dropped emulated gradients that
        nothing else references for the next replayed backward.

        Two levels, both releasing each gradient's memory exactly when torch would:

        * a replayed module's whole **gradient set** (:class:`_GradSet`) is hidden in O(1)
          (checked first with a few C-level passes if it was exposed);
        * any other gradient goes through :meth:`_drop_each`, one parameter at a time.
        """
        sets, others = self._zero_plan(param_groups, owner)
        for gs in sets:
            state = gs.state
            if state is ARMED:
                if not self._hide(gs):
                    self._drop_each(gs.params)
            elif state is not HIDDEN:  # released (made real since) or given up: what is there
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
        if (
            self.on
            and type(g) is EmuTensor
            and _getrefcount(g) == refs
            and not _REQUIRES_GRAD(g)
            and len(g.__dict__) == WRAPPER_ATTRIBUTES
            and self.spare_count < self.spare_limit
        ):
            self.ts.release(g)  # frees its memory (the group's block goes when its last share does)
            lst = self.spare.get(g.emu_key)
            if lst is None:
                self.spare[g.emu_key] = [g]
            else:
                lst.append(g)
            self.spare_count += 1

    def _give_up(self, gs: _GradSet) -> None:
        if gs.state is HIDDEN:
            gs.materialize()
        gs.state = DEAD
        gs.spares = None  # released wrappers die with their group; its memory was already given back
        gs.parent = None
        self.sets.discard(gs)
        self.generation += 1

    def _hide(self, gs: _GradSet) -> bool:
        """Give an armed set's memory back and hide it (zero_grad). O(1) when nothing looked at
        its gradients since it was armed; else the checks of :meth:`_check` first. False when
        nothing was changed because the gradients are not (all) this set's."""
        group = gs.parent_ref()
        if group is None:
            return False
        if group.exposed:
            verdict = self._check(gs, group)
            if verdict is not True:
                return verdict == "dropped"
        if not self.on:
            return False
        group.release()
        group.hidden = True
        gs.parent = group
        gs.state = HIDDEN
        self.hidden += 1
        self.stats["hidden"] += 1
        return True

    def _check(self, gs: _GradSet, group: Any) -> bool | str:
        """Whether an exposed set's gradients may be hidden: True (they are the set's, plain,
        held by nothing else), False (not all this set's: nothing changed), or "dropped" (some
        are held elsewhere: the set was given up and its gradients dropped one by one)."""
        self.stats["checked"] += 1
        params = gs.params
        grads = list(map(_gget, params))
        try:
            if not all(map(is_, map(_get_parent, map(_get_block, grads)), repeat(group))):
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
        # 3: the list, getrefcount's argument and the parameter's .grad (a C++ holder); more
        # means held elsewhere (see _keep_spare)
        if not all(map(eq, map(_getrefcount, grads), repeat(3))):
            deque(map(_gset, params, repeat(None)), 0)
            self._give_up(gs)
            for g in grads:
                self._keep_spare(g, 4)  # the list, g here, the argument, getrefcount's
            return "dropped"
        if not all(map(is_, map(_get_shadow, grads), repeat(None))):
            for g in grads:
                self.ts.forget_value(g)  # a reused gradient's values are unknown again
        group.exposed = False
        return True

    def _zero_plan(self, param_groups: list, owner: Any) -> tuple[list, list]:
        """(gradient sets whose parameters all belong to the groups, the groups' other parameters),
        cached per owner until its groups or the live sets change."""
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
    as one group (:meth:`gpemu.memory.MemoryTracker.allocate_group`). States:

    * *armed*: the parameters hold the wrappers; the set keeps only a weak reference to the
      group, so gradients dropped any other way (a loop of ``p.grad = None``) die and free
      their memory as usual;
    * *hidden* (``zero_grad``): the memory is given back (:meth:`gpemu.memory.GroupBlock.release`)
      and the group is marked hidden: the wrappers stay attached, ``p.grad`` reads None. The next
      replayed backward takes the memory again and arms the set: no per-parameter work either way;
    * *released* (:meth:`materialize`): ``.grad`` is None for real, ``spares`` holds the wrappers
      (the next backward sets them again with one C-level pass);
    * *dead*: given up (a gradient held elsewhere, replaced, partly missing): the per-parameter
      path takes over (``GradientState._give_up``)."""

    __slots__ = ("state_obj", "params", "parent_ref", "parent", "spares", "state", "flag_gen", "__weakref__")

    def __init__(self, state: GradientState, params: list, parent: Any) -> None:
        self.state_obj = state
        self.params = params
        self.parent_ref = weakref.ref(parent)
        self.parent: Any = None  # strong only while hidden or released
        self.spares: list | None = None
        self.state = ARMED
        self.flag_gen = state.ts.flag_generation
        parent.owner = weakref.ref(self)
        parent.exposed = False
        # One live set per parameter: an older set over these parameters (another recording of
        # the module, e.g. the last smaller batch, or the same recording before hub mode) is
        # given up, so zero_grad never walks a parameter twice.
        ids = set(map(id, params))
        for other in list(state.sets):
            if other.params is params or any(id(p) in ids for p in other.params):
                state._give_up(other)
        state.sets.add(self)
        state.generation += 1

    @property
    def alive(self) -> bool:
        return self.state is not DEAD

    def materialize(self) -> None:
        """A hidden set made real: every parameter's ``.grad`` set to None (C-level pass), the
        wrappers kept as spares for the next backward (released state)."""
        if self.state is not HIDDEN:
            return
        params = self.params
        grads = list(map(_gget, params))
        deque(map(_gset, params, repeat(None)), 0)
        group = self.parent
        group.hidden = False
        self.spares = grads
        self.state = RELEASED
        st = self.state_obj
        st.hidden -= 1
        st.stats["materialized"] += 1


def _rearm(gs: _GradSet) -> bool:
    """Hand a released set's wrappers out again (replayed backward). False when some parameter
    has a gradient (then the per-parameter path decides)."""
    params = gs.params
    if not all(map(is_, map(_gget, params), repeat(None))):
        return False
    group, spares = gs.parent, gs.spares
    assert spares is not None  # (a released set keeps its wrappers)
    group.reacquire()  # may raise OOM, before anything changed
    deque(map(_gset, params, spares), 0)
    group.exposed = False
    gs.spares = None
    gs.parent = None
    gs.state = ARMED
    return True


def _accumulator_hook(p: Any) -> Any:
    # ``p`` is held strongly: the accumulator node holds its variable anyway, and a weak
    # reference would stop Module._apply from swapping the parameter in place (swap_tensors
    # refuses weakly referenced tensors: the parameters would lose their objects on a move).
    def hook(grad_outputs: tuple) -> None:
        if grad_outputs and grad_outputs[0] is None:
            return None  # nothing to accumulate
        unhide_grad(p)
        return None

    return hook
