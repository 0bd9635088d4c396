"""Optimizer fast path: an emulated ``optimizer.step()`` has no arithmetic to do.

On an emulated GPU the step's foreach kernels only re-derive metadata that cannot change
(every update is in place), yet running them costs the host ~1-3 ms per step for a ResNet-50
(the optimizer's per-parameter Python plus foreach argument handling over ~160 tensors). Once
the optimizer's state exists, gpemu therefore *skips executing* ``step()`` for the optimizers it
knows (exactly ``torch.optim.SGD``, ``Adam``, ``AdamW``): it keeps what the host can observe
right, and the step's GPU time is charged as before by the global step hooks
(:mod:`gpemu.optimizer_hooks`), which still run.

What a skipped step keeps right:

* Adam/AdamW per-parameter ``state['step']`` counters (CPU tensors) advance by one for every
  parameter that has a gradient, as the real step does;
* host shadows of parameters (known small values, :mod:`gpemu.hostvalues`) are dropped, as
  the real step would (the gradients' values are unknown);
* the step's transient memory (foreach temporaries, e.g. weight decay) is measured on the last
  real step and touched again, so peak memory and OOM behave the same.

Policy (when the real ``step()`` runs instead, silently, every time the condition holds):

* the optimizer is a subclass or another class, a ``closure`` or extra arguments are passed, or
  ``config.replay`` is off;
* any group is ``fused``, ``capturable`` or ``differentiable``, has a tensor ``lr``, or
  ``grad_scale``/``found_inf`` are set on the optimizer (a GradScaler with a fused optimizer);
* a parameter with a gradient has no (complete) state yet, or the state holds shadowed values;
  parameters are not all emulated tensors of one device; a gradient has a host shadow or is sparse;
* since the last real step: ``optimizer.state`` was replaced or changed size (``load_state_dict``,
  manual edits), ``param_groups`` changed (``add_param_group``, edited ``params`` lists, changed
  momentum/amsgrad/foreach/fused/capturable/differentiable), or a different set of parameters
  has gradients. The next real step measures again and re-enables the fast path.

``Optimizer.zero_grad`` is patched too: ``set_to_none=True`` runs a plain loop that keeps each
dropped, otherwise unreferenced emulated gradient as a spare wrapper for the next replayed
backward (:meth:`gpemu.fastpaths.gradients.GradientState.drop_gradients`); ``set_to_none=False``
and the torch profiler run torch's own.

All state is per run: :class:`OptimizerFastPath` (``rt.optimizer_fastpath``). Off with
``config.replay=False`` (nothing is patched then).

Not reproduced: replacing individual state tensors in place of the optimizer's own
(``opt.state[p]['step'] = t`` without changing ``len(opt.state)``) is not noticed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_
from typing import TYPE_CHECKING, Any

import torch

from gpemu.device import EmuTensor

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime

    from .gradients import GradientState
    from .replay import ReplayState

__all__ = ["skippable", "install", "fast_path_info", "OptimizerFastPath"]

_get_shadow = attrgetter("emu_shadow")


class OptimizerFastPath:
    """The optimizer fast path of one run (``rt.optimizer_fastpath``)."""

    def __init__(self, rt: Runtime) -> None:
        self.memory = rt.memory
        self.ts = rt.tensors
        self.engine = rt.engine
        self.replay = rt.replay  # (module parameters for Module.zero_grad)
        self.gradients = rt.gradients  # None without the replay fast path: zero_grad is torch's
        self.enabled = True  # False once the run ended (optimizers made in it run plainly)
        self.plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan] = weakref.WeakKeyDictionary()
        self.stats = {"fast": 0, "real": 0, "zero_grad_fast": 0, "module_zero_grad_fast": 0}

    def end(self) -> None:
        """The run ended: optimizers made in it step plainly from now on."""
        self.enabled = False
        self.plans.clear()


def fast_path_info() -> dict[str, int]:
    """How many optimizer steps of the active run were skipped (``fast``) or executed (``real``),
    and how many ``zero_grad`` calls took the fast path (``zero_grad_fast``)."""
    from gpemu.runtime import current

    rt = current()
    if rt is None or rt.optimizer_fastpath is None:
        return {"fast": 0, "real": 0, "zero_grad_fast": 0}
    return dict(rt.optimizer_fastpath.stats)


def _fast_types() -> dict[type, str]:
    from torch.optim import SGD, Adam, AdamW

    return {SGD: "sgd", Adam: "adam", AdamW: "adam"}


def skippable(opt: torch.optim.Optimizer) -> bool:
    """Whether this fast path may skip ``opt``'s steps (its kind and param groups; its state decides
    the rest): a run with real values (:mod:`.value_entries`) forgives the same steps' host time."""
    kind = _fast_types().get(type(opt))
    attrs = opt.__dict__
    if kind is None or attrs.get("grad_scale") is not None or attrs.get("found_inf") is not None:
        return False
    return _group_signature(opt, kind) is not None


def _group_signature(opt: torch.optim.Optimizer, kind: str) -> tuple | None:
    """What the fast path depends on in the param groups; None when a group is not eligible."""
    sig = []
    for g in opt.param_groups:
        if g.get("fused") or g.get("capturable") or g.get("differentiable") or torch.is_tensor(g.get("lr")):
            return None
        params = g["params"]
        extra = (g.get("momentum", 0) != 0) if kind == "sgd" else bool(g.get("amsgrad"))
        sig.append((id(params), len(params), extra, g.get("foreach")))
    return tuple(sig)


def _state_keys(kind: str, extra: bool) -> tuple[str, ...]:
    if kind == "sgd":
        return ("momentum_buffer",) if extra else ()
    return ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq") if extra else ("step", "exp_avg", "exp_avg_sq")


class _Plan:
    """What one optimizer's skipped step does, built after a real step with complete state."""

    __slots__ = (
        "state",
        "n_state",
        "groups",
        "group_sig",
        "params",
        "has_grad",
        "steps",
        "transient",
        "memory",
        "cover_gen",
        "sets",
        "rest",
        "rest_has_grad",
        "shadow_gen",
    )

    def __init__(self) -> None:
        self.state: Any = None
        self.n_state = 0
        self.groups: Any = None
        self.group_sig: tuple | None = ()
        self.params: list = []
        self.has_grad: list[bool] = []
        self.steps: list[torch.Tensor] = []  # CPU step counters of parameters with gradients
        self.transient = 0
        self.memory: Any = None
        # Which parameters' gradients are whole gradient sets (checked in O(1), see _try_fast),
        # valid while the gradient sets' generation is cover_gen; the rest, checked one by one.
        self.cover_gen = -1
        self.sets: list = []
        self.rest: list = []
        self.rest_has_grad: list[bool] = []
        self.shadow_gen = -1  # the tensor state's shadow_writes when no parameter had a shadow


def _check(opt: torch.optim.Optimizer, kind: str, group_sig: tuple) -> tuple[list, list, list, int] | None:
    """(params, has_grad, steps, device) when every parameter with a gradient has complete,
    eligible state; else None."""
    params: list = []
    has_grad: list[bool] = []
    steps: list = []
    state = opt.state
    dev = None
    for g, (_, _, extra, _) in zip(opt.param_groups, group_sig, strict=False):
        keys = _state_keys(kind, extra)
        for p in g["params"]:
            if type(p) is not EmuTensor and not isinstance(p, EmuTensor):
                return None
            if dev is None:
                dev = p.emu_device
            elif p.emu_device != dev:
                return None
            params.append(p)
            grad = p.grad
            has_grad.append(grad is not None)
            if grad is None:
                continue
            if not isinstance(grad, EmuTensor) or grad.emu_shadow is not None or grad.is_sparse:
                return None
            st = state.get(p)
            if not st:
                return None
            for k in keys:
                v = st.get(k)
                if v is None:
                    return None
                if k == "step":
                    if isinstance(v, EmuTensor) or not isinstance(v, torch.Tensor):
                        return None  # capturable-style counters on the device: real step
                    steps.append(v)
                elif not isinstance(v, EmuTensor) or v.emu_shadow is not None:
                    return None
    if dev is None:
        return None
    return params, has_grad, steps, dev


def _cover(plan: _Plan, gradients: Any) -> None:
    """Split the plan's parameters with gradients into whole gradient sets and the rest."""
    plan.cover_gen = gradients.generation if gradients is not None else -1
    with_grad = {id(p) for p, want in zip(plan.params, plan.has_grad, strict=False) if want}
    sets = []
    if gradients is not None:
        sets = [gs for gs in gradients.live_sets() if all(id(p) in with_grad for p in gs.params)]
    covered = {id(p) for gs in sets for p in gs.params}
    plan.sets = sets
    plan.rest = [p for p in plan.params if id(p) not in covered]
    plan.rest_has_grad = [want for p, want in zip(plan.params, plan.has_grad, strict=False) if id(p) not in covered]


def _try_fast(opt: torch.optim.Optimizer, plan: _Plan, kind: str, fp: OptimizerFastPath) -> bool:
    if opt.state is not plan.state or len(opt.state) != plan.n_state or opt.param_groups is not plan.groups:
        return False
    if _group_signature(opt, kind) != plan.group_sig:
        return False
    attrs = opt.__dict__  # (a GradScaler with a fused optimizer sets these on the instance)
    if attrs.get("grad_scale") is not None or attrs.get("found_inf") is not None:
        return False
    gradients = fp.gradients
    if plan.cover_gen != (gradients.generation if gradients is not None else -1):
        _cover(plan, gradients)
    # A whole gradient set that nothing handed to Python code since it was armed holds exactly
    # its own plain gradients (see gpemu.fastpaths.gradients): one look at its state.
    for gs in plan.sets:
        if gs.state != "armed":
            return False
        group = gs.parent_ref()
        if group is None:
            return False
        if group.exposed and not _grads_ok(gs.params, _ALL):
            return False
    if plan.rest and not _grads_ok(plan.rest, plan.rest_has_grad):
        return False
    # Accepted: do what the real step would leave observable.
    ts = fp.ts
    if plan.shadow_gen != ts.shadow_writes:  # some tensor got a known value since: look
        params = plan.params
        if not all(map(is_, map(_get_shadow, params), repeat(None))):
            for p in params:
                ts.forget_value(p)
        plan.shadow_gen = ts.shadow_writes
    if plan.steps:
        torch._foreach_add_(plan.steps, 1.0)
    if plan.transient:
        plan.memory.touch(plan.transient)
    return True


class _All:
    """``want`` for every parameter of a set: it has a gradient."""

    def __iter__(self) -> Any:
        return repeat(True)


_ALL = _All()
_TENSOR_BASE: Any = torch._C.TensorBase  # (its stubs type the C-level descriptors as values)
_gget = _TENSOR_BASE.grad.__get__  # (C-level: the fast path's own look is no exposure)


def _grads_ok(params: list, has_grad: Any) -> bool:
    """Whether each parameter has a gradient exactly when the plan says, each a plain emulated
    tensor without a known value."""
    for p, want in zip(params, has_grad, strict=False):
        grad = p.grad
        if (grad is not None) is not want:
            return False
        if grad is not None and (grad.__class__ is not EmuTensor or grad.emu_shadow is not None):
            return False
    return True


def _make_step(fp: OptimizerFastPath, inner: Callable, kinds: dict[type, str]) -> Callable:
    plans = fp.plans
    stats = fp.stats

    engine = fp.engine

    def real(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        # torch's (or a subclass's) step, with the closure that may come with it: not the
        # emulator's own time (see gpemu.time.TimeEngine.suspend)
        depth = engine.suspend()
        try:
            return inner(self, *args, **kwargs)
        finally:
            engine.resume(depth)

    @functools.wraps(inner)
    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        kind = kinds.get(type(self))
        if kind is None or args or kwargs or not fp.enabled:
            return real(self, *args, **kwargs)
        plan = plans.get(self)
        if plan is not None:
            if _try_fast(self, plan, kind, fp):
                stats["fast"] += 1
                return None
            del plans[self]
        stats["real"] += 1
        group_sig = _group_signature(self, kind)
        found = None
        attrs = self.__dict__
        if group_sig is not None and attrs.get("grad_scale") is None and attrs.get("found_inf") is None:
            found = _check(self, kind, group_sig)
        if found is None:
            return real(self, *args, **kwargs)
        # State is complete: this real step is measured (transient memory), then later ones skip.
        params, has_grad, steps, dev = found
        mem = fp.memory[dev]
        before = mem.allocated
        n_state = len(self.state)
        with mem.peak_scope() as scope:
            out = real(self, *args, **kwargs)
        step_peak = scope.peak
        if mem.allocated == before and len(self.state) == n_state:
            plan = _Plan()
            plan.state, plan.n_state, plan.groups = self.state, n_state, self.param_groups
            plan.group_sig, plan.params, plan.has_grad, plan.steps = group_sig, params, has_grad, steps
            plan.transient = max(0, step_peak - before)
            plan.memory = mem
            plans[self] = plan
        return out

    step._gpemu_fast = True  # type: ignore[attr-defined]
    return step


_profiler_enabled = torch.autograd._profiler_enabled


def _profile_hook_step(func: Callable, engine: Any) -> Callable:
    """Torch's ``Optimizer.profile_hook_step`` (step pre/post hooks around ``func``) without its
    ``record_function`` range while no profiler records: entering and leaving that range costs
    ~6 µs of every step even when nobody listens (measured: ``benchmarks/step_parts.py``). While
    a profiler records, torch's own wrapper runs, range included. The hook order and the
    pre-hook result handling are torch's.

    It is an emulator entry (:meth:`gpemu.time.TimeEngine.enter`): the emulator's own work
    (gpemu's step hooks, a skipped step) is forgiven; hooks of other modules, and the real step
    (see ``_make_step``), run as the program's own time."""
    from torch.optim.optimizer import Optimizer, _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    with_range = Optimizer.profile_hook_step(func)

    def call_hook(hook: Callable, *args: Any) -> Any:
        if getattr(hook, "__module__", "").startswith("gpemu."):
            return hook(*args)  # the emulator's own (its time charge)
        depth = engine.suspend()
        try:
            return hook(*args)
        finally:
            engine.resume(depth)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _profiler_enabled():
            return with_range(*args, **kwargs)
        if kwargs:
            return engine.call(functools.partial(hooked, **kwargs), *args)
        return engine.call(hooked, *args)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        self = args[0]
        run = call_hook
        for hooks in (_global_optimizer_pre_hooks, self._optimizer_step_pre_hooks):
            for pre_hook in list(hooks.values()) if hooks else ():
                result = run(pre_hook, self, args, kwargs)
                if result is not None:
                    if isinstance(result, tuple) and len(result) == 2:
                        args, kwargs = result
                    else:
                        raise RuntimeError(
                            f"{func} must return None or a tuple of (new_args, new_kwargs), but got {result}."
                        )
        out = func(*args, **kwargs)
        self._optimizer_step_code()
        for hooks in (self._optimizer_step_post_hooks, _global_optimizer_post_hooks):
            for post_hook in list(hooks.values()) if hooks else ():
                run(post_hook, self, args, kwargs)
        return out

    wrapper._gpemu_fast = True  # type: ignore[attr-defined]
    return wrapper


def _make_zero_grad(fp: OptimizerFastPath, gradients: GradientState, inner: Callable) -> Callable:
    """``Optimizer.zero_grad`` with a fast ``set_to_none=True``: the same loop without torch's
    profiler range and foreach bookkeeping, and each dropped emulated gradient that nothing else
    references is kept by :meth:`gpemu.fastpaths.gradients.GradientState.drop_gradients`, so the
    next replayed backward reuses its wrapper instead of creating a new tensor object per
    parameter. Torch's own ``zero_grad`` runs for ``set_to_none=False``, while the torch profiler
    records, and before the optimizer set up its profile name."""
    drop_gradients = gradients.drop_gradients
    stats = fp.stats
    engine = fp.engine

    @functools.wraps(inner)
    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        if not set_to_none or not fp.enabled or _profiler_enabled() or "_zero_grad_profile_name" not in self.__dict__:
            return inner(self, set_to_none)
        stats["zero_grad_fast"] += 1
        engine.call(drop_gradients, self.param_groups, self)  # (the emulator's own work: forgiven)
        return None

    zero_grad._gpemu_fast = True  # type: ignore[attr-defined]
    return zero_grad


def _make_module_zero_grad(
    fp: OptimizerFastPath, gradients: GradientState, replay: ReplayState, inner: Callable
) -> Callable:
    """``Module.zero_grad(set_to_none=True)`` as the optimizer's fast one, over the module's
    parameters (the replay fast path's cached walk of the module tree): a replayed module's
    gradient set is given back whole. Torch's own runs for ``set_to_none=False``, replicas, and
    while the torch profiler records."""
    drop_gradients = gradients.drop_gradients
    params_of = replay.params_of
    stats = fp.stats
    engine = fp.engine

    @functools.wraps(inner)
    def zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
        if not set_to_none or not fp.enabled or _profiler_enabled() or self.__dict__.get("_is_replica"):
            return inner(self, set_to_none)
        params = params_of(self)
        if params is None:
            return inner(self, set_to_none)
        stats["module_zero_grad_fast"] += 1
        engine.call(drop_gradients, [{"params": params}], self)  # (the emulator's own work: forgiven)
        return None

    zero_grad._gpemu_fast = True  # type: ignore[attr-defined]
    return zero_grad


def install(rt: Runtime) -> None:
    """Put the fast path under the ``step`` of SGD/Adam/AdamW (inside torch's hook wrapper, so
    step hooks, including gpemu's time charge, still run) and a fast ``zero_grad`` over all
    optimizers (``config.replay``)."""
    if not rt.config.fast_paths:
        return
    fp = rt.optimizer_fastpath = OptimizerFastPath(rt)
    kinds = _fast_types()
    for cls in kinds:
        current = cls.__dict__.get("step")
        if current is None or getattr(current, "_gpemu_fast", False):
            continue  # inherited (AdamW from Adam), or already ours
        hooked = bool(getattr(current, "hooked", False))
        inner = current.__wrapped__ if hooked else current
        # Hooked now even if torch had not hooked it yet (no instance made): torch would wrap
        # it at the first instance with its own wrapper, range and all.
        new = _profile_hook_step(_make_step(fp, inner, kinds), fp.engine)
        new.hooked = True  # type: ignore[attr-defined]
        rt.patcher.replace(cls, "step", new)

    from torch.optim.optimizer import Optimizer

    if fp.gradients is not None:
        rt.patcher.replace(Optimizer, "zero_grad", _make_zero_grad(fp, fp.gradients, Optimizer.zero_grad))
        if fp.replay is not None:
            M = torch.nn.Module
            zero_grad = _make_module_zero_grad(fp, fp.gradients, fp.replay, M.zero_grad)
            rt.patcher.replace(M, "zero_grad", zero_grad)
    rt.patcher.on_restore(fp.end)
