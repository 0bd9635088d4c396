"""`gpemu gpus`, `gpemu models`, `gpemu show` and `gpemu db ...`: the profile database from the shell.

Every command takes ``--db URL`` (any SQLAlchemy URL); without it GPEMU_DB, then the per-user
default SQLite database (built from the shipped data on first use).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

import click

from gpemu.cli import UserError, console

__all__ = ["gpus", "models", "show", "db"]

_db_option = click.option(
    "--db", "db_url", metavar="URL", default=None,
    help="SQLAlchemy URL of the profile database (default: $GPEMU_DB, else the per-user SQLite file).",
)
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _config(db_url: str | None) -> Any:
    from gpemu.config import EmuConfig

    return EmuConfig.from_env(db_url=db_url)


def _open(db_url: str | None) -> Any:
    from gpemu.db import open_profile_db

    return open_profile_db(_config(db_url))


def _one_line_errors(command: Callable[..., None]) -> Callable[..., None]:
    """A database or file that fails mid-command is one line (no password), not a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            command(*args, **kwargs)
        except SQLAlchemyError as exc:
            from gpemu.db import db_location
            from gpemu.db.build import describe_error

            ctx = click.get_current_context()
            if (ctx.find_root().obj or {}).get("debug"):
                raise
            raise UserError(describe_error(db_location(_config(kwargs.get("db_url"))), exc)) from None
        except OSError as exc:
            if exc.filename is None:
                raise
            raise UserError(f"{exc.filename}: {exc.strerror}") from None

    return run


def _table(title: str, columns: list[tuple[str, str]]) -> Any:
    from rich import box
    from rich.table import Table

    # Compact box: the tables must stay readable at 80 columns (pipes, CI logs).
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for name, justify in columns:
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    return t


def _g(x: float, scale: float, digits: int = 3) -> str:
    return f"{x / scale:.{digits}g}"


def format_value(value: float, unit: str) -> str:
    """Human-readable value: seconds to 4 significant digits, bytes in MiB/GiB."""
    if unit == "seconds":
        return f"{value:.4g} s"
    if unit == "bytes":
        if value >= 1 << 30:
            return f"{value / (1 << 30):.3f} GiB"
        return f"{value / (1 << 20):.1f} MiB"
    return f"{value:g} {unit}"


@click.command("gpus")
@_db_option
@_json_option
@_one_line_errors
def gpus(db_url: str | None, as_json: bool) -> None:
    """List the GPUs the profile database knows, with their datasheet facts."""
    specs = _open(db_url).gpus()
    if as_json:
        from dataclasses import asdict

        click.echo(json.dumps([{**asdict(s), "aliases": list(s.aliases)} for s in specs], indent=2))
        return
    t = _table(f"{len(specs)} GPUs (FP32/FP16 TFLOP/s; mem, host pinned/pageable GB/s)",
               [("GPU", "left"), ("name", "left"), ("memory", "right"), ("FP32", "right"),
                ("FP16", "right"), ("mem", "right"), ("host", "right"), ("SMs", "right")])
    for s in specs:
        t.add_row(s.short_name, s.name, f"{s.memory_bytes / (1 << 30):.0f} GiB", _g(s.fp32_flops, 1e12),
                  _g(s.fp16_flops, 1e12), _g(s.memory_bandwidth, 1e9, 4),
                  f"{_g(s.host_link_bandwidth_pinned, 1e9)}/{_g(s.host_link_bandwidth_pageable, 1e9)}",
                  str(s.sm_count))
    console.print(t)
    if not specs:
        console.print("the database is empty: fill it with `gpemu db init` or `gpemu db import`")


@click.command("models")
@_db_option
@_json_option
@_one_line_errors
def models(db_url: str | None, as_json: bool) -> None:
    """List the models the profile database knows (class and parameter count identify them)."""
    infos = _open(db_url).models()
    if as_json:
        from dataclasses import asdict

        click.echo(json.dumps([asdict(m) for m in infos], indent=2))
        return
    t = _table(f"{len(infos)} models (GFLOP per sample)", [("model", "left"), ("class", "left"),
               ("parameters", "right"), ("fwd", "right"), ("fwd+bwd", "right")])
    for m in infos:
        t.add_row(m.name, m.class_name, f"{m.param_count:,}", _g(m.fwd_flops_per_sample, 1e9, 4),
                  _g(m.fwd_bwd_flops_per_sample, 1e9, 4))
    console.print(t)


@click.command("show")
@click.argument("model")
@click.option("--gpu", required=True, help="GPU name or alias, e.g. V100 (see `gpemu gpus`).")
@click.option("--batch-size", "-b", required=True, type=click.IntRange(min=1), help="Batch size (integer >= 1).")
@_db_option
@_json_option
@_one_line_errors
def show(model: str, gpu: str, batch_size: int, db_url: str | None, as_json: bool) -> None:
    """Show every measurement kind for MODEL on a GPU at a batch size, with its provenance
    (measured, interpolated between profiled batch sizes, or extrapolated beyond them)."""
    pdb = _open(db_url)
    spec, info = pdb.gpu(gpu), pdb.model(model)  # UnknownNameError -> one line with suggestions
    measured = pdb.measured(gpu, model)
    if not measured:
        raise UserError(f"no measurements for {info.name} on {spec.name} in {pdb}")
    # DDP iterations are per world size: one row each, labelled with it.
    results = [(k if w == 1 else f"{k}[world_size={w}]", pdb.lookup(gpu, model, batch_size, k, world_size=w))
               for k, w in measured]
    if as_json:
        click.echo(json.dumps({
            "model": info.name, "gpu": spec.name, "batch_size": batch_size,
            "measurements": {k: {"value": r.value, "unit": r.unit, "provenance": r.provenance} for k, r in results},
        }, indent=2))
        return
    t = _table(f"{info.name} on {spec.name} ({spec.short_name}), batch size {batch_size}",
               [("kind", "left"), ("value", "right"), ("unit", "left"), ("provenance", "left")])
    for k, r in results:
        style = {"measured": "green", "interpolated": "yellow", "extrapolated": "red"}[r.provenance]
        t.add_row(k, format_value(r.value, r.unit), r.unit, f"[{style}]{r.provenance}[/{style}]")
    console.print(t)


@click.group("db")
def db() -> None:
    """Manage the profile database: where it is, build it, export it, import into it."""


@db.command("path")
@_db_option
@_one_line_errors
def db_path(db_url: str | None) -> None:
    """Print the database URL in use (and whether the default file is built yet)."""
    from gpemu.db import db_location

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from gpemu.units import redact_url

    cfg = _config(db_url)
    url = db_location(cfg)
    try:
        make_url(url)
    except ArgumentError:
        raise UserError(f"--db {redact_url(url)!r} is not a SQLAlchemy URL; use e.g. sqlite:////path/to/profiles.sqlite "
                        "or postgresql+psycopg://user@host/db") from None
    click.echo(redact_url(url))
    if not cfg.db_url:
        from gpemu.db.build import default_db_path

        if not default_db_path(cfg.default_data_dir).exists():
            click.echo("(not built yet: it is built on first use, or now with `gpemu db init`)", err=True)


@db.command("init")
@click.option("--force", is_flag=True, help="Rebuild the default database even if it is current.")
@_db_option
@_one_line_errors
def db_init(force: bool, db_url: str | None) -> None:
    """Build the default database from the shipped data, or load the shipped data into --db URL."""
    cfg = _config(db_url)
    if cfg.db_url:
        from gpemu.db.build import load_shipped, open_url

        pdb = open_url(cfg.db_url)
        counts = load_shipped(pdb.engine)
        where = str(pdb)
    else:
        from gpemu.db.build import ensure_default_db, open_url, sqlite_url

        path = ensure_default_db(cfg.default_data_dir, force=force)
        pdb = open_url(sqlite_url(path))
        counts = {"gpus": len(pdb.gpus()), "models": len(pdb.models()), "measurements": pdb.count(),
                  "distributions": len(pdb.distributions())}
        where = str(path)
    click.echo(f"{where}: {counts['gpus']} GPUs, {counts['models']} models, "
               f"{counts['measurements']} measurements, {counts['distributions']} distributions")


@db.command("export")
@click.argument("path", type=click.Path(dir_okay=True, file_okay=True, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["json", "csv"]), default=None,
              help="json: one file; csv: a directory of CSV files (default: json if PATH ends in .json).")
@click.option("--gpu", "gpu_names", multiple=True, help="Only this GPU (repeatable).")
@click.option("--model", "model_names", multiple=True, help="Only this model (repeatable).")
@_db_option
@_one_line_errors
def db_export(path: Path, fmt: str | None, gpu_names: tuple[str, ...], model_names: tuple[str, ...],
              db_url: str | None) -> None:
    """Write the database (or part of it) to PATH as JSON or CSV."""
    from gpemu.db.io import export_db

    counts = export_db(_open(db_url), path, fmt, gpus=gpu_names or None, models=model_names or None)
    click.echo(f"exported {counts['gpus']} GPUs, {counts['models']} models, {counts['measurements']} "
               f"measurements, {counts['distributions']} distributions to {path}")


@db.command("import")
@click.argument("path", type=click.Path(exists=True, dir_okay=True, file_okay=True, path_type=Path))
@click.option("--show-rejected", default=20, show_default=True, help="How many rejected rows to list.")
@_db_option
@_one_line_errors
def db_import(path: Path, show_rejected: int, db_url: str | None) -> None:
    """Import a `gpemu db export` (JSON file or CSV directory) or a measurements CSV file.

    Valid rows are written (re-importing changes nothing); each rejected row is reported with
    its reason, and the exit status is 1 when any row was rejected.
    """
    from gpemu.db.io import import_path

    report = import_path(_open(db_url), path)
    click.echo(f"imported {report.gpus} GPUs, {report.models} models, {report.measurements} measurements, "
               f"{report.distributions} distributions from {path}")
    if report.rejected:
        click.echo(f"rejected {len(report.rejected)} rows:", err=True)
        for r in report.rejected[:show_rejected]:
            reason = r.reason if len(r.reason) <= 300 else r.reason[:300] + "..."
            click.echo(f"  {r.where}: {reason}", err=True)
        if len(report.rejected) > show_rejected:
            click.echo(f"  ... and {len(report.rejected) - show_rejected} more", err=True)
        raise click.exceptions.Exit(1)
