"""The emulated device (component ``gpemu.device``): the emulated CUDA tensor and its ops.

Rooms: :mod:`~gpemu.device.emutensor` (the ``EmuTensor`` type and its public fields),
:mod:`~gpemu.device.state` (the run's :class:`TensorState`: building and charging tensors, the
doors other modules use), :mod:`~gpemu.device.dispatch` (every aten op),
:mod:`~gpemu.device.signature` and :mod:`~gpemu.device.ops` (the op metadata cache: fast and slow
paths), :mod:`~gpemu.device.special` (ops the emulator handles itself), :mod:`~gpemu.device.shadows`
(known small values), :mod:`~gpemu.device.values` (value mode: every tensor's real values),
:mod:`~gpemu.device.copies` (host <-> device and peer copies),
:mod:`~gpemu.device.storage` (``untyped_storage()``: a CUDA storage; resizes allocate and free),
:mod:`~gpemu.device.fake` (ops under a FakeTensorMode: fake results, as for a GPU's tensors).

Values: what host code reads back follows :mod:`gpemu.hostvalues`. The ways in (``.cuda()``,
factories, ``Module.to``) are :mod:`gpemu.ways_in`. The fast paths (:mod:`gpemu.fastpaths`)
build and charge emulated tensors without dispatch through :class:`TensorState`'s methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import values_note
from . import dispatch  # noqa: F401  (binds EmuTensor.__torch_dispatch__)
from .copies import PeerCopy, host_to_emulated, peer_copy, to_emulated, to_host
from .emutensor import DTYPE_NAMES, TYPE_NAMES, WRAPPER_ATTRIBUTES, EmuTensor, unhide_grad
from .fake import fake_mode, modes_active
from .shadows import host_args, host_shadow, set_host_shadow
from .state import (
    CostTap,
    OutputSpec,
    OwnNodes,
    TensorState,
    as_meta,
    backward_pass,
    cache_info,
    contiguous_stride,
    current_state,
    device_index,
    from_meta,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = [
    "EmuTensor",
    "TensorState",
    "CostTap",
    "OwnNodes",
    "OutputSpec",
    "WRAPPER_ATTRIBUTES",
    "TYPE_NAMES",
    "DTYPE_NAMES",
    "unhide_grad",
    "backward_pass",
    "contiguous_stride",
    "current_state",
    "cache_info",
    "device_index",
    "from_meta",
    "as_meta",
    "fake_mode",
    "modes_active",
    "host_args",
    "host_shadow",
    "set_host_shadow",
    "to_emulated",
    "host_to_emulated",
    "to_host",
    "peer_copy",
    "PeerCopy",
    "install",
]


def install(rt: Runtime) -> None:
    """The run's tensor state (``rt.tensors``). The ways in that hand out emulated tensors are
    :mod:`gpemu.ways_in`."""
    rt.tensors = TensorState(rt)
    if rt.config.real_values:
        # Every op's values are computed on the CPU inside the emulator's own entries: all of that
        # time is the emulator's, however long one op takes (gpemu.time.host, MAX_FORGIVEN_WORK).
        rt.engine.max_forgiven_work = float("inf")
        if not rt.config.enable:  # (under `gpemu run` the command said it as the run's first line)
            rt.say_once(values_note(rt.config))
