"""Copies between the host and emulated GPUs, and between emulated GPUs: what ``.cuda()``,
``.to()``, ``.cpu()`` and autograd's device moves do to an emulated tensor (the ways in that
call these are :mod:`gpemu.ways_in`; the copy time is :mod:`gpemu.transfers`')."""

from __future__ import annotations

from typing import Any

import torch

from .. import hostvalues
from .emutensor import EmuTensor
from .state import TensorState, current_state
from .values import laid_out

__all__ = ["to_host", "to_emulated", "host_to_emulated", "peer_copy", "PeerCopy", "charge_h2d"]

_META = torch.device("meta")


def to_host(t: EmuTensor, reason: str = "cpu") -> torch.Tensor:
    """Bring an emulated tensor back: wait for its device, charge the copy, give placeholder
    values (its shadow when known, else zeros; see :mod:`gpemu.hostvalues`)."""
    ts = t.emu_state
    ts.engine.synchronize(t.emu_device, reason)
    if reason == "cpu":
        ts.rt.transfers.copy_to_host(t, t.emu_device)
    values = hostvalues.host_values(t.shape, t.dtype, t.emu_shadow)
    ts.engine.settle()  # (the time since the wait was the emulator's)
    return values


def charge_h2d(ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool, issued_at: float | None = None) -> None:
    """Charge the copy of host tensor ``t`` into an existing emulated tensor on ``dev``."""
    ts.rt.transfers.copy_to_device(t, dev, non_blocking, issued_at)


def _copy_in(ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool) -> EmuTensor:
    """``t`` (a host tensor that needs no gradient) copied onto emulated device ``dev``: run as an
    emulator entry (the copy is issued when the program asked for it; the emulator's own time
    around it, before and after the wait of a pageable copy, is forgiven)."""
    transfers = ts.rt.transfers
    if transfers.moving_model or t.is_meta:
        # Part of a whole-model move (charged once for the model), or a meta tensor: autograd's
        # zeros for an unused output of a custom Function are made on the meta device (an
        # emulated tensor's C++ device), where a real GPU would make them on the device itself:
        # moving one onto the device copies nothing.
        # Model parameters/buffers get no shadows: their values are not what host code reads
        # back, and a shadow would add a host op to every step of the optimizer.
        if t.is_contiguous() or _non_overlapping_dense(t):
            stride = t.stride()
        else:
            stride = torch.empty(t.shape, device=_META).stride()
        # (In value mode they do: gpemu.device.values.)
        nbytes = t.numel() * t.element_size()
        if ts.values is not None and not t.is_meta:
            ts.values.check_room(nbytes)
        block = ts.memory[dev].allocate(nbytes) if nbytes else None
        e = ts.wrap(t.shape, stride, 0, t.dtype, dev, block)
        if ts.values is not None and not t.is_meta:
            e.emu_shadow = laid_out(t.detach().clone(), t.shape, stride)
        return e
    plan = transfers.copy_plan(t, dev, non_blocking)
    nbytes = plan.nbytes
    if ts.values is not None:
        ts.values.check_room(nbytes)
    block = ts.memory[dev].allocate(nbytes) if nbytes else None  # (an OOM changes nothing)
    if nbytes:  # (torch copies nothing for an empty tensor: no transfer, no wait)
        transfers.charge(plan, dev)
    e = ts.wrap(plan.shape, plan.stride, 0, plan.dtype, dev, block)
    if plan.host and plan.numel <= ts.shadow_limit:
        # the copy's values, known on the host (gpemu.hostvalues); the plan keeps t's dtype, and
        # t needs no gradient here (to_emulated detached it), so a plain clone is the copy (its
        # strides are the plan's unless t was not dense)
        shadow = t.clone()
        e.emu_shadow = shadow if shadow.stride() == plan.stride else laid_out(shadow, plan.shape, plan.stride)
    return e


def _non_overlapping_dense(t: torch.Tensor) -> bool:
    try:
        return torch._C._is_non_overlapping_and_dense(t)  # type: ignore[attr-defined]
    except Exception:
        return False


class _ToDevice(torch.autograd.Function):
    """Host -> emulated copy that keeps autograd (grads flow back as host placeholders)."""

    @staticmethod
    def forward(ctx: Any, ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool) -> EmuTensor:
        ctx.host_dtype = t.dtype
        return ts.call(_copy_in, ts, t.detach(), dev, non_blocking)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        host = to_host(grad) if isinstance(grad, EmuTensor) else grad
        return None, host.to(ctx.host_dtype), None, None


def to_emulated(t: torch.Tensor, device: int, non_blocking: bool = False) -> EmuTensor:
    """Copy a host tensor onto the active run's emulated GPU ``device``: counts memory, charges
    transfer time, keeps a shadow of small values. Keeps autograd when ``t`` requires grad."""
    ts = t.emu_state if isinstance(t, EmuTensor) else current_state()
    dev = device if device.__class__ is int and device in ts.ordinals else ts.check(device)
    if isinstance(t, EmuTensor):
        return t if t.emu_device == dev else peer_copy(t, dev)
    return host_to_emulated(ts, t, dev, non_blocking)


def host_to_emulated(ts: TensorState, t: torch.Tensor, dev: int, non_blocking: bool = False) -> EmuTensor:
    """:func:`to_emulated` of a host tensor onto a valid device ``dev`` of ``ts``'s run (the usual
    ``x.cuda()`` of a batch, whose caller knows both)."""
    if t.requires_grad and torch.is_grad_enabled():
        return _ToDevice.apply(ts, t, dev, non_blocking)
    return ts.call(_copy_in, ts, t.detach() if t.requires_grad else t, dev, non_blocking)


def peer_copy(t: EmuTensor, idx: int) -> EmuTensor:
    """A copy of ``t`` on another emulated GPU (counted there). GPU-to-GPU copy time is not
    charged (documented limitation)."""
    ts = t.emu_state
    idx = ts.check(idx)
    nbytes = t.numel() * t.element_size()
    stride = (
        t.stride() if (t.is_contiguous() or _non_overlapping_dense(t)) else torch.empty(t.shape, device=_META).stride()
    )
    out = ts.wrap(t.shape, stride, 0, t.dtype, idx, ts.memory[idx].allocate(nbytes) if nbytes else None)
    if t.emu_shadow is not None:
        out.emu_shadow = t.emu_shadow.clone()
    return out


class PeerCopy(torch.autograd.Function):
    """:func:`peer_copy` that keeps autograd (the gradient goes back to the source device)."""

    @staticmethod
    def forward(ctx: Any, t: EmuTensor, idx: int) -> EmuTensor:
        ctx.src = t.emu_device
        return peer_copy(t, idx)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return peer_copy(grad, ctx.src), None
