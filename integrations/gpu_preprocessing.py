"""GPU-side data preprocessing (DALI / FFCV style) on an emulated GPU.

Pipelines such as NVIDIA DALI (JPEG decoding) and FFCV (normalisation) run part of the input
pipeline on the GPU: it costs GPU time every batch, and it holds GPU memory that grows over the
first batches to a plateau (buffers sized to the largest images seen). :class:`GpuPreprocess`
reproduces both from measurements:

* GPU time: each batch draws one value from a stored per-batch distribution (``decode-dali``,
  ``norm-ffcv`` from the GPEmu artifact, or one the user recorded with
  :func:`record_distribution`), queued as a ``preprocess`` span on the device's current stream
  (the host does not wait; later work on the stream does);
* GPU memory: held in the emulated device's memory tracker, following the curve measured for
  DALI (batch 64, T4): 12% after the first batch, 34% after the second, 92% after the third,
  then 64 MiB steps to the plateau (2.43 GiB) at batch 1128; scaled by batch size;
* mixed CPU/GPU operators: ``cpu_share`` of each sample is real CPU work, burned by
  ``cpu_threads`` busy threads (they release the GIL, so they occupy real cores) before the GPU
  part is queued.

Use it where batches enter the GPU, in the main process::

    prep = GpuPreprocess("decode-dali")
    for images, labels in prep.wrap(loader):      # or: images, labels = prep(batch)
        ...

It is not a ``collate_fn`` for DataLoader *workers*: those are other processes, whose emulated
GPU time would not reach the training process (it says so if tried).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime
    from gpemu.time import TimeEngine

__all__ = [
    "GpuPreprocess",
    "MemoryCurve",
    "DALI_MEMORY_CURVE",
    "MEMORY_PROFILE",
    "record_distribution",
    "burn_cpu",
]

# Name of the db distribution holding DALI's measured memory over time (bytes, one sample per batch).
MEMORY_PROFILE = "prep-mem-dali-b64-t4"


@dataclass(frozen=True)
class MemoryCurve:
    """GPU memory held by a preprocessing pipeline after each batch: a step function.

    ``steps`` are ``(batch_index, fraction)``: from that batch on, ``fraction`` of
    ``plateau_bytes`` is held (indexes count batches from 0). ``batch_size`` is what the curve
    was measured with; other batch sizes scale the plateau linearly.
    """

    steps: tuple[tuple[int, float], ...]
    plateau_bytes: int
    batch_size: int

    def __post_init__(self) -> None:
        if not self.steps or any(not 0.0 <= f <= 1.0 for _, f in self.steps):
            raise ValueError("MemoryCurve.steps must be non-empty (batch_index, fraction 0..1) pairs")
        if list(self.steps) != sorted(self.steps):
            raise ValueError("MemoryCurve.steps must be sorted by batch index")
        if self.plateau_bytes < 0 or self.batch_size < 1:
            raise ValueError("MemoryCurve needs plateau_bytes >= 0 and batch_size >= 1")

    def fraction(self, batch_index: int) -> float:
        frac = 0.0
        for index, f in self.steps:
            if index > batch_index:
                break
            frac = f
        return frac

    def bytes_after(self, batch_index: int, batch_size: int | None = None) -> int:
        """Bytes held once batch ``batch_index`` has been preprocessed."""
        scale = (batch_size / self.batch_size) if batch_size else 1.0
        return int(round(self.plateau_bytes * scale * self.fraction(batch_index)))

    @classmethod
    def from_samples(cls, samples: Sequence[float] | np.ndarray, batch_size: int) -> MemoryCurve:
        """Build from memory samples taken once per batch (the first sample is before batch 0)."""
        arr = np.asarray(samples, dtype=float)
        if arr.ndim != 1 or arr.size < 2 or arr.max() <= 0:
            raise ValueError("a memory curve needs at least two per-batch samples with some memory in use")
        plateau = float(arr.max())
        steps: list[tuple[int, float]] = []
        previous = None
        for i in range(1, arr.size):  # sample i was taken after batch i-1
            if arr[i] != previous:
                steps.append((i - 1, float(arr[i] / plateau)))
                previous = arr[i]
        return cls(tuple(steps), int(plateau), batch_size)


# The same curve, reduced from measurements/mem_consump_prep_mem-b64-t4.txt (used when the
# profile database has no MEMORY_PROFILE, e.g. a user's own database).
DALI_MEMORY_CURVE = MemoryCurve(
    steps=((0, 0.12407), (1, 0.33883), (2, 0.92277), (18, 0.94851), (186, 0.97426), (1127, 1.0)),
    plateau_bytes=2_607_284_224,
    batch_size=64,
)


def burn_cpu(seconds: float, threads: int = 1) -> None:
    """Keep ``threads`` cores busy for ``seconds`` (wall clock), then return.

    Hashing a 64 KiB buffer releases the GIL, so the threads run in parallel on real cores
    like a native pipeline's CPU stage would.
    """
    if seconds <= 0:
        return
    if threads < 1:
        raise ValueError(f"cpu_threads must be >= 1, got {threads}")
    deadline = time.perf_counter() + seconds
    buf = bytes(64 * 1024)

    def spin() -> None:
        while time.perf_counter() < deadline:
            hashlib.sha256(buf).digest()

    workers = [threading.Thread(target=spin, daemon=True) for _ in range(threads - 1)]
    for w in workers:
        w.start()
    spin()
    for w in workers:
        w.join()


def record_distribution(
    name: str, seconds_per_batch: Sequence[float], description: str = "", rt: Runtime | None = None
) -> None:
    """Store a user's measured per-batch preprocessing times under ``name`` in the profile db,
    so ``GpuPreprocess(name)`` samples them (in this and later runs)."""
    rt = rt or _runtime()
    rt.db.add_distribution(
        name,
        "seconds",
        list(seconds_per_batch),
        source="user",
        description=description or f"user-recorded preprocessing ({name})",
    )


def _runtime() -> Runtime:
    import gpemu

    rt = gpemu.current()
    if rt is None:
        raise RuntimeError("GpuPreprocess emulates GPU work: call gpemu.patch() (or use `gpemu run`) first")
    return rt


def _batch_size_of(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = _batch_size_of(item)
            if n is not None:
                return n
    return None


@dataclass(frozen=True)
class _Ready:
    """What a run gives the step at its first batch: the run, its time engine, the emulated
    device the step runs on and the per-batch seconds it samples."""

    rt: Runtime
    engine: TimeEngine
    device: int
    samples: np.ndarray


class GpuPreprocess:
    """One GPU preprocessing step per batch, timed and sized from measurements.

    distribution: a db distribution name (``"decode-dali"``, ``"norm-ffcv"``, or one recorded
        with :func:`record_distribution`) or a sequence of seconds per batch.
    device: emulated GPU index (default: the current device at first use).
    cpu_share: fraction (0..1) of each sampled time that is CPU work (mixed operators).
    cpu_threads: threads that burn the CPU part in parallel.
    memory: ``"auto"`` (DALI's measured curve, scaled by batch size), a :class:`MemoryCurve`,
        a plateau in bytes (DALI's curve shape), or ``None`` / ``0`` for no GPU memory.
    batch_size: for memory scaling; default: read from the first batch.
    seed: random seed for sampling (reproducible runs).
    """

    def __init__(
        self,
        distribution: str | Sequence[float] = "decode-dali",
        *,
        device: int | None = None,
        cpu_share: float = 0.0,
        cpu_threads: int = 1,
        memory: Any = "auto",
        batch_size: int | None = None,
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= float(cpu_share) <= 1.0:
            raise ValueError(f"cpu_share must be a fraction from 0 to 1, got {cpu_share!r}")
        if not isinstance(cpu_threads, int) or cpu_threads < 1:
            raise ValueError(f"cpu_threads must be an integer >= 1, got {cpu_threads!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not (memory is None or memory == "auto" or isinstance(memory, (MemoryCurve, int))) or (
            isinstance(memory, int) and memory < 0
        ):
            raise ValueError("memory must be 'auto', a MemoryCurve, a plateau in bytes (>= 0) or None")
        self.distribution = distribution if isinstance(distribution, str) else "custom"
        self._given_samples = None if isinstance(distribution, str) else np.asarray(distribution, dtype=float)
        if self._given_samples is not None and (
            self._given_samples.ndim != 1 or self._given_samples.size == 0 or np.any(self._given_samples < 0)
        ):
            raise ValueError("distribution samples must be a non-empty sequence of seconds >= 0")
        self.device = device
        self.cpu_share = float(cpu_share)
        self.cpu_threads = cpu_threads
        self.batch_size = batch_size
        self._memory_arg = memory
        self._rng = np.random.default_rng(seed)
        self._ready: _Ready | None = None
        self._curve: MemoryCurve | None = None
        self._blocks: list[Any] = []
        self._held = 0
        self._lock = threading.Lock()
        self.batches = 0
        self.gpu_seconds = 0.0
        self.cpu_seconds = 0.0
        self.sampled: list[float] = []  # every drawn per-batch time, in order

    # ------------------------------------------------------------------ set-up on first use
    def _setup(self) -> _Ready:
        rt = _runtime()
        if self._ready is not None and self._ready.rt is rt:
            return self._ready
        self.device = rt.check_device(self.device if self.device is not None else rt.current_device)
        samples = self._given_samples if self._given_samples is not None else rt.db.distribution(self.distribution)
        if samples.size == 0:
            raise ValueError(f"distribution {self.distribution!r} has no samples")
        self._ready = _Ready(rt, rt.engine, self.device, samples)
        memory = self._memory_arg
        if memory == "auto":
            try:
                self._curve = MemoryCurve.from_samples(rt.db.distribution(MEMORY_PROFILE), batch_size=64)
            except ValueError:  # a database without the measured curve
                self._curve = DALI_MEMORY_CURVE
        elif isinstance(memory, MemoryCurve):
            self._curve = memory
        elif isinstance(memory, int) and memory > 0:
            self._curve = MemoryCurve(DALI_MEMORY_CURVE.steps, memory, self.batch_size or DALI_MEMORY_CURVE.batch_size)
        else:
            self._curve = None
        return self._ready

    # ------------------------------------------------------------------ one batch
    def __call__(self, batch: Any = None) -> Any:
        """Preprocess one batch on the emulated GPU; returns ``batch`` unchanged."""
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            raise RuntimeError(
                "GpuPreprocess runs on the training process's emulated GPU, not in a DataLoader worker "
                "process: wrap the loader instead (`for batch in prep.wrap(loader)`) or use num_workers=0"
            )
        ready = self._setup()
        rt = ready.rt
        with self._lock:
            index = self.batches
            self.batches += 1
            if self.batch_size is None:
                self.batch_size = _batch_size_of(batch)
            seconds = float(self._rng.choice(ready.samples))
            self.sampled.append(seconds)
        cpu = seconds * self.cpu_share
        gpu = seconds - cpu
        if cpu > 0:
            burn_cpu(cpu, self.cpu_threads)
            self.cpu_seconds += cpu
            rt.recorder.add("preprocess_cpu_seconds", cpu)
        self._grow_memory(ready, index)
        ready.engine.stream(ready.device).enqueue(gpu, "preprocess", self.distribution)
        self.gpu_seconds += gpu
        rt.recorder.add("preprocess_seconds", gpu)
        return batch

    def wrap(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Yield each batch of ``batches`` (e.g. a DataLoader) after preprocessing it on the GPU."""
        for batch in batches:
            yield self(batch)

    # ------------------------------------------------------------------ memory
    @property
    def memory_bytes(self) -> int:
        """GPU memory this step holds now."""
        return self._held

    def _grow_memory(self, ready: _Ready, index: int) -> None:
        if self._curve is None:
            return
        target = self._curve.bytes_after(index, self.batch_size)
        if target <= self._held:
            return
        grow = target - self._held
        rt = ready.rt
        trackers = rt.memory
        if trackers:
            # A real allocation on the emulated device: counts in memory_allocated and can OOM.
            tracker = trackers[ready.device]
            self._blocks.append(tracker.allocate(grow))
            tracker.sample()
        self._held = target
        rt.recorder.add("preprocess_memory_bytes", grow)

    def close(self) -> None:
        """Free the GPU memory this step holds (as destroying a DALI pipeline does)."""
        self._blocks = []  # the tracker frees a block when its last reference goes
        self._held = 0

    def __enter__(self) -> GpuPreprocess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"GpuPreprocess({self.distribution!r}, device={self.device}, cpu_share={self.cpu_share}, "
            f"batches={self.batches}, memory_bytes={self._held})"
        )
