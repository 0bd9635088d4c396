"""What happened on the emulated GPUs, as plain records.

The time engine, the memory tracker, transfers and integrations append records here while a
script runs; the summary, the metrics JSON and the Chrome trace (``gpemu.observe``) are built
from them afterwards. Appending a tuple is all that happens on the hot path.

Times are ``time.perf_counter()`` seconds (the engine's clock). Kinds of GPU spans:
``forward``, ``backward``, ``optimizer``, ``transfer``, ``comm``, ``preprocess``, ``op``
(work outside an identified model), ``sharing-wait`` is a host wait reason.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Recorder", "GpuSpan", "HostWait", "MemorySample", "IterationMark"]


class GpuSpan(NamedTuple):
    device: int
    stream: int
    kind: str
    name: str
    start: float
    end: float
    enqueued_at: float  # host time the work was enqueued (for data-stall accounting)


class HostWait(NamedTuple):
    device: int
    reason: str  # "item", "synchronize", "pageable-copy", "event", "sharing", ...
    start: float
    end: float


class MemorySample(NamedTuple):
    device: int
    time: float
    allocated: int
    reserved: int


class IterationMark(NamedTuple):
    device: int
    time: float
    index: int


@dataclass
class Recorder:
    """Append-only log of one emulated run. Thread-safe appends (list.append is atomic)."""

    started_at: float = field(default_factory=time.perf_counter)
    spans: list[GpuSpan] = field(default_factory=list)
    waits: list[HostWait] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    iterations: list[IterationMark] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # e.g. transfer bytes, sharing waits
    notes: list[str] = field(default_factory=list)  # provenance messages said once
    keep_memory_samples: bool = True
    _iteration_count: dict[int, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def span(self, device: int, stream: int, kind: str, name: str, start: float, end: float,
             enqueued_at: float) -> None:
        self.spans.append(GpuSpan(device, stream, kind, name, start, end, enqueued_at))

    def host_wait(self, device: int, reason: str, start: float, end: float) -> None:
        self.waits.append(HostWait(device, reason, start, end))

    def memory_sample(self, device: int, t: float, allocated: int, reserved: int) -> None:
        if self.keep_memory_samples:
            self.memory.append(MemorySample(device, t, allocated, reserved))

    def iteration(self, device: int, t: float) -> None:
        with self._lock:
            index = self._iteration_count.get(device, 0)
            self._iteration_count[device] = index + 1
            self.iterations.append(IterationMark(device, t, index))

    def add(self, counter: str, amount: float) -> None:
        with self._lock:
            self.counters[counter] = self.counters.get(counter, 0.0) + amount

    def add_many(self, *pairs: tuple[str, float]) -> None:
        """Several :meth:`add` at once, under one lock (hot paths such as every input copy)."""
        counters = self.counters
        with self._lock:
            for counter, amount in pairs:
                counters[counter] = counters.get(counter, 0.0) + amount

    def note(self, message: str) -> bool:
        """Record a message once; returns True the first time (so the caller may print it)."""
        with self._lock:
            if message in self.notes:
                return False
            self.notes.append(message)
            return True
