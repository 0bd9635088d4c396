"""Is the emulated GPU busy, or waiting for data? (component ``gpemu.observe``)

At the end of an emulated run (and on demand, ``gpemu.observe.summary()``), this module turns the
run's :class:`~gpemu.recorder.Recorder` into a per-GPU summary: iterations, wall time, emulated
GPU busy time and utilisation, data stall, host waits, transfers, peak and persistent memory, and
the accelerator utilisation of DLIO / MLPerf Storage, ``AU = busy / wall``. It prints the summary
(``config.summary``), writes it as JSON (``config.metrics_path``) and writes a Chrome trace
(``config.trace_path``, see :mod:`gpemu.trace`): that end-of-run output is
:mod:`gpemu.run_outputs`.

Accounting, per emulated GPU (one timeline over all its streams):

* **busy** — the union of its GPU spans (overlapping streams count once);
* **data stall** — idle time during which the host had not yet enqueued the next work: in the
  idle gap before a span, the part before that span's ``enqueued_at``. The GPU sees input
  fetch/preprocessing on the host and any other host-side work (Python, logging) alike;
  ``stall_before`` says which kind of work the GPU was then waiting for (``transfer`` = the next
  input batch);
* **other idle** — idle time although work was already enqueued (it waited on another stream or
  device, or on a sharing manager running other jobs).

``busy + data stall + other idle = wall`` by construction, for two windows: **whole run** (from the
device's first GPU work to the end of its last) and **steady state** (from the end of the first
iteration to the end of the last, leaving out start-up: model move, DataLoader start, first
batch). Iterations are marked at each optimizer step that follows a backward pass; on a device
whose program takes no optimizer step (an evaluation or benchmark loop), at each sync point
(``item()``, ``synchronize()``, a copy to the host) that follows GPU work since the previous one
(:func:`marks_at_syncs`).
"""

from __future__ import annotations

import bisect
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .clock import REAL
from .commstats import communication_lines, device_communication, run_communication
from .recorder import GpuSpan, HostWait, IterationMark, MemorySample, SyncPoint
from .serving import TokenStep, serving_lines, serving_summary
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = [
    "RunRecords",
    "Timeline",
    "summary",
    "print_summary",
    "format_summary",
    "compute_summary",
    "records_from_runtime",
    "json_safe",
    "CATEGORIES",
    "WINDOW_NAMES",
    "format_seconds",
    "format_size",
    "model_source",
    "marks_at_syncs",
    "with_sync_marks",
    "SYNC_REASONS",
]

# Categories of a device timeline, in display order.
CATEGORIES: tuple[str, ...] = ("busy", "data_stall", "other_idle")
METRICS_FORMAT = "gpemu-metrics/1"


# ---------------------------------------------------------------------------------------------
# the records a summary is computed from (from a live run or read back from a trace)
# ---------------------------------------------------------------------------------------------
@dataclass
class RunRecords:
    """Everything a summary needs, detached from the live runtime (a trace file holds the same)."""

    gpus: list[str]  # GPU model of each device
    spans: list[GpuSpan] = field(default_factory=list)
    waits: list[HostWait] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    iterations: list[IterationMark] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started_at: float = 0.0  # patch time (engine clock seconds)
    ended_at: float = 0.0  # when the records were taken
    # Per device, from the memory tracker: capacity, peak_allocated, peak_reserved, allocated,
    # reserved, ooms (missing keys fall back to the memory samples).
    memory_stats: list[dict[str, int]] = field(default_factory=list)
    config: str = ""
    # Where each model's forward/backward time came from (gpemu.model_time's sources).
    models: list[dict[str, Any]] = field(default_factory=list)
    # The clock every time above is on: "real" (the wall clock) or "virtual" (docs/time.md), and
    # for a live run on virtual time, the real seconds it took (its speed-up).
    clock: str = "real"
    wall_s: float | None = None
    # The token steps of generation and serving loops (gpemu.serving): the serving metrics.
    serving: list[TokenStep] = field(default_factory=list)

    @property
    def num_devices(self) -> int:
        return len(self.gpus)


def records_from_runtime(rt: Runtime) -> RunRecords:
    """Snapshot of a live run (copies of the recorder's lists; appends may go on meanwhile)."""
    rec = rt.recorder
    stats: list[dict[str, int]] = []
    for tracker in rt.memory:
        stats.append(
            {
                "capacity": int(tracker.capacity),
                "peak_allocated": int(tracker.peak_allocated),
                "peak_reserved": int(tracker.peak_reserved),
                "allocated": int(tracker.allocated),
                "reserved": int(tracker.reserved),
                "ooms": int(getattr(tracker, "num_ooms", 0)),
            }
        )
    engine = rt.engine
    now = engine.clock.now() if engine is not None else time.perf_counter()
    return RunRecords(
        gpus=[g.name for g in rt.gpus],
        spans=list(rec.spans),
        waits=list(rec.waits),
        memory=list(rec.memory),
        iterations=with_sync_marks(list(rec.iterations), list(rec.spans), list(rec.syncs), len(rt.gpus)),
        counters=dict(rec.counters),
        notes=list(rec.notes),
        started_at=rec.started_at,
        ended_at=now,
        memory_stats=stats,
        config=rt.config.describe(),
        models=[dict(m) for m in rt.model_time.sources.values()] if rt.model_time is not None else [],
        clock="virtual" if rt.config.virtual_time else "real",
        wall_s=REAL.perf_counter() - engine.started_wall if rt.config.virtual_time and engine is not None else None,
        serving=list(rt.model_time.serving.steps) if rt.model_time is not None else [],
    )


# Sync points of a loop (not a sharing backend's switch or the emulator's own calibration).
SYNC_REASONS = frozenset({"item", "synchronize", "torch.cuda.synchronize", "cpu", "tolist", "numpy", "print"})
# GPU work that is not a loop's own (moving the model and inputs, the emulator's calibration).
_NOT_STEP_WORK = frozenset({"transfer", "calibration"})


def marks_at_syncs(spans: Sequence[GpuSpan], syncs: Sequence[SyncPoint], device: int) -> list[IterationMark]:
    """Iteration marks of a device whose program took no optimizer step: one at each sync point
    that follows GPU work (forward, backward, ops, collectives) since the previous mark, at the
    time the host went on (the work was done)."""
    ends = sorted(s.end for s in spans if s.device == device and s.kind not in _NOT_STEP_WORK)
    marks: list[IterationMark] = []
    i = 0
    points = sorted((p for p in syncs if p.device == device and p.reason in SYNC_REASONS), key=lambda p: p.time)
    for p in points:
        j = bisect.bisect_right(ends, p.time, lo=i)
        if j > i:  # work ended since the previous mark
            marks.append(IterationMark(device, p.time, len(marks)))
            i = j
    return marks


def with_sync_marks(
    marks: list[IterationMark], spans: Sequence[GpuSpan], syncs: Sequence[SyncPoint], devices: int
) -> list[IterationMark]:
    """``marks`` (the optimizer steps'), and for each device without any, its marks at syncs."""
    marked = {m.device for m in marks}
    out = list(marks)
    for d in range(devices):
        if d not in marked:
            out.extend(marks_at_syncs(spans, syncs, d))
    return out


# ---------------------------------------------------------------------------------------------
# one device's timeline: a partition of [first work, last work end] into categories
# ---------------------------------------------------------------------------------------------
class Timeline:
    """Non-overlapping, sorted segments ``(start, end, category, detail)`` covering one device
    from its first GPU work to the end of its last; ``detail`` is the kind of the span a
    ``data_stall`` segment waited for (``""`` otherwise)."""

    def __init__(self, spans: Sequence[GpuSpan]) -> None:
        self.segments: list[tuple[float, float, str, str]] = []
        ordered = sorted(spans, key=lambda s: (s.start, s.enqueued_at))
        if ordered:
            cur_start, cur_end = ordered[0].start, ordered[0].end
            for s in ordered[1:]:
                if s.start <= cur_end:
                    if s.end > cur_end:
                        cur_end = s.end
                    continue
                self.segments.append((cur_start, cur_end, "busy", ""))
                # Idle gap before s: stalled while the host had not enqueued s, then waiting.
                ready = min(max(s.enqueued_at, cur_end), s.start)
                if ready > cur_end:
                    self.segments.append((cur_end, ready, "data_stall", s.kind))
                if s.start > ready:
                    self.segments.append((ready, s.start, "other_idle", ""))
                cur_start, cur_end = s.start, s.end
            self.segments.append((cur_start, cur_end, "busy", ""))
        self._starts = [seg[0] for seg in self.segments]
        # prefix[c][k]: time of category c in segments[:k]
        self._prefix: dict[str, list[float]] = {c: [0.0] for c in CATEGORIES}
        for start, end, cat, _ in self.segments:
            for c in CATEGORIES:
                self._prefix[c].append(self._prefix[c][-1] + ((end - start) if c == cat else 0.0))

    @property
    def start(self) -> float | None:
        return self.segments[0][0] if self.segments else None

    @property
    def end(self) -> float | None:
        return self.segments[-1][1] if self.segments else None

    def _before(self, t: float) -> dict[str, float]:
        """Time of each category before ``t``."""
        k = bisect.bisect_right(self._starts, t) - 1
        if k < 0:
            return {c: 0.0 for c in CATEGORIES}
        start, end, cat, _ = self.segments[k]
        out = {c: self._prefix[c][k] for c in CATEGORIES}
        out[cat] += min(t, end) - start
        return out

    def between(self, a: float, b: float) -> dict[str, float]:
        """Time of each category inside ``[a, b]`` (O(log n))."""
        if b <= a:
            return {c: 0.0 for c in CATEGORIES}
        lo, hi = self._before(a), self._before(b)
        return {c: max(0.0, hi[c] - lo[c]) for c in CATEGORIES}

    def stall_before(self, a: float, b: float) -> dict[str, float]:
        """Data stall inside ``[a, b]`` by the kind of work the GPU was waiting for."""
        out: dict[str, float] = {}
        for start, end, cat, detail in self.segments:
            if cat != "data_stall" or end <= a or start >= b:
                continue
            out[detail] = out.get(detail, 0.0) + min(end, b) - max(start, a)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _kind_totals(spans: Iterable[GpuSpan], a: float, b: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in spans:
        d = min(s.end, b) - max(s.start, a)
        if d > 0:
            out[s.kind] = out.get(s.kind, 0.0) + d
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _window(timeline: Timeline, spans: Sequence[GpuSpan], a: float, b: float, t0: float) -> dict[str, Any]:
    parts = timeline.between(a, b)
    wall = b - a
    busy = parts["busy"]
    return {
        "start_s": a - t0,
        "end_s": b - t0,
        "wall_s": wall,
        "busy_s": busy,
        "idle_s": parts["data_stall"] + parts["other_idle"],
        "data_stall_s": parts["data_stall"],
        "other_idle_s": parts["other_idle"],
        "utilisation": busy / wall if wall > 0 else 0.0,
        "data_stall_share": parts["data_stall"] / wall if wall > 0 else 0.0,
        "busy_by_kind_s": _kind_totals(spans, a, b),
        "stall_before_s": timeline.stall_before(a, b),
    }


def iteration_breakdown(
    timeline: Timeline, marks: Sequence[float], start: float | None = None
) -> list[dict[str, float]]:
    """Per iteration (between consecutive iteration marks; the first from ``start``, default the
    device's first work): its duration and busy / data stall / other idle seconds."""
    out: list[dict[str, float]] = []
    prev = timeline.start if start is None else start
    if prev is None:
        return out
    for i, t in enumerate(marks):
        parts = timeline.between(prev, t)
        out.append(
            {
                "index": i,
                "start": prev,
                "end": t,
                "duration_s": max(0.0, t - prev),
                **{f"{c}_s": parts[c] for c in CATEGORIES},
            }
        )
        prev = t
    return out


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    median = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    return {"mean_s": sum(ordered) / n, "median_s": median, "min_s": ordered[0], "max_s": ordered[-1]}


# ---------------------------------------------------------------------------------------------
# the summary
# ---------------------------------------------------------------------------------------------
def compute_summary(records: RunRecords) -> dict[str, Any]:
    """The summary of a run as a JSON-ready dict (the metrics file's content)."""
    t0 = records.started_at
    devices: list[dict[str, Any]] = []
    for d, gpu in enumerate(records.gpus):
        spans = [s for s in records.spans if s.device == d]
        timeline = Timeline(spans)
        marks = sorted(m.time for m in records.iterations if m.device == d)
        waits = [w for w in records.waits if w.device == d]
        samples = [m for m in records.memory if m.device == d]
        dev: dict[str, Any] = {"device": d, "gpu": gpu, "iterations": len(marks), "spans": len(spans)}
        if timeline.start is not None and timeline.end is not None:
            a, b = timeline.start, timeline.end
            dev["whole"] = _window(timeline, spans, a, b, t0)
            # A mark can fall after the last span's end (the host was behind): clip to the work.
            steady = [m for m in marks if m >= a]
            dev["steady"] = (
                _window(timeline, spans, steady[0], min(steady[-1], b), t0)
                if len(steady) >= 2 and min(steady[-1], b) > steady[0]
                else None
            )
            dev["iteration_time"] = _stats([y - x for x, y in zip(marks, marks[1:], strict=False)])
        else:
            dev["whole"] = None
            dev["steady"] = None
            dev["iteration_time"] = None
        headline = dev["steady"] or dev["whole"]
        dev["communication"] = device_communication(spans, headline, t0) if headline else None
        dev["au"] = headline["utilisation"] if headline else 0.0
        dev["au_window"] = "steady" if dev["steady"] else ("whole" if dev["whole"] else None)
        by_reason: dict[str, float] = {}
        for w in waits:
            by_reason[w.reason] = by_reason.get(w.reason, 0.0) + max(0.0, w.end - w.start)
        dev["host_waits"] = {
            "total_s": sum(by_reason.values()),
            "count": len(waits),
            "by_reason_s": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
        }
        dev["memory"] = _memory(records, d, samples, marks)
        devices.append(dev)

    counters = records.counters
    transfers = {
        "h2d_bytes": int(counters.get("h2d_bytes", 0)),
        "h2d_copies": int(counters.get("h2d_copies", 0)),
        "h2d_seconds": counters.get("h2d_seconds", 0.0),
        "h2d_pinned_bytes": int(counters.get("h2d_pinned_bytes", 0)),
        "h2d_pageable_bytes": int(counters.get("h2d_pageable_bytes", 0)),
        "d2h_bytes": int(counters.get("d2h_bytes", 0)),
        "d2h_copies": int(counters.get("d2h_copies", 0)),
        "d2h_seconds": counters.get("d2h_seconds", 0.0),
        "model_transfer_bytes": int(counters.get("model_transfer_bytes", 0)),
        "model_transfer_seconds": counters.get("model_transfer_seconds", 0.0),
        "pinned_bytes": int(counters.get("pin_bytes", 0)),
    }
    active = [d for d in devices if d["whole"]]
    return {
        "format": METRICS_FORMAT,
        "config": records.config,
        "num_gpus": records.num_devices,
        "gpus": list(records.gpus),
        "run_s": max(0.0, records.ended_at - t0),
        "iterations": max((d["iterations"] for d in devices), default=0),
        "au": (sum(d["au"] for d in active) / len(active)) if active else 0.0,
        "data_stall_share": (sum((d["steady"] or d["whole"])["data_stall_share"] for d in active) / len(active))
        if active
        else 0.0,
        "devices": devices,
        "transfers": transfers,
        "counters": dict(sorted(counters.items())),
        "notes": list(records.notes),
        "models": list(records.models),
        "communication": run_communication(counters),
        "clock": records.clock,
        "wall_s": records.wall_s,
        "serving": serving_summary(records.serving),
    }


def _memory(records: RunRecords, d: int, samples: Sequence[MemorySample], marks: Sequence[float]) -> dict[str, Any]:
    stats = records.memory_stats[d] if d < len(records.memory_stats) else {}
    peak_alloc = max([int(stats.get("peak_allocated", 0))] + [s.allocated for s in samples])
    peak_reserved = max([int(stats.get("peak_reserved", 0))] + [s.reserved for s in samples])
    # Persistent: what stays allocated between iterations (parameters, gradients, optimizer state
    # and the batch in hand): the least allocated at any sample once the first iteration is done.
    steady = [s.allocated for s in samples if marks and s.time >= marks[0]]
    persistent = min(steady) if steady else None
    return {
        "capacity_bytes": int(stats["capacity"]) if "capacity" in stats else None,
        "peak_allocated_bytes": peak_alloc,
        "peak_reserved_bytes": peak_reserved,
        "persistent_bytes": persistent,
        "allocated_bytes": int(stats["allocated"])
        if "allocated" in stats
        else (samples[-1].allocated if samples else 0),
        "ooms": int(stats.get("ooms", 0)),
        "samples": len(samples),
    }


# ---------------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------------
def format_size(n: float | None) -> str:
    """A size as the summary writes it ('-' when unknown)."""
    return "-" if n is None else format_bytes(n)


def format_seconds(s: float) -> str:
    """A duration as the summary writes it: '62.50 ms', '1.885 s', '126.4 s'."""
    if s >= 100:
        return f"{s:.1f} s"
    if s >= 1:
        return f"{s:.3f} s"
    return f"{s * 1e3:.2f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _by(d: dict[str, float], limit: int = 6) -> str:
    items = [f"{k} {format_seconds(v)}" for k, v in list(d.items())[:limit] if v > 0]
    return ", ".join(items) if items else "-"


WINDOW_NAMES = {"steady": "steady state", "whole": "whole run"}


_LABEL_WIDTH = 34


def format_summary(s: dict[str, Any]) -> str:
    """The summary as aligned text (what ``gpemu run`` prints at exit and ``gpemu report`` prints).

    A rank of a multi-process job (``s["rank"]`` set) lists only the GPUs it did work on; a
    single process also names its idle GPUs, one line each."""
    rank = s.get("rank")
    active = [dev for dev in s["devices"] if dev["whole"] is not None]
    shown = active if rank is not None and active else s["devices"]
    gpus = (
        f"{len(shown)} of {s['num_gpus']} emulated GPU(s) [{', '.join(d['gpu'] for d in shown)}]"
        if len(shown) != s["num_gpus"]
        else f"{s['num_gpus']} emulated GPU(s) [{', '.join(s['gpus'])}]"
    )
    lines = [
        f"gpemu summary: {gpus}, {s['iterations']} iteration(s), run {format_seconds(s['run_s'])}"
        + (f"  ({s['config']})" if s.get("config") else "")
    ]
    virtual = _virtual_time_line(s)
    if virtual:
        lines.append(virtual)
    for dev in shown:
        lines += _device_lines(dev)
    w = _LABEL_WIDTH
    models = s.get("models") or []
    if models:
        lines.append("model time".ljust(w + 2) + "; ".join(model_source(m) for m in models))
    lines += communication_lines(s, w, format_seconds, format_size)
    lines += serving_lines(s.get("serving"), w, format_seconds, format_size)
    t = s["transfers"]
    lines.append(
        "transfers".ljust(w + 2)
        + f"host->GPU {format_size(t['h2d_bytes'])} ({t['h2d_copies']} copies, {format_seconds(t['h2d_seconds'])}; "
        f"pinned {format_size(t['h2d_pinned_bytes'])}, model {format_size(t['model_transfer_bytes'])}), "
        f"GPU->host {format_size(t['d2h_bytes'])} ({t['d2h_copies']} copies)"
    )
    return "\n".join(lines)


def _virtual_time_line(s: dict[str, Any]) -> str | None:
    """On virtual time: that every time is virtual, and the run's speed-up over real time."""
    if s.get("clock") != "virtual":
        return None
    line = "virtual time".ljust(_LABEL_WIDTH + 2) + "every time in this summary is virtual (docs/time.md)"
    wall = s.get("wall_s")
    if isinstance(wall, (int, float)) and wall > 0:
        line += f"; {format_seconds(s['run_s'])} ran in {format_seconds(wall)} of real time ({s['run_s'] / wall:.1f}x)"
    return line


def _device_lines(dev: dict[str, Any]) -> list[str]:
    """One GPU's block of the summary: its windows side by side, then one line per fact."""
    w = _LABEL_WIDTH
    whole, steady, mem = dev["whole"], dev["steady"], dev["memory"]
    if whole is None:
        peak = mem["peak_allocated_bytes"]
        return [
            f"GPU {dev['device']} ({dev['gpu']}): no GPU work recorded"
            + (f"; peak {format_size(peak)} allocated" if peak else "")
        ]
    cols = [("whole run", whole)] + ([("steady state", steady)] if steady else [])
    lines = [f"GPU {dev['device']} ({dev['gpu']})", "  " + "".ljust(w) + "".join(name.ljust(26) for name, _ in cols)]

    def row(label: str, fn: Any) -> None:
        lines.append("  " + label.ljust(w) + "".join(fn(win).ljust(26) for _, win in cols))

    row("window (since patch)", lambda x: f"{x['start_s']:.3f}-{x['end_s']:.3f} s")
    row("wall time", lambda x: format_seconds(x["wall_s"]))
    row("GPU busy", lambda x: f"{format_seconds(x['busy_s'])} ({_pct(x['utilisation'])})")
    row("data stall (host not ready)", lambda x: f"{format_seconds(x['data_stall_s'])} ({_pct(x['data_stall_share'])})")
    row("other idle (deps, sharing)", lambda x: format_seconds(x["other_idle_s"]))
    window = WINDOW_NAMES.get(dev["au_window"] or "", "whole run")
    lines.append("  " + "accelerator utilisation (AU)".ljust(w) + f"{_pct(dev['au'])} ({window})")
    it = dev["iteration_time"]
    if it:
        lines.append(
            "  "
            + "iteration time".ljust(w)
            + f"mean {format_seconds(it['mean_s'])}, median {format_seconds(it['median_s'])}, "
            f"max {format_seconds(it['max_s'])}"
        )
    head = steady or whole
    lines.append("  " + f"GPU busy by kind ({window})".ljust(w) + _by(head["busy_by_kind_s"]))
    lines.append("  " + f"stall, waiting for ({window})".ljust(w) + _by(head["stall_before_s"]))
    comm = dev.get("communication")
    if comm and comm["comm_s"] > 0:
        lines.append(
            "  "
            + f"communication ({window})".ljust(w)
            + f"{format_seconds(comm['comm_s'])} on the GPU, {format_seconds(comm['exposed_s'])} exposed "
            f"(not overlapped by computation), {format_seconds(comm['overlapped_s'])} overlapped"
        )
    hw = dev["host_waits"]
    waited = (
        f"{format_seconds(hw['total_s'])} in {hw['count']} waits ({_by(hw['by_reason_s'])})" if hw["count"] else "-"
    )
    lines.append("  " + "host waited for GPU".ljust(w) + waited)
    cap = f" of {format_size(mem['capacity_bytes'])}" if mem["capacity_bytes"] else ""
    lines.append(
        "  " + "memory".ljust(w) + f"peak {format_size(mem['peak_allocated_bytes'])} allocated / "
        f"{format_size(mem['peak_reserved_bytes'])} reserved{cap}, "
        f"persistent {format_size(mem['persistent_bytes'])}" + (f", {mem['ooms']} OOM(s)" if mem["ooms"] else "")
    )
    return lines


def model_source(m: dict[str, Any]) -> str:
    """``resnet50 on H100: scaled (GPU, from A100) ±19% (p90 52%)``: where a model's time came from."""
    fwd, bwd = m.get("forward"), m.get("backward")
    how = str(fwd or "") if fwd == bwd or bwd is None else f"forward {fwd}, backward {bwd}"
    if "scaled" in (fwd, bwd) and m.get("scaled_for"):
        how += f" ({m['scaled_for']})"
    return f"{m['model']} on {m['gpu']}: {how or '-'}" + (f" {m['uncertainty']}" if m.get("uncertainty") else "")


# ---------------------------------------------------------------------------------------------
# public API on a live run
# ---------------------------------------------------------------------------------------------
def _runtime(rt: Runtime | None) -> Runtime:
    if rt is None:
        from .runtime import current

        rt = current()
    if rt is None:
        raise RuntimeError("gpemu is not patched: call gpemu.patch() first (there is no emulated run to summarise)")
    return rt


def summary(rt: Runtime | None = None) -> dict[str, Any]:
    """The current run's summary (as written to the metrics JSON); usable any time while patched.

    Work already enqueued but not yet finished on the emulated GPU counts as done."""
    return compute_summary(records_from_runtime(_runtime(rt)))


def print_summary(rt: Runtime | None = None, file: Any = None) -> dict[str, Any]:
    """Print the current run's summary (stderr by default); returns it."""
    s = summary(rt)
    print(format_summary(s), file=file if file is not None else sys.stderr, flush=True)
    return s


def json_safe(x: Any) -> Any:
    """A summary with inf/nan written as None (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
