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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Recorder", "Records", "GpuSpan", "HostWait", "MemorySample", "IterationMark", "SyncPoint"]

_append = list.append  # (records are appended as plain tuples, see Records)


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


class SyncPoint(NamedTuple):
    """The host synchronised with a device (``item()``, ``synchronize()``, a copy to the host),
    whether or not it had to wait: at ``time``, the device's work issued so far was done."""

    device: int
    reason: str
    time: float


class IterationMark(NamedTuple):
    device: int
    time: float
    index: int  # type: ignore[assignment]  # (a field named as tuple.index, which no one calls)


class Records(list):
    """A list of records of one kind (:class:`GpuSpan`, :class:`HostWait`, ...), stored compactly.

    Hot paths append plain tuples (``list.append(records, (device, ...))``): a plain tuple of
    numbers and strings is cheap to make and the garbage collector stops tracking it, where a
    named tuple stays tracked for the whole run (the spans of a long run made every full
    collection longer). Reading gives the named records: items, slices, iteration, ``reversed``.
    """

    __slots__ = ("kind",)

    def __init__(self, kind: Any, items: Iterable = ()) -> None:  # kind: a NamedTuple class
        super().__init__(items)
        self.kind = kind

    def __getitem__(self, index: int | slice) -> Any:  # type: ignore[override]
        item = list.__getitem__(self, index)
        if isinstance(index, slice):
            return list(map(self.kind._make, item))
        return self.kind._make(item)

    def __iter__(self) -> Iterator:
        return map(self.kind._make, list.__iter__(self))

    def __reversed__(self) -> Iterator:
        return map(self.kind._make, list.__reversed__(self))

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> Any:
        return (Records, (self.kind, list(list.__iter__(self))))


def _records(kind: type) -> Callable[[], Records]:
    return lambda: Records(kind)


@dataclass
class Recorder:
    """Append-only log of one emulated run. Thread-safe appends (list.append is atomic)."""

    started_at: float = field(default_factory=time.perf_counter)
    spans: Records = field(default_factory=_records(GpuSpan))
    waits: Records = field(default_factory=_records(HostWait))
    memory: Records = field(default_factory=_records(MemorySample))
    iterations: Records = field(default_factory=_records(IterationMark))
    syncs: Records = field(default_factory=_records(SyncPoint))
    _counts: dict[str, float] = field(default_factory=dict, repr=False)  # see counters
    notes: list[str] = field(default_factory=list)  # provenance messages said once
    keep_memory_samples: bool = True
    _iteration_count: dict[int, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Counter sources (add_source): hot paths that count in objects of their own instead of
    # updating the counters on every event (a copy plan counts its copies).
    _sources: list = field(default_factory=list, repr=False)

    @property
    def counters(self) -> dict[str, float]:
        """Totals by name (e.g. transfer bytes, sharing waits): what :meth:`add` counted plus the
        counter sources' totals, as a new dict at each read."""
        with self._lock:
            out = dict(self._counts)
        for source in self._sources:
            for name, amount in source():
                out[name] = out.get(name, 0.0) + amount
        return out

    def add_source(self, source: Callable[[], Iterable[tuple[str, float]]]) -> None:
        """``source()`` returns ``(counter, total)`` pairs that :attr:`counters` adds in."""
        self._sources.append(source)

    def span(
        self, device: int, stream: int, kind: str, name: str, start: float, end: float, enqueued_at: float
    ) -> None:
        _append(self.spans, (device, stream, kind, name, start, end, enqueued_at))

    def host_wait(self, device: int, reason: str, start: float, end: float) -> None:
        _append(self.waits, (device, reason, start, end))

    def sync_point(self, device: int, reason: str, t: float) -> None:
        _append(self.syncs, (device, reason, t))

    def memory_sample(self, device: int, t: float, allocated: int, reserved: int) -> None:
        if self.keep_memory_samples:
            _append(self.memory, (device, t, allocated, reserved))

    def iteration(self, device: int, t: float) -> None:
        with self._lock:
            index = self._iteration_count.get(device, 0)
            self._iteration_count[device] = index + 1
            _append(self.iterations, (device, t, index))

    def add(self, counter: str, amount: float) -> None:
        counters = self._counts
        with self._lock:
            counters[counter] = counters.get(counter, 0.0) + amount

    def add_many(self, *pairs: tuple[str, float]) -> None:
        """Several :meth:`add` at once, under one lock (hot paths such as every input copy)."""
        counters = self._counts
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
