"""Every aten op on an emulated tensor: ``EmuTensor.__torch_dispatch__``.

Ops are keyed by ``id()`` (``OpOverload.__hash__`` is a Python method, and ops are singletons).
An emulated op is the emulator's own host work (:meth:`gpemu.time.host.HostTime.call`): the
host's emulated time is frozen from here to the op's return. A few ops are the emulator's own
(:mod:`gpemu.device.special`: reading a value, copies, AMP's scaler ops, detach); the rest go
through the op cache (:mod:`gpemu.device.ops`).

Note: this function is bound to :class:`~gpemu.device.emutensor.EmuTensor` here, when this
module is imported (by the package), rather than defined in the class: the dispatcher needs the
state, cache and special ops, which all need the tensor type, so defining it in the class would
make the type's module import all of them in a cycle.
"""

from __future__ import annotations

from typing import Any

from ..costmodel.precision import tf32_cudnn, tf32_matmul
from ..runtime import current
from .emutensor import EmuTensor
from .fake import fake_mode, modes_active, run_faked
from .ops import cached_op, current_task
from .signature import FLOAT_SENSITIVE, keyword_signature, signature
from .special import DETACH, SPECIAL, detach
from .state import TensorState, backward_pass, current_state

__all__ = ["torch_dispatch"]


def torch_dispatch(cls: type, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """``EmuTensor.__torch_dispatch__``: one emulated op."""
    fid = id(func)
    if fid == DETACH:  # (hot inside autograd; a few attribute copies)
        return detach(func, args, kwargs)
    if modes_active():
        faking = fake_mode()
        if faking is not None:  # (the mode refused our tensors: fake results, as for a GPU's)
            return run_faked(faking, func, args, kwargs or {})
    special = SPECIAL.get(fid)
    if special is not None:
        ts = _owner(args)
        if ts is None:
            return special(func, args, kwargs or {})
        return ts.call(special, func, args, kwargs or {})
    emus: list[EmuTensor] = []
    exact = fid in FLOAT_SENSITIVE
    arg_sig = signature(args, emus, exact)
    kw_sig = keyword_signature(kwargs, emus, exact) if kwargs else None
    ts = emus[0].emu_state if emus else current_state()
    host = ts.local.host
    backward = (current_task() != -1 or host.direct_backward) and backward_pass(ts)
    if backward and emus:
        # (however the backward pass was started: a model's own marks see only module calls)
        ts.engine.note_backward(emus[0].emu_device)
    # (one op's price differs between the passes: see backward_pass; and with the TF32 switches)
    key = (fid, arg_sig, kw_sig, backward, tf32_matmul(), tf32_cudnn())
    # Note: TensorState.call (gpemu.time.host.HostTime.call) written out: this is the path of every
    # op, where its call level and argument tuple cost ~0.3 us of a ~4 us op (measured with
    # benchmarks/step_parts.py); everywhere else the emulator enters through call().
    if host.depth:
        return cached_op(ts, key, func, args, kwargs, emus)
    host.entry = ts.read_clock()
    host.depth = 1
    try:
        return cached_op(ts, key, func, args, kwargs, emus)
    finally:
        ts.leave()


def _owner(args: tuple) -> TensorState | None:
    """The tensor state of the first emulated tensor among the first two arguments (a copy's
    source or destination), else the active run's (None when nothing is patched)."""
    for a in args[:2]:
        if isinstance(a, EmuTensor):
            return a.emu_state
    rt = current()
    return rt.tensors if rt is not None else None


EmuTensor.__torch_dispatch__ = classmethod(torch_dispatch)  # type: ignore[assignment]
