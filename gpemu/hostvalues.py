"""Values on an emulated GPU, and shapes that depend on them: the one policy.

Emulated tensors carry no data. Whenever the host asks for values, or an op's output shape
depends on values, gpemu answers with this policy (documented in docs/device.md):

1. **Every way back is a sync point.** ``.item()``, ``bool()``/``float()``/``int()``,
   ``.cpu()``/``.to('cpu')``, ``.tolist()``, ``repr``/``print`` and ``f"{t:.3f}"`` wait until the
   device's streams are done (like CUDA), recorded as a host wait with a reason.
2. **Known values stay correct.** A tensor created from host data of at most
   :data:`SHADOW_MAX_ELEMENTS` elements (``torch.tensor(3.0, device='cuda')``, a GradScaler's
   scale, step counters, ``torch.full((), 65536.0, device='cuda')``, small ``arange``) keeps a host
   *shadow* copy, propagated through any op whose tensor inputs all have shadows (elementwise math,
   views, reductions, in-place updates). ``.item()`` on such a tensor gives the right number.
3. **Unknown values are zeros** of the right shape and dtype (``False`` for bool), and the program's
   own logic on a model's outputs computes with those zeros: without autograd (generation,
   evaluation), outside a model's forward and a backward pass, an op that mixes known values with
   unknown ones gives a known result computed with zeros in their place (a token buffer written
   with generated tokens, beam search's bookkeeping). An in-place write of unknown values into
   part of a known tensor (through a view) reads as zeros there, never as the old values. Zero keeps
   the usual host checks quiet (``if not torch.isfinite(loss)`` passes, ``found_inf`` is 0,
   accuracy counts are 0, or in an evaluation without autograd the labels that are class 0) and
   is deterministic; a printed loss reads ``0.000``.
   Ops that make values from scalars alone (``x.new_ones(3)``, ``fill_``, ``zero_``) give known
   results from unknown inputs. Gradients and everything computed from parameters stay unknown
   (a model's parameters carry no values), so the emulator never computes a model on the host.
4. **Data-dependent shapes assume "everything selected"**: ``nonzero``/``argwhere`` return one
   row per element, ``masked_select`` and boolean-mask indexing return as many elements as the
   mask has, ``unique`` returns every element (all distinct). When the inputs have shadows,
   the real shape is computed from them instead. Said once per op.
5. **Known values decide where the unknown ones cannot matter**: ``known_true | unknown`` is
   true, ``known_zero & unknown`` and an integer ``known_zero * unknown`` are zero,
   ``where(known_cond, a, b)`` is the known side it selects. A generation loop's length limit
   (``max_length_reached | eos_seen``) then ends it as on a GPU whatever the tokens were.
6. **Non-finite checks see finite values**: ``_amp_foreach_non_finite_check_and_unscale_`` leaves
   ``found_inf`` as it was (0), so GradScaler never skips a step and its scale grows on schedule.

With real values (``values="real"``, :mod:`gpemu.device.values`) every tensor keeps its
values, whatever its size, random ones included: points 2 to 5 then read the real values.

This module holds the policy and the host computations; attaching shadows to emulated tensors
is the tensor type's mechanics (:mod:`gpemu.device`), which calls in here with plain host and
meta tensors only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = [
    "SHADOW_MAX_ELEMENTS",
    "POLICY",
    "host_values",
    "scalar_value",
    "known_factory_value",
    "data_dependent_shape",
    "DATA_DEPENDENT_OPS",
    "RANDOM_FACTORIES",
    "VALUE_INDEPENDENT_OPS",
    "decided_by_known",
]

aten = torch.ops.aten
_META = torch.device("meta")

# Tensors up to this many elements keep a host shadow of their values: well above what programs
# read back to decide what to do (a CPU generator's state, 5,056 bytes; padding masks and token
# ids of a batch, e.g. 8 x 1024 or 64 x 4096; labels; scalars and step counters), below a batch of
# images or activations (whose values nothing reads). An op on known values runs on the host
# (a fraction of a millisecond at this size); replayed modules run none of their ops.
SHADOW_MAX_ELEMENTS = 1 << 18

POLICY = (
    "values read back from an emulated GPU are zeros unless the tensor was made from small host "
    "data (then its real value); data-dependent shapes assume every element is selected"
)

# Factories whose values are random or uninitialised: their values are unknown (uninitialised
# memory reads as zeros either way; unknown, nothing is computed from it on the host).
RANDOM_FACTORIES = frozenset(
    (
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "normal",
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
    )
)


def host_values(shape: torch.Size, dtype: torch.dtype, shadow: torch.Tensor | None) -> torch.Tensor:
    """The CPU tensor a way back returns: the shadow's values when known, else zeros."""
    if shadow is not None:
        return shadow.detach().clone(memory_format=torch.contiguous_format)
    return torch.zeros(shape, dtype=dtype)


def scalar_value(dtype: torch.dtype, shadow: torch.Tensor | None) -> bool | int | float | complex:
    """What ``.item()`` returns for a one-element emulated tensor."""
    if shadow is not None:
        return shadow.reshape(()).item()
    if dtype is torch.bool:
        return False
    if dtype.is_complex:
        return 0j
    if dtype.is_floating_point:
        return 0.0
    return 0


# Ops that make a tensor's values from scalars alone, whatever the values of the tensor they are
# called on: ``x.new_ones(3)``, ``x.new_full(...)``, ``t.fill_(1.0)``, ``t.zero_()``. Their result
# is known even when the input's values are not. (``*_like`` factories are not among them: autograd makes every
# implicit gradient with ``ones_like``, and gradients must stay unknown, see below.)
VALUE_INDEPENDENT_OPS = frozenset(
    op
    for op in (
        aten.new_ones.default,
        aten.new_zeros.default,
        aten.new_full.default,
        aten.fill_.Scalar,
        aten.fill.Scalar,
        aten.zero_.default,
        getattr(getattr(aten, "zero", None), "default", None),
    )
    if op is not None
)


def known_factory_value(
    factory: Callable,
    name: str,
    host_args: tuple,
    kwargs: dict,
    meta: torch.Tensor,
    limit: int = SHADOW_MAX_ELEMENTS,
    random: Callable[[], AbstractContextManager] | None = None,
) -> torch.Tensor | None:
    """The shadow of a factory's emulated result (``torch.ones(3, device='cuda')``): its real
    values computed on the host when at most ``limit`` elements and deterministic, else None.
    ``host_args``: the factory's arguments with emulated tensors replaced by their host values.
    ``random``: in value mode (:mod:`gpemu.device.values`), the emulated device's generator, under
    which random and uninitialised factories are computed too."""
    if meta.numel() > limit:
        return None
    if name in RANDOM_FACTORIES:
        if random is None:
            return None
        with random():
            return factory(*host_args, device="cpu", **kwargs)
    return factory(*host_args, device="cpu", **kwargs)


# ----------------------------------------------------------------------------------------------
# results the known inputs decide alone
# ----------------------------------------------------------------------------------------------
def _all_true(x: Any) -> bool:
    return isinstance(x, (bool, int, float)) and bool(x) or isinstance(x, torch.Tensor) and bool(x.all())


def _all_zero(x: Any) -> bool:
    return isinstance(x, (bool, int, float)) and not x or isinstance(x, torch.Tensor) and not bool(x.any())


def _or_decided(known: list, out_dtype: torch.dtype) -> bool:
    # (a bitwise or of integers is decided only by all bits set; booleans and logical_or by true)
    return (out_dtype is torch.bool) and any(_all_true(x) for x in known)


def _and_decided(known: list, out_dtype: torch.dtype) -> bool:
    return any(_all_zero(x) for x in known)


def _mul_decided(known: list, out_dtype: torch.dtype) -> bool:
    # (integers only: a float zero times an unknown inf or NaN is NaN on a GPU)
    return not out_dtype.is_floating_point and not out_dtype.is_complex and any(_all_zero(x) for x in known)


_ABSORBING: dict[Any, Callable[[list, torch.dtype], bool]] = {
    **dict.fromkeys(
        (aten.bitwise_or, aten.bitwise_or_, aten.logical_or, aten.logical_or_, aten.__or__, aten.__ior__), _or_decided
    ),
    **dict.fromkeys(
        (aten.bitwise_and, aten.bitwise_and_, aten.logical_and, aten.logical_and_, aten.__and__, aten.__iand__),
        _and_decided,
    ),
    **dict.fromkeys((aten.mul, aten.mul_), _mul_decided),
}
_WHERE = aten.where


def decided_by_known(func: Any, values: list, unknown: list[bool], out_dtype: torch.dtype) -> bool:
    """Whether an op's result does not depend on its unknown inputs (rule 5 above): ``values``
    are its positional arguments' host values (an unknown tensor's entry is not read),
    ``unknown`` says which are unknown. The caller then computes the result with zeros in their
    place, which is exact."""
    packet = func.overloadpacket
    if packet is _WHERE:
        if len(values) < 3 or unknown[0]:
            return False
        cond = values[0]
        # every element takes the known side
        return (not unknown[1] and _all_true(cond)) or (not unknown[2] and _all_zero(cond))
    rule = _ABSORBING.get(packet)
    if rule is None:
        return False
    known = [v for v, u in zip(values, unknown, strict=False) if not u]
    return rule(known, out_dtype)


# ----------------------------------------------------------------------------------------------
# data-dependent output shapes
# ----------------------------------------------------------------------------------------------
def _nonzero(func: Any, margs: list, mkw: dict) -> Any:
    x = margs[0]
    return torch.empty((x.numel(), x.dim()), dtype=torch.int64, device=_META)


def _masked_select(func: Any, margs: list, mkw: dict) -> Any:
    x, mask = margs[0], margs[1]
    n = torch.broadcast_shapes(x.shape, mask.shape).numel()
    return torch.empty((n,), dtype=x.dtype, device=_META)


def _unique(func: Any, margs: list, mkw: dict) -> Any:
    x = margs[0]
    name = func.overloadpacket.__name__
    n = x.numel()
    flat = torch.empty((n,), dtype=x.dtype, device=_META)
    inverse = torch.empty(x.shape if name != "unique_dim" else (x.shape[margs[1]],), dtype=torch.int64, device=_META)
    counts = torch.empty((n,), dtype=torch.int64, device=_META)
    if name == "unique_dim":
        flat = torch.empty(x.shape, dtype=x.dtype, device=_META)
        counts = torch.empty((x.shape[margs[1]],), dtype=torch.int64, device=_META)
    if name == "_unique":
        return (flat, inverse)
    return (flat, inverse, counts)


def _index(func: Any, margs: list, mkw: dict) -> Any:
    # Each boolean mask stands for "all of its positions" (integer index tensors of full size).
    x, indices = margs[0], margs[1]
    new_idx: list = []
    for i in indices:
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            n = i.numel()
            for _ in range(i.dim()):
                new_idx.append(torch.empty((n,), dtype=torch.int64, device=_META))
        else:
            new_idx.append(i)
    return func(x, new_idx)


def _index_put(func: Any, margs: list, mkw: dict) -> Any:
    x = margs[0]
    if func.overloadpacket.__name__.endswith("_"):
        return x  # in place: the input itself
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=_META)


def _repeat_interleave(func: Any, margs: list, mkw: dict) -> Any:
    rep = margs[0]
    return torch.empty((rep.numel(),), dtype=torch.int64, device=_META)


# op overload packet -> (name said once, meta outputs when the values are unknown)
DATA_DEPENDENT_OPS: dict[Any, tuple[str, Callable[[Any, list, dict], Any]]] = {
    aten.nonzero: ("nonzero", _nonzero),
    aten.argwhere: ("argwhere", _nonzero),
    aten.masked_select: ("masked_select", _masked_select),
    aten._unique: ("unique", _unique),
    aten._unique2: ("unique", _unique),
    aten.unique_dim: ("unique", _unique),
    aten.unique_consecutive: ("unique", _unique),
    aten.index: ("boolean-mask indexing", _index),
    aten.index_put_: ("boolean-mask assignment", _index_put),
    aten.index_put: ("boolean-mask assignment", _index_put),
    aten._index_put_impl_: ("boolean-mask assignment", _index_put),
    aten.repeat_interleave: ("repeat_interleave", _repeat_interleave),
}
# Ops whose result is computed from known values (shadows) when every input has one; boolean
# assignment never is (it writes into a tensor whose other values may be unknown).
_FROM_KNOWN_VALUES = frozenset(
    op for op in DATA_DEPENDENT_OPS if op not in (aten.index_put_, aten.index_put, aten._index_put_impl_)
)


def data_dependent_shape(
    func: Any, margs: list, mkw: dict, host_args: list | None, host_kwargs: dict | None
) -> tuple[str, Any] | None:
    """How to emulate an op whose output shape depends on values (its meta kernel refused):

    * ``("host", result)`` — the real result, computed on the inputs' known values
      (``host_args`` are the arguments with every emulated tensor replaced by its shadow; None
      when some value is unknown);
    * ``("meta", outputs)`` — meta outputs for "every element selected", to be said once under
      the returned name (``("meta:<name>", outputs)``);
    * None — no policy for this op.
    """
    entry = DATA_DEPENDENT_OPS.get(func.overloadpacket)
    if entry is None:
        return None
    name, meta_policy = entry
    if host_args is not None and func.overloadpacket in _FROM_KNOWN_VALUES:
        return "host", func(*host_args, **(host_kwargs or {}))
    return f"meta:{name}", meta_policy(func, margs, mkw)
