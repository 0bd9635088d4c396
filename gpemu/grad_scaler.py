"""``torch.amp.GradScaler`` on emulated GPUs (component ``gpemu.grad_scaler``).

On the CPU build a ``GradScaler('cuda')`` warns and disables itself; on emulated GPUs it stays
enabled, as on a real GPU. Gradients carry no values, so the scaler's checks are emulated with
the values a healthy run has (see :mod:`gpemu.hostvalues`): no inf/NaN is ever found, every step
is taken, and the scale grows by ``growth_factor`` every ``growth_interval`` steps. With real
values (``values="real"``) torch's own scaler runs on them: an overflow skips the step and backs
the scale off, as on a GPU. The scale is
kept on the host (``get_scale()`` and ``state_dict()`` are right); unscaling charges one
memory-bound kernel over the gradients, and ``step()`` waits for the backward pass as the real
``found_inf.item()`` would.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.amp.grad_scaler import GradScaler, _refresh_per_optimizer_state

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "ScalerEmulation", "METHODS"]


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


class ScalerEmulation:
    """The emulated ``GradScaler`` methods of one run. Each takes the scaler first, as the
    method it stands for does (:data:`METHODS`), and runs only for an enabled CUDA scaler
    (:func:`_emulated`); any other scaler keeps torch's own method."""

    def __init__(self, rt: Runtime, originals: dict[str, Callable[..., object]]) -> None:
        self.rt = rt
        self.originals = originals  # torch's methods, by their names

    def _charge(self, device: torch.device, seconds: float, name: str) -> None:
        engine = self.rt.engine
        if engine is not None and device.type == "cuda":
            engine.stream(device.index or 0).enqueue(seconds, "op", name)

    def unscale_grads(
        self,
        scaler: GradScaler,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """One memory-bound kernel per device over its gradients; a found-inf flag per device."""
        per_device: dict[torch.device, torch.Tensor] = {}
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
            bandwidth = float(self.rt.gpus[device.index or 0].memory_bandwidth)
            self._charge(device, 2 * n / bandwidth, "amp unscale")
        if self.rt.config.real_values:  # torch's own unscale and check, on the real values
            return cast(
                dict[torch.device, torch.Tensor],
                self.originals["_unscale_grads_"](scaler, optimizer, inv_scale, found_inf, allow_fp16),
            )
        return per_device

    def maybe_opt_step(
        self,
        scaler: GradScaler,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict,
        *args: Any,  # (handed to optimizer.step as the script gave them)
        **kwargs: Any,
    ) -> float | None:
        """The optimizer step, after the host waited for the backward pass as found_inf.item() makes
        it wait on a real GPU (a sync point); no inf is ever found."""
        engine = self.rt.engine
        for device in optimizer_state["found_inf_per_device"]:
            if engine is not None and device.type == "cuda":
                engine.stream(device.index or 0).synchronize("GradScaler.step")
        return optimizer.step(*args, **kwargs)

    def update(self, scaler: GradScaler, new_scale: float | torch.Tensor | None = None) -> None:
        """The scale set or grown on the host mirror, and copied to the device-side tensors."""
        scale, _ = scaler._check_scale_growth_tracker("update")
        m = _mirror(scaler)
        if new_scale is not None:
            m.scale = _given_scale(new_scale)
            m.growth = 0
        else:
            found = [f for st in scaler._per_optimizer_states.values() for f in st["found_inf_per_device"].values()]
            if len(found) == 0:
                raise AssertionError("No inf checks were recorded prior to update.")
            m.growth += 1
            if m.growth >= scaler._growth_interval:
                m.scale *= scaler._growth_factor
                m.growth = 0
        # Keep the device-side tensors in step (their host shadows, where the device layer keeps them).
        with torch.no_grad():
            scale.fill_(m.scale)
            if scaler._growth_tracker is not None:
                scaler._growth_tracker.fill_(m.growth)
        scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)

    def get_scale(self, scaler: GradScaler) -> float:
        return _mirror(scaler).scale

    def get_growth_tracker(self, scaler: GradScaler) -> int:
        return _mirror(scaler).growth

    def load_state_dict(self, scaler: GradScaler, state_dict: dict[str, Any]) -> None:
        self.originals["load_state_dict"](scaler, state_dict)
        scaler.__dict__["_gpemu_mirror"] = _ScaleMirror(state_dict["scale"], state_dict["_growth_tracker"])


# GradScaler's method -> the ScalerEmulation method that stands for it on an enabled CUDA scaler.
METHODS: dict[str, str] = {
    "_unscale_grads_": "unscale_grads",
    "_maybe_opt_step": "maybe_opt_step",
    "update": "update",
    "get_scale": "get_scale",
    "_get_growth_tracker": "get_growth_tracker",
    "load_state_dict": "load_state_dict",
}


def _emulated(scaler: GradScaler) -> bool:
    return getattr(scaler, "_device", None) == "cuda" and getattr(scaler, "_enabled", False)


def _mirror(scaler: GradScaler) -> _ScaleMirror:
    m = scaler.__dict__.get("_gpemu_mirror")
    if m is None:
        m = scaler.__dict__["_gpemu_mirror"] = _ScaleMirror(scaler._init_scale, scaler._init_growth_tracker)
    return m


def _given_scale(new_scale: float | torch.Tensor) -> float:
    """``update(new_scale)``'s value, checked as torch checks it."""
    if isinstance(new_scale, float):
        return new_scale
    if not (isinstance(new_scale, torch.Tensor) and new_scale.numel() == 1 and not new_scale.requires_grad):
        raise AssertionError(
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor "
            "or torch.FloatTensor with requires_grad=False."
        )
    return float(new_scale.item())


def _scaler_method(emulated: Callable[..., object], original: Callable[..., object]) -> Callable[..., object]:
    """A GradScaler method: ``emulated`` for an enabled CUDA scaler, torch's ``original`` otherwise
    (named and documented as the original)."""

    @functools.wraps(original)
    def method(scaler: GradScaler, *args: object, **kwargs: object) -> object:
        if _emulated(scaler):
            return emulated(scaler, *args, **kwargs)
        return original(scaler, *args, **kwargs)

    return method


def install(rt: Runtime) -> None:
    """Patch ``torch.amp.GradScaler`` (and so ``torch.cuda.amp.GradScaler``) for this run."""
    originals = {name: GradScaler.__dict__[name] for name in METHODS}
    emulation = ScalerEmulation(rt, originals)
    for name, ours in METHODS.items():
        if rt.config.real_values and name != "_unscale_grads_":
            # Real values: torch's own scaler (found_inf read back, steps skipped on overflow, the
            # scale backed off), its unscale charged as above.
            continue
        rt.patcher.replace(GradScaler, name, _scaler_method(getattr(emulation, ours), originals[name]))
