"""Host shadows: the known values of small emulated tensors, and how ops carry them.

The mechanics behind :mod:`gpemu.hostvalues`' policy: what host code reads back is a tensor's
shadow when its value is known (a loss scale, a step counter, a mask built on the host), else
zeros. An op whose inputs' values are all known computes its outputs' values on the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import hostvalues
from ..hostvalues import SHADOW_MAX_ELEMENTS
from .emutensor import EmuTensor
from .state import TensorState, from_meta

__all__ = [
    "FROM_INPUTS",
    "RANDOM",
    "INDEPENDENT",
    "host_shadow",
    "set_host_shadow",
    "propagate_shadow",
    "drop_written_shadows",
    "placeholder_logic",
    "mixed_conv",
    "small_shadow",
    "host_to_emu",
    "shadow_conv",
    "host_args",
]

_META = torch.device("meta")
_CPU = torch.device("cpu")
_grad_enabled = torch.is_grad_enabled
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass

# How an op's result values relate to its inputs' (gpemu.device.ops.OpEntry.values): computed from
# them, random (never known), or independent of them (e.g. zeros_like: known whatever the inputs).
FROM_INPUTS, RANDOM, INDEPENDENT = 0, 1, 2


def host_shadow(t: Any) -> torch.Tensor | None:
    """The known host value of a small emulated tensor (see :mod:`gpemu.hostvalues`), or None
    when its value is unknown or ``t`` is not emulated."""
    if isinstance(t, EmuTensor):
        value = t.emu_shadow
        return value if isinstance(value, torch.Tensor) else None
    return None


def set_host_shadow(t: Any, value: torch.Tensor | None) -> bool:
    """Make ``value`` the known host value of emulated tensor ``t`` (None: unknown). A value that
    does not fit (other element count, or more than SHADOW_MAX_ELEMENTS elements) makes it
    unknown instead. Returns whether a value is now known."""
    if not isinstance(t, EmuTensor):
        return False
    if (
        value is None
        or not isinstance(value, torch.Tensor)
        or value.numel() != t.numel()
        or t.numel() > SHADOW_MAX_ELEMENTS
    ):
        t.emu_shadow = None
        return False
    t.emu_shadow = value.detach().to("cpu", t.dtype).reshape(t.shape).clone()
    t.emu_state.shadow_writes += 1
    return True


def propagate_shadow(func: Any, args: tuple, kwargs: dict, emus: list, out: Any, values: int) -> None:
    """Give the op's emulated outputs their values computed on the host from the inputs' known
    values (``values``: how the result relates to the inputs, see ``_Entry``). With some inputs
    unknown the result is known only when the known ones decide it (``known_true | unknown``) or
    the op is the program's own logic on a model's placeholders (:func:`placeholder_logic`):
    zeros stand in for the unknown values."""
    if values == RANDOM or (
        values == FROM_INPUTS
        and any(e.emu_shadow is None for e in emus)
        and not _decided(func, args, out)
        and not placeholder_logic(emus[0].emu_state)
    ):
        # Unknown inputs: any tensor written in place loses its known value.
        drop_written_shadows(out, emus)
        return
    outs = tree_flatten(out)[0]
    if not any(isinstance(o, EmuTensor) and o.numel() <= SHADOW_MAX_ELEMENTS for o in outs):
        # Only large results (e.g. small.repeat(1000, 1000)): not worth computing on the host.
        drop_written_shadows(out, emus)
        for o in outs:
            if isinstance(o, EmuTensor):
                o.emu_shadow = None
        return
    # (known inputs as their shadows themselves: an in-place op updates the shadow its views share)
    sargs = mixed_conv(list(args))
    skw = {k: mixed_conv(v) for k, v in kwargs.items()}
    try:
        with torch.no_grad():
            sout = func(*sargs, **skw)
    except Exception:
        drop_written_shadows(out, emus)
        return
    souts, _ = tree_flatten(sout)
    if len(outs) != len(souts):
        return
    for o, s in zip(outs, souts, strict=False):
        if isinstance(o, EmuTensor) and isinstance(s, torch.Tensor):
            if s.shape == o.shape and s.numel() <= SHADOW_MAX_ELEMENTS and s.dtype == o.dtype:
                o.emu_shadow = s
                if any(o is e for e in emus):  # an input got it (in place)
                    o.emu_state.shadow_writes += 1
            else:
                o.emu_shadow = None


def placeholder_logic(ts: TensorState) -> bool:
    """Whether an op now is the program's own logic on a model's outputs, run without autograd:
    generation (stopping criteria, beam bookkeeping, a server's slots) or evaluation, outside any
    model's forward and outside a backward pass. There a mix of known values and a model's
    placeholders is computed on the host with zeros for the placeholders, as a host would compute
    from the zeros it reads back (gpemu.hostvalues, rule 3)."""
    return not _grad_enabled() and _graph_task() == -1 and not ts.in_model()


def _decided(func: Any, args: tuple, out: Any) -> bool:
    """Whether the op's known inputs decide its result alone (``known_true | unknown``: see
    :func:`gpemu.hostvalues.decided_by_known`)."""
    if not isinstance(out, EmuTensor):
        return False
    unknown = [isinstance(a, EmuTensor) and a.emu_shadow is None for a in args]
    values = [a.emu_shadow if isinstance(a, EmuTensor) else a for a in args]
    return hostvalues.decided_by_known(func, values, unknown, out.dtype)


def drop_written_shadows(out: Any, emus: list) -> None:
    """Tensors the op wrote in place with unknown values lose their known values. Their shadow is
    zeroed first: a view or base sharing it reads the placeholder there, never a stale value."""
    ids = {id(e) for e in emus}
    for o in tree_flatten(out)[0]:
        if isinstance(o, EmuTensor) and id(o) in ids:
            if isinstance(o.emu_shadow, torch.Tensor):
                o.emu_shadow.zero_()
            o.emu_shadow = None


def small_shadow(t: torch.Tensor) -> torch.Tensor | None:
    if t.numel() <= SHADOW_MAX_ELEMENTS and t.device.type == "cpu":
        return t.detach().clone(memory_format=torch.preserve_format)
    return None


def host_to_emu(ts: TensorState, x: Any, dev: int) -> Any:
    """An emulated tensor (with its shadow) from a real CPU result computed on shadows."""
    if isinstance(x, torch.Tensor):
        e = from_meta(ts, torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META), dev)
        e.emu_shadow = small_shadow(x)
        return e
    return x


def shadow_conv(a: Any) -> Any:
    if isinstance(a, EmuTensor):
        return a.emu_shadow
    if isinstance(a, (list, tuple)):
        return type(a)(shadow_conv(x) for x in a)
    if isinstance(a, torch.device) and a.type in ("cuda", "meta"):
        return _CPU
    return a


def mixed_conv(a: Any) -> Any:
    """As :func:`shadow_conv`, with an unknown value as zeros."""
    if isinstance(a, EmuTensor):
        shadow = a.emu_shadow
        return shadow if shadow is not None else torch.zeros(a.shape, dtype=a.dtype)
    if isinstance(a, (list, tuple)):
        return type(a)(mixed_conv(x) for x in a)
    if isinstance(a, torch.device) and a.type in ("cuda", "meta"):
        return _CPU
    return a


def host_args(args: tuple) -> tuple:
    """``args`` with each emulated tensor replaced by its known values, or zeros when unknown
    (what a factory computing on emulated inputs sees on the host)."""
    return tuple(
        hostvalues.host_values(a.shape, a.dtype, a.emu_shadow) if isinstance(a, EmuTensor) else a for a in args
    )
