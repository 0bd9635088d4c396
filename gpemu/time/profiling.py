"""The torch profiler's timestamps on virtual time.

Note: why a map and not a patched clock. The torch profiler (kineto) stamps its events with its
own C++ clock, which no Python patch reaches. So while it records, the time engine samples, on
the thread that started it, pairs of (real time, the host's virtual time) at the points where
virtual time departs from real time: each outermost exit from the emulator's own code (its time
is forgiven there) and each wait (which jumps). A real timestamp is then mapped by interpolating
between the samples around it (:class:`TimeMap`), and the profiler's events (``prof.events()``,
``key_averages()``) and its Chrome trace (``export_chrome_trace``) come out in virtual time. Work
inside the emulator's own code maps to no time, as it is forgiven; events of other threads are
mapped with the same samples (an approximation: they rarely matter in a training loop).
"""

from __future__ import annotations

import bisect
import gzip
import json
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ..clock import REAL

if TYPE_CHECKING:  # pragma: no cover
    from types import ModuleType

    from ..runtime import Runtime
    from .host import HostTime

__all__ = ["TimeMap", "install"]


class TimeMap:
    """Real wall-clock seconds -> virtual wall-clock seconds, from samples on one thread."""

    def __init__(self, wall_offset: float) -> None:
        self.thread = threading.get_ident()
        self.wall_offset = wall_offset  # virtual wall time = host time + this
        self.real: list[float] = []
        self.virtual: list[float] = []

    def sample(self, host: HostTime) -> None:
        """A pair (real time now, the host's virtual time now), on the profiling thread only."""
        if threading.get_ident() != self.thread:
            return
        real, virtual = REAL.time(), host.now() + self.wall_offset
        if self.real and (real < self.real[-1] or virtual < self.virtual[-1]):
            return  # (keeps both columns increasing)
        self.real.append(real)
        self.virtual.append(virtual)

    def __call__(self, real: float) -> float:
        """The virtual time of real time ``real`` (interpolated; outside the samples, at the
        nearest one's pace, one second per second)."""
        rs, vs = self.real, self.virtual
        if not rs:
            return real
        i = bisect.bisect_right(rs, real)
        if i == 0:
            return vs[0] - (rs[0] - real)
        if i == len(rs):
            return vs[-1] + (real - rs[-1])
        r0, r1, v0, v1 = rs[i - 1], rs[i], vs[i - 1], vs[i]
        return v0 + (real - r0) * (v1 - v0) / (r1 - r0) if r1 > r0 else v1


def _remap_events(events: Any, trace_start_ns: int, tmap: TimeMap) -> None:
    """``FunctionEvent.time_range`` (microseconds from the trace's start) in virtual time."""
    from torch.autograd.profiler_util import Interval

    start = trace_start_ns / 1e9
    origin = tmap(start)
    for e in events:
        r = e.time_range
        a, b = tmap(start + r.start / 1e6), tmap(start + r.end / 1e6)
        e.time_range = Interval((a - origin) * 1e6, (b - origin) * 1e6)


def _remap_trace_file(path: str, tmap: TimeMap) -> None:
    """Rewrite a kineto Chrome trace's timestamps (microseconds after ``baseTimeNanoseconds``)."""
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    base = float(doc.get("baseTimeNanoseconds", 0)) / 1e9
    new_base = tmap(base) if base else 0.0
    for e in doc.get("traceEvents", []):
        ts = e.get("ts")
        if not isinstance(ts, (int, float)):
            continue
        real = base + ts / 1e6
        virtual = tmap(real)
        dur = e.get("dur")
        if isinstance(dur, (int, float)):
            e["dur"] = (tmap(real + dur / 1e6) - virtual) * 1e6
        e["ts"] = (virtual - new_base) * 1e6
    if base:
        doc["baseTimeNanoseconds"] = int(new_base * 1e9)
    doc["gpemuClock"] = "virtual"
    with opener(path, "wt") as f:
        json.dump(doc, f)


def _patch(rt: Runtime, wall_offset: float, module: ModuleType) -> None:
    engine = rt.engine
    profile = module.profile
    maps: weakref.WeakKeyDictionary[Any, TimeMap] = weakref.WeakKeyDictionary()
    start_trace, exit_, parse, export = (
        profile._start_trace,
        profile.__exit__,
        profile._parse_kineto_results,
        profile.export_chrome_trace,
    )

    def _start_trace(self: Any) -> None:
        tmap = maps[self] = TimeMap(wall_offset)
        tmap.sample(engine)
        engine.time_map = tmap
        start_trace(self)

    def __exit__(self: Any, *exc: Any) -> Any:
        tmap = maps.get(self)
        if tmap is not None:
            tmap.sample(engine)
            if engine.time_map is tmap:
                engine.time_map = None
        return exit_(self, *exc)

    def _parse_kineto_results(self: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
        events = parse(self, result, *args, **kwargs)
        tmap = maps.get(self)
        if tmap is not None:
            _remap_events(events, result.trace_start_ns(), tmap)
        return events

    def export_chrome_trace(self: Any, path: str, *args: Any, **kwargs: Any) -> Any:
        out = export(self, path, *args, **kwargs)
        tmap = maps.get(self)
        if tmap is not None:
            _remap_trace_file(path, tmap)
        return out

    for name, fn in (
        ("_start_trace", _start_trace),
        ("__exit__", __exit__),
        ("_parse_kineto_results", _parse_kineto_results),
        ("export_chrome_trace", export_chrome_trace),
    ):
        rt.patcher.replace(profile, name, fn)
    rt.patcher.on_restore(lambda: setattr(engine, "time_map", None))


def install(rt: Runtime, wall_offset: float) -> None:
    """The torch profiler's timestamps on virtual time (when the program imports it)."""
    rt.patcher.after_import("torch.autograd.profiler", lambda m: _patch(rt, wall_offset, m))
