"""``torch.save`` / ``torch.load`` with emulated tensors.

Saving: an emulated tensor is pickled as a plain CPU tensor of the right shape and dtype holding
its placeholder values (see :mod:`gpemu.hostvalues`), carrying one extra attribute,
``_gpemu_device = "cuda:N"``. The file is an ordinary PyTorch checkpoint: it loads without
gpemu (also with ``weights_only=True``), giving CPU tensors; with gpemu, tensors come back
on the emulated device they were saved from (as a real CUDA checkpoint would).

Loading (with gpemu patched): ``torch.load`` is wrapped. Storages are always read to the host
first, then tensors are placed according to ``map_location``, exactly like PyTorch does for
real devices:

* ``None`` - where they were saved: storages tagged ``cuda:N`` (files written by real CUDA runs)
  and gpemu placeholders go to emulated device N; CPU storages stay on the CPU;
* ``'cuda'``/``'cuda:K'``/``torch.device``/int K - every tensor to emulated device K;
* ``{'cuda:1': 'cuda:0', ...}`` - saved locations remapped, unlisted ones kept;
* ``'cpu'`` - everything on the CPU (plain torch.load);
* a callable ``f(storage, location)`` - called with the host storage; whatever it returns is
  kept on the host, except that the location string it is given decides the emulated device
  when it returns the storage unchanged for a ``cuda`` location (``lambda s, loc: s`` keeps
  every tensor on the CPU, as in PyTorch).

Host-to-device copy time of loaded tensors is charged like any ``.cuda()``.

Another process (``torch.multiprocessing``: ``mp.Process`` / ``mp.spawn`` arguments, queues): a CUDA
tensor crosses by CUDA IPC, and the other process gets a tensor on the same device over the same
memory (Hogwild trains one model shared so). An emulated tensor crosses as its metadata and known
value (:class:`SharedTensor`); the other process, patched by ``gpemu run`` as every child is,
rebuilds it on the same emulated device without allocating (IPC memory is the sender's).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .device import EmuTensor, device_index, host_shadow, set_host_shadow, to_emulated, to_host
from .runtime import current

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "reduce_emulated", "reduce_for_process", "rebuild_in_process", "SharedTensor", "MARKER"]

MARKER = "_gpemu_device"
_HOST = "host"  # a map_location callable chose to keep this storage on the host


def reduce_emulated(t: EmuTensor, protocol: int) -> Any:
    """Pickle an emulated tensor as a CPU placeholder tensor with a device marker."""
    values = to_host(t, reason="save")
    if getattr(t, "_is_param", False):
        host: torch.Tensor = torch.nn.Parameter(values, requires_grad=t.requires_grad)
    else:
        host = values.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else values
    setattr(host, MARKER, f"cuda:{t.emu_device}")
    return host.__reduce_ex__(protocol)


class SharedTensor(NamedTuple):
    """What another process needs to rebuild an emulated tensor it was sent."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: int
    requires_grad: bool
    is_parameter: bool
    value: torch.Tensor | None  # its known host value (small tensors), else None


def reduce_for_process(t: EmuTensor) -> tuple[Callable[[SharedTensor], torch.Tensor], tuple[SharedTensor]]:
    """``ForkingPickler``'s reduction of an emulated tensor (what CUDA IPC is for a CUDA tensor)."""
    spec = SharedTensor(
        tuple(t.shape),
        tuple(t.stride()),
        int(t.storage_offset()),
        t.dtype,
        t.emu_device,
        t.requires_grad,
        isinstance(t, torch.nn.Parameter) or bool(getattr(t, "_is_param", False)),
        host_shadow(t),
    )
    return rebuild_in_process, (spec,)


def rebuild_in_process(spec: SharedTensor) -> torch.Tensor:
    """The tensor another process was sent: emulated on the same device, over no new memory (the
    sender's); a CPU tensor of placeholder zeros in a process gpemu does not emulate in."""
    rt = current()
    if rt is None:
        t: torch.Tensor = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype).zero_()
        if spec.value is not None:
            t.copy_(spec.value.reshape(spec.shape))
    else:
        t = rt.tensors.wrap(spec.shape, spec.stride, spec.offset, spec.dtype, spec.device, None)
        if spec.value is not None:
            set_host_shadow(t, spec.value)
    if spec.is_parameter:
        return torch.nn.Parameter(t, requires_grad=spec.requires_grad)
    return t.requires_grad_(spec.requires_grad) if spec.requires_grad else t


def _target_for(location: str, map_location: Any) -> str:
    """The device string a storage saved at ``location`` goes to."""
    if map_location is None:
        return location
    if isinstance(map_location, dict):
        return map_location.get(location, location)
    if isinstance(map_location, int) and not isinstance(map_location, bool):
        return f"cuda:{map_location}"
    if isinstance(map_location, (str, torch.device)):
        return str(map_location)
    return location


def _make_load(orig_load: Callable) -> Callable:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if callable(map_location) and not isinstance(map_location, (str, dict, torch.device)):
            user_fn = map_location
            kept: dict[int, str] = {}

            def host_fn(storage: Any, location: str) -> Any:
                try:
                    out = user_fn(storage, location)
                except Exception:
                    # e.g. ``lambda s, loc: s.cuda(0)``: real CUDA storages cannot exist here;
                    # the tensors go to the emulated device the location names.
                    kept[storage._cdata] = location if location.startswith("cuda") else "cuda"
                    return storage
                if out is None:
                    out = storage
                kept[out._cdata] = _HOST
                return out

            return _place(orig_load(f, host_fn, *args, **kwargs), kept, None, {})
        if map_location is not None and not _mentions_cuda(map_location):
            return orig_load(f, map_location, *args, **kwargs)
        saved: dict[int, str] = {}

        def to_host(storage: Any, location: str) -> Any:
            saved[storage._cdata] = location
            return storage

        result = orig_load(f, to_host, *args, **kwargs)
        return _place(result, saved, map_location, {})

    return load


def _mentions_cuda(map_location: Any) -> bool:
    if isinstance(map_location, dict):
        return any(str(v).startswith("cuda") for v in map_location.values()) or any(
            str(k).startswith("cuda") for k in map_location
        )
    if isinstance(map_location, int) and not isinstance(map_location, bool):
        return True
    return str(map_location).startswith("cuda")


def _tensor_target(t: torch.Tensor, saved: dict[int, str], map_location: Any) -> int | None:
    marker = t.__dict__.get(MARKER) if hasattr(t, "__dict__") else None
    try:
        location = saved.get(t.untyped_storage()._cdata, "cpu")
    except Exception:
        location = "cpu"
    if location == _HOST:
        return None
    if marker is not None and location == "cpu":
        location = marker
    target = _target_for(location, map_location)
    return device_index(target)


def _place(obj: Any, saved: dict[int, str], map_location: Any, memo: dict[int, Any]) -> Any:
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, EmuTensor):
        return obj
    if isinstance(obj, torch.Tensor):
        idx = _tensor_target(obj, saved, map_location)
        if MARKER in getattr(obj, "__dict__", {}):
            del obj.__dict__[MARKER]
        if idx is None:
            out: Any = obj
        else:
            with torch.no_grad():
                out = to_emulated(obj.detach(), idx)
            if isinstance(obj, torch.nn.Parameter):
                out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
            elif obj.requires_grad:
                out.requires_grad_(True)
        memo[id(obj)] = out
        return out
    if isinstance(obj, torch.nn.Module):
        memo[id(obj)] = obj
        for mod in obj.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = _place(p, saved, map_location, memo)
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = _place(b, saved, map_location, memo)
        return obj
    if isinstance(obj, collections.OrderedDict):
        out_d = type(obj)()
        memo[id(obj)] = out_d
        for k, v in obj.items():
            out_d[k] = _place(v, saved, map_location, memo)
        if hasattr(obj, "_metadata"):
            out_d._metadata = obj._metadata  # type: ignore[attr-defined]
        return out_d
    if isinstance(obj, dict):
        out_d2: dict[Any, Any] = {}
        memo[id(obj)] = out_d2
        for k, v in obj.items():
            out_d2[k] = _place(v, saved, map_location, memo)
        return out_d2
    if isinstance(obj, list):
        out_l: list = []
        memo[id(obj)] = out_l
        out_l.extend(_place(v, saved, map_location, memo) for v in obj)
        return out_l
    if isinstance(obj, tuple):
        items = [_place(v, saved, map_location, memo) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    return obj


def install(rt: Runtime) -> None:
    """Pickle emulated tensors as placeholders (``EmuTensor.__reduce_ex__``) and wrap torch.load
    (every module-level reference, e.g. torch.serialization.load too)."""
    import torch.serialization as ser

    rt.patcher.replace(EmuTensor, "__reduce_ex__", reduce_emulated)
    # Another process: registered with the pickler torch.multiprocessing sends tensors with.
    reducers = vars(ForkingPickler)["_extra_reducers"]  # the table register() fills (not in typeshed)
    before = reducers.get(EmuTensor)
    ForkingPickler.register(EmuTensor, reduce_for_process)
    rt.patcher.on_restore(
        lambda: reducers.pop(EmuTensor, None) if before is None else reducers.__setitem__(EmuTensor, before)
    )
    orig = ser.load
    new = _make_load(orig)
    rt.patcher.replace_everywhere(orig, new)
