"""What a run's GPUs spent on communication: per collective kind and link, and how much of it was
exposed (not overlapped by computation on another stream).

* **exposed communication** of a device: the time its ``comm`` spans cover while no other kind of
  span runs on any of its streams; the rest of the communication hid behind computation (FSDP's
  prefetched all-gathers, DDP's buckets during the backward, tensor parallelism's collectives on a
  side stream). DDP charges only the part of its all-reduce that outlasts the backward as a span,
  so its spans are exposed by construction;
* **per collective kind and link**: the counters the collectives leave
  (``comm_seconds/<kind>/<links>``, ``comm_bytes/...``, ``comm_count/...``: modelled seconds on
  the GPU, overlapped or not), and ``comm_wait_seconds``, the time spent waiting for slower ranks
  at collectives (a straggler's cost to everyone else).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .recorder import GpuSpan

__all__ = ["exposed_intervals", "device_communication", "by_kind_and_link", "run_communication", "communication_lines"]

_COUNTERS = {"comm_seconds": "seconds", "comm_bytes": "bytes", "comm_count": "count"}


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _minus(keep: Sequence[tuple[float, float]], cut: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``keep`` with ``cut`` taken out (both sorted, disjoint)."""
    out: list[tuple[float, float]] = []
    j = 0
    for start, end in keep:
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(cut) and cut[k][0] < end:
            if cut[k][0] > cursor:
                out.append((cursor, cut[k][0]))
            cursor = max(cursor, cut[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def exposed_intervals(spans: Iterable[GpuSpan]) -> list[tuple[float, float]]:
    """The intervals of one device where communication runs and nothing else does."""
    spans = list(spans)
    comm = _union((s.start, s.end) for s in spans if s.kind == "comm")
    other = _union((s.start, s.end) for s in spans if s.kind != "comm")
    return _minus(comm, other)


def _clipped(intervals: Iterable[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for start, end in intervals)


def device_communication(spans: Sequence[GpuSpan], window: Mapping[str, Any], t0: float) -> dict[str, float]:
    """One device's communication inside a summary ``window`` (``start_s`` / ``end_s`` after
    ``t0``): on the GPU (its comm spans' union), exposed and overlapped."""
    a, b = window["start_s"] + t0, window["end_s"] + t0
    comm = _clipped(_union((s.start, s.end) for s in spans if s.kind == "comm"), a, b)
    exposed = _clipped(exposed_intervals(spans), a, b)
    return {"comm_s": comm, "exposed_s": exposed, "overlapped_s": max(0.0, comm - exposed)}


def by_kind_and_link(counters: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``"all_reduce/nvlink+ib" -> {seconds, bytes, count}`` from the collectives' counters,
    longest first."""
    out: dict[str, dict[str, float]] = {}
    for name, value in counters.items():
        prefix, _, key = name.partition("/")
        if prefix in _COUNTERS and key:
            out.setdefault(key, {"seconds": 0.0, "bytes": 0.0, "count": 0.0})[_COUNTERS[prefix]] += value
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["seconds"]))


def run_communication(counters: Mapping[str, float]) -> dict[str, Any]:
    """The run's communication: per collective kind and link, and the wait for slower ranks."""
    return {
        "by_kind_link": by_kind_and_link(counters),
        "wait_s": counters.get("comm_wait_seconds", 0.0),
        # of which at point-to-point receives: a pipeline stage waiting for its neighbour (bubbles)
        "p2p_wait_s": counters.get("comm_p2p_wait_seconds", 0.0),
    }


def communication_lines(summary: Mapping[str, Any], width: int, seconds: Any, size: Any) -> list[str]:
    """The summary's lines about communication (none when the run had none): per kind and link,
    and the wait for slower ranks. ``seconds`` / ``size`` format a duration / a byte count."""
    comm = summary.get("communication") or {}
    kinds = comm.get("by_kind_link") or {}
    if not kinds:
        return []
    items = [
        f"{key} {seconds(v['seconds'])} ({int(v['count'])} x, {size(v['bytes'])})" for key, v in list(kinds.items())[:6]
    ]
    lines = ["communication".ljust(width + 2) + "; ".join(items)]
    if comm.get("wait_s", 0.0) > 0:
        bubbles = comm.get("p2p_wait_s", 0.0)
        at = f", of which {seconds(bubbles)} at receives (pipeline bubbles)" if bubbles > 0 else ""
        lines.append("waited for slower ranks".ljust(width + 2) + f"{seconds(comm['wait_s'])} at collectives{at}")
    return lines
