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
from .value_kernels import HOST_KERNELS
from .values import laid_out

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
    does not fit (other element count, or more than SHADOW_MAX_ELEMENTS elements with placeholder
    values) makes it unknown instead. Returns whether a value is now known."""
    if not isinstance(t, EmuTensor):
        return False
    if (
        value is None
        or not isinstance(value, torch.Tensor)
        or value.numel() != t.numel()
        or t.numel() > t.emu_state.shadow_limit
    ):
        t.emu_shadow = None
        return False
    value = value.detach().to("cpu", t.dtype).reshape(t.shape).clone()
    t.emu_shadow = laid_out(value, t.shape, t.stride())
    t.emu_state.shadow_writes += 1
    return True


def propagate_shadow(func: Any, args: tuple, kwargs: dict, emus: list, out: Any, values: int) -> None:
    """Give the op's emulated outputs their values computed on the host from the inputs' known
    values (``values``: how the result relates to the inputs, see ``_Entry``). With some inputs
    unknown the result is known only when the known ones decide it (``known_true | unknown``) or
    the op is the program's own logic on a model's placeholders (:func:`placeholder_logic`):
    zeros stand in for the unknown values. In value mode (:mod:`gpemu.device.values`) random
    results are computed too, whatever their size."""
    outs = tree_flatten(out)[0]
    first = emus[0] if emus else next((o for o in outs if isinstance(o, EmuTensor)), None)
    if first is None:
        return
    ts: TensorState = first.emu_state
    vm = ts.values
    independent = values == INDEPENDENT
    unknown = not independent and any(e.emu_shadow is None for e in emus)
    if (values == RANDOM and vm is None) or (unknown and not _decided(func, args, out) and not placeholder_logic(ts)):
        # Unknown inputs: any tensor written in place loses its known value.
        drop_written_shadows(out, emus)
        return
    limit = ts.shadow_limit
    results = [o for o in outs if isinstance(o, EmuTensor)]
    if results and not any(o.numel() <= limit for o in results):
        # Only large results (e.g. small.repeat(1000, 1000)): not worth computing on the host.
        drop_written_shadows(out, emus)
        for o in results:
            o.emu_shadow = None
        return
    # (No tensor result: an in-place op returning None, e.g. _foreach_add_, writes the values.)
    written = None if results else _writes_large(func, args, kwargs, limit)
    if written is not None:
        drop_written_shadows(written, written)
        return
    device = first.emu_device if values == RANDOM else None
    souts = _host_results(ts, func, args, kwargs, outs, independent, device, unknown)
    if souts is None:
        drop_written_shadows(out, emus)
        return
    if len(outs) != len(souts):
        return
    for o, s in zip(outs, souts, strict=False):
        if isinstance(o, EmuTensor) and isinstance(s, torch.Tensor):
            o.emu_shadow = _fitted(o, s, limit, vm is not None)
            if o.emu_shadow is not None and any(o is e for e in emus):  # an input got it (in place)
                o.emu_state.shadow_writes += 1


def _writes_large(func: Any, args: tuple, kwargs: dict, limit: int) -> list | None:
    """The emulated tensors the op writes (its schema's mutable arguments) when one is too large to
    keep a known value, else None. Such an op (an optimizer's fused step over a model's
    parameters) has unknown inputs: its host run on zeros that size would cost seconds per step
    to give the small ones what reading them back as unknown gives, zeros' results."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written += [t for t in tree_flatten(value)[0] if isinstance(t, EmuTensor)]
    return written if any(t.numel() > limit for t in written) else None


def _host_results(
    ts: TensorState,
    func: Any,
    args: tuple,
    kwargs: dict,
    outs: list,
    independent: bool,
    random: int | None,
    unknown: bool = False,
) -> list | None:
    """The op run on the host values of its inputs, its outputs flattened (None when it fails
    there); ``random``: the device whose generator a random op draws from (value mode);
    ``unknown``: some inputs' values are unknown (zeros stand in for them). In value mode a
    CUDA-only op runs as its host kernel (:mod:`gpemu.device.value_kernels`)."""
    key = _placeholder_key(func, args, kwargs) if unknown and ts.values is None else None
    if key is not None and key in ts.placeholder_results:
        return [_copied(r) for r in ts.placeholder_results[key]]
    conv = mixed_conv if independent or unknown else shadow_conv
    sargs = conv(list(args))
    skw = {k: conv(v) for k, v in kwargs.items()}
    found = _host_results_of(ts, func, sargs, skw, outs, random)
    if key is not None and found is not None:
        if len(ts.placeholder_results) >= _PLACEHOLDER_RESULTS:
            ts.placeholder_results.clear()
        # (a result too large to keep as a known value is kept as none: see _fitted)
        ts.placeholder_results[key] = [None if _large(r) else _copied(r) for r in found]
    return found


# Ops on placeholders remembered per run (a step's distinct reductions of gradients: a few).
_PLACEHOLDER_RESULTS = 4096
_KEYED_VALUES = 4096  # known values a key may hold, per tensor


def _placeholder_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """What an op on placeholders computes from when an emulated input with unknown values is large
    (zeros the size of a model's gradients cost a second to make and reduce: a gradient norm over
    every parameter, each step): the op, each emulated input's shape, dtype, strides and known
    values (small), the other arguments. None when not worth it or an argument is a host tensor."""
    parts: list = [func]
    large = [False]
    for a in (*args, *sorted(kwargs.items())):
        if not _key_part(a, parts, large):
            return None
    return tuple(parts) if large[0] else None


def _key_part(a: Any, parts: list, large: list) -> bool:
    if isinstance(a, EmuTensor):
        shadow = a.emu_shadow
        if shadow is not None and shadow.numel() > _KEYED_VALUES:
            return False  # (keys stay small: a norm layer's weights, a step counter)
        known = b"" if shadow is None else shadow.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        large[0] = large[0] or (shadow is None and a.numel() > SHADOW_MAX_ELEMENTS)
        parts.append((tuple(a.shape), a.dtype, a.stride(), shadow is None, known))
        return True
    if isinstance(a, (list, tuple)):
        parts.append(len(a))
        return all(_key_part(x, parts, large) for x in a)
    if isinstance(a, torch.Tensor):
        return False
    try:
        hash(a)
    except TypeError:
        return False
    parts.append((type(a), a))  # (1, 1.0 and True are equal keys)
    return True


def _large(r: Any) -> bool:
    return isinstance(r, torch.Tensor) and r.numel() > SHADOW_MAX_ELEMENTS


def _copied(r: Any) -> Any:
    return r.clone() if isinstance(r, torch.Tensor) else r


def _host_results_of(ts: TensorState, func: Any, sargs: list, skw: dict, outs: list, random: int | None) -> list | None:
    values = ts.values
    try:
        if values is not None:
            kernel = HOST_KERNELS.get(func)
            if kernel is not None:
                return kernel(values, sargs, skw, outs, outs[0].emu_device)
        with torch.no_grad():
            if random is not None and values is not None:
                with values.random(random):
                    return tree_flatten(func(*sargs, **skw))[0]
            return tree_flatten(func(*sargs, **skw))[0]
    except Exception as exc:
        if ts.values is not None:
            line = ts.values.failed_op(getattr(func, "__name__", str(func)), exc)
            if line is not None:
                ts.say_once(line)
        return None


def _fitted(o: EmuTensor, s: torch.Tensor, limit: int, real: bool) -> torch.Tensor | None:
    """Host result ``s`` as output ``o``'s values, or None when it does not fit ``o``."""
    if s.shape != o.shape or s.numel() > limit:
        return None
    if s.dtype != o.dtype:
        if not real:
            return None
        s = s.to(o.dtype)
    if real and s.stride() != o.stride():
        s = laid_out(s, o.shape, o.stride())
    return s


def placeholder_logic(ts: TensorState) -> bool:
    """Whether an op now is the program's own logic on a model's outputs, run without autograd:
    generation (stopping criteria, beam bookkeeping, a server's slots) or evaluation, outside any
    model's forward and outside a backward pass (the engine's, or the engine-free one of
    gpemu.fastpaths.backward). There a mix of known values and a model's placeholders is
    computed on the host with zeros for the placeholders, as a host would compute from the
    zeros it reads back (gpemu.hostvalues, rule 3)."""
    return not _grad_enabled() and _graph_task() == -1 and not ts.local.host.direct_backward and not ts.in_model()


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


def small_shadow(t: torch.Tensor, limit: int = SHADOW_MAX_ELEMENTS) -> torch.Tensor | None:
    if t.numel() <= limit and t.device.type == "cpu":
        return t.detach().clone(memory_format=torch.preserve_format)
    return None


def host_to_emu(ts: TensorState, x: Any, dev: int) -> Any:
    """An emulated tensor (with its shadow) from a real CPU result computed on shadows."""
    if isinstance(x, torch.Tensor):
        e = from_meta(ts, torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META), dev)
        e.emu_shadow = small_shadow(x, ts.shadow_limit)
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
