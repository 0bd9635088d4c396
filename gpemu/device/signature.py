"""Op signatures: the keys of the op metadata cache.

The output metadata of an op depends only on the op, its inputs' shapes/strides/dtypes/devices
and its non-tensor arguments, so the first call of each signature runs the meta kernel and later
calls build outputs from the cached entry (:mod:`gpemu.device.ops`). Python floats enter the key
by type only (an optimizer's changing step size must not miss the cache), except for the few ops
where a float decides a shape (``arange``, ``linspace``, interpolation scales:
:data:`FLOAT_SENSITIVE`).
"""

from __future__ import annotations

from typing import Any

import torch

from .emutensor import EmuTensor

__all__ = ["signature", "call_signature", "keyword_signature", "FLOAT_SENSITIVE"]

aten = torch.ops.aten


class _Float:
    """Key token standing for "some Python float" (value not part of the op's metadata)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<float>"


_FLOAT = _Float()


def signature(args: Any, emus: list, exact: bool) -> tuple:
    """The op-cache signature of ``args`` (a tuple); appends each emulated tensor met to
    ``emus``; ``exact``: floats by value, not by type."""
    out = []
    for a in args:
        c = a.__class__
        if c is EmuTensor:
            emus.append(a)
            out.append(a.emu_key)
        elif c is int:
            out.append(a)
        elif c is float:
            out.append(a if exact else _FLOAT)
        elif c is list or c is tuple:
            # (sizes, dims, strides: ints alone, the usual list, are their own signature; a view's
            # arguments cost 0.32 us here instead of 0.72 through the recursion)
            for x in a:
                if x.__class__ is not int:
                    out.append(signature(a, emus, exact))
                    break
            else:
                out.append(tuple(a))
        elif isinstance(a, torch.Tensor):
            if isinstance(a, EmuTensor):  # a subclass of ours (rare)
                emus.append(a)
                out.append(a.emu_key)
            else:
                out.append(("host", a.device.type, a.shape, a.stride(), a.dtype))
        else:
            out.append(a)
    return tuple(out)


def call_signature(args: Any, emus: list) -> tuple:
    """:func:`signature` (floats by value) for a module call: emulated tensors by shape, strides,
    dtype and device, not by where they sit in their storage."""
    out: list[Any] = []
    for a in args:
        c = a.__class__
        if c is EmuTensor:
            emus.append(a)
            k = a.emu_key
            out.append((k[0], k[1], k[3], k[4]))  # (shape, stride, dtype, device): no offset
        elif c is list or c is tuple:
            out.append(call_signature(a, emus))
        elif isinstance(a, torch.Tensor):
            if isinstance(a, EmuTensor):  # a subclass of ours (rare)
                emus.append(a)
                k = a.emu_key
                out.append((k[0], k[1], k[3], k[4]))
            else:
                out.append(("host", a.device.type, a.shape, a.stride(), a.dtype))
        else:
            out.append(a)
    return tuple(out)


def keyword_signature(kwargs: dict, emus: list, exact: bool) -> tuple:
    """:func:`signature` of keyword arguments."""
    return tuple((k, signature((v,), emus, exact)) for k, v in kwargs.items())


def _float_sensitive() -> set:
    ops = set()
    for name in (
        "arange",
        "linspace",
        "logspace",
        "range",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "upsample_bilinear2d",
        "upsample_bicubic2d",
        "upsample_linear1d",
        "upsample_trilinear3d",
        "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d",
        "_upsample_bilinear2d_aa",
        "_upsample_bicubic2d_aa",
        "affine_grid_generator",
    ):
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            ops.add(id(getattr(packet, overload)))
    return ops


FLOAT_SENSITIVE = _float_sensitive()  # a per-process constant: ids of torch's op singletons
