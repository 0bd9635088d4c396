"""The one policy for values that leave an emulated GPU, and for data-dependent shapes.

Emulated tensors carry no data. Whenever the host asks for values, gpemu answers with this
policy (documented in docs/device.md):

1. **Every way back is a sync point.** ``.item()``, ``bool()``/``float()``/``int()``,
   ``.cpu()``/``.to('cpu')``, ``.tolist()``, ``repr``/``print`` and ``f"{t:.3f}"`` wait until the
   device's streams are done (like CUDA), recorded as a host wait with a reason.
2. **Known values stay correct.** A tensor created from host data of at most
   :data:`SHADOW_MAX_ELEMENTS` elements (``torch.tensor(3.0, device='cuda')``, a GradScaler's
   scale, step counters, ``torch.full((), 65536.0, device='cuda')``, small ``arange``) keeps a host
   *shadow* copy, propagated through any op whose tensor inputs all have shadows (elementwise math,
   views, reductions, in-place updates). ``.item()`` on such a tensor gives the right number.
3. **Unknown values are zeros** of the right shape and dtype (``False`` for bool). Zero keeps
   the usual host checks quiet (``if not torch.isfinite(loss)`` passes, ``found_inf`` is 0,
   accuracy counts are 0) and is deterministic; a printed loss reads ``0.000``.
4. **Data-dependent shapes assume "everything selected"**: ``nonzero``/``argwhere`` return one
   row per element, ``masked_select`` and boolean-mask indexing return as many elements as the
   mask has, ``unique`` returns every element (all distinct). When the inputs have shadows,
   the real shape is computed from them instead. Said once per op.
5. **Non-finite checks see finite values**: ``_amp_foreach_non_finite_check_and_unscale_`` leaves
   ``found_inf`` as it was (0), so GradScaler never skips a step and its scale grows on schedule.
"""

from __future__ import annotations

import torch

__all__ = ["SHADOW_MAX_ELEMENTS", "host_values", "scalar_value", "POLICY"]

# Tensors up to this many elements keep a host shadow of their values. Small enough that the
# extra CPU op per emulated op costs microseconds; large enough for scalars, step counters,
# small label vectors.
SHADOW_MAX_ELEMENTS = 64

POLICY = (
    "values read back from an emulated GPU are zeros unless the tensor was made from small host "
    "data (then its real value); data-dependent shapes assume every element is selected"
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
