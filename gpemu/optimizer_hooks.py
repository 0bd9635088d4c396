"""Optimizer steps on emulated GPUs (component ``gpemu.optimizer_hooks``).

Torch's global optimizer-step hooks mark each ``optimizer.step()`` of an optimizer whose
parameters live on an emulated GPU: the step's own ops are covered by ONE charge
(:func:`gpemu.costs.optimizer_step_seconds`: the database's ``optimizer_step`` when measured,
else the bytes the update reads and writes over memory bandwidth), enqueued on the device's
stream when the step ends, and the step marks the end of an iteration (the summary's iteration
count and steady state; a sharing backend's ``iteration`` granularity).

Whether the step's foreach kernels are executed at all is the optimizer fast path's business
(:mod:`gpemu.fastpaths.optimizer`); these hooks run either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .costs import optimizer_step_host_seconds, optimizer_step_seconds

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime
    from .time import TimeEngine

__all__ = ["install", "optimizer_device", "StepHooks"]


def optimizer_device(optimizer: torch.optim.Optimizer) -> int | None:
    """The emulated device of the optimizer's first parameter; None for a host optimizer."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            dev = p.device
            if dev.type == "cuda":
                return dev.index or 0
            return None
    return None


def _uncovered(engine: TimeEngine, closure: Callable[[], Any]) -> Callable[[], Any]:
    """``closure`` run outside the optimizer step's charge (which covers the step's own ops)."""

    def run_closure() -> Any:
        engine.set_charged(False)
        try:
            return closure()
        finally:
            engine.set_charged(True)

    return run_closure


class StepHooks:
    """The global optimizer-step hooks of one run: :meth:`before_step` takes the step's own ops
    out of per-op charging, :meth:`after_step` charges the step as one and ends the iteration."""

    def __init__(self, rt: Runtime, engine: TimeEngine) -> None:
        self.rt = rt
        self.engine = engine

    def before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
        engine = self.engine
        # The step's own ops are covered by one optimizer charge (no per-op time inside).
        engine.set_charged(True)
        # A closure (Lightning's automatic optimization, LBFGS) runs the forward and backward
        # inside step(): that is the program's own GPU work, charged as anywhere else.
        if "closure" in kwargs:
            closure = kwargs["closure"]
            if callable(closure):
                return args, {**kwargs, "closure": _uncovered(engine, closure)}
        elif len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
            return (args[0], _uncovered(engine, args[1]), *args[2:]), kwargs
        return None

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        engine = self.engine
        engine.set_charged(False)
        device = optimizer_device(optimizer)
        if device is None or device >= engine.num_devices:
            return  # a CPU optimizer: no GPU time
        seconds, _ = optimizer_step_seconds(self.rt, optimizer, device)
        # (0 without a host model, decided here: the look-up is a call on every step)
        issue = 0.0 if engine.host_model is None else optimizer_step_host_seconds(self.rt, optimizer)
        # (its last kernel cannot end before the host launched it)
        engine.stream(device).enqueue(seconds if seconds > issue else issue, "optimizer", type(optimizer).__name__)
        if issue:
            engine.charge_host(issue)
        engine.end_iteration(device)


def install(rt: Runtime) -> None:
    """Register the global step hooks for this run (removed by ``gpemu.unpatch()``)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    hooks = StepHooks(rt, rt.engine)
    pre = register_optimizer_step_pre_hook(hooks.before_step)
    post = register_optimizer_step_post_hook(hooks.after_step)
    rt.patcher.on_restore(pre.remove)
    rt.patcher.on_restore(post.remove)
