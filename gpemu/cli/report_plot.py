"""The figure of ``gpemu report --plot``: one function per panel (see :mod:`.report_cmd`).

1. **whole run, per GPU**: the share of each time bin the GPU was busy, stalled on data (the host
   had not enqueued the next work) or otherwise idle, stacked to 100%; start-up (before the first
   iteration ended) shaded, iteration marks on the top axis (every k-th on long runs), the zoomed
   window outlined;
2. **memory over the whole run**, from the model copy on: allocated and reserved; on long runs the
   range within each time bin (the upper edge is each iteration's peak, the lower edge what stays
   allocated between iterations);
3. **a zoom on the steady state**: a few iterations from the middle of the run, every GPU span
   coloured by kind (forward, backward, optimizer, transfer, ...), the idle gaps as data stall or
   other idle, the host's waits, iteration boundaries; and memory in that window below it;
4. **where each iteration's time went**: stacked bars (busy / data stall / other idle); on long
   runs each bar is the mean of a group of consecutive iterations.

Legends sit beside the panels, never on the data.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["plot_timeline"]

# Colours (colour-blind safe: Okabe-Ito and Tol).
_COLOURS = {"busy": "#0072B2", "data_stall": "#E69F00", "other_idle": "#BBBBBB"}
_LABELS = {"busy": "GPU busy", "data_stall": "data stall (host not ready)", "other_idle": "other idle (deps, sharing)"}
_KIND_COLOURS = {
    "forward": "#0072B2",
    "backward": "#56B4E9",
    "optimizer": "#009E73",
    "transfer": "#CC79A7",
    "op": "#332288",
    "comm": "#D55E00",
    "preprocess": "#882255",
}
_OTHER_KIND = "#444444"
_MAX_BARS = 150  # per-iteration bars before they are grouped
_MAX_MARKS = 40  # iteration marks on the top axis before only every k-th is marked
_ZOOM_ITERATIONS = 4  # iterations in the steady-state zoom
_MAX_GPU_ROWS = 4  # whole-run panels drawn (the rest are summarised in the title)
_GIB = float(1 << 30)
_LEGEND_KW: dict[str, Any] = {
    "loc": "upper left",
    "bbox_to_anchor": (1.005, 1.0),
    "fontsize": "small",
    "frameon": False,
    "borderaxespad": 0.0,
}


def _nice_step(n: int, most: int) -> int:
    """Smallest of 1, 2, 5, 10, 20, 50, ... that leaves at most ``most`` of ``n`` items."""
    step = 1
    while n / step > most:
        for m in (2, 2.5, 2):
            step = int(step * m)
            if n / step <= most:
                break
    return max(1, step)


def _typical_window(marks: Sequence[float], k: int) -> int:
    """Index of the first of ``k`` consecutive steady-state iterations (after iteration 0) whose
    mean time is closest to the run's median iteration time; the most central on ties."""
    durations = [y - x for x, y in zip(marks, marks[1:], strict=False)]
    median = sorted(durations)[len(durations) // 2]
    centre = (len(durations) - k) / 2
    best, best_key = 0, (math.inf, math.inf)
    window = sum(durations[:k])
    for i in range(len(durations) - k + 1):
        if i:
            window += durations[i + k - 1] - durations[i - 1]
        key = (round(abs(window / k - median) / median, 2) if median > 0 else 0.0, abs(i - centre))
        if key < best_key:
            best, best_key = i, key
    return best


def _memory_series(
    records: Any, d: int, start: float | None, end: float | None
) -> tuple[list[float], list[int], list[int], bool]:
    """(times, allocated, reserved, from_model_copy) of device ``d``. The tracker samples memory
    at forward/backward boundaries; before the first sample the model copies' bytes (from the
    transfer counters, split over the copies by their duration) are drawn from the moment each
    copy was issued (when the memory is allocated, as with CUDA's allocator)."""
    samples = sorted((m for m in records.memory if m.device == d), key=lambda m: m.time)
    ts = [m.time for m in samples]
    alloc = [m.allocated for m in samples]
    reserved = [m.reserved for m in samples]
    first = ts[0] if ts else math.inf
    copies_all = [s for s in records.spans if s.kind == "transfer" and s.name.startswith("model h2d")]
    copies = sorted((s for s in copies_all if s.device == d and s.enqueued_at < first), key=lambda s: s.enqueued_at)
    model_bytes = float(records.counters.get("model_transfer_bytes", 0.0))
    from_copy = False
    if copies and model_bytes > 0:
        total = sum(s.end - s.start for s in copies_all) or 1.0
        pre_t, pre_a = [min(copies[0].enqueued_at, start if start is not None else math.inf)], [0]
        acc = 0.0
        for s in copies:
            acc += model_bytes * (s.end - s.start) / total
            pre_t.append(s.enqueued_at)
            pre_a.append(int(acc))
        ts, alloc, reserved = pre_t + ts, pre_a + alloc, pre_a + reserved
        from_copy = True
    elif ts and start is not None and start < ts[0]:
        ts, alloc, reserved = [start] + ts, [0] + alloc, [0] + reserved
    if ts and end is not None and end > ts[-1]:
        ts, alloc, reserved = ts + [end], alloc + [alloc[-1]], reserved + [reserved[-1]]
    return ts, alloc, reserved, from_copy


def _envelope(ts: Sequence[float], values: Sequence[float], a: float, b: float, bins: int) -> tuple[Any, Any, Any]:
    """Per time bin of [a, b]: (bin centres, min, max) of a step function sampled at ``ts``."""
    import numpy as np

    t = np.asarray(ts, dtype=float)
    v = np.asarray(values, dtype=float)
    edges = np.linspace(a, b, bins + 1)
    lo, hi = np.empty(bins), np.empty(bins)
    first = np.searchsorted(t, edges[:-1], side="right") - 1  # the sample in force at a bin's start
    last = np.searchsorted(t, edges[1:], side="left") - 1  # the last one before its end
    for i in range(bins):
        j0 = max(first[i], 0)
        j1 = max(last[i], j0)
        seg = v[j0 : j1 + 1]
        lo[i], hi[i] = seg.min(), seg.max()
    return (edges[:-1] + edges[1:]) / 2, lo, hi


@dataclass
class _Run:
    """What every panel reads: the records, the summary and what was derived from them once."""

    records: Any
    summary: dict[str, Any]
    bins: int
    t0: float = 0.0
    timelines: list[Any] = field(default_factory=list)
    marks: list[list[float]] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    shown: list[int] = field(default_factory=list)
    ref: int | None = None
    zoom: tuple[float, float] | None = None
    zoom_title: str = ""

    def colour(self, d: int) -> str:
        return _KIND_COLOURS["forward"] if len(self.shown) == 1 else f"C{d % 10}"


def _derive(records: Any, summary: dict[str, Any], bins: int) -> _Run:
    from gpemu.observe import Timeline

    n = records.num_devices
    run = _Run(records, summary, bins, t0=records.started_at)
    run.timelines = [Timeline([s for s in records.spans if s.device == d]) for d in range(n)]
    run.marks = [sorted(m.time for m in records.iterations if m.device == d) for d in range(n)]
    run.active = [d for d in range(n) if run.timelines[d].start is not None]
    run.shown = run.active[:_MAX_GPU_ROWS] or [0]
    run.ref = next((d for d in run.active if len(run.marks[d]) >= 2), run.active[0] if run.active else None)
    _choose_zoom(run)
    return run


def _choose_zoom(run: _Run) -> None:
    """Zoom window: a few iterations from the middle of the steady state."""
    if run.ref is None:
        return
    m = run.marks[run.ref]
    if len(m) >= 2:
        k = min(_ZOOM_ITERATIONS, len(m) - 1)
        i0 = _typical_window(m, k)
        run.zoom = (m[i0], m[i0 + k])
        durations = sorted(y - x for x, y in zip(m, m[1:], strict=False))
        run.zoom_title = (
            f"Zoom on the steady state: iterations {i0 + 1}-{i0 + k} of {len(m)} (GPU {run.ref}), "
            f"{1e3 * (run.zoom[1] - run.zoom[0]) / k:.1f} ms per iteration "
            f"(median of the run {1e3 * durations[len(durations) // 2]:.1f} ms); "
            "dashed: iteration ends"
        )
    else:
        tl = run.timelines[run.ref]
        run.zoom = (max(tl.start, tl.end - min(1.0, (tl.end - tl.start))), tl.end)
        run.zoom_title = "Zoom on the end of the run (no steady state: fewer than 2 iterations)"


def plot_timeline(records: Any, summary: dict[str, Any], path: Path, bins: int = 100) -> Path:
    """Draw the run in ``records`` to ``path`` (see the module docstring for the panels)."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never needs a display
    import matplotlib.pyplot as plt

    run = _derive(records, summary, bins)
    shown = run.shown
    heights = [1.25] * len(shown) + [1.6, 0.55 + 0.45 * len(shown) + (0.3 if len(shown) == 1 else 0), 0.9, 1.8]
    fig = plt.figure(figsize=(11, sum(heights) + 1.6), layout="constrained")
    gs = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    ax_states = [fig.add_subplot(gs[i, 0]) for i in range(len(shown))]
    for ax in ax_states[1:]:
        ax.sharex(ax_states[0])
    ax_mem = fig.add_subplot(gs[len(shown), 0], sharex=ax_states[0])
    ax_zoom = fig.add_subplot(gs[len(shown) + 1, 0])
    ax_zmem = fig.add_subplot(gs[len(shown) + 2, 0], sharex=ax_zoom)
    ax_iter = fig.add_subplot(gs[len(shown) + 3, 0])
    for row, d in enumerate(shown):
        _draw_states(run, ax_states[row], row, d)
    if len(run.active) > len(shown):
        ax_states[-1].set_xlabel(f"(GPUs {', '.join(map(str, run.active[len(shown) :]))} not drawn)", fontsize="small")
    _draw_memory(run, ax_mem)
    if run.zoom is not None:
        _draw_zoom(run, ax_zoom, ax_zmem)
        _draw_zoom_memory(run, ax_zmem)
    else:
        for ax in (ax_zoom, ax_zmem):
            ax.text(0.5, 0.5, "no GPU work recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
    _draw_iterations(run, ax_iter)
    fig.suptitle(
        f"gpemu: {', '.join(sorted(set(records.gpus)))} x{records.num_devices}, {summary['iterations']} iteration(s)"
        + (f"  ({records.config})" if records.config else ""),
        fontsize="medium",
    )
    try:
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


def _draw_states(run: _Run, ax: Any, row: int, d: int) -> None:
    """Panel 1, one GPU: busy / data stall / other idle per time bin, stacked to 100%."""
    from gpemu.observe import CATEGORIES

    tl, dev, t0, bins = run.timelines[d], run.summary["devices"][d], run.t0, run.bins
    if tl.start is None:
        ax.text(0.5, 0.5, "no GPU work recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
        return
    width = (tl.end - tl.start) / bins
    xs: list[float] = []
    shares: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    for i in range(bins):
        a = tl.start + i * width
        parts = tl.between(a, a + width)
        xs.append(a - t0)
        for c in CATEGORIES:
            shares[c].append(100 * parts[c] / width if width > 0 else 0.0)
    xs.append(tl.end - t0)
    bottom = [0.0] * bins
    for c in CATEGORIES:
        top = [b + v for b, v in zip(bottom, shares[c], strict=False)]
        ax.stairs(top, xs, baseline=bottom, fill=True, color=_COLOURS[c], label=_LABELS[c], linewidth=0)
        bottom = top
    ax.set_ylim(0, 100)
    ax.set_xlim(tl.start - t0, tl.end - t0)
    ax.set_ylabel(f"GPU {d}\n% of time", fontsize="small")
    window = "steady state" if dev["au_window"] == "steady" else "whole run"
    stall = (dev["steady"] or dev["whole"])["data_stall_share"]
    ax.set_title(
        f"GPU {d} ({dev['gpu']}) over the whole run: AU {100 * dev['au']:.1f}%, "
        f"data stall {100 * stall:.1f}% ({window})",
        fontsize="medium",
        loc="left",
    )
    _mark_iterations(run, ax, d)
    if run.zoom is not None:
        ax.axvspan(
            run.zoom[0] - t0, run.zoom[1] - t0, facecolor="none", edgecolor="black", linewidth=1.2, label="zoomed below"
        )
    if row == 0:
        ax.legend(**_LEGEND_KW)
    if row < len(run.shown) - 1:
        ax.tick_params(labelbottom=False)


def _mark_iterations(run: _Run, ax: Any, d: int) -> None:
    """Start-up shaded, iteration ends on the top axis (every k-th on long runs)."""
    dm, t0, tl = run.marks[d], run.t0, run.timelines[d]
    if not dm:
        return
    ax.axvspan(
        tl.start - t0,
        dm[0] - t0,
        facecolor="none",
        edgecolor="#555555",
        hatch="//",
        linewidth=0,
        alpha=0.5,
        label="start-up (to the end of iteration 0)",
    )
    step = _nice_step(len(dm), _MAX_MARKS)
    top_ax = ax.secondary_xaxis("top")
    chosen = list(range(0, len(dm), step))
    top_ax.set_xticks(
        [dm[i] - t0 for i in chosen],
        [str(i) if j % max(1, len(chosen) // 8) == 0 else "" for j, i in enumerate(chosen)],
        fontsize="x-small",
    )
    top_ax.tick_params(direction="in", length=5)
    top_ax.set_xlabel(
        "iteration ends" + (f" (every {step}th marked)" if step > 1 else ""), fontsize="x-small", labelpad=1
    )


def _draw_memory(run: _Run, ax_mem: Any) -> None:
    """Panel 2: memory over the whole run, from the model copy."""
    records, t0 = run.records, run.t0
    cap = max((int(ms.get("capacity", 0)) for ms in records.memory_stats), default=0)
    drew_mem = False
    for d in run.shown:
        tl = run.timelines[d]
        ts, alloc, reserved, from_copy = _memory_series(records, d, tl.start, tl.end)
        if not ts:
            continue
        label = f"GPU {d} " if len(run.shown) > 1 else ""
        if len(ts) > 400 and tl.start is not None:
            _memory_envelope(run, ax_mem, ts, alloc, reserved, run.colour(d), label)
        else:
            xs = [t - t0 for t in ts]
            ax_mem.step(xs, [v / _GIB for v in alloc], where="post", color=run.colour(d), linewidth=1,
                        label=f"{label}allocated")  # fmt: skip
            ax_mem.step(xs, [v / _GIB for v in reserved], where="post", color="#666666", linewidth=1,
                        linestyle="--", label=f"{label}reserved")  # fmt: skip
        if from_copy:
            ax_mem.axvline(ts[1] - t0, color="#999999", linewidth=0.8, linestyle=":")
            ax_mem.annotate("model copied", (ts[1] - t0, max(alloc[1], 1) / _GIB), xytext=(4, 6),
                            textcoords="offset points", fontsize="x-small", color="#555555")  # fmt: skip
        drew_mem = True
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_ylabel("GiB", fontsize="small")
    ax_mem.set_xlabel("time since start (s)", fontsize="small")
    ax_mem.set_title(
        "Emulated GPU memory over the whole run" + (f" (capacity {cap / 2**30:.0f} GiB)" if cap else ""),
        fontsize="medium",
        loc="left",
    )
    if run.zoom is not None:
        ax_mem.axvspan(run.zoom[0] - t0, run.zoom[1] - t0, facecolor="none", edgecolor="black", linewidth=1.2)
    if drew_mem:
        ax_mem.legend(**_LEGEND_KW)
    else:
        ax_mem.text(0.5, 0.5, "no memory samples", ha="center", va="center", transform=ax_mem.transAxes)


def _memory_envelope(
    run: _Run, ax_mem: Any, ts: list[float], alloc: list[int], reserved: list[int], colour: str, label: str
) -> None:
    """Long runs: the range of allocated memory within each time bin, and the reserved peak."""
    t0 = run.t0
    nb = min(300, max(50, run.bins * 2))
    xs, lo, hi = _envelope(ts, alloc, ts[0], ts[-1], nb)
    ax_mem.fill_between(xs - t0, lo / _GIB, hi / _GIB, step="mid", color=colour, alpha=0.25, linewidth=0)
    ax_mem.step(xs - t0, hi / _GIB, where="mid", color=colour, linewidth=1, label=f"{label}allocated, peak in each bin")
    ax_mem.step(xs - t0, lo / _GIB, where="mid", color=colour, linewidth=1, linestyle=":",
                label=f"{label}allocated, least in each bin")  # fmt: skip
    _, _, rhi = _envelope(ts, reserved, ts[0], ts[-1], nb)
    ax_mem.step(xs - t0, rhi / _GIB, where="mid", color="#666666", linewidth=1, linestyle="--",
                label=f"{label}reserved")  # fmt: skip


def _draw_zoom(run: _Run, ax_zoom: Any, ax_zmem: Any) -> None:
    """Panel 3: spans by kind, idle gaps, host waits and iteration boundaries in the zoom window."""
    from matplotlib.patches import Patch

    assert run.zoom is not None
    za, zb = run.zoom
    pad = 0.03 * (zb - za)
    lo_t, hi_t = za - pad, zb + pad
    lanes: list[str] = []
    kinds_seen: list[str] = []
    for d in run.shown:
        _zoom_lanes(run, ax_zoom, d, lanes, kinds_seen, (lo_t, hi_t))
    for i, t in enumerate(run.marks[run.ref] if run.ref is not None else []):
        if lo_t <= t <= hi_t:
            for ax in (ax_zoom, ax_zmem):
                ax.axvline(1e3 * (t - za), color="black", linewidth=0.8, linestyle="--")
            ax_zoom.annotate(str(i), (1e3 * (t - za), 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                             textcoords="offset points", fontsize="x-small", ha="center", va="bottom")  # fmt: skip
    ax_zoom.set_yticks(range(len(lanes)), lanes, fontsize="small")
    ax_zoom.set_ylim(len(lanes) - 0.5, -0.5)
    ax_zoom.set_xlim(1e3 * (lo_t - za), 1e3 * (hi_t - za))
    ax_zoom.set_title(run.zoom_title, fontsize="medium", loc="left", pad=14)
    order = list(_KIND_COLOURS)
    kinds_seen.sort(key=lambda k: order.index(k) if k in order else len(order))
    handles = [Patch(color=_KIND_COLOURS.get(k, _OTHER_KIND), label=k) for k in kinds_seen]
    handles += [
        Patch(color=_COLOURS["data_stall"], label=_LABELS["data_stall"]),
        Patch(color=_COLOURS["other_idle"], label=_LABELS["other_idle"]),
    ]
    if len(run.shown) == 1:
        handles.append(Patch(color="#999999", label="host waits for the GPU"))
    ax_zoom.legend(handles=handles, **{**_LEGEND_KW, "ncols": 2 if len(handles) > 5 else 1})
    ax_zoom.tick_params(labelbottom=False)


def _zoom_lanes(
    run: _Run, ax_zoom: Any, d: int, lanes: list[str], kinds_seen: list[str], window: tuple[float, float]
) -> None:
    """One GPU's lanes of the zoom: its work, its idle gaps, and (one GPU only) the host's waits."""
    assert run.zoom is not None
    za = run.zoom[0]
    lo_t, hi_t = window
    tag = f"GPU {d} " if len(run.shown) > 1 else "GPU "
    y_work, y_idle = len(lanes), len(lanes) + 1
    lanes += [f"{tag}work", f"{tag}idle"]
    for s in run.records.spans:
        if s.device != d or s.end < lo_t or s.start > hi_t:
            continue
        if s.kind not in kinds_seen:
            kinds_seen.append(s.kind)
        ax_zoom.broken_barh([(1e3 * (s.start - za), 1e3 * max(s.end - s.start, 0.0))], (y_work - 0.4, 0.8),
                            facecolors=_KIND_COLOURS.get(s.kind, _OTHER_KIND), linewidth=0)  # fmt: skip
    for start, end, cat, _ in run.timelines[d].segments:
        if cat == "busy" or end < lo_t or start > hi_t:
            continue
        ax_zoom.broken_barh([(1e3 * (start - za), 1e3 * (end - start))], (y_idle - 0.4, 0.8),
                            facecolors=_COLOURS[cat], linewidth=0)  # fmt: skip
    if len(run.shown) == 1:
        y_host = len(lanes)
        lanes.append("host waits")
        for w in run.records.waits:
            if w.device == d and w.end >= lo_t and w.start <= hi_t:
                ax_zoom.broken_barh([(1e3 * (w.start - za), 1e3 * max(0.0, w.end - w.start))], (y_host - 0.3, 0.6),
                                    facecolors="#999999", linewidth=0)  # fmt: skip


def _draw_zoom_memory(run: _Run, ax_zmem: Any) -> None:
    """Panel 3, below: memory in the zoom window."""
    assert run.zoom is not None
    za, zb = run.zoom
    pad = 0.03 * (zb - za)
    lo_t, hi_t = za - pad, zb + pad
    for d in run.shown:
        ts, alloc, _reserved, _ = _memory_series(run.records, d, run.timelines[d].start, run.timelines[d].end)
        if not ts:
            continue
        i0 = max(0, bisect.bisect_right(ts, lo_t) - 1)
        i1 = bisect.bisect_right(ts, hi_t)
        xs = [lo_t] + ts[i0 + 1 : i1] + [hi_t]
        ys = [alloc[i0]] + alloc[i0 + 1 : i1] + [alloc[i1 - 1] if i1 > 0 else alloc[0]]
        ax_zmem.step([1e3 * (x - za) for x in xs], [y / 2**30 for y in ys], where="post", color=run.colour(d),
                     linewidth=1.2, label=(f"GPU {d} " if len(run.shown) > 1 else "") + "allocated")  # fmt: skip
    ax_zmem.set_ylim(bottom=0)
    ax_zmem.set_ylabel("GiB", fontsize="small")
    ax_zmem.set_xlabel(f"ms from {za - run.t0:.3f} s (the start of the zoomed window)", fontsize="small")
    if ax_zmem.lines:
        ax_zmem.legend(**_LEGEND_KW)


def _draw_iterations(run: _Run, ax_iter: Any) -> None:
    """Panel 4: each iteration's busy / data stall / other idle (grouped on long runs)."""
    from matplotlib.ticker import MaxNLocator

    from gpemu.observe import CATEGORIES, iteration_breakdown

    shown = run.shown
    width = 0.8 / max(len(shown), 1)
    drawn = False
    note = ""
    for j, d in enumerate(shown):
        rows = iteration_breakdown(run.timelines[d], run.marks[d]) if run.timelines[d].start is not None else []
        if len(rows) >= 2:
            note = f"iteration 0 (start-up, {1e3 * rows[0]['duration_s']:.0f} ms) not drawn"
            rows = rows[1:]
        if not rows:
            continue
        group = _nice_step(len(rows), _MAX_BARS)
        xs: list[float] = []
        vals: dict[str, list[float]] = {c: [] for c in CATEGORIES}
        for g in range(0, len(rows), group):
            chunk = rows[g : g + group]
            xs.append(chunk[0]["index"] + (len(chunk) - 1) / 2 + (j - (len(shown) - 1) / 2) * width * group)
            for c in CATEGORIES:
                vals[c].append(1e3 * sum(r[f"{c}_s"] for r in chunk) / len(chunk))
        bottom = [0.0] * len(xs)
        for c in CATEGORIES:
            ax_iter.bar(xs, vals[c], width=width * group, bottom=bottom, color=_COLOURS[c],
                        label=_LABELS[c] if not drawn else None, linewidth=0)  # fmt: skip
            bottom = [b + v for b, v in zip(bottom, vals[c], strict=False)]
        if group > 1:
            note += (", " if note else "") + f"each bar: mean of {group} iterations"
        drawn = True
    ax_iter.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_iter.set_xlabel("iteration" + (" (bars per GPU, left to right)" if len(shown) > 1 else ""), fontsize="small")
    ax_iter.set_ylabel("ms", fontsize="small")
    ax_iter.set_title(
        "Where each iteration's time went"
        + (f" ({note})" if note else "")
        + ("" if drawn else ": no iterations recorded"),
        fontsize="medium",
        loc="left",
    )
    if drawn:
        ax_iter.legend(**_LEGEND_KW)


def _save(fig: Any, path: Path) -> None:
    """Save through a temporary file beside ``path`` (same suffix: it picks the format): a figure
    that cannot be written leaves neither a 0-byte file nor a temporary one."""
    import contextlib
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            from gpemu.cli import UserError

            raise UserError(f"cannot write the figure to {path}: {exc.strerror or exc}") from None
        raise
