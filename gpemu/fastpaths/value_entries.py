"""With real values (``values="real"``), the host time of what the fast paths would run as the
emulator's own work is forgiven as theirs is. Component ``gpemu.fastpaths.value_entries``.

A run with real values runs every op (the fast paths would compute no values: see
:mod:`gpemu.device.values`), so its host also runs the Python and the autograd engine that a
run with placeholder values replaces by a replay: a model's forward, ``loss.backward()``, a
skippable optimizer step, ``zero_grad``. On a run with placeholders those are emulator entries
(:mod:`gpemu.time.host`), their host time forgiven; here they run at CPU speed with the values
computed, and that time is no more the emulated program's than the replay's was. So each is an
emulator entry here too (GPU work enqueued inside is issued at the call's start, as a replay
issues it; waits inside count; a modelled host still charges each op's issue time), and the
times a script prints are those of the same run with placeholder values (``docs/device.md``).

What stays the program's own, in both runs: its loop (data, logging, the learning-rate
schedule), optimizer steps the fast path would not skip (fused, with a closure, under a
GradScaler), and ops it calls outside these (``clip_grad_norm_``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gpemu.model_time import emulated_device

from .optimizer import skippable

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.model_time import ModelTime
    from gpemu.runtime import Runtime
    from gpemu.time.engine import TimeEngine

__all__ = ["install"]


def _as_entry(engine: TimeEngine, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run as an emulator entry (its host time forgiven)."""

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        engine.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            engine.leave()

    return entry


def _module_call(engine: TimeEngine, mt: ModelTime, inner: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.__call__``: an outermost call on emulated tensors (what a replay stands for) is
    an emulator entry; inner calls and calls on host tensors are the program's."""

    def __call__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not mt.outermost():
            return inner(self, *args, **kwargs)
        engine.enter()  # (looking for the module's device is the emulator's work too: ~40 us)
        try:
            if emulated_device(self, args, kwargs) is not None:
                return inner(self, *args, **kwargs)
        finally:
            engine.leave()
        return inner(self, *args, **kwargs)

    __call__.__wrapped__ = inner  # type: ignore[attr-defined]
    return __call__


def _optimizer_step(engine: TimeEngine, hooked: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer's ``step()`` (``hooked``: torch's step-hook wrapper around the class's own): an
    emulator entry where the fast path would skip it, hooks included (its own are gpemu's charge)."""

    @functools.wraps(hooked)
    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not skippable(self):  # (a closure runs the program's forward)
            return hooked(self, *args, **kwargs)
        engine.enter()
        try:
            return hooked(self, *args, **kwargs)
        finally:
            engine.leave()

    step.hooked = True  # type: ignore[attr-defined]  # (torch wraps an unhooked step at the next instance)
    return step


def install(rt: Runtime) -> None:
    """Install the entries (only with real values: otherwise the fast paths are these entries)."""
    if not rt.config.real_values:
        return
    engine, patcher = rt.engine, rt.patcher
    M = torch.nn.Module
    patcher.replace(M, "__call__", _module_call(engine, rt.model_time, M.__call__))
    patcher.replace(torch.autograd, "backward", _as_entry(engine, torch.autograd.backward))
    patcher.replace(torch.autograd, "grad", _as_entry(engine, torch.autograd.grad))
    F = torch.nn.functional
    patcher.replace(F, "cross_entropy", _as_entry(engine, F.cross_entropy))  # (the fused loss's)
    from torch.optim import SGD, Adam, AdamW, Optimizer

    for cls in (SGD, Adam, AdamW):
        current = cls.__dict__.get("step")
        if current is None:  # (inherited: AdamW's is Adam's)
            continue
        hooked = current if getattr(current, "hooked", False) else Optimizer.profile_hook_step(current)
        patcher.replace(cls, "step", _optimizer_step(engine, hooked))
    patcher.replace(Optimizer, "zero_grad", _as_entry(engine, Optimizer.zero_grad))
    patcher.replace(M, "zero_grad", _as_entry(engine, M.zero_grad))
