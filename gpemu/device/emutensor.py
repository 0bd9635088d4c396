"""The emulated CUDA tensor type: a meta-backed wrapper that says it lives on ``cuda:N``.

:class:`EmuTensor` is a ``torch.Tensor`` wrapper subclass whose real device stays ``meta`` (a
wrapper whose real device is ``cuda`` aborts inside autograd on the CPU build); ``.device``,
``.is_cuda`` and ``.get_device()`` report the emulated GPU. Every aten op reaches
``__torch_dispatch__`` (:mod:`gpemu.device.dispatch`), which works out the outputs' metadata on
the meta device and re-wraps them. No arithmetic happens.

Each emulated tensor carries six public fields, set when it is made
(:meth:`gpemu.device.state.TensorState.wrap`) and read by the rest of gpemu:

- ``emu_device``: the emulated GPU's index;
- ``emu_block``: its storage's :class:`gpemu.memory.Block` (None: no storage); views and
  in-place results share their input's block;
- ``emu_shadow``: its known host value (small tensors, :mod:`gpemu.hostvalues`), or None;
- ``emu_key``: its op-cache signature ``(shape, stride, offset, dtype, device)``, fixed at
  creation (wrapper metadata never changes; ``.data = x`` refreshes it);
- ``emu_meta``: the meta tensor ops run on (made lazily), or None;
- ``emu_state``: the :class:`gpemu.device.state.TensorState` of the run that made it.

They are plain instance attributes, not properties, because the hot paths read them per op (a
property costs ~50 ns more per read here); modules outside :mod:`gpemu.device` only read them and
change them through ``TensorState``'s methods (``tests/test_layers.py`` checks this).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .storage import storage_of

if TYPE_CHECKING:  # pragma: no cover
    from .state import TensorState

__all__ = ["EmuTensor", "unhide_grad", "WRAPPER_ATTRIBUTES", "TYPE_NAMES", "DTYPE_NAMES"]

_DEVICES = [torch.device("cuda", i) for i in range(64)]
# torch's C-level descriptors and methods of a tensor (its stubs type the descriptors as values):
# calling them bypasses the Python-level overrides below.
_TENSOR_BASE: Any = torch._C.TensorBase
_REQUIRES_GRAD = _TENSOR_BASE.requires_grad
_REQUIRES_GRAD_METHOD = _TENSOR_BASE.requires_grad_
_DATA = _TENSOR_BASE.data
# Attributes every emulated tensor carries (the six fields above); a gradient with more was
# marked by the program and is never reused by the fast paths.
WRAPPER_ATTRIBUTES = 6


class EmuTensor(torch.Tensor):
    """A tensor on an emulated GPU: shape, dtype, strides, autograd; no data."""

    emu_device: int
    emu_block: Any
    emu_shadow: torch.Tensor | None
    emu_key: tuple
    emu_meta: torch.Tensor | None
    emu_state: TensorState

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # (torch's own idiom)

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: int = 0, requires_grad: bool = False) -> EmuTensor:
        """Wrap a meta tensor as a new allocation on emulated device ``device``."""
        if meta.device.type != "meta":
            raise ValueError(f"EmuTensor wraps a meta tensor, got one on {meta.device}; use to_emulated() for data")
        from .state import current_state, from_meta

        return from_meta(current_state(), meta, device, requires_grad=requires_grad)

    # -- where it lives ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _DEVICES[self.emu_device]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:
        return self.emu_device

    def data_ptr(self) -> int:
        block = self.emu_block
        base = block.address if block is not None else 0
        return base + int(self.storage_offset()) * self.element_size()

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # ``param.data = x`` swaps the TensorImpl's metadata in C++; the Python-side state
        # (device index, memory block, shadow) must follow or the accounting goes wrong.
        unhide_grad(self)
        _DATA.__set__(self, new)
        self.emu_state.param_generation += 1
        self.emu_state.shadow_writes += 1
        if isinstance(new, EmuTensor):
            self.emu_device = new.emu_device
            self.emu_block = new.emu_block
            self.emu_meta = new.emu_meta
            self.emu_shadow = new.emu_shadow
            self.emu_key = new.emu_key

    # requires_grad changes of parameters invalidate replay recordings (gpemu.fastpaths.replay
    # keys on a generation counter instead of reading every parameter's flag on every call).
    @property
    def requires_grad(self) -> bool:
        return _REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        _REQUIRES_GRAD.__set__(self, value)
        ts = self.emu_state
        ts.flag_generation += 1
        if getattr(self, "_is_param", False):
            ts.param_generation += 1

    def requires_grad_(self, requires_grad: bool = True) -> EmuTensor:
        # torch's method, not the property: on a non-leaf that requires grad, requires_grad_(True)
        # is allowed (HF's gradient checkpointing calls it on embedding outputs).
        _REQUIRES_GRAD_METHOD(self, requires_grad)
        ts = self.emu_state
        ts.flag_generation += 1
        if self.__dict__.get("_is_param", False):
            ts.param_generation += 1
        return self

    # .grad through Python: a gradient set given back by zero_grad keeps its wrappers attached
    # to their parameters and reads as None (gpemu.fastpaths.gradients; the group's flags live
    # on its memory block, see gpemu.memory.GroupBlock). Anything that hands a gradient to
    # Python code marks its group exposed; setting a parameter's gradient detaches a hidden
    # group for real first.
    @property
    def grad(self) -> torch.Tensor | None:
        g = _GRAD_GET(self)
        if g is not None:
            block = g.__dict__.get("emu_block")
            group = block.parent if block is not None else None
            if group is not None:
                if group.hidden:
                    return None
                group.exposed = True
        return g

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        unhide_grad(self)
        _GRAD_SET(self, value)

    @grad.deleter
    def grad(self) -> None:
        unhide_grad(self)
        _GRAD_SET(self, None)

    _grad = grad  # (torch's alias, as its C property)

    def untyped_storage(self) -> torch.UntypedStorage:
        """Its storage, on the emulated GPU (:mod:`gpemu.device.storage`: resizes allocate and free
        emulated memory; sharing is a no-op, as for any CUDA storage)."""
        return storage_of(self)

    def record_stream(self, stream: Any) -> None:
        """No-op: emulated blocks are freed when the last tensor dies; stream-ordered reuse
        is not modelled."""

    def new_tensor(  # type: ignore[override]  # (torch's stub spells its keywords differently)
        self, data: Any, dtype: Any = None, device: Any = None, requires_grad: bool = False, **kwargs: Any
    ) -> torch.Tensor:
        idx = self.emu_device if device is None else self.emu_state.device_index(device)
        host = torch.as_tensor(
            data.cpu() if isinstance(data, torch.Tensor) else data, dtype=dtype or self.dtype
        ).clone()
        from .copies import to_emulated

        out = host if idx is None else to_emulated(host, idx)
        return out.requires_grad_(requires_grad) if requires_grad else out

    # -- ways back ---------------------------------------------------------------------------
    def tolist(self) -> Any:
        from .copies import to_host

        return to_host(self, reason="tolist").tolist()

    def numpy(self, *, force: bool = False) -> Any:
        if force:
            from .copies import to_host

            return to_host(self, reason="numpy").numpy()
        raise TypeError(
            f"can't convert cuda:{self.emu_device} device type tensor to numpy. Use Tensor.cpu() to copy the "
            "tensor to host memory first."
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return self.numpy()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return object.__format__(self, spec)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        import torch._tensor_str as ts

        from .copies import to_host

        values = to_host(self, reason="print")

        contents = tensor_contents
        if contents is None:
            with torch.no_grad():
                contents = ts._tensor_str(values, len("tensor(")) if values.numel() or values.dim() else "[]"
        prefix = "Parameter containing:\n" if self.__dict__.get("_is_param", False) else ""
        try:
            # On a detached alias: torch would print a subclass parameter as "Parameter(EmuTensor(".
            text = ts._str_intern(self.detach(), tensor_contents=contents)
            text = "tensor(" + text[len(type(self).__name__) + 1 : -1]
            if self.grad_fn is not None:
                text += f", grad_fn=<{type(self.grad_fn).__name__}>"
            elif self.requires_grad:
                text += ", requires_grad=True"
            return prefix + text + ")"
        except Exception:  # e.g. torch.cuda.current_device() not available yet
            extra = f", device='cuda:{self.emu_device}'"
            if self.dtype not in (torch.get_default_dtype(), torch.int64, torch.bool):
                extra += f", dtype={self.dtype}"
            if self.grad_fn is not None:
                extra += f", grad_fn=<{type(self.grad_fn).__name__}>"
            elif self.requires_grad:
                extra += ", requires_grad=True"
            return f"{prefix}tensor({contents}{extra})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        # gpemu.serialization installs the real reduction for its run (torch.save of emulated
        # tensors); without it an emulated tensor has nothing to pickle.
        raise TypeError(
            "an emulated GPU tensor can only be pickled while gpemu is patched "
            "(torch.save writes its placeholder values)"
        )

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone(memory_format=torch.preserve_format)
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        if self.grad is not None:
            import copy

            new.grad = copy.deepcopy(self.grad, memo)
        return new


_GRAD_GET = _TENSOR_BASE.grad.__get__
_GRAD_SET = _TENSOR_BASE.grad.__set__


def unhide_grad(t: torch.Tensor) -> None:
    """Before ``t``'s gradient changes: if it is a share of a hidden group (see EmuTensor.grad),
    detach the whole group for real; if of a live one, mark the group exposed."""
    g = _GRAD_GET(t)
    if g is not None:
        block = g.__dict__.get("emu_block")
        group = block.parent if block is not None else None
        if group is not None:
            if group.hidden:
                owner = group.owner() if group.owner is not None else None
                if owner is not None:
                    owner.materialize()
            else:
                group.exposed = True


# torch's legacy type names (``x.type()`` -> "torch.cuda.FloatTensor").
TYPE_NAMES = {
    "FloatTensor": torch.float32,
    "DoubleTensor": torch.float64,
    "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16,
    "LongTensor": torch.int64,
    "IntTensor": torch.int32,
    "ShortTensor": torch.int16,
    "CharTensor": torch.int8,
    "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TYPE_NAMES.items()}
