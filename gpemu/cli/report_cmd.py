"""``gpemu report``: the summary recomputed from a trace, two traces side by side, and a figure.

The figure (:func:`plot_timeline`) is made to be read at a glance for a 30-iteration run and a
2,000-iteration run alike:

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

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

__all__ = ["report", "plot_timeline", "compare_rows", "print_comparison"]

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


@click.command("report", short_help="Summarise, compare or plot traces written by `gpemu run --trace`.")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--compare",
    "other",
    metavar="TRACE_B",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Compare TRACE with TRACE_B side by side (e.g. a baseline and a data-loader change).",
)
@click.option(
    "--plot",
    "plot_path",
    metavar="FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also draw a figure to FILE (.png, .pdf or .svg): utilisation and data stalls over the "
    "run, memory, a zoom on the steady state, and each iteration's time.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (the --metrics format).")
@click.option(
    "--bins",
    default=100,
    show_default=True,
    type=click.IntRange(1, 100000),
    help="Time bins of the whole-run panels of the figure.",
)
def report(trace: Path, other: Path | None, plot_path: Path | None, as_json: bool, bins: int) -> None:
    """Summarise TRACE (written by `gpemu run --trace TRACE`), compare it with another, or plot it.

    \b
      gpemu report trace.json                             the run's summary
      gpemu report trace.json --plot timeline.png         ... and a figure
      gpemu report base.json --compare workers2.json      two runs side by side
      gpemu report trace.json --json > metrics.json       the summary as JSON
    """
    from gpemu.observe import compute_summary, format_summary, json_safe
    from gpemu.trace_reader import load_trace

    if plot_path is not None and plot_path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise click.BadParameter(
            f"the figure's file name must end in .png, .pdf or .svg, got {plot_path.name!r}", param_hint="--plot"
        )
    if plot_path is not None:
        from gpemu.run_outputs import unwritable_reason

        reason = unwritable_reason(plot_path)
        if reason is not None:
            raise click.BadParameter(f"cannot write the figure to {plot_path} ({reason})", param_hint="--plot")
    records = load_trace(trace)  # TraceError (a ValueError) -> one clear line
    summary = compute_summary(records)
    if other is not None:
        summary_b = compute_summary(load_trace(other))
        if as_json:
            click.echo(json.dumps({"a": json_safe(summary), "b": json_safe(summary_b)}, indent=2))
        else:
            print_comparison(summary, summary_b, str(trace), str(other))
    elif as_json:
        click.echo(json.dumps(json_safe(summary), indent=2))
    else:
        click.echo(format_summary(summary))
    if plot_path is not None:
        plot_timeline(records, summary, plot_path, bins=bins)
        click.echo(f"figure written to {plot_path}", err=True)


# ---------------------------------------------------------------------------------------------
# two runs side by side
# ---------------------------------------------------------------------------------------------
def _per_iteration(dev: dict[str, Any], win: dict[str, Any] | None, key: str, kind: str | None = None) -> float | None:
    """A window's seconds per iteration (steady state: the iterations after the first; whole run:
    all of them). ``kind`` picks one entry of a by-kind dict such as ``busy_by_kind_s``."""
    if win is None:
        return None
    n = dev["iterations"] - 1 if dev["steady"] is win else dev["iterations"]
    value = win[key] if kind is None else win[key].get(kind, 0.0)
    return value / n if n > 0 else None


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Rows ``(what, a, b, change)`` comparing two summaries, GPU by GPU. Times are per iteration
    of the steady state (whole run when a run has no steady state), so runs of different lengths
    compare; the change is relative for times and sizes, in percentage points for shares."""
    from gpemu.observe import WINDOW_NAMES
    from gpemu.observe import format_seconds as _secs
    from gpemu.observe import format_size as _bytes

    def rel(x: float | None, y: float | None) -> str:
        if x is None or y is None:
            return ""
        tiny = 5e-6  # below what the table shows (0.00 ms): rounding noise, not a change
        if abs(x) < tiny:
            return "" if abs(y) < tiny else "from 0"
        change = 100 * (y - x) / x
        return f"{change if abs(change) >= 0.05 else 0.0:+.1f}%"  # no "-0.0%" from float noise

    def pp(x: float | None, y: float | None) -> str:
        return "" if x is None or y is None else f"{100 * (y - x):+.1f} pp"

    def fmt_s(x: float | None) -> str:
        return "-" if x is None else _secs(x)

    def fmt_p(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    rows: list[tuple[str, str, str, str]] = []
    rows.append(("GPUs", ", ".join(a["gpus"]), ", ".join(b["gpus"]), ""))
    rows.append(("iterations", str(a["iterations"]), str(b["iterations"]), ""))
    rows.append(("run (since patch)", _secs(a["run_s"]), _secs(b["run_s"]), rel(a["run_s"], b["run_s"])))
    for d in range(min(a["num_gpus"], b["num_gpus"])):
        da, db = a["devices"][d], b["devices"][d]
        wa, wb = da["steady"] or da["whole"], db["steady"] or db["whole"]
        if wa is None and wb is None:
            continue
        names = {WINDOW_NAMES.get(x["au_window"] or "", "-") for x in (da, db)}
        prefix = f"GPU {d} " if a["num_gpus"] > 1 or b["num_gpus"] > 1 else ""
        rows.append(
            (
                f"{prefix}window".strip(),
                WINDOW_NAMES.get(da["au_window"] or "", "-"),
                WINDOW_NAMES.get(db["au_window"] or "", "-"),
                "" if len(names) == 1 else "differs",
            )
        )
        ita, itb = da["iteration_time"], db["iteration_time"]
        for label, key in (("iteration time, mean", "mean_s"), ("iteration time, median", "median_s")):
            x = ita[key] if ita else None
            y = itb[key] if itb else None
            rows.append((prefix + label, fmt_s(x), fmt_s(y), rel(x, y)))
        for label, key in (
            ("GPU busy / iteration", "busy_s"),
            ("data stall / iteration", "data_stall_s"),
            ("other idle / iteration", "other_idle_s"),
        ):
            x, y = _per_iteration(da, wa, key), _per_iteration(db, wb, key)
            rows.append((prefix + label, fmt_s(x), fmt_s(y), rel(x, y)))
        x, y = (da["au"] if wa else None), (db["au"] if wb else None)
        rows.append((prefix + "accelerator utilisation (AU)", fmt_p(x), fmt_p(y), pp(x, y)))
        x, y = (wa["data_stall_share"] if wa else None), (wb["data_stall_share"] if wb else None)
        rows.append((prefix + "data stall share", fmt_p(x), fmt_p(y), pp(x, y)))
        kinds: list[str] = []
        for w in (wa, wb):
            for k in (w or {}).get("busy_by_kind_s", {}):
                if k not in kinds:
                    kinds.append(k)
        for k in kinds:
            x = _per_iteration(da, wa, "busy_by_kind_s", k)
            y = _per_iteration(db, wb, "busy_by_kind_s", k)
            rows.append((prefix + f"  {k} / iteration", fmt_s(x), fmt_s(y), rel(x, y)))
        ha, hb = da["host_waits"], db["host_waits"]
        x = ha["total_s"] / da["iterations"] if da["iterations"] else None
        y = hb["total_s"] / db["iterations"] if db["iterations"] else None
        rows.append((prefix + "host waited for GPU / iteration (whole run)", fmt_s(x), fmt_s(y), rel(x, y)))
        ma, mb = da["memory"], db["memory"]
        rows.append(
            (
                prefix + "peak memory allocated",
                _bytes(ma["peak_allocated_bytes"]),
                _bytes(mb["peak_allocated_bytes"]),
                rel(ma["peak_allocated_bytes"], mb["peak_allocated_bytes"]),
            )
        )
        rows.append(
            (
                prefix + "persistent memory",
                _bytes(ma["persistent_bytes"]),
                _bytes(mb["persistent_bytes"]),
                rel(ma["persistent_bytes"], mb["persistent_bytes"]),
            )
        )
    ta, tb = a["transfers"], b["transfers"]
    rows.append(
        (
            "host->GPU bytes (whole run)",
            _bytes(ta["h2d_bytes"]),
            _bytes(tb["h2d_bytes"]),
            rel(ta["h2d_bytes"], tb["h2d_bytes"]),
        )
    )
    rows.append(
        (
            "host->GPU pinned bytes",
            _bytes(ta["h2d_pinned_bytes"]),
            _bytes(tb["h2d_pinned_bytes"]),
            rel(ta["h2d_pinned_bytes"], tb["h2d_pinned_bytes"]),
        )
    )
    return rows


def print_comparison(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str) -> None:
    """Print :func:`compare_rows` as a rich table (stdout)."""
    from rich.table import Table

    from gpemu.cli import console

    table = Table(
        title=f"A: {name_a}   vs   B: {name_b}",
        title_justify="left",
        show_edge=False,
        caption="per iteration: steady state (iterations after the first); change: B vs A "
        "(relative; shares in percentage points)",
        caption_justify="left",
    )
    table.add_column("", no_wrap=True)
    table.add_column("A", justify="right", no_wrap=True)
    table.add_column("B", justify="right", no_wrap=True)
    table.add_column("change", justify="right", no_wrap=True)
    for what, x, y, change in compare_rows(a, b):
        style = None
        if change.startswith("-") and ("stall" in what or "idle" in what or "iteration time" in what):
            style = "green"
        elif change.startswith("+") and ("stall" in what or "idle" in what or "iteration time" in what):
            style = "red"
        table.add_row(what, x, y, f"[{style}]{change}[/{style}]" if style and change else change)
    console.print(table)


# ---------------------------------------------------------------------------------------------
# the figure
# ---------------------------------------------------------------------------------------------
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


def plot_timeline(records: Any, summary: dict[str, Any], path: Path, bins: int = 100) -> Path:
    """Draw the run in ``records`` to ``path`` (see the module docstring for the panels)."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from gpemu.observe import CATEGORIES, Timeline, iteration_breakdown

    t0 = records.started_at
    n = records.num_devices
    timelines = [Timeline([s for s in records.spans if s.device == d]) for d in range(n)]
    marks = [sorted(m.time for m in records.iterations if m.device == d) for d in range(n)]
    active = [d for d in range(n) if timelines[d].start is not None]
    shown = active[:_MAX_GPU_ROWS] or [0]
    ref = next((d for d in active if len(marks[d]) >= 2), active[0] if active else None)

    # Zoom window: a few iterations from the middle of the steady state.
    zoom: tuple[float, float] | None = None
    zoom_title = ""
    if ref is not None:
        m = marks[ref]
        if len(m) >= 2:
            k = min(_ZOOM_ITERATIONS, len(m) - 1)
            i0 = _typical_window(m, k)
            zoom = (m[i0], m[i0 + k])
            durations = sorted(y - x for x, y in zip(m, m[1:], strict=False))
            zoom_title = (
                f"Zoom on the steady state: iterations {i0 + 1}-{i0 + k} of {len(m)} (GPU {ref}), "
                f"{1e3 * (zoom[1] - zoom[0]) / k:.1f} ms per iteration "
                f"(median of the run {1e3 * durations[len(durations) // 2]:.1f} ms); "
                "dashed: iteration ends"
            )
        else:
            tl = timelines[ref]
            zoom = (max(tl.start, tl.end - min(1.0, (tl.end - tl.start))), tl.end)
            zoom_title = "Zoom on the end of the run (no steady state: fewer than 2 iterations)"

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
    legend_kw = {
        "loc": "upper left",
        "bbox_to_anchor": (1.005, 1.0),
        "fontsize": "small",
        "frameon": False,
        "borderaxespad": 0.0,
    }

    # 1. whole run, per GPU: busy / data stall / other idle per time bin, stacked to 100%
    for row, d in enumerate(shown):
        ax = ax_states[row]
        tl = timelines[d]
        dev = summary["devices"][d]
        if tl.start is None:
            ax.text(0.5, 0.5, "no GPU work recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
            continue
        width = (tl.end - tl.start) / bins
        xs, shares = [], {c: [] for c in CATEGORIES}
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
        dm = marks[d]
        if dm:
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
        if zoom is not None:
            ax.axvspan(
                zoom[0] - t0, zoom[1] - t0, facecolor="none", edgecolor="black", linewidth=1.2, label="zoomed below"
            )
        if row == 0:
            ax.legend(**legend_kw)
        if row < len(shown) - 1:
            ax.tick_params(labelbottom=False)
    if len(active) > len(shown):
        ax_states[-1].set_xlabel(f"(GPUs {', '.join(map(str, active[len(shown) :]))} not drawn)", fontsize="small")

    # 2. memory over the whole run, from the model copy
    cap = max((int(ms.get("capacity", 0)) for ms in records.memory_stats), default=0)
    drew_mem = False
    for d in shown:
        tl = timelines[d]
        ts, alloc, reserved, from_copy = _memory_series(records, d, tl.start, tl.end)
        if not ts:
            continue
        colour = _KIND_COLOURS["forward"] if len(shown) == 1 else f"C{d % 10}"
        label = f"GPU {d} " if len(shown) > 1 else ""
        gib = float(1 << 30)
        if len(ts) > 400 and tl.start is not None:
            nb = min(300, max(50, bins * 2))
            xs, lo, hi = _envelope(ts, alloc, ts[0], ts[-1], nb)
            ax_mem.fill_between(xs - t0, lo / gib, hi / gib, step="mid", color=colour, alpha=0.25, linewidth=0)
            ax_mem.step(
                xs - t0, hi / gib, where="mid", color=colour, linewidth=1, label=f"{label}allocated, peak in each bin"
            )
            ax_mem.step(
                xs - t0,
                lo / gib,
                where="mid",
                color=colour,
                linewidth=1,
                linestyle=":",
                label=f"{label}allocated, least in each bin",
            )
            _, _, rhi = _envelope(ts, reserved, ts[0], ts[-1], nb)
            ax_mem.step(
                xs - t0, rhi / gib, where="mid", color="#666666", linewidth=1, linestyle="--", label=f"{label}reserved"
            )
        else:
            ax_mem.step(
                [t - t0 for t in ts],
                [v / gib for v in alloc],
                where="post",
                color=colour,
                linewidth=1,
                label=f"{label}allocated",
            )
            ax_mem.step(
                [t - t0 for t in ts],
                [v / gib for v in reserved],
                where="post",
                color="#666666",
                linewidth=1,
                linestyle="--",
                label=f"{label}reserved",
            )
        if from_copy:
            ax_mem.axvline(ts[1] - t0, color="#999999", linewidth=0.8, linestyle=":")
            ax_mem.annotate(
                "model copied",
                (ts[1] - t0, max(alloc[1], 1) / gib),
                xytext=(4, 6),
                textcoords="offset points",
                fontsize="x-small",
                color="#555555",
            )
        drew_mem = True
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_ylabel("GiB", fontsize="small")
    ax_mem.set_xlabel("time since start (s)", fontsize="small")
    ax_mem.set_title(
        "Emulated GPU memory over the whole run" + (f" (capacity {cap / 2**30:.0f} GiB)" if cap else ""),
        fontsize="medium",
        loc="left",
    )
    if zoom is not None:
        ax_mem.axvspan(zoom[0] - t0, zoom[1] - t0, facecolor="none", edgecolor="black", linewidth=1.2)
    if drew_mem:
        ax_mem.legend(**legend_kw)
    else:
        ax_mem.text(0.5, 0.5, "no memory samples", ha="center", va="center", transform=ax_mem.transAxes)

    # 3. zoom: spans by kind, idle gaps, host waits, iteration boundaries; memory in the window
    if zoom is not None:
        za, zb = zoom
        pad = 0.03 * (zb - za)
        lo_t, hi_t = za - pad, zb + pad
        lanes: list[str] = []
        kinds_seen: list[str] = []
        for d in shown:
            tag = f"GPU {d} " if len(shown) > 1 else "GPU "
            y_work, y_idle = len(lanes), len(lanes) + 1
            lanes += [f"{tag}work", f"{tag}idle"]
            for s in records.spans:
                if s.device != d or s.end < lo_t or s.start > hi_t:
                    continue
                if s.kind not in kinds_seen:
                    kinds_seen.append(s.kind)
                ax_zoom.broken_barh(
                    [(1e3 * (s.start - za), 1e3 * max(s.end - s.start, 0.0))],
                    (y_work - 0.4, 0.8),
                    facecolors=_KIND_COLOURS.get(s.kind, _OTHER_KIND),
                    linewidth=0,
                )
            for start, end, cat, _ in timelines[d].segments:
                if cat == "busy" or end < lo_t or start > hi_t:
                    continue
                ax_zoom.broken_barh(
                    [(1e3 * (start - za), 1e3 * (end - start))],
                    (y_idle - 0.4, 0.8),
                    facecolors=_COLOURS[cat],
                    linewidth=0,
                )
            if len(shown) == 1:
                y_host = len(lanes)
                lanes.append("host waits")
                for w in records.waits:
                    if w.device == d and w.end >= lo_t and w.start <= hi_t:
                        ax_zoom.broken_barh(
                            [(1e3 * (w.start - za), 1e3 * max(0.0, w.end - w.start))],
                            (y_host - 0.3, 0.6),
                            facecolors="#999999",
                            linewidth=0,
                        )
        for i, t in enumerate(marks[ref] if ref is not None else []):
            if lo_t <= t <= hi_t:
                for ax in (ax_zoom, ax_zmem):
                    ax.axvline(1e3 * (t - za), color="black", linewidth=0.8, linestyle="--")
                ax_zoom.annotate(
                    str(i),
                    (1e3 * (t - za), 1.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(0, 2),
                    textcoords="offset points",
                    fontsize="x-small",
                    ha="center",
                    va="bottom",
                )
        ax_zoom.set_yticks(range(len(lanes)), lanes, fontsize="small")
        ax_zoom.set_ylim(len(lanes) - 0.5, -0.5)
        ax_zoom.set_xlim(1e3 * (lo_t - za), 1e3 * (hi_t - za))
        ax_zoom.set_title(zoom_title, fontsize="medium", loc="left", pad=14)
        order = list(_KIND_COLOURS)
        kinds_seen.sort(key=lambda k: order.index(k) if k in order else len(order))
        handles = [Patch(color=_KIND_COLOURS.get(k, _OTHER_KIND), label=k) for k in kinds_seen]
        handles += [
            Patch(color=_COLOURS["data_stall"], label=_LABELS["data_stall"]),
            Patch(color=_COLOURS["other_idle"], label=_LABELS["other_idle"]),
        ]
        if len(shown) == 1:
            handles.append(Patch(color="#999999", label="host waits for the GPU"))
        ax_zoom.legend(handles=handles, **{**legend_kw, "ncols": 2 if len(handles) > 5 else 1})
        ax_zoom.tick_params(labelbottom=False)
        for d in shown:
            ts, alloc, reserved, _ = _memory_series(records, d, timelines[d].start, timelines[d].end)
            if not ts:
                continue
            import bisect

            i0 = max(0, bisect.bisect_right(ts, lo_t) - 1)
            i1 = bisect.bisect_right(ts, hi_t)
            xs = [lo_t] + ts[i0 + 1 : i1] + [hi_t]
            ys = [alloc[i0]] + alloc[i0 + 1 : i1] + [alloc[i1 - 1] if i1 > 0 else alloc[0]]
            colour = _KIND_COLOURS["forward"] if len(shown) == 1 else f"C{d % 10}"
            ax_zmem.step(
                [1e3 * (x - za) for x in xs],
                [y / 2**30 for y in ys],
                where="post",
                color=colour,
                linewidth=1.2,
                label=(f"GPU {d} " if len(shown) > 1 else "") + "allocated",
            )
        ax_zmem.set_ylim(bottom=0)
        ax_zmem.set_ylabel("GiB", fontsize="small")
        ax_zmem.set_xlabel(f"ms from {za - t0:.3f} s (the start of the zoomed window)", fontsize="small")
        if ax_zmem.lines:
            ax_zmem.legend(**legend_kw)
    else:
        for ax in (ax_zoom, ax_zmem):
            ax.text(0.5, 0.5, "no GPU work recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])

    # 4. per-iteration breakdown (grouped on long runs)
    width = 0.8 / max(len(shown), 1)
    drawn = False
    note = ""
    for j, d in enumerate(shown):
        rows = iteration_breakdown(timelines[d], marks[d]) if timelines[d].start is not None else []
        if len(rows) >= 2:
            note = f"iteration 0 (start-up, {1e3 * rows[0]['duration_s']:.0f} ms) not drawn"
            rows = rows[1:]
        if not rows:
            continue
        group = _nice_step(len(rows), _MAX_BARS)
        xs, vals = [], {c: [] for c in CATEGORIES}
        for g in range(0, len(rows), group):
            chunk = rows[g : g + group]
            xs.append(chunk[0]["index"] + (len(chunk) - 1) / 2 + (j - (len(shown) - 1) / 2) * width * group)
            for c in CATEGORIES:
                vals[c].append(1e3 * sum(r[f"{c}_s"] for r in chunk) / len(chunk))
        bottom = [0.0] * len(xs)
        for c in CATEGORIES:
            ax_iter.bar(
                xs,
                vals[c],
                width=width * group,
                bottom=bottom,
                color=_COLOURS[c],
                label=_LABELS[c] if not drawn else None,
                linewidth=0,
            )
            bottom = [b + v for b, v in zip(bottom, vals[c], strict=False)]
        if group > 1:
            note += (", " if note else "") + f"each bar: mean of {group} iterations"
        drawn = True
    from matplotlib.ticker import MaxNLocator

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
        ax_iter.legend(**legend_kw)

    fig.suptitle(
        f"gpemu: {', '.join(sorted(set(records.gpus)))} x{n}, {summary['iterations']} iteration(s)"
        + (f"  ({records.config})" if records.config else ""),
        fontsize="medium",
    )
    try:
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


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
