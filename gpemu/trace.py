"""Chrome trace of an emulated run (Trace Event Format, JSON object form).

Loads in https://ui.perfetto.dev and chrome://tracing:

* one **process** per emulated GPU ("GPU 0 (V100)");
* one **thread** per stream with the GPU spans as complete events (``"ph": "X"``, microseconds):
  forward, backward, optimizer, transfer, comm, preprocess, op (the category is the kind);
* a **host** thread with the host's waits for the GPU (``item``, ``synchronize``, copies...) and
  the iteration boundaries as instant events (``"ph": "i"``);
* an **idle** thread showing when the GPU sat idle: data stall (host had not enqueued the next
  work) and other idle;
* a **communication** thread showing exposed communication: when collectives ran and nothing
  else did (:mod:`gpemu.commstats`); each comm span's name says its links and NCCL's algorithm;
* **memory** as a counter track (``"ph": "C"``, MiB allocated / reserved).

Times are relative to patch time, on the run's clock (``otherData.clock``: "real", or "virtual"
for a run on virtual time, see docs/time.md). ``otherData`` holds what a summary needs besides the events
(GPU names, counters, memory tracker peaks) and the summary itself, so ``gpemu report`` can
recompute the summary from the file alone (:func:`gpemu.trace_reader.load_trace`).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from .commstats import exposed_intervals
from .observe import Timeline, compute_summary, json_safe

__all__ = ["write_trace", "trace_events", "TRACE_FORMAT"]

TRACE_FORMAT = "gpemu-trace/1"
HOST_TID = 0
IDLE_TID = 99999  # after the streams in the viewer (sort index below)
EXPOSED_TID = 99998  # exposed communication, just above the idle thread
_MiB = float(1 << 20)


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def trace_events(records: Any) -> list[dict[str, Any]]:
    """Trace events for :class:`gpemu.observe.RunRecords` (metadata first)."""
    t0 = records.started_at
    events = _metadata_events(records)
    for s in records.spans:
        events.append(
            {
                "name": s.name,
                "cat": s.kind,
                "ph": "X",
                "ts": _us(s.start, t0),
                "dur": round((s.end - s.start) * 1e6, 3),
                "pid": s.device + 1,
                "tid": s.stream + 1,
                "args": {"kind": s.kind, "stream": s.stream, "enqueued_us": _us(s.enqueued_at, t0)},
            }
        )
    for w in records.waits:
        events.append(
            {
                "name": f"wait: {w.reason}",
                "cat": "host-wait",
                "ph": "X",
                "ts": _us(w.start, t0),
                "dur": round(max(0.0, w.end - w.start) * 1e6, 3),
                "pid": w.device + 1,
                "tid": HOST_TID,
                "args": {"reason": w.reason},
            }
        )
    for m in records.iterations:
        events.append(
            {"name": f"iteration {m.index}", "cat": "iteration", "ph": "i", "s": "p", "ts": _us(m.time, t0),
             "pid": m.device + 1, "tid": HOST_TID, "args": {"index": m.index}}
        )  # fmt: skip
    for sample in records.memory:
        events.append(
            {"name": "memory", "cat": "memory", "ph": "C", "ts": _us(sample.time, t0), "pid": sample.device + 1,
             "tid": HOST_TID,
             "args": {"allocated_MiB": sample.allocated / _MiB, "reserved_MiB": sample.reserved / _MiB}}
        )  # fmt: skip
    return events + _idle_events(records) + _exposed_events(records)


def _metadata_events(records: Any) -> list[dict[str, Any]]:
    """A process per GPU, a thread per stream plus the host and idle threads, in display order."""
    events: list[dict[str, Any]] = []
    streams: dict[int, set[int]] = {d: set() for d in range(records.num_devices)}
    for s in records.spans:
        streams.setdefault(s.device, set()).add(s.stream)
    for d, gpu in enumerate(records.gpus):
        pid = d + 1
        events.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": HOST_TID, "args": {"name": f"GPU {d} ({gpu})"}}
        )
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": HOST_TID, "args": {"sort_index": d}})
        threads = [(HOST_TID, "host (waits for GPU, iterations)", 0)]
        threads += [
            (sid + 1, "stream 0 (default)" if sid == 0 else f"stream {sid}", sid + 1)
            for sid in sorted(streams.get(d, ()))
        ]
        threads.append((EXPOSED_TID, "communication not overlapped", (1 << 20) - 1))
        threads.append((IDLE_TID, "GPU idle (data stall / other)", 1 << 20))
        for tid, name, order in threads:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": order}}
            )
    return events


def _idle_events(records: Any) -> list[dict[str, Any]]:
    """Idle segments: derived (report recomputes them from the spans), drawn for the eye."""
    t0 = records.started_at
    events: list[dict[str, Any]] = []
    for d in range(records.num_devices):
        timeline = Timeline([s for s in records.spans if s.device == d])
        for start, end, cat, detail in timeline.segments:
            if cat == "busy" or end <= start:
                continue
            name = f"data stall (waiting for {detail})" if cat == "data_stall" else "idle, work enqueued"
            events.append(
                {"name": name, "cat": cat, "ph": "X", "ts": _us(start, t0), "dur": round((end - start) * 1e6, 3),
                 "pid": d + 1, "tid": IDLE_TID, "args": {}}
            )  # fmt: skip
    return events


def _exposed_events(records: Any) -> list[dict[str, Any]]:
    """Exposed communication per device (derived from the spans, drawn for the eye)."""
    t0 = records.started_at
    events: list[dict[str, Any]] = []
    for d in range(records.num_devices):
        for start, end in exposed_intervals(s for s in records.spans if s.device == d):
            events.append(
                {"name": "communication, nothing overlapping", "cat": "comm_exposed", "ph": "X", "ts": _us(start, t0),
                 "dur": round((end - start) * 1e6, 3), "pid": d + 1, "tid": EXPOSED_TID, "args": {}}
            )  # fmt: skip
    return events


def write_trace(records: Any, path: str | os.PathLike[str], summary: dict[str, Any] | None = None) -> Path:
    """Write ``records`` (:class:`gpemu.observe.RunRecords`) as a Chrome trace JSON file."""

    if summary is None:
        summary = compute_summary(records)
    doc = {
        "traceEvents": trace_events(records),
        "displayTimeUnit": "ms",
        "otherData": {
            "format": TRACE_FORMAT,
            "gpus": list(records.gpus),
            "config": records.config,
            "ended_us": _us(records.ended_at, records.started_at),
            "counters": dict(records.counters),
            "notes": list(records.notes),
            "models": list(records.models),
            "memory_stats": list(records.memory_stats),
            # "virtual": every time in this file is on the run's virtual timeline (docs/time.md).
            "clock": getattr(records, "clock", "real"),
            "summary": json_safe(summary),
        },
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:  # a reader never sees half a file; a failed write (full disk) leaves no temporary file
        with open(tmp, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return p
