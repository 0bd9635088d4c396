"""One reading of device arguments, and one check of device ordinals.

Torch takes a device as ``None``, an int, a string (``'cuda'``, ``'cuda:1'``, ``'cpu'``), a
``torch.device`` or a ``torch.cuda.device`` context; every place gpemu accepts one (tensor
moves, factories, the ``torch.cuda`` surface, streams) reads it here, so a bool, a ``'cpu'`` or a
bad ordinal means the same thing everywhere.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["cuda_index", "check_ordinal", "InvalidDeviceError"]


class InvalidDeviceError(ValueError):
    """A device argument of a type or form torch does not accept."""


def cuda_index(device: Any, current: int) -> int | None:
    """The CUDA index ``device`` names (``current`` for ``'cuda'`` without an index), or None when
    it names no CUDA device (None, ``'cpu'``, ``'meta'``...). Ints are CUDA ordinals, as in torch.
    Raises :class:`InvalidDeviceError` for bools, malformed strings and other types."""
    if device is None:
        return None
    if isinstance(device, bool):  # (bool is an int subclass; torch rejects it too)
        raise InvalidDeviceError(
            f"a device must be an int, a string such as 'cuda:0' or a torch.device, got {device!r}"
        )
    if isinstance(device, int):
        return device
    # (torch is imported by whoever passes a device; this module must not import it itself:
    # `gpemu run`'s bootstrap imports gpemu in every Python process, most never use torch.)
    torch = sys.modules["torch"]
    if isinstance(device, str):
        if not device.startswith("cuda"):
            if device.split(":", 1)[0] in _OTHER_TYPES:
                return None
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise InvalidDeviceError(
                f"invalid device string {device!r}; expected e.g. 'cuda', 'cuda:1' or 'cpu'"
            ) from exc
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        return current if device.index is None else device.index
    idx = getattr(device, "idx", None)  # a torch.cuda.device(...) context object
    if isinstance(idx, int) and not isinstance(idx, bool):
        return idx
    raise InvalidDeviceError(
        f"a device must be an int, a string such as 'cuda:0' or a torch.device, got {type(device).__name__} {device!r}"
    )


# Device types torch knows besides CUDA (strings of these are "not CUDA", not errors).
_OTHER_TYPES = frozenset(
    (
        "cpu",
        "meta",
        "mps",
        "xpu",
        "xla",
        "hpu",
        "ipu",
        "mtia",
        "privateuseone",
        "lazy",
        "vulkan",
        "ort",
        "ve",
        "fpga",
        "maia",
        "hip",
        "opengl",
        "opencl",
        "ideep",
        "mkldnn",
    )
)


def check_ordinal(index: Any, count: int) -> int:
    """``index`` when it is a valid ordinal of ``count`` emulated GPUs; else CUDA's error."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal (gpemu: device {index!r} requested, "
            f"{count} emulated GPU(s) available: 0..{count - 1})"
        )
    return index
