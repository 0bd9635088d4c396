"""``gpemu report``: the summary recomputed from a trace, two traces side by side, and a figure
(drawn by :mod:`.report_plot`, which describes its panels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

__all__ = ["report", "compare_rows", "print_comparison"]


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
        from .report_plot import plot_timeline

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


def _rel(x: float | None, y: float | None) -> str:
    """Relative change of y against x ("" when either is missing)."""
    if x is None or y is None:
        return ""
    tiny = 5e-6  # below what the table shows (0.00 ms): rounding noise, not a change
    if abs(x) < tiny:
        return "" if abs(y) < tiny else "from 0"
    change = 100 * (y - x) / x
    return f"{change if abs(change) >= 0.05 else 0.0:+.1f}%"  # no "-0.0%" from float noise


def _pp(x: float | None, y: float | None) -> str:
    return "" if x is None or y is None else f"{100 * (y - x):+.1f} pp"


def _fmt_s(x: float | None) -> str:
    from gpemu.observe import format_seconds

    return "-" if x is None else format_seconds(x)


def _fmt_p(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


Row = tuple[str, str, str, str]  # (what, A, B, change)


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[Row]:
    """Rows ``(what, a, b, change)`` comparing two summaries, GPU by GPU. Times are per iteration
    of the steady state (whole run when a run has no steady state), so runs of different lengths
    compare; the change is relative for times and sizes, in percentage points for shares."""
    from gpemu.observe import format_size

    rows: list[Row] = [
        ("GPUs", ", ".join(a["gpus"]), ", ".join(b["gpus"]), ""),
        ("iterations", str(a["iterations"]), str(b["iterations"]), ""),
        ("run (since patch)", _fmt_s(a["run_s"]), _fmt_s(b["run_s"]), _rel(a["run_s"], b["run_s"])),
    ]
    prefix_all = a["num_gpus"] > 1 or b["num_gpus"] > 1
    for d in range(min(a["num_gpus"], b["num_gpus"])):
        rows += _device_rows(a["devices"][d], b["devices"][d], f"GPU {d} " if prefix_all else "")
    ta, tb = a["transfers"], b["transfers"]
    for label, key in (("host->GPU bytes (whole run)", "h2d_bytes"), ("host->GPU pinned bytes", "h2d_pinned_bytes")):
        rows.append((label, format_size(ta[key]), format_size(tb[key]), _rel(ta[key], tb[key])))
    return rows


def _device_rows(da: dict[str, Any], db: dict[str, Any], prefix: str) -> list[Row]:
    """One GPU's rows: window, iteration time, busy / stall / idle per iteration, shares, kinds,
    host waits, memory."""
    from gpemu.observe import WINDOW_NAMES, format_size

    wa, wb = da["steady"] or da["whole"], db["steady"] or db["whole"]
    if wa is None and wb is None:
        return []
    names = {WINDOW_NAMES.get(x["au_window"] or "", "-") for x in (da, db)}
    rows: list[Row] = [
        (
            f"{prefix}window".strip(),
            WINDOW_NAMES.get(da["au_window"] or "", "-"),
            WINDOW_NAMES.get(db["au_window"] or "", "-"),
            "" if len(names) == 1 else "differs",
        )
    ]
    ita, itb = da["iteration_time"], db["iteration_time"]
    for label, key in (("iteration time, mean", "mean_s"), ("iteration time, median", "median_s")):
        x = ita[key] if ita else None
        y = itb[key] if itb else None
        rows.append((prefix + label, _fmt_s(x), _fmt_s(y), _rel(x, y)))
    for label, key in (
        ("GPU busy / iteration", "busy_s"),
        ("data stall / iteration", "data_stall_s"),
        ("other idle / iteration", "other_idle_s"),
    ):
        x, y = _per_iteration(da, wa, key), _per_iteration(db, wb, key)
        rows.append((prefix + label, _fmt_s(x), _fmt_s(y), _rel(x, y)))
    x, y = (da["au"] if wa else None), (db["au"] if wb else None)
    rows.append((prefix + "accelerator utilisation (AU)", _fmt_p(x), _fmt_p(y), _pp(x, y)))
    x, y = (wa["data_stall_share"] if wa else None), (wb["data_stall_share"] if wb else None)
    rows.append((prefix + "data stall share", _fmt_p(x), _fmt_p(y), _pp(x, y)))
    kinds: list[str] = []
    for w in (wa, wb):
        kinds += [k for k in (w or {}).get("busy_by_kind_s", {}) if k not in kinds]
    for k in kinds:
        x, y = _per_iteration(da, wa, "busy_by_kind_s", k), _per_iteration(db, wb, "busy_by_kind_s", k)
        rows.append((prefix + f"  {k} / iteration", _fmt_s(x), _fmt_s(y), _rel(x, y)))
    ha, hb = da["host_waits"], db["host_waits"]
    x = ha["total_s"] / da["iterations"] if da["iterations"] else None
    y = hb["total_s"] / db["iterations"] if db["iterations"] else None
    rows.append((prefix + "host waited for GPU / iteration (whole run)", _fmt_s(x), _fmt_s(y), _rel(x, y)))
    ma, mb = da["memory"], db["memory"]
    for label, key in (("peak memory allocated", "peak_allocated_bytes"), ("persistent memory", "persistent_bytes")):
        rows.append((prefix + label, format_size(ma[key]), format_size(mb[key]), _rel(ma[key], mb[key])))
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
