"""An emulated tensor's storage as Python code sees it: ``t.untyped_storage()``.

An emulated tensor's real storage is the meta storage of its wrapper; code that reads it decides
what to do from its device, so it must say ``cuda:N``, as a CUDA storage does:

* ``share_memory_()`` is a no-op on a CUDA storage (torch's own ``UntypedStorage.share_memory_``
  decides by the device; ``Module.share_memory()`` of a CUDA model, mnist_hogwild ``--cuda``) and
  ``is_shared()`` is true;
* ``resize_(n)`` frees (``n == 0``) or allocates the storage's memory: FSDP2 frees its unsharded
  parameters with ``untyped_storage().resize_(0)`` after forward and backward and grows them again
  with ``resize_(size)`` before the next all-gather; emulated memory follows both ways (the memory
  block is shared by every view of the storage, as the bytes are on a GPU);
* ``data_ptr()`` is the block's fake device address (one per allocation: storage aliasing checks).

:class:`EmuStorage` is the storage object's class: the first ``untyped_storage()`` of a wrapper
turns its storage object into one (torch keeps that one Python object for the storage's life, so
it is done once per wrapper).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .emutensor import EmuTensor

__all__ = ["EmuStorage", "storage_of"]

_UNTYPED_STORAGE = torch._C.TensorBase.untyped_storage


class EmuStorage(torch.UntypedStorage):
    """The storage of an emulated tensor: a meta storage that says it lives on the emulated GPU
    and whose resizes allocate and free emulated memory."""

    emu_owner: Any  # weak reference to the wrapper it was read from

    def _tensor(self) -> EmuTensor | None:
        return self.emu_owner()

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        t = self._tensor()
        return t.device if t is not None else torch.device("cuda")

    @property
    def is_cuda(self) -> bool:
        return True

    def is_shared(self) -> bool:
        return True  # (a CUDA storage needs no move to be shared between processes)

    def data_ptr(self) -> int:
        t = self._tensor()
        block = t.emu_block if t is not None else None
        return block.address if block is not None else 0

    def resize_(self, size: int) -> EmuStorage:
        """Resize the storage to ``size`` bytes: its memory block is freed (0) or allocated anew
        (OutOfMemoryError before any change when it does not fit)."""
        t = self._tensor()
        if t is not None:
            t.emu_state.resize_block(t, int(size))
        super().resize_(size)
        return self


def storage_of(t: EmuTensor) -> EmuStorage:
    """``t.untyped_storage()``: its storage object, as an :class:`EmuStorage`."""
    st = _UNTYPED_STORAGE(t)
    if isinstance(st, EmuStorage):
        return st
    # (the same C object, given this class: torch keeps it as the storage's Python object)
    st.__class__ = EmuStorage
    ours = cast(EmuStorage, st)
    ours.emu_owner = weakref.ref(t)
    return ours
