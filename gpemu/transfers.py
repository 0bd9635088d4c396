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

Moving a model onto a GPU (``Module.to``/``.cuda``, whose patch in :mod:`gpemu.ways_in` calls
:meth:`TransferState.model_to_device`) is charged once, as the database's measured
``model_transfer`` for an identified model or the bandwidth estimate over all its tensors; moving
it back (``Module.cpu()``/``.to("cpu")``) is also charged once. The per-tensor copies inside a
move are not charged again.

Whether a host tensor is page-locked is asked of ``TransferState.is_pinned``, which the
pinned-memory component (:mod:`gpemu.integrations.pinned_memory`) sets to its own check; without
it no host memory is pinned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .reference import measured_on, reference_gpu

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.db import GpuSpec
    from gpemu.runtime import Runtime

__all__ = [
    "COPY_LATENCY_SECONDS",
    "host_to_device_seconds",
    "device_to_host_seconds",
    "install",
    "TransferState",
    "CopyPlan",
]

# Fixed cost of one cudaMemcpy (driver call + DMA set-up); ~10 us on PCIe GPUs.
COPY_LATENCY_SECONDS = 10e-6
# Inputs the profile database's h2d_transfer was measured with: ImageNet-sized images.
_DATASET_INPUT_SHAPE = (3, 224, 224)


def _never_pinned(tensor: torch.Tensor) -> bool:
    return False


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _MoveDepth(threading.local):
    depth = 0  # whole-model moves open on this thread


class CopyPlan:
    """Everything one kind of host->device copy needs, worked out once (``TransferState.copy_plan``):
    a copy of the same shape, strides, dtype, pinnedness and blocking to the same device costs
    the same, so the hot path is a lookup and a charge (:meth:`TransferState.charge`)."""

    __slots__ = (
        "shape",
        "stride",
        "dtype",
        "nbytes",
        "numel",
        "seconds",
        "name",
        "wait",
        "reason",
        "pinned",
        "host",
        "count",
        "__weakref__",
    )

    def __init__(
        self,
        shape: tuple,
        stride: tuple,
        dtype: torch.dtype,
        numel: int,
        nbytes: int,
        seconds: float,
        pinned: bool,
        non_blocking: bool,
        host: bool,
    ) -> None:
        self.shape, self.stride, self.dtype, self.numel, self.nbytes = shape, stride, dtype, numel, nbytes
        self.seconds = seconds
        self.pinned = pinned
        self.name = "h2d pinned" if pinned else "h2d pageable"
        # Who waits, as in CUDA: pageable copies, and any copy that is not non_blocking.
        self.wait = not (pinned and non_blocking)
        self.reason = "pageable-copy" if not pinned else "blocking-copy"
        self.host = host  # from host memory (its values can be kept: gpemu.hostvalues' policy)
        self.count = 0  # copies charged with this plan (the recorder's h2d counters)


class TransferState:
    """The transfers component of one run (``rt.transfers``): what copies cost and charging them."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.cache: dict[tuple, tuple[float, str] | None] = {}  # db lookups, keyed by what decides them
        self.references: dict[int, GpuSpec | None] = {}  # see _reference
        self.models: dict[int, str | None] = {}  # dataset model moved onto each device
        # seconds of one input copy by (shape, dtype, device, pinned); cleared when a model
        # moves (the model decides which measured copy time applies)
        self.h2d: dict[tuple, float] = {}
        # copy plans by (shape, stride, dtype, host device?, device, pinned, non_blocking), cleared
        # with h2d; the copies charged with retired plans are folded into the recorder's counters
        self.plans: dict[tuple, CopyPlan] = {}
        self._retired: dict[str, float] = {}  # counters of the copies of plans cleared since
        rt.recorder.add_source(self._counters)
        # Is this host tensor page-locked? Set by the pinned-memory component.
        self.is_pinned: Callable[[torch.Tensor], bool] = _never_pinned
        self._local = _MoveDepth()

    # ------------------------------------------------------------------ model moves
    @property
    def moving_model(self) -> bool:
        """True inside a whole-model move (its per-tensor copies are not charged)."""
        return self._local.depth > 0

    @contextmanager
    def moving(self) -> Iterator[None]:
        """Copies made inside are part of one model move (charged once by the caller)."""
        self._local.depth += 1
        try:
            yield
        finally:
            self._local.depth -= 1

    # ------------------------------------------------------------------ costs
    def _bandwidth_seconds(self, nbytes: int, device: int, pinned: bool, copies: int = 1) -> float:
        spec = self.rt.gpus[device]
        bandwidth = spec.host_link_bandwidth_pinned if pinned else spec.host_link_bandwidth_pageable
        return copies * COPY_LATENCY_SECONDS + nbytes / float(bandwidth)

    def _model_on_device(self, device: int) -> str | None:
        """The dataset model whose inputs this device receives: the one moved there, else configured."""
        name = self.models.get(device)
        return name if name is not None else self.rt.config.model

    def _lookup(self, device: int, model: str, batch: int, kind: str) -> tuple[float, str] | None:
        """A cached db lookup (None when the db has nothing for this model/kind on the device's
        GPU, nor on its reference GPU (:mod:`gpemu.reference`) when it has no measurements of
        its own: an H100 copies as the A100 measured, provenance "measured on A100")."""
        rt = self.rt
        spec = rt.gpus[device]
        key = (spec.name, model, batch, kind)
        if key in self.cache:
            return self.cache[key]
        result: tuple[float, str] | None = None
        try:
            source = measured_on(rt.db, (spec, self._reference(device)), model, kind)
            if source is not None:
                found = rt.db.lookup(source.name, model, batch, kind)
                provenance = str(found.provenance)
                result = (float(found.value), provenance if source is spec else f"{provenance} on {source.short_name}")
        except ValueError:  # unknown model / kind in a user's database: fall back to bandwidth
            result = None
        self.cache[key] = result
        return result

    def _reference(self, device: int) -> GpuSpec | None:
        """The device's reference GPU when its own GPU has no measurements (None otherwise)."""
        if device not in self.references:
            spec = self.rt.gpus[device]
            try:
                found = reference_gpu(self.rt.db, spec)
            except Exception:  # a partial or unreachable database: bandwidth estimates
                found = None
            self.references[device] = found if found is not None and found.name != spec.name else None
        return self.references[device]

    def host_to_device_seconds(self, tensor: torch.Tensor, device: int, pinned: bool) -> tuple[float, str]:
        """Seconds one host->device copy of ``tensor`` takes on ``device``, and where that came from.

        Provenance is the database's ("measured", "interpolated", "extrapolated") for a recognised
        input batch, else "estimated" (bandwidth + latency).
        """
        shape = tuple(tensor.shape)
        if len(shape) == 4 and shape[1:] == _DATASET_INPUT_SHAPE and tensor.dtype.is_floating_point and shape[0] > 0:
            model = self._model_on_device(device)
            if model is not None:
                found = self._lookup(device, model, shape[0], "h2d_transfer")
                if found is not None:
                    seconds, provenance = found
                    if pinned:
                        spec = self.rt.gpus[device]
                        seconds *= min(1.0, spec.host_link_bandwidth_pageable / spec.host_link_bandwidth_pinned)
                    return seconds, provenance
        return self._bandwidth_seconds(_nbytes(tensor), device, pinned), "estimated"

    def device_to_host_seconds(self, tensor: torch.Tensor, device: int, pinned: bool = False) -> tuple[float, str]:
        """Seconds one device->host copy of ``tensor`` takes (bandwidth + latency)."""
        return self._bandwidth_seconds(_nbytes(tensor), device, pinned), "estimated"

    # ------------------------------------------------------------------ charging
    def copy_plan(self, tensor: torch.Tensor, device: int, non_blocking: bool) -> CopyPlan:
        """The :class:`CopyPlan` of copying host ``tensor`` to ``device`` (made once per kind of copy)."""
        pinned = self.is_pinned(tensor)
        key = (tensor.shape, tensor.stride(), tensor.dtype, tensor.is_cpu, device, pinned, non_blocking)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._make_plan(tensor, device, pinned, non_blocking, key)
        return plan

    def _make_plan(self, tensor: torch.Tensor, device: int, pinned: bool, non_blocking: bool, key: tuple) -> CopyPlan:
        seconds_key = (tensor.shape, tensor.dtype, device, pinned)
        seconds = self.h2d.get(seconds_key)
        if seconds is None:
            seconds = self.h2d[seconds_key] = self.host_to_device_seconds(tensor, device, pinned)[0]
        if tensor.is_contiguous() or _non_overlapping_dense(tensor):
            stride = tuple(tensor.stride())
        else:  # the copy is dense: contiguous strides
            stride = tuple(torch.empty(tensor.shape, device="meta").stride())
        numel = tensor.numel()
        plan = CopyPlan(
            tuple(tensor.shape),
            stride,
            tensor.dtype,
            numel,
            numel * tensor.element_size(),
            seconds,
            pinned,
            non_blocking,
            tensor.is_cpu,
        )
        if len(self.plans) >= 4096:  # ever new shapes: start again (their counts are kept)
            self._retire_plans()
        self.plans[key] = plan
        return plan

    def _retire_plans(self) -> None:
        for name, value in self._counters():
            self._retired[name] = value
        self.plans.clear()

    def charge(self, plan: CopyPlan, device: int) -> None:
        """Charge one copy of ``plan`` onto ``device``'s current stream; the host waits for it
        unless it is a pinned ``non_blocking`` copy."""
        plan.count += 1
        engine = self.rt.engine
        stream = engine.stream(device)
        if plan.wait:
            engine.enqueue_wait(stream, plan.seconds, "transfer", plan.name, plan.reason)
        else:
            stream.enqueue(plan.seconds, "transfer", plan.name)

    def _counters(self) -> list[tuple[str, float]]:
        """The recorder's h2d counters of the copies charged with plans (a counter source)."""
        retired = self._retired
        copies, nbytes, seconds = (
            retired.get("h2d_copies", 0.0),
            retired.get("h2d_bytes", 0.0),
            retired.get("h2d_seconds", 0.0),
        )
        pinned, pageable = retired.get("h2d_pinned_bytes", 0.0), retired.get("h2d_pageable_bytes", 0.0)
        for plan in list(self.plans.values()):
            n = plan.count
            if n:
                copies += n
                nbytes += n * plan.nbytes
                seconds += n * plan.seconds
                if plan.pinned:
                    pinned += n * plan.nbytes
                else:
                    pageable += n * plan.nbytes
        if not copies:
            return []
        return [
            ("h2d_bytes", nbytes),
            ("h2d_copies", copies),
            ("h2d_seconds", seconds),
            ("h2d_pinned_bytes", pinned),
            ("h2d_pageable_bytes", pageable),
        ]

    def copy_to_device(
        self, tensor: torch.Tensor, device: int, non_blocking: bool, issued_at: float | None = None
    ) -> None:
        """Charge one host->device copy of CPU ``tensor``: queue it on the device's current stream;
        the host waits for it unless it is a pinned ``non_blocking`` copy. ``issued_at``: the host
        time (``engine.now()``) the program asked for the copy, before the emulator's own work
        (inside an emulator entry the host's time is the entry's anyway)."""
        if self.moving_model:
            return  # charged once for the whole model by model_to_device
        plan = self.copy_plan(tensor, device, non_blocking)
        if issued_at is None:
            self.charge(plan, device)
            return
        plan.count += 1
        stream = self.rt.engine.stream(device)
        stream.enqueue(plan.seconds, "transfer", plan.name, at=issued_at)
        if plan.wait:
            stream.synchronize(plan.reason)

    def copy_to_host(self, tensor: torch.Tensor, device: int) -> None:
        """Charge one device->host copy into ordinary (pageable) memory; the host waits for it."""
        if self.moving_model:
            return
        rt = self.rt
        seconds, _ = self.device_to_host_seconds(tensor, device, pinned=False)
        stream = rt.engine.stream(device)
        stream.enqueue(seconds, "transfer", "d2h")
        rt.recorder.add_many(("d2h_bytes", _nbytes(tensor)), ("d2h_copies", 1), ("d2h_seconds", seconds))
        stream.synchronize("d2h-copy")

    def model_to_device(
        self, module: torch.nn.Module, device: int, nbytes: int | None = None, copies: int | None = None
    ) -> float:
        """Charge moving ``module``'s parameters and buffers to ``device``; the host waits (model
        tensors are pageable). Returns the seconds charged.

        ``nbytes``/``copies`` give what actually moved (tensors already on the GPU are not copied
        again); default: every parameter and buffer.
        """
        rt = self.rt
        if nbytes is None or copies is None:
            tensors = [t for t in list(module.parameters()) + list(module.buffers()) if t is not None]
            nbytes = sum(_nbytes(t) for t in tensors) if nbytes is None else nbytes
            copies = len(tensors) if copies is None else copies
        from .identify import identify

        name = identify(rt, module).name
        self.models[device] = name
        self.h2d.clear()
        self._retire_plans()
        found = self._lookup(device, name, 1, "model_transfer") if name is not None else None
        if found is not None:
            seconds, provenance = found
        else:
            seconds, provenance = self._bandwidth_seconds(nbytes, device, pinned=False, copies=copies), "estimated"
        stream = rt.engine.stream(device)
        stream.enqueue(seconds, "transfer", f"model h2d ({name or type(module).__name__}, {provenance})")
        rt.recorder.add_many(
            ("h2d_bytes", nbytes), ("model_transfer_bytes", nbytes), ("model_transfer_seconds", seconds)
        )
        stream.synchronize("model-copy")
        if device < len(rt.memory):
            rt.memory[device].sample()  # the memory timeline starts at the model copy
        return seconds

    def model_to_host(self, module: torch.nn.Module, device: int, nbytes: int, copies: int) -> float:
        """Charge moving ``nbytes`` of a model (``copies`` tensors) from ``device`` back to the host."""
        rt = self.rt
        seconds = self._bandwidth_seconds(nbytes, device, pinned=False, copies=copies)
        stream = rt.engine.stream(device)
        stream.enqueue(seconds, "transfer", f"model d2h ({type(module).__name__})")
        rt.recorder.add_many(("d2h_bytes", nbytes), ("d2h_seconds", seconds))
        stream.synchronize("model-copy")
        return seconds


def _non_overlapping_dense(t: torch.Tensor) -> bool:
    try:
        return torch._C._is_non_overlapping_and_dense(t)  # type: ignore[attr-defined]
    except Exception:
        return False


def host_to_device_seconds(rt: Runtime, tensor: torch.Tensor, device: int, pinned: bool) -> tuple[float, str]:
    """Seconds one host->device copy of ``tensor`` takes on ``device`` of run ``rt``, and its provenance."""
    return rt.transfers.host_to_device_seconds(tensor, device, pinned)


def device_to_host_seconds(rt: Runtime, tensor: torch.Tensor, device: int, pinned: bool = False) -> tuple[float, str]:
    """Seconds one device->host copy of ``tensor`` takes on ``device`` of run ``rt``."""
    return rt.transfers.device_to_host_seconds(tensor, device, pinned)


def install(rt: Runtime) -> None:
    """Component ``gpemu.transfers``: the run's transfer state (``rt.transfers``). Copies are
    charged by the emulated tensor type (``.cuda()``, ``.cpu()``, ``copy_``) and whole-model moves
    by :mod:`gpemu.ways_in`."""
    rt.transfers = TransferState(rt)
