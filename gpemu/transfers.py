"""How long host<->GPU copies take, and who waits for them.

Time of one host->device copy:

* when the tensor looks like the input batch of the dataset model on that device
  (N x 3 x 224 x 224 floating point, the ImageNet-sized inputs the profile database was measured
  with) the database's measured ``h2d_transfer`` for that model and batch size;
* otherwise ``bytes / host-link bandwidth + a fixed latency`` (10 us, the launch and DMA set-up
  cost of one cudaMemcpy), with the GPU's pinned or pageable bandwidth.

The database's ``h2d_transfer`` values are pageable copies: on every GPU they imply 4-5.4 GB/s for
a 64x3x224x224 fp32 batch, the pageable PCIe rate, while the same artifact's per-iteration copy
times inside real training loops with pinned loaders are ~3x shorter (AlexNet P100 batch 64: 3.2 ms
measured in the loop vs 9.1 ms in the profile). So a pinned copy of a recognised batch takes the
profiled time scaled by the GPU's pageable/pinned bandwidth ratio (P100: 9.14 ms x 4.54/12.6 =
3.29 ms, within 3% of the 3.2 ms measured in the loop).

Who waits, as in CUDA: a copy from pageable memory, and any copy with ``non_blocking=False``,
blocks the host until the copy has finished on its stream (which first waits for everything
queued before it on that stream). A ``non_blocking=True`` copy from pinned memory is only queued:
later work on the same stream runs after it, and it overlaps with compute only when issued on
another stream (``torch.cuda.stream(s)``), which is the time engine's business.

Moving a model onto a GPU (``Module.to``/``.cuda``, whose patch in gpemu.tensor calls
:func:`model_to_device`) is charged once, as the database's measured ``model_transfer`` for an
identified model or the bandwidth estimate over all its tensors; moving it back
(``Module.cpu()``/``.to("cpu")``, patched here) is also charged once. The per-tensor copies
inside a move are not charged again.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime

__all__ = [
    "COPY_LATENCY_SECONDS",
    "host_to_device_seconds",
    "device_to_host_seconds",
    "copy_to_device",
    "copy_to_host",
    "model_to_device",
    "model_to_host",
    "install",
    "TransferState",
]

# Fixed cost of one cudaMemcpy (driver call + DMA set-up); ~10 us on PCIe GPUs.
COPY_LATENCY_SECONDS = 10e-6
# Inputs the profile database's h2d_transfer was measured with: ImageNet-sized images.
_DATASET_INPUT_SHAPE = (3, 224, 224)


class TransferState:
    """Per-run state of the transfers component (``rt.state["transfers"]``)."""

    def __init__(self) -> None:
        self.cache: dict[tuple, tuple[float, str]] = {}   # db lookups, keyed by what decides them
        self.models: dict[int, str | None] = {}            # dataset model moved onto each device
        # seconds of one input copy by (shape, dtype, device, pinned); cleared when a model
        # moves (the model decides which measured copy time applies)
        self.h2d: dict[tuple, float] = {}
        self._local = threading.local()

    @property
    def moving_model(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def enter_move(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def exit_move(self) -> None:
        self._local.depth -= 1


def _state(rt: "Runtime") -> TransferState:
    st = rt.state.get("transfers")
    if st is None:
        st = rt.state["transfers"] = TransferState()
    return st


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_pinned_check: "Callable[[torch.Tensor], bool] | None" = None


def _is_pinned(tensor: torch.Tensor) -> bool:
    global _pinned_check
    if _pinned_check is None:  # imported on first use, once (this runs on every input copy)
        from gpemu.integrations.pinned_memory import is_pinned
        _pinned_check = is_pinned
    return _pinned_check(tensor)


def _bandwidth_seconds(rt: "Runtime", nbytes: int, device: int, pinned: bool, copies: int = 1) -> float:
    spec = rt.gpus[device]
    bandwidth = spec.host_link_bandwidth_pinned if pinned else spec.host_link_bandwidth_pageable
    return copies * COPY_LATENCY_SECONDS + nbytes / float(bandwidth)


def _model_on_device(rt: "Runtime", device: int) -> str | None:
    """The dataset model whose inputs this device receives: the one moved there, else configured."""
    name = _state(rt).models.get(device)
    return name if name is not None else rt.config.model


def _lookup(rt: "Runtime", device: int, model: str, batch: int, kind: str) -> tuple[float, str] | None:
    """A cached db lookup (None when the db has nothing for this GPU/model/kind)."""
    st = _state(rt)
    gpu = rt.gpus[device].name
    key = (gpu, model, batch, kind)
    hit = st.cache.get(key)
    if hit is not None or key in st.cache:
        return hit
    result: tuple[float, str] | None = None
    try:
        if rt.db.has(gpu, model, kind):
            found = rt.db.lookup(gpu, model, batch, kind)
            result = (float(found.value), str(found.provenance))
    except ValueError:  # unknown model / kind in a user's database: fall back to bandwidth
        result = None
    st.cache[key] = result
    return result


def host_to_device_seconds(rt: "Runtime", tensor: torch.Tensor, device: int, pinned: bool) -> tuple[float, str]:
    """Seconds one host->device copy of ``tensor`` takes on ``device``, and where that came from.

    Provenance is the database's ("measured", "interpolated", "extrapolated") for a recognised
    input batch, else "estimated" (bandwidth + latency).
    """
    nbytes = _nbytes(tensor)
    shape = tuple(tensor.shape)
    if len(shape) == 4 and shape[1:] == _DATASET_INPUT_SHAPE and tensor.dtype.is_floating_point and shape[0] > 0:
        model = _model_on_device(rt, device)
        if model is not None:
            found = _lookup(rt, device, model, shape[0], "h2d_transfer")
            if found is not None:
                seconds, provenance = found
                if pinned:
                    spec = rt.gpus[device]
                    seconds *= min(1.0, spec.host_link_bandwidth_pageable / spec.host_link_bandwidth_pinned)
                return seconds, provenance
    return _bandwidth_seconds(rt, nbytes, device, pinned), "estimated"


def device_to_host_seconds(rt: "Runtime", tensor: torch.Tensor, device: int, pinned: bool = False) -> tuple[float, str]:
    """Seconds one device->host copy of ``tensor`` takes (bandwidth + latency)."""
    return _bandwidth_seconds(rt, _nbytes(tensor), device, pinned), "estimated"


def copy_to_device(rt: "Runtime", tensor: torch.Tensor, device: int, non_blocking: bool,
                   issued_at: float | None = None) -> None:
    """Charge one host->device copy of CPU ``tensor``: queue it on the device's current stream;
    the host waits for it unless it is a pinned ``non_blocking`` copy. ``issued_at``: the host
    time (``engine.now()``) the program asked for the copy, before the emulator's own work."""
    st = _state(rt)
    if st.moving_model:
        return  # charged once for the whole model by model_to_device
    nbytes = _nbytes(tensor)
    pinned = _is_pinned(tensor)
    key = (tensor.shape, tensor.dtype, device, pinned)
    seconds = st.h2d.get(key)
    if seconds is None:
        seconds = st.h2d[key] = host_to_device_seconds(rt, tensor, device, pinned)[0]
    stream = rt.state["engine"].stream(device)
    rt.recorder.add_many(("h2d_bytes", nbytes), ("h2d_copies", 1), ("h2d_seconds", seconds),
                         ("h2d_pinned_bytes" if pinned else "h2d_pageable_bytes", nbytes))
    stream.enqueue(seconds, "transfer", "h2d pinned" if pinned else "h2d pageable", at=issued_at)
    if not (pinned and non_blocking):
        stream.synchronize("pageable-copy" if not pinned else "blocking-copy")


def copy_to_host(rt: "Runtime", tensor: torch.Tensor, device: int) -> None:
    """Charge one device->host copy into ordinary (pageable) memory; the host waits for it."""
    st = _state(rt)
    if st.moving_model:
        return
    nbytes = _nbytes(tensor)
    seconds, _ = device_to_host_seconds(rt, tensor, device, pinned=False)
    stream = rt.state["engine"].stream(device)
    stream.enqueue(seconds, "transfer", "d2h")
    rt.recorder.add("d2h_bytes", nbytes)
    rt.recorder.add("d2h_copies", 1)
    rt.recorder.add("d2h_seconds", seconds)
    stream.synchronize("d2h-copy")


def _identify(rt: "Runtime", module: torch.nn.Module) -> str | None:
    try:
        from gpemu.identify import identify
    except ModuleNotFoundError:  # identification not available in this build
        return rt.config.model
    identity = identify(rt, module)
    return getattr(identity, "name", None)


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in list(module.parameters()) + list(module.buffers()) if t is not None]


def model_to_device(rt: "Runtime", module: torch.nn.Module, device: int, nbytes: int | None = None,
                    copies: int | None = None) -> float:
    """Charge moving ``module``'s parameters and buffers to ``device``; the host waits (model
    tensors are pageable). Returns the seconds charged.

    ``nbytes``/``copies`` give what actually moved (tensors already on the GPU are not copied
    again); default: every parameter and buffer.
    """
    if nbytes is None or copies is None:
        tensors = _module_tensors(module)
        nbytes = sum(_nbytes(t) for t in tensors) if nbytes is None else nbytes
        copies = len(tensors) if copies is None else copies
    st = _state(rt)
    name = _identify(rt, module)
    st.models[device] = name
    st.h2d.clear()
    found = _lookup(rt, device, name, 1, "model_transfer") if name is not None else None
    if found is not None:
        seconds, provenance = found
    else:
        seconds, provenance = _bandwidth_seconds(rt, nbytes, device, pinned=False, copies=copies), "estimated"
    stream = rt.state["engine"].stream(device)
    stream.enqueue(seconds, "transfer", f"model h2d ({name or type(module).__name__}, {provenance})")
    rt.recorder.add("h2d_bytes", nbytes)
    rt.recorder.add("model_transfer_bytes", nbytes)
    rt.recorder.add("model_transfer_seconds", seconds)
    stream.synchronize("model-copy")
    return seconds


def model_to_host(rt: "Runtime", module: torch.nn.Module, device: int, nbytes: int, copies: int) -> float:
    """Charge moving ``nbytes`` of a model (``copies`` tensors) from ``device`` back to the host."""
    seconds = _bandwidth_seconds(rt, nbytes, device, pinned=False, copies=copies)
    stream = rt.state["engine"].stream(device)
    stream.enqueue(seconds, "transfer", f"model d2h ({type(module).__name__})")
    rt.recorder.add("d2h_bytes", nbytes)
    rt.recorder.add("d2h_seconds", seconds)
    stream.synchronize("model-copy")
    return seconds


# ---------------------------------------------------------------------- Module.to / .cuda / .cpu
def _device_index(rt: "Runtime", device: Any) -> int | None:
    """Emulated device index a Module move targets; None for the CPU or no device."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return rt.check_device(device)
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    return rt.check_device(dev.index if dev.index is not None else rt.current_device)


def _split(module: torch.nn.Module) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(bytes, count) of the module's tensors on the host, and (bytes, count, device index) of
    those on emulated GPUs."""
    host_b = host_n = gpu_b = gpu_n = 0
    gpu_dev = 0
    for t in _module_tensors(module):
        if t.device.type == "cuda":
            gpu_b += _nbytes(t)
            gpu_n += 1
            gpu_dev = t.device.index or 0
        elif t.device.type == "cpu":
            host_b += _nbytes(t)
            host_n += 1
    return (host_b, host_n), (gpu_b, gpu_n, gpu_dev)


def _wrap_move(rt: "Runtime", original: Callable[..., Any],
               target: Callable[[tuple, dict], tuple[int | None, bool, tuple, dict]]) -> Callable[..., Any]:
    st = _state(rt)

    def move(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        device, to_host, args, kwargs = target(args, kwargs)
        if st.moving_model or (device is None and not to_host):
            return original(self, *args, **kwargs)
        (host_b, host_n), (gpu_b, gpu_n, gpu_dev) = _split(self)
        st.enter_move()
        try:
            out = original(self, *args, **kwargs)
        finally:
            st.exit_move()
        if device is not None and host_n:
            model_to_device(rt, self, device, nbytes=host_b, copies=host_n)
        elif to_host and gpu_n:
            model_to_host(rt, self, gpu_dev, gpu_b, gpu_n)
        return out

    move.__wrapped__ = original  # type: ignore[attr-defined]
    move.__doc__ = original.__doc__
    return move


def install(rt: "Runtime") -> None:
    """Component ``gpemu.transfers``. Tensor copies are charged by the emulated tensor's
    ``.to``/``.cuda``/``.cpu`` calling :func:`copy_to_device` / :func:`copy_to_host`, and moves of a
    whole model onto a GPU by its ``Module.to``/``.cuda`` calling :func:`model_to_device` once
    (gpemu.tensor). Here: moves of a model back to the host (``Module.cpu()``,
    ``Module.to("cpu")``) are charged once instead of once per tensor."""
    _state(rt)
    Module = torch.nn.Module

    def to_target(args: tuple, kwargs: dict) -> tuple[int | None, bool, tuple, dict]:
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, (int, torch.dtype, torch.Tensor)) or device is None:
            # .to(0) (a GPU), .to(dtype), .to(tensor): not a move to the host by device name.
            if isinstance(device, torch.Tensor) and device.device.type == "cpu":
                return None, True, args, kwargs
            return None, False, args, kwargs
        try:
            to_host = torch.device(device).type == "cpu"
        except (RuntimeError, TypeError):
            to_host = False
        return None, to_host, args, kwargs

    def cpu_target(args: tuple, kwargs: dict) -> tuple[int | None, bool, tuple, dict]:
        return None, True, args, kwargs

    rt.patcher.replace(Module, "to", _wrap_move(rt, Module.to, to_target))
    rt.patcher.replace(Module, "cpu", _wrap_move(rt, Module.cpu, cpu_target))
