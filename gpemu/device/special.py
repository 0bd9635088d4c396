"""The ops the emulator handles itself instead of through the op cache: reading a value
(``item``), device changes and copies (``_to_copy``, ``copy_``), a tensor resized in place
(``resize_``), GradScaler's finite check and scale update, and ``detach`` (hot inside autograd)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import hostvalues
from .copies import charge_h2d, peer_copy, to_emulated, to_host
from .emutensor import EmuTensor
from .ops import run_op
from .shadows import shadow_conv
from .state import device_index

__all__ = ["SPECIAL", "DETACH", "detach"]

aten = torch.ops.aten
_make_wrapper = torch.Tensor._make_wrapper_subclass
_META = torch.device("meta")
_inference_mode = torch.is_inference_mode_enabled


def _local_scalar_dense(func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    ts = t.emu_state
    ts.engine.synchronize(t.emu_device, "item")
    if t.numel() != 1:
        raise RuntimeError(f"a Tensor with {t.numel()} elements cannot be converted to Scalar")
    value = hostvalues.scalar_value(t.dtype, t.emu_shadow)
    ts.engine.settle()  # (the time since the wait was the emulator's)
    return value


def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    t = args[0]
    if not isinstance(t, EmuTensor):  # host tensor to an emulated device (e.g. autograd backward)
        idx = device_index(kwargs.get("device"))
        if idx is None:
            return func(*args, **kwargs)
        dtype = kwargs.get("dtype") or t.dtype
        return to_emulated(t.to(dtype), idx, bool(kwargs.get("non_blocking", False)))
    d = kwargs.get("device")
    if d is not None and torch.device(d).type == "cpu":
        values = to_host(t, reason="cpu")
        dtype = kwargs.get("dtype")
        if dtype is not None and dtype != values.dtype:
            values = values.to(dtype)
        if kwargs.get("pin_memory"):
            values = values.pin_memory()
        return values
    ts = t.emu_state
    idx = ts.device_index(d) if d is not None else None
    kw = dict(kwargs)
    kw.pop("device", None)
    out = run_op(ts, func, args, kw)
    if idx is not None and idx != out.emu_device:
        return peer_copy(out, idx)
    return out


def _copy_(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if not isinstance(dst, EmuTensor):
        # device -> host copy into an existing CPU tensor: a sync point with placeholder values.
        values = to_host(src, reason="cpu")
        with torch.no_grad():
            dst.copy_(values)
        return dst
    ts = dst.emu_state
    ts.shadow_writes += 1  # (dst's value may become known below)
    if not isinstance(src, EmuTensor):
        if isinstance(src, torch.Tensor) and src.dim() > 0 and src.device.type == "cpu":
            charge_h2d(ts, src, dst.emu_device, bool(kwargs.get("non_blocking", False) or (len(args) > 2 and args[2])))
        new_shadow = None
        if dst.numel() <= ts.shadow_limit:
            base = dst.emu_shadow if dst.emu_shadow is not None else _zeros_as(dst)
            try:
                with torch.no_grad():
                    base.copy_(src if isinstance(src, torch.Tensor) else torch.tensor(src))
                new_shadow = base
            except Exception:
                new_shadow = None
        dst.emu_shadow = new_shadow
        return dst
    if src.emu_device != dst.emu_device:
        # Peer copy between emulated GPUs: allowed by CUDA; metadata of dst is unchanged.
        if dst.numel() <= ts.shadow_limit and src.emu_shadow is not None:
            base = dst.emu_shadow if dst.emu_shadow is not None else _zeros_as(dst)
            with torch.no_grad():
                base.copy_(src.emu_shadow)
            dst.emu_shadow = base
        else:
            dst.emu_shadow = None
        return dst
    if dst.emu_shadow is None and src.emu_shadow is not None and dst.numel() <= ts.shadow_limit:
        dst.emu_shadow = _zeros_as(dst)
    return run_op(ts, func, args, kwargs)


def _resize_(func: Any, args: tuple, kwargs: dict) -> Any:
    """``t.resize_(size)`` as CUDA does it (ATen's ``resize_``): the tensor takes the new shape
    in place, contiguous (or in ``memory_format``) from its storage offset; its storage grows
    when the new shape needs more bytes (a new allocation: both count at the peak, as
    :meth:`gpemu.memory.Block.resize` says) and is kept otherwise. Context parallelism shards its
    buffers so (``context_parallel(mesh, buffers=...)``), and restores them on exit."""
    t, size = args[0], args[1]
    if not isinstance(t, EmuTensor):
        return func(*args, **kwargs)
    ts = t.emu_state
    fmt = kwargs.get("memory_format") or torch.contiguous_format
    layout = torch.empty(size, dtype=t.dtype, device=_META, memory_format=fmt)
    offset = int(t.storage_offset())
    needed = (offset + layout.numel()) * t.element_size() if layout.numel() else 0
    block = t.emu_block
    if needed > (block.size if block is not None else 0):
        ts.resize_block(t, needed)
    shadow = t.emu_shadow
    kept = None
    if shadow is not None and layout.numel() <= shadow.numel() and offset == 0 and t.is_contiguous():
        kept = shadow.reshape(-1)[: layout.numel()].reshape(layout.shape).contiguous(memory_format=fmt)
    t.data = ts.wrap(layout.shape, layout.stride(), offset, t.dtype, t.emu_device, t.emu_block)
    ts.set_known_value(t, kept)  # (growing: the new elements are uninitialised, as on a GPU)
    return t


def _zeros_as(t: EmuTensor) -> torch.Tensor:
    """Zeros laid out as emulated tensor ``t`` (the values a copy into part of it starts from)."""
    return torch.zeros_like(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))


def _non_finite_check(func: Any, args: tuple, kwargs: dict) -> Any:
    # Placeholder values: emulated gradients are finite, found_inf keeps its value (see
    # hostvalues). Real values (gpemu.device.values): the check and unscale run on them.
    emus = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, EmuTensor)]
    if not emus or emus[0].emu_state.values is None:
        return None
    if all(e.emu_shadow is not None for e in emus):
        func(*shadow_conv(list(args)), **{k: shadow_conv(v) for k, v in kwargs.items()})
    return None


def _amp_update_scale(func: Any, args: tuple, kwargs: dict) -> Any:
    scale = args[0]
    emus = [a for a in args if isinstance(a, EmuTensor)]
    if emus and all(e.emu_shadow is not None for e in emus):
        func(*shadow_conv(list(args)), **{k: shadow_conv(v) for k, v in kwargs.items()})
    else:
        for e in emus:
            if e is scale or e is args[1]:
                e.emu_shadow = None
    return scale


def detach(func: Any, args: tuple, kwargs: dict | None) -> Any:
    # Hot (autograd detaches every gradient it stores): an alias with the same metadata.
    t = args[0]
    k = t.emu_key
    if _inference_mode() and not t.is_inference():
        # (a view of a normal tensor stays normal: see TensorState.view)
        with torch.inference_mode(False):
            out = _make_wrapper(EmuTensor, k[0], strides=k[1], storage_offset=k[2], dtype=k[3], device=_META)
    else:
        out = _make_wrapper(EmuTensor, k[0], strides=k[1], storage_offset=k[2], dtype=k[3], device=_META)
    out.emu_device = t.emu_device
    out.emu_block = t.emu_block
    out.emu_shadow = t.emu_shadow
    out.emu_meta = t.emu_meta
    out.emu_key = k
    out.emu_state = t.emu_state
    return out


DETACH = id(aten.detach.default)
SPECIAL: dict[int, Callable] = {
    id(op): handler
    for op, handler in {
        aten._local_scalar_dense.default: _local_scalar_dense,
        aten._to_copy.default: _to_copy,
        aten.copy_.default: _copy_,
        aten.resize_.default: _resize_,
        aten._amp_foreach_non_finite_check_and_unscale_.default: _non_finite_check,
        aten._amp_update_scale_.default: _amp_update_scale,
    }.items()
}
