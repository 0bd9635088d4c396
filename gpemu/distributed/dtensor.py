"""``DTensor`` over emulated local tensors reports their device.

A DTensor's C-level wrapper is made on its local tensor's real device, ``meta`` for an emulated
one; here it reports the emulated device instead, so parameters sharded by FSDP2
(``fully_shard``) or tensor parallelism are CUDA parameters to optimizers, ``Module.to``, FSDP's
checks and the user. ``torch.distributed.tensor`` is slow to import: it is patched when the
program imports it (:meth:`gpemu.patching.Patcher.after_import`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ..device import EmuTensor
from ..patching import Patcher

__all__ = ["DTENSOR_MODULE", "patch_dtensor"]

DTENSOR_MODULE = "torch.distributed.tensor._api"
_BASE_DEVICE = torch.Tensor.device  # the C-level property, as DTensor has it


def _local_emulated(dtensor: Any) -> EmuTensor | None:
    local = dtensor.__dict__.get("_local_tensor") if hasattr(dtensor, "__dict__") else None
    if local is None:
        try:
            local = dtensor._local_tensor
        except AttributeError:
            return None
    return local if isinstance(local, EmuTensor) else None


def _device(self: Any) -> torch.device:
    local = _local_emulated(self)
    return local.device if local is not None else _BASE_DEVICE.__get__(self)


def _is_cuda(self: Any) -> bool:
    return _local_emulated(self) is not None or _BASE_DEVICE.__get__(self).type == "cuda"


def _is_meta(self: Any) -> bool:
    return _local_emulated(self) is None and _BASE_DEVICE.__get__(self).type == "meta"


def _get_device(self: Any) -> int:
    local = _local_emulated(self)
    return local.get_device() if local is not None else torch.Tensor.get_device(self)


def patch_dtensor(patcher: Patcher, module: ModuleType) -> None:
    """Give ``module.DTensor`` the emulated device's ``device``, ``is_cuda``, ``is_meta`` and
    ``get_device`` (``module``: torch.distributed.tensor._api, once imported)."""
    cls = module.DTensor
    patcher.replace(cls, "device", property(_device))
    patcher.replace(cls, "is_cuda", property(_is_cuda))
    patcher.replace(cls, "is_meta", property(_is_meta))
    patcher.replace(cls, "get_device", _get_device)
