"""The ways tensors and models get onto (and off) an emulated GPU (component ``gpemu.ways_in``).

* ``Tensor.cuda`` / ``Tensor.to`` / ``Tensor.type`` and ``Tensor.new_empty/zeros/ones/full`` with
  a CUDA device: torch's C++ would initialise CUDA, so the conversion happens here;
* factories with ``device='cuda'`` (``torch.zeros``, ``torch.tensor``, ``torch.arange``...), also
  through ``torch.set_default_device('cuda')`` and ``with torch.device('cuda')`` (torch's
  ``DeviceContext`` mode), produce emulated tensors; small deterministic results keep their
  values (:mod:`gpemu.hostvalues`);
* ``Module.to`` / ``Module.cuda`` / ``Module.cpu`` / ``Module.to_empty``: each tensor moves as
  usual and parameters keep their Python objects (as on a real GPU, so optimizers built before the
  move keep working), and the model transfer is charged once for the whole module
  (:meth:`gpemu.transfers.TransferState.model_to_device`) instead of once per tensor;
* optimizers may take their foreach path over emulated tensors, and torch groups tensors for
  foreach kernels by their emulated device (``clip_grad_norm_(foreach=True)``, fused optimizers);
* under a FakeTensorMode (DTensor's sharding propagation) the ways in make the mode's fake
  tensors on ``cuda``, as on a real GPU, and take no memory; an explicit ``meta`` target
  (``x.to("meta")``, ``empty_like(x, device="meta")``) gives a meta tensor.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass, transform_subclass

from . import hostvalues
from .device import (
    DTYPE_NAMES,
    TYPE_NAMES,
    EmuTensor,
    PeerCopy,
    TensorState,
    as_meta,
    fake_mode,
    from_meta,
    host_args,
    host_to_emulated,
    modes_active,
    peer_copy,
    to_emulated,
)

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "FACTORIES"]

_DEVICES = [torch.device("cuda", i) for i in range(64)]
_META = torch.device("meta")

# Factories that take data (their values are the host data's).
_DATA_FACTORIES = frozenset(("tensor", "as_tensor", "asarray", "scalar_tensor"))
FACTORIES = (
    "empty",
    "empty_strided",
    "empty_permuted",
    "zeros",
    "ones",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "range",
    "linspace",
    "logspace",
    "eye",
    "tensor",
    "as_tensor",
    "asarray",
    "scalar_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "tril_indices",
    "triu_indices",
    "normal",
)


def faking() -> bool:
    """Whether a FakeTensorMode is active (DTensor's sharding propagation, torch.compile's tracing,
    ``torch.utils.flop_counter`` estimates): tensors made now are fake tensors of the mode, as on a
    real GPU, and take no memory; torch's own path makes them (the mode says ``cuda``)."""
    return fake_mode() is not None


def _is_meta(device: Any) -> bool:
    """Whether a device argument names the meta device."""
    if isinstance(device, torch.device):
        return device.type == "meta"
    return isinstance(device, str) and device.split(":")[0] == "meta"


def _fake_to(
    t: torch.Tensor, device: torch.device, dtype: Any, non_blocking: bool, copy: bool, memory_format: Any
) -> torch.Tensor:
    """``t.to(device)`` as aten's own ``to`` does it: ``t`` itself when nothing changes, else
    ``_to_copy`` (under a fake mode, a fake tensor of the mode), without the CPU build's CUDA
    check."""
    same_format = memory_format in (None, torch.preserve_format)
    if not copy and t.device == device and (dtype is None or dtype == t.dtype) and same_format:
        return t
    return torch.ops.aten._to_copy.default(
        t,
        dtype=dtype or t.dtype,
        device=device,
        non_blocking=non_blocking,
        memory_format=memory_format if memory_format is not None else torch.preserve_format,
    )


# -- Tensor.to / .cuda / .type -----------------------------------------------------------------
def _holds_tensors(t: Any) -> bool:
    """A tensor subclass that holds inner tensors (``DTensor``): it moves by moving what it holds,
    as its own dispatch does on a real GPU (here that dispatch would reach the CPU build's CUDA)."""
    return not isinstance(t, EmuTensor) and is_traceable_wrapper_subclass(t)


def _inner(t: torch.Tensor, move: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A new instance of wrapper subclass ``t`` holding ``move(x)`` for each tensor it holds
    (what it holds besides tensors, e.g. a DTensor's device mesh, is kept)."""
    return transform_subclass(t, lambda _, x: move(x) if isinstance(x, torch.Tensor) else x)


def _parse_to(args: tuple, kwargs: dict) -> tuple[Any, Any, bool, bool, Any]:
    """(device, dtype, non_blocking, copy, memory_format) of a Tensor.to / Module.to call."""
    kwargs = dict(kwargs)
    copy = bool(kwargs.pop("copy", False))
    rest = list(args)
    if rest and isinstance(rest[0], int) and not isinstance(rest[0], bool):
        # .to(0): the CPU build cannot parse an int device in C; an int means cuda:N.
        kwargs.setdefault("device", torch.device("cuda", rest.pop(0)))
    elif "device" in kwargs and isinstance(kwargs["device"], int) and not isinstance(kwargs["device"], bool):
        kwargs["device"] = torch.device("cuda", kwargs["device"])
    if rest and isinstance(rest[0], torch.Tensor):
        other = rest.pop(0)
        kwargs.setdefault("device", other.device)
        kwargs.setdefault("dtype", other.dtype)
    if len(rest) >= 4:  # (device, dtype, non_blocking, copy)
        copy = bool(rest.pop(3))
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
    return device, dtype, bool(non_blocking), copy, memory_format


def _make_tensor_to(ts: TensorState, orig_to: Callable) -> Callable:
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        device, dtype, non_blocking, copy, memory_format = _parse_to(args, kwargs)
        idx = ts.device_index(device)
        if idx is not None and faking():
            return _fake_to(self, _DEVICES[ts.check(idx)], dtype, non_blocking, copy, memory_format)
        if idx is None and isinstance(self, EmuTensor) and _is_meta(device):
            # (the wrapper's own device is meta: torch's .to would hand back the emulated tensor)
            out = as_meta(self)
            return out if dtype is None else out.to(dtype)
        if idx is None:
            call: dict[str, Any] = {"non_blocking": non_blocking, "copy": copy}
            if device is not None:
                call["device"] = device
            if dtype is not None:
                call["dtype"] = dtype
            if memory_format is not None:
                call["memory_format"] = memory_format
            return orig_to(self, **call)
        idx = ts.check(idx)
        if _holds_tensors(self):
            return _inner(self, lambda x: to(x, *args, **kwargs))
        if isinstance(self, EmuTensor):
            if idx == self.emu_device and (dtype is None or dtype == self.dtype) and not copy:
                return self
            # torch's C++ .to() initialises CUDA for a cuda target: convert here instead.
            out = self
            if dtype is not None and dtype != self.dtype:  # (an emulated op: its result is emulated)
                out = cast(EmuTensor, orig_to(self, dtype=dtype, non_blocking=non_blocking))
            elif copy and idx == self.emu_device:
                out = cast(EmuTensor, self.clone())
            if idx != out.emu_device:
                out = PeerCopy.apply(out, idx) if out.requires_grad and torch.is_grad_enabled() else peer_copy(out, idx)
            return out
        host = self if dtype is None or dtype == self.dtype else orig_to(self, dtype=dtype)
        return to_emulated(host, idx, non_blocking)

    return to


def _make_tensor_cuda(ts: TensorState) -> Callable:
    rt = ts.rt
    plain = torch.Tensor

    def cuda(
        self: torch.Tensor, device: Any = None, non_blocking: bool = False, memory_format: Any = torch.preserve_format
    ) -> torch.Tensor:
        if device is None and self.__class__ is plain and not modes_active():  # the usual x.cuda() of a batch
            return host_to_emulated(ts, self, rt.current_device, non_blocking)
        idx = ts.rt.current_device if device is None else ts.device_index(device)
        if idx is None:
            raise ValueError(f"Invalid device, must be cuda device, got {device!r}")
        idx = ts.check(idx)
        if faking():
            return _fake_to(self, _DEVICES[idx], None, non_blocking, False, memory_format)
        if _holds_tensors(self):
            return _inner(self, lambda x: cuda(x, idx, non_blocking))
        if isinstance(self, EmuTensor):
            return self if self.emu_device == idx else self.to(_DEVICES[idx], non_blocking=non_blocking)
        return to_emulated(self, idx, non_blocking)

    return cuda


def _make_tensor_type(ts: TensorState, orig_type: Callable) -> Callable:
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:
            if isinstance(self, EmuTensor):
                return f"torch.cuda.{DTYPE_NAMES.get(self.dtype, 'Tensor')}"
            return orig_type(self)
        if isinstance(dtype, str):
            if dtype.startswith("torch.cuda."):
                name = dtype[len("torch.cuda.") :]
                if name not in TYPE_NAMES:
                    raise ValueError(
                        f"invalid type: {dtype!r}; valid CUDA types: "
                        + ", ".join(f"torch.cuda.{n}" for n in TYPE_NAMES)
                    )
                idx = self.emu_device if isinstance(self, EmuTensor) else ts.rt.current_device
                return self.to(device=_DEVICES[idx], dtype=TYPE_NAMES[name], non_blocking=non_blocking)
            if isinstance(self, EmuTensor) and dtype.startswith("torch.") and dtype[6:] in TYPE_NAMES:
                return self.to(device="cpu", dtype=TYPE_NAMES[dtype[6:]])
        if isinstance(self, EmuTensor) and isinstance(dtype, torch.dtype):
            return self.to(dtype=dtype)
        return orig_type(self, dtype, non_blocking, **kwargs)

    return type_


# -- factories -----------------------------------------------------------------------------------
def _emulated_factory(ts: TensorState, orig: Callable, name: str, args: tuple, kwargs: dict, idx: int) -> torch.Tensor:
    dev = ts.check(idx)
    kw = dict(kwargs)
    kw.pop("device", None)
    kw.pop("pin_memory", None)
    requires_grad = bool(kw.pop("requires_grad", False))
    if args and isinstance(args[0], EmuTensor):
        # *_like / as_tensor of an emulated tensor: runs through dispatch on its device.
        out = orig(*args, **kw) if name not in ("tensor",) else args[0].detach().clone()
        if out.get_device() != dev:
            out = out.to(_DEVICES[dev])
    elif name in _DATA_FACTORIES:
        out = to_emulated(orig(*args, **kw), dev)
    else:
        meta = orig(*args, device=_META, **kw)
        values = ts.values
        if values is not None:  # (value mode: the values take host memory)
            values.check_room(meta.numel() * meta.element_size())
        out = from_meta(ts, meta, dev)
        random = functools.partial(values.random, dev) if values is not None else None
        known = hostvalues.known_factory_value(orig, name, host_args(args), kw, meta, ts.shadow_limit, random)
        ts.set_known_value(out, known)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _make_factory(ts: TensorState, orig: Callable, name: str) -> Callable:
    @functools.wraps(orig)
    def factory(*args: Any, **kwargs: Any) -> Any:
        d = kwargs.get("device")
        if d is not None and faking():
            idx = ts.device_index(d)
            if idx is not None and name in _DATA_FACTORIES:  # (made on the host, then moved)
                host = orig(*args, **{k: v for k, v in kwargs.items() if k != "device"})
                return _fake_to(host, _DEVICES[ts.check(idx)], None, False, False, None)
        elif d is not None:
            if args and isinstance(args[0], EmuTensor) and _is_meta(d):  # empty_like(x, device="meta")
                return orig(as_meta(args[0]), *args[1:], **kwargs)
            idx = ts.device_index(d)
            if idx is not None:
                if args and _holds_tensors(args[0]):  # empty_like(dtensor, device='cuda')
                    return _inner(args[0], lambda x: factory(x, *args[1:], **kwargs))
                return _emulated_factory(ts, orig, name, args, kwargs, idx)
        return orig(*args, **kwargs)

    return factory


def _make_tensor_new(ts: TensorState, orig: Callable) -> Callable:
    """``t.new_zeros(..., device='cuda')`` and friends (the C++ path would initialise CUDA)."""

    @functools.wraps(orig)
    def new(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        d = kwargs.get("device")
        if isinstance(self, EmuTensor) and _is_meta(d):  # x.new_empty(n, device="meta")
            return orig(as_meta(self), *args, **kwargs)
        idx = ts.device_index(d) if d is not None else None
        if idx is None or faking():
            return orig(self, *args, **kwargs)
        idx = ts.check(idx)
        kw = dict(kwargs)
        kw["device"] = _META
        kw.pop("pin_memory", None)
        requires_grad = bool(kw.pop("requires_grad", False))
        kw.setdefault("dtype", self.dtype)
        meta_self = torch.empty((), dtype=self.dtype, device=_META)
        meta = orig(meta_self, *args, **kw)
        out = from_meta(ts, meta, idx)
        # new_zeros/new_ones/new_full: known values, as for the factories (new_empty: zeros)
        host_kw = {k: v for k, v in kw.items() if k != "device"}
        known = hostvalues.known_factory_value(
            lambda *a, device=None, **k: orig(torch.empty((), dtype=self.dtype), *a, **k),
            orig.__name__.replace("new_", ""),
            args,
            host_kw,
            meta,
            ts.shadow_limit,
        )
        ts.set_known_value(out, known)
        return out.requires_grad_(True) if requires_grad else out

    return new


def _cuda_for_cpp(t: torch.Tensor) -> bool:
    """Whether ``t`` is on cuda for torch's C++ too: a fake tensor of a FakeTensorMode (an
    emulated tensor's C++ device is meta). The Python methods that take a device guard (copy_,
    new_tensor) fail on such a tensor in the CPU build, which has no CUDA guard; on a GPU the guard
    changes nothing here."""
    return type(t) is not torch.Tensor and not isinstance(t, EmuTensor) and t.device.type == "cuda"


def _make_tensor_copy(orig: Callable) -> Callable:
    """``dst.copy_(src)`` (the mode's own decompositions copy into fake tensors: ``uniform_``): into
    a tensor on cuda for C++, the op is dispatched as for any other tensor."""
    copy_op = torch.ops.aten.copy_.default

    @functools.wraps(orig)
    def copy_(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
        if _cuda_for_cpp(self):
            return copy_op(self, src, non_blocking)
        return orig(self, src, non_blocking)

    return copy_


def _make_tensor_new_tensor(orig: Callable) -> Callable:
    """``t.new_tensor(data, ...)`` of a tensor on cuda for C++ (``trunc_normal_`` reads its bounds
    so under a fake mode): made by ``torch.tensor`` with ``t``'s dtype and device as defaults."""

    @functools.wraps(orig)
    def new_tensor(self: torch.Tensor, data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not _cuda_for_cpp(self) or args:
            return orig(self, data, *args, **kwargs)
        kwargs.setdefault("dtype", self.dtype)
        kwargs.setdefault("device", self.device)
        return torch.tensor(data, **kwargs)

    return new_tensor


def _make_device_context_tf(ts: TensorState, orig_tf: Callable) -> Callable:
    """``torch.set_default_device('cuda')`` / ``with torch.device('cuda')``: torch's DeviceContext
    mode adds ``device='cuda'`` to factories; route those to emulated factories."""
    from torch.utils._device import _device_constructors

    constructors = _device_constructors()

    def __torch_function__(self: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.device.type == "cuda" and func in constructors and not faking():
            d = kwargs.get("device")
            idx = ts.device_index(self.device if d is None else d)
            if idx is not None:
                return _emulated_factory(ts, func, getattr(func, "__name__", ""), args, kwargs, idx)
        return orig_tf(self, func, types, args, kwargs)

    return __torch_function__


# -- modules -------------------------------------------------------------------------------------
def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in list(module.parameters()) + list(module.buffers()) if t is not None]


def _split(module: torch.nn.Module) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(bytes, count) of the module's tensors on the host, and (bytes, count, device index) of
    those on emulated GPUs."""
    host_b = host_n = gpu_b = gpu_n = 0
    gpu_dev = 0
    for t in _module_tensors(module):
        nbytes = t.numel() * t.element_size()
        if t.device.type == "cuda":
            gpu_b += nbytes
            gpu_n += 1
            gpu_dev = t.device.index or 0
        elif t.device.type == "cpu":
            host_b += nbytes
            host_n += 1
    return (host_b, host_n), (gpu_b, gpu_n, gpu_dev)


def _move(rt: Runtime, module: torch.nn.Module, to_device: int | None, to_host: bool, move: Callable[[], Any]) -> Any:
    """Run ``move`` (torch's own per-tensor move) and charge the model transfer once: onto
    ``to_device`` for the tensors that were on the host, or back to the host (``to_host``) for
    those that were on an emulated GPU. The per-tensor copies inside are not charged."""
    transfers = rt.transfers
    if transfers.moving_model:
        return move()
    (host_b, host_n), (gpu_b, gpu_n, gpu_dev) = _split(module)
    with transfers.moving(), _same_parameter_objects(module):
        result = move()
    if to_device is not None and host_n:
        transfers.model_to_device(module, to_device, nbytes=host_b, copies=host_n)
    elif to_host and gpu_n:
        transfers.model_to_host(module, gpu_dev, gpu_b, gpu_n)
    return result


@contextmanager
def _same_parameter_objects(module: torch.nn.Module) -> Iterator[None]:
    """Inside, ``Module._apply`` keeps each parameter's Python object and swaps its contents
    (``torch.utils.swap_tensors``). Real torch keeps the objects on a CPU<->CUDA move (the two
    tensor types are compatible, so it sets ``param.data``); an emulated tensor is another type,
    for which torch would make new Parameter objects and leave optimizers, GradScalers and EMA
    helpers built before the move holding the old ones. Not done for parameters something holds
    a weak reference to (swap_tensors refuses them): those get torch's new objects."""
    if any(weakref.getweakrefs(p) or _holds_tensors(p) for p in module.parameters()):
        # (torch swaps tensor-subclass parameters itself: is_traceable_wrapper_subclass)
        yield
        return
    future = torch.__future__
    before = future.get_swap_module_params_on_conversion()
    future.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        future.set_swap_module_params_on_conversion(before)


def _make_module_to_empty(rt: Runtime, ts: TensorState, orig: Callable) -> Callable:
    def to_empty(self: torch.nn.Module, *, device: Any, recurse: bool = True) -> torch.nn.Module:
        if ts.device_index(device) is None:
            return orig(self, device=device, recurse=recurse)
        # New (uninitialised) storage on the device: no data moves, nothing to charge; the
        # parameters keep their objects as on a real GPU.
        with _same_parameter_objects(self):
            return orig(self, device=device, recurse=recurse)

    to_empty.__wrapped__ = orig  # type: ignore[attr-defined]
    return to_empty


def _make_module_to(rt: Runtime, ts: TensorState, orig_to: Callable) -> Callable:
    def to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, non_blocking, _copy, memory_format = _parse_to(args, kwargs)
        idx = ts.device_index(device)
        call: dict[str, Any] = {"non_blocking": non_blocking}
        if dtype is not None:
            call["dtype"] = dtype
        if memory_format is not None:
            call["memory_format"] = memory_format
        if idx is None:
            if device is not None:
                call["device"] = device
            if device is None or device.type != "cpu":
                return orig_to(self, **call)  # a dtype change, or another device type
            return _move(rt, self, None, True, lambda: orig_to(self, **call))
        idx = ts.check(idx)
        call["device"] = _DEVICES[idx]
        return _move(rt, self, idx, False, lambda: orig_to(self, **call))

    to.__wrapped__ = orig_to  # type: ignore[attr-defined]
    return to


def _make_module_cuda(rt: Runtime, ts: TensorState, orig_cuda: Callable) -> Callable:
    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        idx = rt.current_device if device is None else ts.device_index(device)
        if idx is None:
            raise ValueError(f"Invalid device, must be cuda device, got {device!r}")
        idx = ts.check(idx)
        return _move(rt, self, idx, False, lambda: orig_cuda(self, idx))

    cuda.__wrapped__ = orig_cuda  # type: ignore[attr-defined]
    return cuda


def _make_module_cpu(rt: Runtime, orig_cpu: Callable) -> Callable:
    def cpu(self: torch.nn.Module) -> torch.nn.Module:
        return _move(rt, self, None, True, lambda: orig_cpu(self))

    cpu.__wrapped__ = orig_cpu  # type: ignore[attr-defined]
    cpu.__doc__ = orig_cpu.__doc__
    return cpu


def _make_where(orig: Callable) -> Callable:
    """``torch.where(cond, x, -1e9)`` and ``x.where(cond, 0)``: a Python number enters as a host
    0-dim tensor, as CUDA takes host scalars. torch's own form wraps it in a tensor on the
    emulated tensor's C++ device (meta), where its value is lost; a value the program decides
    with (beam search's worst score) must stay known."""

    @functools.wraps(orig)
    def where(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 3 and any(isinstance(a, EmuTensor) for a in args):
            args = tuple(
                torch.tensor(a) if isinstance(a, (bool, int, float)) and i > 0 else a for i, a in enumerate(args)
            )
        return orig(*args, **kwargs)

    return where


# ----------------------------------------------------------------------------------------------
# install
# ----------------------------------------------------------------------------------------------
def install(rt: Runtime) -> None:
    """Patch the ways in (Tensor.to/.cuda/.type, factories, default device, Module.to/.cuda/.cpu)
    and let optimizers take their foreach path over emulated tensors."""
    p = rt.patcher
    ts = rt.tensors
    # The installing thread's current device, set explicitly (device 0, as before): reading an
    # unset per-thread value costs an AttributeError inside getattr on every x.cuda().
    rt.current_device = rt.current_device
    T = torch.Tensor
    p.replace(T, "to", _make_tensor_to(ts, T.to))
    p.replace(T, "cuda", _make_tensor_cuda(ts))
    p.replace(T, "type", _make_tensor_type(ts, T.type))
    for name in ("new_empty", "new_zeros", "new_ones", "new_full"):
        p.replace(T, name, _make_tensor_new(ts, getattr(T, name)))
    p.replace(T, "copy_", _make_tensor_copy(T.copy_))
    p.replace(T, "new_tensor", _make_tensor_new_tensor(T.new_tensor))
    p.replace(torch, "where", _make_where(torch.where))
    p.replace(T, "where", _make_where(T.where))
    from torch.utils._device import DeviceContext, _device_constructors

    _device_constructors()  # fill its cache with torch's own functions before ours replace them
    p.replace(DeviceContext, "__torch_function__", _make_device_context_tf(ts, DeviceContext.__torch_function__))
    for name in FACTORIES:
        orig = getattr(torch, name, None)
        if orig is not None:
            p.replace(torch, name, _make_factory(ts, orig, name))
    M = torch.nn.Module
    p.replace(M, "to", _make_module_to(rt, ts, M.to))
    p.replace(M, "cuda", _make_module_cuda(rt, ts, M.cuda))
    p.replace(M, "cpu", _make_module_cpu(rt, M.cpu))
    p.replace(M, "to_empty", _make_module_to_empty(rt, ts, M.to_empty))
    # Optimizers choose their foreach (multi-tensor) path only for listed tensor types.
    import torch.optim.optimizer as opt_mod
    import torch.utils._foreach_utils as fe_mod

    for mod in (opt_mod, fe_mod):
        types = getattr(mod, "_foreach_supported_types", None)
        if isinstance(types, list) and EmuTensor not in types:
            p.replace(mod, "_foreach_supported_types", types + [EmuTensor])
    # ... and decide foreach support (clip_grad_norm_'s foreach=True) and per-device state
    # (fused optimizers' grad scale) from the devices the tensors are grouped by.
    grouping = getattr(fe_mod, "_group_tensors_by_device_and_dtype", None)
    if grouping is not None:
        p.replace_everywhere(grouping, group_tensors_by_device_and_dtype)


@torch.no_grad()
def group_tensors_by_device_and_dtype(tensorlistlist: list, with_indices: bool = False) -> dict:
    """torch's ``_group_tensors_by_device_and_dtype`` with emulated tensors grouped by their
    emulated device (torch's C++ sees their meta storage: every emulated GPU's tensors would be one
    group on ``meta``, where foreach kernels are refused). A wrapper over an emulated tensor (FSDP2's
    and DTensor's gradients are DTensors) is grouped by the device it reports too, as on a GPU."""
    grouped = torch._C._group_tensors_by_device_and_dtype(tensorlistlist, with_indices)
    if not any(device is not None and device.type == "meta" for device, _ in grouped):
        return grouped
    out: dict = {}
    for (device, dtype), (lists, indices) in grouped.items():
        if device is None or device.type != "meta":
            out[(device, dtype)] = (lists, indices)
            continue
        members: dict[torch.device, list[int]] = {}  # each device's positions in the group
        for j, t in enumerate(lists[0]):
            members.setdefault(t.device if t is not None else device, []).append(j)
        for dev, js in members.items():
            if len(members) == 1:
                out[(dev, dtype)] = (lists, indices)
            else:
                # (a list the caller left empty, e.g. amsgrad's state without amsgrad, stays empty)
                parts = [[lst[j] for j in js] if lst else [] for lst in lists]
                out[(dev, dtype)] = (parts, [indices[j] for j in js] if indices else [])
    return out
