"""Timing and memory measurement of training iterations on one device.

On ``cuda`` every phase is timed with CUDA events between synchronisations (so phases never
overlap and the figure is GPU time), and memory comes from the caching allocator's counters
(``torch.cuda.max_memory_allocated`` / ``memory_allocated``).

On ``cpu`` (the testable path) phases are timed with ``time.perf_counter`` and memory is an
*estimate*, because the host allocator has no per-tensor counters:

* persistent = unique storage bytes of parameters, buffers, gradients and optimizer state after
  an optimizer step (what stays between iterations; the same set CUDA's memory_allocated sees);
* peak = persistent without gradients + input batch and targets + output + every other tensor
  autograd saves for backward (unique storages, found with ``saved_tensors_hooks``) + gradients. It is an upper
  estimate: a real allocator frees activations while gradients are being allocated.

``memory_limit`` (bytes) makes the CPU path behave like a smaller GPU: the running estimate is
checked each time autograd saves a tensor and after the iteration, and exceeding it raises a
real ``torch.OutOfMemoryError``. On CUDA the limit becomes a per-process memory fraction.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .models import LoadedModel

__all__ = ["Stats", "BatchMeasurement", "Measurer", "summarize", "TIME_PHASES"]

# Phases timed every iteration, in the order they run.
TIME_PHASES = ("h2d_pageable", "h2d_pinned", "forward", "backward", "optimizer_step", "d2h_transfer")


@dataclass(frozen=True)
class Stats:
    """Summary of repeated measurements (seconds or bytes)."""

    count: int
    mean: float
    std: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("count", "mean", "std", "min", "max", "p50", "p90", "p99")}


def summarize(values: list[float]) -> Stats:
    """Mean, spread and percentiles of ``values`` (at least one)."""
    if not values:
        raise ValueError("cannot summarise zero measurements")
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Stats(
        count=len(values),
        mean=float(a.mean()),
        std=float(a.std(ddof=1)) if len(a) > 1 else 0.0,
        min=float(a.min()),
        max=float(a.max()),
        p50=float(p50),
        p90=float(p90),
        p99=float(p99),
    )


@dataclass
class BatchMeasurement:
    """Everything measured for one (model, batch size)."""

    batch_size: int
    times: dict[str, Stats]  # phase -> seconds
    peak_memory: int  # bytes
    persistent_memory: int  # bytes
    input_bytes: int
    memory_method: str  # "cuda-allocator" | "cpu-estimate"
    extra: dict[str, Any] = field(default_factory=dict)


class Measurer:
    """Measures one model on one device. Build once per model, then call :meth:`measure`."""

    def __init__(
        self, model: LoadedModel, device: torch.device, optimizer: str = "sgd", memory_limit: int | None = None
    ) -> None:
        self.model = model
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.memory_limit = memory_limit
        self.module = model.module
        self.module.train()
        self.optimizer_name = optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        if self.is_cuda:
            # CUDA events record on the current device's stream: make it the profiled one.
            torch.cuda.set_device(device)
        if self.is_cuda and memory_limit is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit / total), device)

    # ------------------------------------------------------------------ model-level
    def measure_model_transfer(self, repeats: int = 5) -> Stats:
        """Seconds to move the model's parameters and buffers from host memory to the device.

        The first move is not recorded (it pays one-time CUDA context and allocator costs). On
        CPU the "transfer" is a copy of every parameter and buffer (what moving bytes costs here).
        """
        samples: list[float] = []
        host = self.module
        for i in range(repeats + 1):
            if self.is_cuda:
                host_copy = copy.deepcopy(host).to("cpu")
                torch.cuda.synchronize(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                moved = host_copy.to(self.device)
                end.record()
                torch.cuda.synchronize(self.device)
                seconds = start.elapsed_time(end) / 1000.0
                del moved, host_copy
            else:
                t0 = time.perf_counter()
                copies = [t.detach().clone() for t in list(host.parameters()) + list(host.buffers())]
                seconds = time.perf_counter() - t0
                del copies
            if i > 0:
                samples.append(seconds)
        self.module = host.to(self.device)
        return summarize(samples)

    def to_device(self) -> None:
        """Move the model to the device without timing it (its transfer is already stored)."""
        self.module = self.module.to(self.device)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=1e-3)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=1e-3)
        raise ValueError(f"unknown optimizer {self.optimizer_name!r}; valid: sgd, adam, adamw")

    def flops_per_sample(self) -> tuple[float | None, float | None]:
        """Forward and forward+backward FLOPs of one sample (FlopCounterMode, batch 1; a
        convolution's backward counted as the cost model counts it, not by torch's formula, which
        overcounts grouped convolutions: gpemu.costmodel.flops)."""
        try:
            from torch.utils.flop_counter import FlopCounterMode
        except ImportError:  # pragma: no cover - old torch
            return None, None
        from gpemu.costmodel.flops import flop_counter_mapping

        inputs, targets = self.model.make_batch(1)
        inputs = inputs.to(self.device)
        counter = FlopCounterMode(display=False, custom_mapping=flop_counter_mapping())
        try:
            with counter:
                out = self.module(inputs)
                loss = self.model.loss(out, targets)
            fwd = float(counter.get_total_flops())
            with counter:
                loss.backward()
            total = fwd + float(counter.get_total_flops())
        except Exception:  # some models cannot run at batch 1 (BatchNorm on 1 value); FLOPs stay unknown
            return None, None
        finally:
            self.module.zero_grad(set_to_none=True)
        return fwd, total

    # ------------------------------------------------------------------ batch-level
    def measure(
        self, batch_size: int, warmup: int, iterations: int, check_interrupt: Callable[[], None] | None = None
    ) -> BatchMeasurement:
        """Run ``warmup`` unrecorded then ``iterations`` recorded training iterations.

        Raises ``torch.OutOfMemoryError`` when the batch does not fit (on CUDA, or on CPU over
        ``memory_limit``); the caller records that as the model's limit.
        """
        if self.optimizer is None:
            self.optimizer = self._make_optimizer()
        inputs, targets = self.model.make_batch(batch_size)
        input_bytes = inputs.numel() * inputs.element_size()
        pinned = inputs.pin_memory() if self.is_cuda else inputs
        samples: dict[str, list[float]] = {p: [] for p in TIME_PHASES}
        peaks: list[int] = []
        persistents: list[int] = []
        for i in range(warmup + iterations):
            if check_interrupt is not None:
                check_interrupt()
            phase_times, peak, persistent = self._iteration(inputs, pinned, targets, input_bytes)
            if i >= warmup:
                for k, v in phase_times.items():
                    samples[k].append(v)
                peaks.append(peak)
                persistents.append(persistent)
        return BatchMeasurement(
            batch_size=batch_size,
            times={k: summarize(v) for k, v in samples.items()},
            peak_memory=max(peaks),
            persistent_memory=max(persistents),
            input_bytes=input_bytes,
            memory_method="cuda-allocator" if self.is_cuda else "cpu-estimate",
        )

    def release(self) -> None:
        """Free what a failed (OOM) batch left behind so the next model starts clean."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ one iteration
    def _iteration(
        self, inputs: torch.Tensor, pinned: torch.Tensor, targets: torch.Tensor | None, input_bytes: int
    ) -> tuple[dict[str, float], int, int]:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        timer = _CudaTimer(self.device) if self.is_cuda else _CpuTimer()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        times: dict[str, float] = {}

        with timer.phase(times, "h2d_pageable"):
            x_pageable = inputs.to(self.device) if self.is_cuda else inputs.clone()
        del x_pageable
        with timer.phase(times, "h2d_pinned"):
            x = pinned.to(self.device, non_blocking=True) if self.is_cuda else pinned.clone()
        y = targets.to(self.device, non_blocking=True) if (targets is not None and self.is_cuda) else targets
        saved = None
        if not self.is_cuda:
            # The batch (and targets) are counted once in the base, not again when autograd saves them.
            batch = {x.untyped_storage().data_ptr()} | ({y.untyped_storage().data_ptr()} if y is not None else set())
            target_bytes = y.untyped_storage().nbytes() if y is not None else 0
            saved = _SavedBytes(
                self._static_storages() | batch,
                self._bytes_without_grads() + input_bytes + target_bytes,
                self.memory_limit,
            )
        if saved is not None:
            with timer.phase(times, "forward"), torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack):
                out = self.module(x)
                loss = self.model.loss(out, y)
            output_bytes = _output_bytes(out)
        else:
            with timer.phase(times, "forward"):
                out = self.module(x)
                loss = self.model.loss(out, y)
            output_bytes = 0
        with timer.phase(times, "backward"):
            loss.backward()
        with timer.phase(times, "optimizer_step"):
            self.optimizer.step()
        with timer.phase(times, "d2h_transfer"):
            # One input batch back to the host: same bytes as the host->GPU copy.
            back = x.to("cpu") if self.is_cuda else x.clone()
        timer.finish()
        del back, out, loss, x, y
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            persistent = int(torch.cuda.memory_allocated(self.device))
        else:
            assert saved is not None
            persistent = self._static_bytes()
            grads = persistent - self._bytes_without_grads()
            peak = saved.base + saved.saved + output_bytes + grads
            if self.memory_limit is not None and peak > self.memory_limit:
                raise torch.OutOfMemoryError(_oom_message(peak, self.memory_limit))
        return times, peak, persistent

    # ------------------------------------------------------------------ CPU memory estimate
    def _tensors(self, with_grads: bool) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for p in self.module.parameters():
            out.append(p)
            if with_grads and p.grad is not None:
                out.append(p.grad)
        out.extend(self.module.buffers())
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out

    def _static_storages(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self._tensors(with_grads=True)}

    def _static_bytes(self) -> int:
        return _unique_bytes(self._tensors(with_grads=True))

    def _bytes_without_grads(self) -> int:
        return _unique_bytes(self._tensors(with_grads=False))


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _output_bytes(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    if isinstance(out, (tuple, list)):
        return sum(_output_bytes(o) for o in out)
    if isinstance(out, dict):
        return sum(_output_bytes(o) for o in out.values())
    return 0


def _oom_message(needed: int, limit: int) -> str:
    return (
        f"gpemu profile: the batch needs about {needed / 2**20:.1f} MiB but the memory limit is "
        f"{limit / 2**20:.1f} MiB (--memory-limit)"
    )


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _SavedBytes:
    """Counts the unique storages autograd saves for backward (the activations), checking the
    running total against the memory limit as each one is saved, like an allocator would."""

    def __init__(self, static: set[int], base: int, limit: int | None) -> None:
        self.static = static
        self.base = base
        self.limit = limit
        self.seen: set[int] = set()
        self.saved = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key not in self.static and key not in self.seen:
            self.seen.add(key)
            self.saved += s.nbytes()
            if self.limit is not None and self.base + self.saved > self.limit:
                raise torch.OutOfMemoryError(_oom_message(self.base + self.saved, self.limit))
        return t


class _Phase:
    def __init__(self, timer: Any, times: dict[str, float], name: str) -> None:
        self.timer, self.times, self.name = timer, times, name

    def __enter__(self) -> None:
        self.timer.start(self.name)

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.times[self.name] = self.timer.stop(self.name)


class _CpuTimer:
    def __init__(self) -> None:
        self._t0: dict[str, float] = {}

    def phase(self, times: dict[str, float], name: str) -> _Phase:
        return _Phase(self, times, name)

    def start(self, name: str) -> None:
        self._t0[name] = time.perf_counter()

    def stop(self, name: str) -> float:
        return time.perf_counter() - self._t0[name]

    def finish(self) -> None:
        pass


class _CudaTimer:
    """CUDA events around each phase, with a synchronisation before each so phases do not
    overlap; the elapsed times are read once at the end of the iteration."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._events: dict[str, tuple[Any, Any]] = {}
        self._times: dict[str, float] | None = None

    def phase(self, times: dict[str, float], name: str) -> _Phase:
        self._times = times
        return _Phase(self, times, name)

    def start(self, name: str) -> None:
        torch.cuda.synchronize(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._events[name] = (start, end)

    def stop(self, name: str) -> float:
        self._events[name][1].record()
        return float("nan")  # filled in by finish()

    def finish(self) -> None:
        torch.cuda.synchronize(self.device)
        assert self._times is not None
        for name, (start, end) in self._events.items():
            self._times[name] = start.elapsed_time(end) / 1000.0
