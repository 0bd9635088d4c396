"""Reading a trace back (``gpemu report``): streamed, validated, bounded.

A trace file may come from anywhere (a colleague, a shared directory, a crafted file), so it is
read as hostile input:

* **streamed** with ijson (``basic_parse``, the yajl C backend): the file is never loaded whole,
  and values under keys the report does not use (the stored summary, unknown keys) are skipped
  event by event without being built, so a 100 MB value anywhere costs no memory, and nesting
  of any depth costs no recursion;
* **bounded**: every value the report keeps is built with a bounded depth, number of items and
  string length, and the file with a bounded number of events and GPUs (gpemu emulates at most
  64 per process), so the summary printed from it is bounded too;
* **validated**: every number is finite and within its range (durations and sizes are not
  negative; times are relative to patch time, so work recorded before it is), every
  field has its type; anything else is one :class:`TraceError` naming what was wrong.

ijson (not ``json.load``) because the standard library has no streaming parser: bounding the
file's size instead would refuse long real traces, and ``json.load`` of a file within any such
bound still builds every value in it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .observe import RunRecords
from .recorder import GpuSpan, HostWait, IterationMark, MemorySample
from .serving import steps_from_rows
from .trace import TRACE_FORMAT

__all__ = ["load_trace", "TraceError", "MAX_EVENTS", "MAX_GPUS"]

MAX_EVENTS = 5_000_000  # about 1 GiB of records in memory; real traces of long runs stay far below
MAX_GPUS = 64  # gpemu emulates at most 64 GPUs per process
MAX_US = 1e15  # 31 years in microseconds: any time beyond is not from a run
MAX_MIB = float(1 << 40)
_MiB = float(1 << 20)
_EVENT_LIMITS = (3, 64, 4096)  # depth, items per container, string length of one event
_OTHER_LIMITS = {  # otherData fields the report uses: (depth, items, string length)
    "format": (0, 0, 64),
    "gpus": (1, MAX_GPUS, 256),
    "config": (0, 0, 2048),
    "ended_us": (0, 0, 64),
    "counters": (1, 10_000, 256),
    "notes": (1, 1_000, 4096),
    "models": (2, 256, 512),
    "memory_stats": (2, MAX_GPUS, 64),
    "serving": (2, 200_000, 64),  # (gpemu.serving.MAX_STEPS rows)
}
_SCALARS = ("string", "number", "boolean", "null")


class TraceError(ValueError):
    """A file that is not a trace written by gpemu (or is damaged); one line says what."""


class _Limits:
    def __init__(self, where: str, depth: int, items: int, chars: int) -> None:
        self.where, self.depth, self.items, self.chars = where, depth, items, chars


def _build(events: Iterator[tuple[str, Any]], event: str, value: Any, limits: _Limits, depth: int = 0) -> Any:
    """The JSON value starting at (``event``, ``value``), within ``limits``."""
    if event in _SCALARS:
        if isinstance(value, str) and len(value) > limits.chars:
            raise TraceError(f"{limits.where}: a string of more than {limits.chars} characters")
        if isinstance(value, float) and not math.isfinite(value):
            raise TraceError(f"{limits.where}: a number that is not finite ({value})")
        return value
    if depth >= limits.depth:
        raise TraceError(f"{limits.where}: nested deeper than {limits.depth} level(s)")
    if event == "start_array":
        out: list[Any] = []
        for event, value in events:
            if event == "end_array":
                return out
            if len(out) >= limits.items:
                raise TraceError(f"{limits.where}: more than {limits.items} items")
            out.append(_build(events, event, value, limits, depth + 1))
    elif event == "start_map":
        obj: dict[str, Any] = {}
        for event, value in events:
            if event == "end_map":
                return obj
            if len(obj) >= limits.items:
                raise TraceError(f"{limits.where}: more than {limits.items} keys")
            key = value[: limits.chars]
            obj[key] = _build(events, *next(events), limits, depth + 1)
    raise TraceError(f"{limits.where}: the file ends in the middle of a value")


def _skip(events: Iterator[tuple[str, Any]], event: str) -> None:
    """Consume the value starting at ``event`` without building it (any size, any depth)."""
    if event in _SCALARS:
        return
    depth = 1
    for event, _ in events:
        if event in ("start_map", "start_array"):
            depth += 1
        elif event in ("end_map", "end_array"):
            depth -= 1
            if depth == 0:
                return


def _number(
    e: dict[str, Any], key: str, where: str, default: float | None = None, hi: float = MAX_US, lo: float = 0.0
) -> float:
    value = e.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise TraceError(f"{where}: {key} must be a number from {lo:g} to {hi:g}, got {str(value)[:40]!r}")
    return float(value)


def _integer(e: dict[str, Any], key: str, where: str, default: int | None = None, hi: int = 1 << 31) -> int:
    value = e.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise TraceError(f"{where}: {key} must be a whole number from 0 to {hi}, got {str(value)[:40]!r}")
    return value


def _add_event(rec: RunRecords, e: Any, n: int) -> None:
    """One trace event into ``rec`` (metadata and kinds the report does not use are skipped)."""
    where = f"trace event {n}"
    if not isinstance(e, dict):
        raise TraceError(f"{where}: must be an object, got {type(e).__name__}")
    ph, cat, name = e.get("ph"), e.get("cat"), e.get("name", "")
    if ph == "M":
        return
    args = e.get("args") if e.get("args") is not None else {}
    if not isinstance(args, dict):
        raise TraceError(f"{where}: args must be an object")
    if ph not in ("X", "i", "C"):
        return
    device = _integer(e, "pid", where, hi=MAX_GPUS) - 1
    ts = _number(e, "ts", where, lo=-MAX_US) / 1e6  # (before patch time: negative, and fine)
    if ph == "X" and "enqueued_us" in args:
        stream = _integer(args, "stream", where, _integer(e, "tid", where, 1) - 1, hi=1 << 20)
        end = ts + _number(e, "dur", where, 0) / 1e6
        kind = str(args.get("kind", cat))
        rec.spans.append(
            GpuSpan(device, stream, kind, str(name), ts, end, _number(args, "enqueued_us", where, lo=-MAX_US) / 1e6)
        )
    elif ph == "X" and cat == "host-wait":
        end = ts + _number(e, "dur", where, 0) / 1e6
        rec.waits.append(HostWait(device, str(args.get("reason", name)), ts, end))
    elif ph == "i" and cat == "iteration":
        rec.iterations.append(IterationMark(device, ts, _integer(args, "index", where, 0)))
    elif ph == "C" and name == "memory":
        alloc = _number(args, "allocated_MiB", where, hi=MAX_MIB)
        reserved = _number(args, "reserved_MiB", where, hi=MAX_MIB)
        rec.memory.append(MemorySample(device, ts, int(round(alloc * _MiB)), int(round(reserved * _MiB))))


def _read_events(events: Iterator[tuple[str, Any]], rec: RunRecords) -> None:
    event, _ = next(events)
    if event != "start_array":
        raise TraceError("traceEvents must be a list of events")
    n = 0
    for event, value in events:
        if event == "end_array":
            return
        n += 1
        if n > MAX_EVENTS:
            raise TraceError(f"more than {MAX_EVENTS:,} trace events; `gpemu report` reads at most that many")
        _add_event(rec, _build(events, event, value, _Limits(f"trace event {n}", *_EVENT_LIMITS)), n)


def _read_other(events: Iterator[tuple[str, Any]]) -> dict[str, Any]:
    event, _ = next(events)
    if event != "start_map":
        raise TraceError("otherData must be an object")
    other: dict[str, Any] = {}
    for event, value in events:
        if event == "end_map":
            return other
        limits = _OTHER_LIMITS.get(value)
        if limits is None:  # the stored summary (recomputed from the events), unknown keys
            _skip(events, next(events)[0])
        else:
            other[value] = _build(events, *next(events), _Limits(f"otherData.{value}", *limits))
    raise TraceError("the file ends inside otherData")


def _records(other: dict[str, Any], rec: RunRecords) -> RunRecords:
    """Check otherData's fields and put them on ``rec``."""
    gpus = other.get("gpus")
    if not isinstance(gpus, list) or not gpus or not all(isinstance(g, str) for g in gpus):
        raise TraceError(f"otherData.gpus must list the emulated GPUs (1 to {MAX_GPUS} names)")
    counters, notes = other.get("counters") or {}, other.get("notes") or []
    models, stats = other.get("models") or [], other.get("memory_stats") or []
    if not isinstance(counters, dict) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in counters.values()
    ):
        raise TraceError("otherData.counters must map names to numbers")
    if not isinstance(notes, list) or not all(isinstance(x, str) for x in notes):
        raise TraceError("otherData.notes must be a list of strings")
    if not isinstance(models, list) or not isinstance(stats, list) or not all(isinstance(s, dict) for s in stats):
        raise TraceError("otherData.models and otherData.memory_stats must be lists of objects")
    for d, s in enumerate(stats):
        for key in s:
            _integer(s, key, f"otherData.memory_stats[{d}]", hi=1 << 60)
    rec.gpus = list(gpus)
    rec.counters, rec.notes, rec.memory_stats = dict(counters), list(notes), [dict(s) for s in stats]
    rec.ended_at = _number(other, "ended_us", "otherData", 0, lo=-MAX_US) / 1e6
    config = other.get("config")
    rec.config = config if isinstance(config, str) else ""
    rec.models = [m for m in models if isinstance(m, dict) and isinstance(m.get("model"), str)]
    try:
        rec.serving = steps_from_rows(other.get("serving") or [], len(gpus))
    except ValueError as exc:
        raise TraceError(f"otherData.{exc}") from None
    for kind, items in (
        ("span", rec.spans),
        ("wait", rec.waits),
        ("iteration", rec.iterations),
        ("memory", rec.memory),
    ):
        bad = next((x.device for x in items if not 0 <= x.device < len(gpus)), None)
        if bad is not None:
            raise TraceError(f"a {kind} event is on GPU {bad}, but otherData.gpus lists {len(gpus)} GPU(s)")
    return rec


def load_trace(path: str | os.PathLike[str]) -> RunRecords:
    """Read a trace written by :func:`gpemu.trace.write_trace` back into
    :class:`gpemu.observe.RunRecords` (times in seconds since patch time). TraceError for
    anything that is not such a trace, within the bounds above."""
    import ijson

    p = Path(path)
    if not p.is_file():
        raise TraceError(f"no trace file at {str(p)!r}; write one with `gpemu run --trace trace.json -- ...`")
    rec = RunRecords(gpus=[])
    other: dict[str, Any] | None = None
    seen_events = False
    try:
        with open(p, "rb") as f:
            events = iter(ijson.basic_parse(f, use_float=True))
            if next(events, (None, None))[0] != "start_map":
                raise TraceError(f"{p} is not a gpemu trace (expected a JSON object with traceEvents and otherData)")
            for event, value in events:
                if event == "end_map":
                    break
                if value == "traceEvents":
                    _read_events(events, rec)
                    seen_events = True
                elif value == "otherData":
                    other = _read_other(events)
                else:
                    _skip(events, next(events)[0])
    except ijson.JSONError as exc:
        raise TraceError(
            f"{p} is not JSON ({' '.join(str(exc).split())[:100]}); `gpemu report` reads traces written by "
            "`gpemu run --trace FILE`"
        ) from None
    except (StopIteration, UnicodeDecodeError):
        raise TraceError(f"{p} ends before its JSON does (a damaged or truncated trace)") from None
    except TraceError as exc:
        raise TraceError(f"{p}: {exc}") from None
    if other is None or other.get("format") != TRACE_FORMAT or not seen_events:
        raise TraceError(
            f"{p} is not a gpemu trace (expected a JSON object with traceEvents and "
            f"otherData.format {TRACE_FORMAT!r}); write one with `gpemu run --trace FILE`"
        )
    try:
        return _records(other, rec)
    except TraceError as exc:
        raise TraceError(f"{p}: {exc}") from None
