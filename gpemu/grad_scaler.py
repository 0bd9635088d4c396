"""``torch.amp.GradScaler`` on emulated GPUs (component ``gpemu.grad_scaler``).

On the CPU build a ``GradScaler('cuda')`` warns and disables itself; on emulated GPUs it stays
enabled, as on a real GPU. Gradients carry no values, so the scaler's checks are emulated with
the values a healthy run has (see :mod:`gpemu.hostvalues`): no inf/NaN is ever found, every step
is taken, and the scale grows by ``growth_factor`` every ``growth_interval`` steps. The scale is
kept on the host (``get_scale()`` and ``state_dict()`` are right); unscaling charges one
memory-bound kernel over the gradients, and ``step()`` waits for the backward pass as the real
``found_inf.item()`` would.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install"]


class _ScaleMirror:
    """The scaler's scale and growth tracker kept on the host.

    Emulated tensors hold no values, so ``torch._amp_update_scale_`` cannot change the scale;
    with no infs found (placeholders are never inf), the scale grows by ``growth_factor`` every
    ``growth_interval`` steps, exactly as on a GPU when training is healthy.
    """

    __slots__ = ("scale", "growth")

    def __init__(self, scale: float, growth: int = 0) -> None:
        self.scale = float(scale)
        self.growth = int(growth)


def install(rt: Runtime) -> None:
    """Patch ``torch.amp.GradScaler`` (and so ``torch.cuda.amp.GradScaler``) for this run."""
    from torch.amp import grad_scaler as gs

    cls = gs.GradScaler
    orig = {
        name: cls.__dict__[name]
        for name in (
            "_unscale_grads_",
            "_maybe_opt_step",
            "update",
            "get_scale",
            "_get_growth_tracker",
            "load_state_dict",
        )
    }

    def emulated(self: Any) -> bool:
        return getattr(self, "_device", None) == "cuda" and getattr(self, "_enabled", False)

    def mirror(self: Any) -> _ScaleMirror:
        m = self.__dict__.get("_gpemu_mirror")
        if m is None:
            m = _ScaleMirror(self._init_scale, self._init_growth_tracker)
            self.__dict__["_gpemu_mirror"] = m
        return m

    def charge(device: torch.device, seconds: float, name: str) -> None:
        eng = rt.engine
        if eng is not None and device.type == "cuda":
            eng.stream(device.index or 0).enqueue(seconds, "op", name)

    def _unscale_grads_(self: Any, optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool) -> dict:
        if not emulated(self):
            return orig["_unscale_grads_"](self, optimizer, inv_scale, found_inf, allow_fp16)
        per_device: dict[torch.device, Any] = {}
        nbytes: dict[torch.device, int] = collections.defaultdict(int)
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                nbytes[grad.device] += grad.numel() * grad.element_size()
                if grad.device not in per_device:
                    per_device[grad.device] = torch.full((), 0.0, dtype=torch.float32, device=grad.device)
        for device, n in nbytes.items():
            # A memory-bound kernel: read and write every gradient once.
            bandwidth = float(getattr(rt.gpus[device.index or 0], "memory_bandwidth", 0) or 900e9)
            charge(device, 2 * n / bandwidth, "amp unscale")
        return per_device

    def _maybe_opt_step(self: Any, optimizer: Any, optimizer_state: dict, *args: Any, **kwargs: Any) -> Any:
        if not emulated(self):
            return orig["_maybe_opt_step"](self, optimizer, optimizer_state, *args, **kwargs)
        eng = rt.engine
        # found_inf.item() is a sync point on a real GPU: the host waits for the backward pass.
        for device in optimizer_state["found_inf_per_device"]:
            if eng is not None and device.type == "cuda":
                eng.stream(device.index or 0).synchronize("GradScaler.step")
        return optimizer.step(*args, **kwargs)

    def update(self: Any, new_scale: Any = None) -> None:
        if not emulated(self):
            return orig["update"](self, new_scale)
        _scale, _ = self._check_scale_growth_tracker("update")
        m = mirror(self)
        if new_scale is not None:
            if isinstance(new_scale, float):
                m.scale = new_scale
            else:
                if not (isinstance(new_scale, torch.Tensor) and new_scale.numel() == 1 and not new_scale.requires_grad):
                    raise AssertionError(
                        "new_scale should be a float or a 1-element torch.cuda.FloatTensor "
                        "or torch.FloatTensor with requires_grad=False."
                    )
                m.scale = float(new_scale.item())
            m.growth = 0
        else:
            found = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
            if len(found) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            m.growth += 1
            if m.growth >= self._growth_interval:
                m.scale *= self._growth_factor
                m.growth = 0
        # Keep the device-side tensors in step (their host shadows, where the device layer keeps them).
        with torch.no_grad():
            _scale.fill_(m.scale)
            if self._growth_tracker is not None:
                self._growth_tracker.fill_(m.growth)
        self._per_optimizer_states = collections.defaultdict(gs._refresh_per_optimizer_state)

    def get_scale(self: Any) -> float:
        if not emulated(self):
            return orig["get_scale"](self)
        return mirror(self).scale

    def _get_growth_tracker(self: Any) -> int:
        if not emulated(self):
            return orig["_get_growth_tracker"](self)
        return mirror(self).growth

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        orig["load_state_dict"](self, state_dict)
        if emulated(self):
            self.__dict__["_gpemu_mirror"] = _ScaleMirror(state_dict["scale"], state_dict["_growth_tracker"])

    for name, fn in (
        ("_unscale_grads_", _unscale_grads_),
        ("_maybe_opt_step", _maybe_opt_step),
        ("update", update),
        ("get_scale", get_scale),
        ("_get_growth_tracker", _get_growth_tracker),
        ("load_state_dict", load_state_dict),
    ):
        fn.__name__ = name
        fn.__qualname__ = f"GradScaler.{name}"
        rt.patcher.replace(cls, name, fn)
