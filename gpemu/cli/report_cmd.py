"""``gpemu report``: the summary recomputed from a trace, and a figure for papers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

__all__ = ["report", "plot_timeline"]

# Colours of the timeline categories (colour-blind safe: Okabe-Ito).
_COLOURS = {"busy": "#0072B2", "data_stall": "#E69F00", "other_idle": "#999999"}
_LABELS = {"busy": "GPU busy", "data_stall": "data stall (host not ready)", "other_idle": "other idle"}


@click.command("report", short_help="Summarise or plot a trace written by `gpemu run --trace`.")
@click.argument("trace", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--plot", "plot_path", metavar="FILE", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw utilisation over time, stall per iteration and memory over time to FILE "
                   "(.png, .pdf or .svg).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (the --metrics format).")
@click.option("--bins", default=100, show_default=True, type=click.IntRange(1, 100000),
              help="Time bins of the utilisation-over-time panel.")
def report(trace: Path, plot_path: Path | None, as_json: bool, bins: int) -> None:
    """Recompute the per-GPU summary from TRACE (written by `gpemu run --trace TRACE`).

    \b
      gpemu report trace.json
      gpemu report trace.json --plot timeline.png
      gpemu report trace.json --json > metrics.json
    """
    from gpemu.observe import compute_summary, format_summary, json_safe
    from gpemu.trace import load_trace

    records = load_trace(trace)  # TraceError (a ValueError) -> one clear line
    summary = compute_summary(records)
    if plot_path is not None:
        suffix = plot_path.suffix.lower()
        if suffix not in (".png", ".pdf", ".svg"):
            raise click.BadParameter(f"the figure's file name must end in .png, .pdf or .svg, got {plot_path.name!r}",
                                     param_hint="--plot")
    if as_json:
        click.echo(json.dumps(json_safe(summary), indent=2))
    else:
        click.echo(format_summary(summary))
    if plot_path is not None:
        plot_timeline(records, summary, plot_path, bins=bins)
        click.echo(f"figure written to {plot_path}", err=True)


def plot_timeline(records: Any, summary: dict[str, Any], path: Path, bins: int = 100) -> Path:
    """Three panels: GPU utilisation over time (per GPU), per-iteration time split into busy /
    data stall / other idle (per GPU, side by side), memory allocated over time (per GPU)."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; never needs a display
    import matplotlib.pyplot as plt

    from gpemu.observe import CATEGORIES, Timeline, iteration_breakdown

    t0 = records.started_at
    n = records.num_devices
    fig, axes = plt.subplots(3, 1, figsize=(8, 8.5), constrained_layout=True)
    ax_util, ax_iter, ax_mem = axes
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    # 1. utilisation over time
    timelines = [Timeline([s for s in records.spans if s.device == d]) for d in range(n)]
    for d, tl in enumerate(timelines):
        if tl.start is None:
            continue
        width = (tl.end - tl.start) / bins
        xs, ys = [], []
        for i in range(bins):
            a = tl.start + i * width
            parts = tl.between(a, a + width)
            xs.append(a + width / 2 - t0)
            ys.append(100 * parts["busy"] / width if width > 0 else 0.0)
        colour = colours[d % len(colours)]
        ax_util.step(xs, ys, where="mid", color=colour,
                     label=f"GPU {d} (AU {100 * summary['devices'][d]['au']:.0f}%)")
        ax_util.fill_between(xs, ys, step="mid", color=colour, alpha=0.25 if n > 1 else 0.5, linewidth=0)
    ax_util.set_ylim(0, 105)
    ax_util.set_xlabel("time since start (s)")
    ax_util.set_ylabel("GPU utilisation (%)")
    ax_util.set_title("Emulated GPU utilisation over time")
    if any(tl.start is not None for tl in timelines):
        ax_util.legend(loc="lower right", fontsize="small")

    # 2. per-iteration breakdown: stacked bars, one group per GPU
    width = 0.8 / max(n, 1)
    drawn = skipped_first = False
    for d, tl in enumerate(timelines):
        marks = sorted(m.time for m in records.iterations if m.device == d)
        rows = iteration_breakdown(tl, marks)
        if len(rows) >= 2:
            # Iteration 0 also holds start-up (model move, DataLoader start, first batch); it would
            # dwarf the steady-state bars.
            rows = rows[1:]
            skipped_first = True
        if not rows:
            continue
        xs = [r["index"] + (d - (n - 1) / 2) * width for r in rows]
        bottom = [0.0] * len(rows)
        for c in CATEGORIES:
            vals = [1e3 * r[f"{c}_s"] for r in rows]
            ax_iter.bar(xs, vals, width=width, bottom=bottom, color=_COLOURS[c],
                        label=_LABELS[c] if not drawn else None, edgecolor="none")
            bottom = [b + v for b, v in zip(bottom, vals)]
        drawn = True
    ax_iter.set_xlabel("iteration" + (" (bars per GPU, left to right)" if n > 1 else ""))
    ax_iter.set_ylabel("time (ms)")
    ax_iter.set_title("Where each iteration's time went"
                      + (" (iteration 0, with start-up, left out)" if skipped_first else "")
                      + ("" if drawn else " (no iterations recorded)"))
    if drawn:
        ax_iter.set_ylim(top=ax_iter.get_ylim()[1] * 1.3)  # room for the legend above the bars
        ax_iter.legend(loc="upper right", fontsize="small", ncols=3)

    # 3. memory over time
    for d in range(n):
        samples = sorted((m for m in records.memory if m.device == d), key=lambda m: m.time)
        if not samples:
            continue
        ax_mem.step([m.time - t0 for m in samples], [m.allocated / 2**30 for m in samples], where="post",
                    color=colours[d % len(colours)], label=f"GPU {d} allocated")
        ax_mem.step([m.time - t0 for m in samples], [m.reserved / 2**30 for m in samples], where="post",
                    color=colours[d % len(colours)], linestyle="--", alpha=0.6, label=f"GPU {d} reserved")
    if any(tl.start is not None for tl in timelines):
        ax_mem.set_xlim(ax_util.get_xlim())  # same time axis as the utilisation panel
    ax_mem.set_xlabel("time since start (s)")
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_ylabel("GPU memory (GiB)")
    ax_mem.set_title("Emulated GPU memory")
    if records.memory:
        ax_mem.legend(loc="lower right", fontsize="small")
    fig.suptitle(f"gpemu: {', '.join(sorted(set(records.gpus)))} x{n}", fontsize="medium")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
