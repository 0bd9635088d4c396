"""Float8 matrix products on emulated GPUs (component ``gpemu.float8``).

``torch._scaled_mm`` (and its ``_scaled_mm_v2`` and grouped forms) multiplies float8 matrices on
FP8 tensor cores. Real CUDA torch runs them only on GPUs that have such units and refuses them
elsewhere, before looking at the operands (ATen's ``ScaledBlas.cpp``): compute capability 8.9
(Ada) or 9.0 and later for ``_scaled_mm``, only 9.x and 10.x (Hopper, datacenter Blackwell) for
the grouped forms. This component gives the emulated GPUs the same refusal, with torch's own
exception type and message. Where the GPU has FP8 tensor cores, the op runs as any other: the op
cache gives its outputs (torch's meta kernels: shape, output dtype, a new allocation) and the
cost model prices it at the GPU's FP8 tensor-core peak (``gpemu.costmodel.precision``), so
torchao's ``Float8Linear`` and other float8 training recipes are charged what they are.

The check is an op handler (``TensorState.op_handlers``) that declines (``NotImplemented``) once
the GPU passes: the op cache then keeps the op's entry, and later calls never reach the handler.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .costmodel.gpus import compute_capability
from .device import EmuTensor

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["Fp8Requirement", "REQUIREMENTS", "Float8Gate", "install"]

aten = torch.ops.aten

# The messages of ATen's checks, word for word (aten/src/ATen/native/cuda/ScaledBlas.cpp).
_SCALED_MM_MESSAGE = (
    "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9, or ROCm MI300+"
)
_GROUPED_MESSAGE = (
    "torch._scaled_grouped_mm is only supported on CUDA devices with compute capability = [9.0, 10.0], or ROCm MI300+"
)


@dataclass(frozen=True)
class Fp8Requirement:
    """Which GPUs run an op, and what torch raises on the others (``error(message)``)."""

    allowed: Callable[[tuple[int, int]], bool]
    error: type[Exception]
    message: str


def _ada_or_later(capability: tuple[int, int]) -> bool:
    return capability >= (8, 9)


def _hopper_or_datacenter_blackwell(capability: tuple[int, int]) -> bool:
    return capability[0] in (9, 10)


# ATen raises with TORCH_CHECK (RuntimeError) in _scaled_mm, TORCH_CHECK_NOT_IMPLEMENTED in
# _scaled_mm_v2 and TORCH_CHECK_VALUE (ValueError) in the grouped forms.
_SCALED_MM = Fp8Requirement(_ada_or_later, RuntimeError, _SCALED_MM_MESSAGE)
_SCALED_MM_V2 = Fp8Requirement(_ada_or_later, NotImplementedError, _SCALED_MM_MESSAGE)
_GROUPED = Fp8Requirement(_hopper_or_datacenter_blackwell, ValueError, _GROUPED_MESSAGE)
_OPS: dict[str, Fp8Requirement] = {
    "_scaled_mm": _SCALED_MM,
    "_scaled_mm_v2": _SCALED_MM_V2,
    "_scaled_grouped_mm": _GROUPED,
    "_scaled_grouped_mm_v2": _GROUPED,
}
# Every overload of those ops this torch has (``default``, ``out``), by overload.
REQUIREMENTS: dict[Any, Fp8Requirement] = {
    getattr(packet, overload): need
    for name, need in _OPS.items()
    if (packet := getattr(aten, name, None)) is not None
    for overload in packet.overloads()
}


class Float8Gate:
    """The FP8 ops' GPU requirement, checked against the emulated GPU an op runs on."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def handlers(self) -> dict[int, Callable[[Any, tuple, dict], Any]]:
        """Op handlers by ``id(op)`` (``TensorState.op_handlers``' keys)."""
        return {id(op): self.check for op in REQUIREMENTS}

    def check(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Raise torch's error when the op's GPU cannot run it; else decline (NotImplemented),
        so that the op runs, and is priced, as any other."""
        need = REQUIREMENTS[func]
        device = _device_of(args, kwargs)
        if device is not None and not need.allowed(compute_capability(self.rt.gpus[device])):
            raise need.error(need.message)
        return NotImplemented


def _device_of(args: tuple, kwargs: dict) -> int | None:
    """The emulated device of the op's first emulated tensor (None: none is emulated)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, EmuTensor):
            return a.emu_device
    return None


def install(rt: Runtime) -> None:
    """Check the FP8 ops' GPU requirement on the run's emulated tensors."""
    handlers = Float8Gate(rt).handlers()
    table = rt.tensors.op_handlers
    table.update(handlers)
    rt.patcher.on_restore(functools.partial(_forget, table, handlers))


def _forget(table: dict[int, Any], handlers: dict[int, Any]) -> None:
    for key in handlers:
        table.pop(key, None)
