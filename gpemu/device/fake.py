"""Emulated tensors under a ``FakeTensorMode`` (DTensor's sharding propagation, memory estimators,
``torch.utils.flop_counter`` with fake inputs): as a real GPU's tensors are.

A fake mode refuses tensor subclasses it does not know (it returns NotImplemented), so an op on
emulated tensors reaches the emulated dispatch while the mode is active. On a real GPU the mode
would see plain CUDA tensors: with ``allow_non_fake_inputs`` it converts them to fake tensors on
their device and runs the op on those (fake results: no memory, no GPU time), else it refuses them.
The emulated dispatch hands such ops here and gets the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from .emutensor import EmuTensor
from .state import meta_of

__all__ = ["fake_mode", "modes_active", "run_faked"]

_get_mode = torch._C._get_dispatch_mode
# How many dispatch modes are active (the infra modes, a FakeTensorMode among them, counted): 0
# means no fake mode, for a C call's price (the hot paths' first test).
modes_active = torch._C._len_torch_dispatch_stack
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def fake_mode() -> Any:
    """The active FakeTensorMode, or None."""
    # Note: asked on every x.cuda(); the stack's length (above) is a quarter of the keyed look-up's
    # cost, whose enum argument pybind converts on each call.
    return _get_mode(_FAKE) if modes_active() else None


def run_faked(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` under fake mode ``mode``, its emulated arguments as fake tensors on their emulated
    device (one fake tensor per emulated tensor's metadata, kept by the mode)."""
    if not mode.allow_non_fake_inputs:
        raise AssertionError(
            "Please convert all Tensors to FakeTensors first or instantiate FakeTensorMode with "
            f"'allow_non_fake_inputs'. Found in {func} on an emulated cuda tensor"
        )
    converter = mode.fake_tensor_converter

    def fake(a: Any) -> Any:
        if isinstance(a, EmuTensor):
            return converter.from_meta_and_device(mode, meta_of(a), a.device)
        return a

    fargs, fkwargs = tree_map(fake, (args, kwargs))
    return func(*fargs, **fkwargs)
