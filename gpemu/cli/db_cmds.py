"""`gpemu gpus`, `gpemu models`, `gpemu show` and `gpemu db ...`: the profile database from the shell.

Every command takes ``--db URL`` (any SQLAlchemy URL); without it GPEMU_DB, then the per-user
default SQLite database (built from the shipped data on first use).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from gpemu.cli import UserError, console

__all__ = ["gpus", "models", "show", "db"]

_db_option = click.option(
    "--db",
    "db_url",
    metavar="URL",
    default=None,
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


@click.group("gpus", invoke_without_command=True)
@_db_option
@_json_option
@click.pass_context
@_one_line_errors
def gpus(ctx: click.Context, db_url: str | None, as_json: bool) -> None:
    """List the GPUs you can emulate: measured (the profile database has times of models on it)
    or datasheet-only (priced by the cost model from its datasheet figures).

    \b
      gpemu gpus                      the table
      gpemu gpus --json               every fact, as JSON
      gpemu gpus add --help           add a GPU from its datasheet numbers
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = {**(ctx.obj or {}), "db_url": db_url}
        return
    pdb = _open(db_url)
    specs, counts = pdb.gpus(), pdb.measurement_counts()
    if as_json:
        from gpemu.db.io import gpu_json

        click.echo(json.dumps([{**gpu_json(s), "measurements": counts.get(s.name, 0)} for s in specs], indent=2))
        return
    _print_gpu_table(specs, counts)


def _gpu_status(spec: Any, rows: int) -> str:
    """measured: the database has model times on it; datasheet: shipped figures only; added:
    figures someone entered (`gpemu gpus add`, an import); profiled: rates `gpemu profile` measured."""
    if rows:
        return "[green]measured[/green]"
    if spec.provenance == "datasheet":
        return "[yellow]datasheet[/yellow]"
    return f"[yellow]{'added' if spec.provenance == 'user' else spec.provenance}[/yellow]"


def _gpu_row(spec: Any, rows: int, width: int) -> list[str]:
    cc = f"{spec.compute_capability[0]}.{spec.compute_capability[1]}" if spec.compute_capability else "?"
    bf16 = spec.bf16_tensor_flops
    bf16_text = "?" if bf16 is None else ("-" if bf16 == 0 else _g(bf16, 1e12, 4))
    row = [spec.short_name] + ([spec.name] if width >= 110 else [])
    row += [
        spec.generation or "?",
        cc,
        _gpu_status(spec, rows),
        f"{rows:,}" if rows else "-",
        f"{spec.memory_bytes / (1 << 30):.0f}",
        str(spec.sm_count),
        _g(spec.fp32_flops, 1e12),
        bf16_text,
        _g(spec.memory_bandwidth, 1e9, 4),
    ]
    return row + ([_short(spec.source or "", 60)] if width >= 150 else [])


def _print_gpu_table(specs: list[Any], counts: dict[str, int]) -> None:
    # Oldest architecture first; measured before datasheet-only within one.
    specs = sorted(specs, key=lambda s: (s.compute_capability or (99, 0), s.name not in counts, s.short_name.lower()))
    n_measured = sum(1 for s in specs if s.name in counts)
    # Readable at 80 columns; the full name and the source join when the terminal is wider.
    width = console.width
    cols = [("GPU", "left")] + ([("name", "left")] if width >= 110 else [])
    cols += [("gen", "left"), ("cc", "right"), ("status", "left"), ("rows", "right"), ("GiB", "right"),
             ("SMs", "right"), ("FP32", "right"), ("BF16", "right"), ("mem GB/s", "right")]  # fmt: skip
    cols += [("source", "left")] if width >= 150 else []
    t = _table(f"{len(specs)} GPUs: {n_measured} measured, {len(specs) - n_measured} datasheet-only", cols)
    if width >= 150:
        t.columns[-1].no_wrap = False
    for spec in specs:
        t.add_row(*_gpu_row(spec, counts.get(spec.name, 0), width))
    console.print(t)
    if not specs:
        console.print("the database is empty: fill it with `gpemu db init` or `gpemu db import`")
    else:
        console.print(
            "rows: measurements of models on it. FP32, BF16: peak TFLOP/s (BF16 on tensor cores, dense; "
            "- none). added: your datasheet figures (`gpemu gpus add`). A GPU without measurements takes "
            "the nearest measured generation's, scaled by the cost model (`gpemu show resnet50 --gpu H100 "
            "-b 64`); `gpemu gpus --json` has every figure and its source.",
            highlight=False,
        )


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


@gpus.command("add")
@click.argument("name", required=False)
@click.option(
    "--alias",
    "aliases",
    multiple=True,
    metavar="SHORT",
    help="Short name for --gpu (repeatable; the first is shown in tables), e.g. RTX3090.",
)
@click.option(
    "--generation",
    metavar="ARCH",
    help="Architecture: kepler, maxwell, pascal, volta, turing, ampere, ada, "
    "hopper or blackwell (decides which calibrated curves price it).",
)
@click.option(
    "--compute-capability", metavar="M.m", help="Compute capability, e.g. 8.6 [default: the generation's usual one]."
)
@click.option("--sms", type=int, metavar="N", help="Streaming multiprocessors.")
@click.option(
    "--memory-gb",
    type=float,
    metavar="GB",
    help="Memory as the datasheet says it (24 for a 24 GB card; stored as GiB like every shipped GPU).",
)
@click.option("--bandwidth-gbs", type=float, metavar="GB/S", help="Memory bandwidth, GB/s.")
@click.option("--fp32-tflops", type=float, metavar="TF", help="FP32 peak without tensor cores, TFLOP/s.")
@click.option(
    "--tf32-tensor-tflops",
    type=float,
    metavar="TF",
    help="TF32 tensor-core peak, dense (half NVIDIA's "
    "'with sparsity' figure), TFLOP/s; 0: none [default: 0 before Ampere].",
)
@click.option(
    "--fp16-tensor-tflops",
    type=float,
    metavar="TF",
    help="FP16 tensor-core peak with FP32 accumulate, dense, TFLOP/s; 0: none.",
)
@click.option("--bf16-tensor-tflops", type=float, metavar="TF", help="BF16 tensor-core peak, dense, TFLOP/s; 0: none.")
@click.option("--fp16-tflops", type=float, metavar="TF", help="FP16 peak without tensor cores, TFLOP/s [optional].")
@click.option("--fp64-tflops", type=float, metavar="TF", help="FP64 peak, TFLOP/s [optional].")
@click.option("--pcie-gen", type=int, metavar="N", help="PCIe generation of the host link [default: 4].")
@click.option(
    "--nvlink-gbs", type=float, metavar="GB/S", help="Total NVLink bandwidth per GPU, GB/s [default: 0, none]."
)
@click.option(
    "--host-pinned-gbs", type=float, metavar="GB/S", help="Pinned host->GPU copy rate [default: 0.8 x the PCIe link]."
)
@click.option(
    "--host-pageable-gbs",
    type=float,
    metavar="GB/S",
    help="Pageable host->GPU copy rate [default: the shipped GPUs' with that PCIe generation].",
)
@click.option("--source", metavar="TEXT", help="Where the numbers come from (datasheet title or URL).")
@click.option(
    "--file",
    "from_file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="FILE",
    help="Read the GPU(s) from a YAML or JSON file with the same fields (memory_gb: 24, ...) instead.",
)
@click.option("--replace", is_flag=True, help="Update a GPU you added before (same name).")
@_db_option
@click.pass_context
@_one_line_errors
def gpus_add(
    ctx: click.Context,
    name: str | None,
    aliases: tuple[str, ...],
    from_file: Path | None,
    replace: bool,
    db_url: str | None,
    **numbers: Any,
) -> None:
    """Add a GPU to the database from its datasheet numbers, so `gpemu run --gpu NAME` emulates it.

    NAME is what torch.cuda.get_device_name() reports on the real GPU. Without measurements of
    models on it, its times come from the cost model: a model measured on another GPU is scaled
    from the nearest measured generation (provenance `scaled`), other models are priced op by op
    (`estimated`). Every field is checked first; a bad one is one error naming it, and nothing is
    written. docs/adding.md explains each figure and where to find it.

    \b
      gpemu gpus add "NVIDIA GeForce RTX 3090" --alias RTX3090 --generation ampere \\
          --compute-capability 8.6 --sms 82 --memory-gb 24 --bandwidth-gbs 936 \\
          --fp32-tflops 35.6 --tf32-tensor-tflops 35.6 --fp16-tensor-tflops 71 \\
          --bf16-tensor-tflops 71 --pcie-gen 4 --source "NVIDIA Ampere GA102 whitepaper"
      gpemu gpus add --file examples/rtx3090.yaml
    """
    from gpemu.db.datasheet import check_names_free, read_datasheet_file, spec_from_datasheet

    db_url = db_url or (ctx.obj or {}).get("db_url")
    given = {k: v for k, v in numbers.items() if v is not None}
    if from_file is not None:
        if name or aliases or given:
            raise click.UsageError("give the GPU either as options or with --file, not both")
        entries = read_datasheet_file(from_file)
        specs = []
        for i, entry in enumerate(entries, 1):
            try:
                specs.append(spec_from_datasheet(entry))
            except ValueError as exc:
                which = entry.get("name") if isinstance(entry.get("name"), str) else f"GPU #{i}"
                raise UserError(f"{from_file}: {which}: {exc}") from None
    else:
        if not name:
            raise click.UsageError("give the GPU's NAME (what torch.cuda.get_device_name() reports), or --file FILE")
        specs = [spec_from_datasheet({"name": name, "aliases": list(aliases) or None, **given})]
    pdb = _open(db_url)
    known = pdb.gpus()
    for i, spec in enumerate(specs):
        check_names_free(spec, known + specs[:i], replace)
    for spec in specs:
        pdb.add_gpu(spec)
    for spec in specs:
        tc = ", ".join(
            f"{label} {getattr(spec, attr) / 1e12:g}"
            for label, attr in (
                ("TF32", "tf32_tensor_flops"),
                ("FP16", "fp16_tensor_flops"),
                ("BF16", "bf16_tensor_flops"),
            )
            if getattr(spec, attr)
        )
        cc = spec.compute_capability
        cc_text = f"{cc[0]}.{cc[1]}" if cc else "?"
        click.echo(
            f"added {spec.name} ({spec.short_name}): {spec.generation}, compute capability {cc_text}, "
            f"{spec.sm_count} SMs, {spec.memory_bytes / (1 << 30):g} GiB at {spec.memory_bandwidth / 1e9:g} GB/s, "
            f"FP32 {spec.fp32_flops / 1e12:g} TFLOP/s" + (f", tensor {tc}" if tc else ", no tensor cores")
        )
    first = specs[0].short_name
    click.echo(
        f"try it: gpemu run --gpu {first} -- python train.py   (times from the cost model until you import "
        f"measurements: docs/adding.md)"
    )


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
    t = _table(
        f"{len(infos)} models (GFLOP per sample)",
        [("model", "left"), ("class", "left"), ("parameters", "right"), ("fwd", "right"), ("fwd+bwd", "right")],
    )
    for m in infos:
        t.add_row(
            m.name,
            m.class_name,
            f"{m.param_count:,}",
            _g(m.fwd_flops_per_sample, 1e9, 4),
            _g(m.fwd_bwd_flops_per_sample, 1e9, 4),
        )
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
    (measured, interpolated between profiled batch sizes, or extrapolated beyond them).

    A GPU without measurements of MODEL (a datasheet-only GPU such as the H100) shows what
    `gpemu run` uses: the measurements of its reference GPU (the nearest measured generation),
    forward and backward scaled to this GPU by the cost model (provenance `scaled`, with its
    cross-validated ±), the other kinds as measured there."""
    from gpemu.db import ARTIFACT_SOURCE

    pdb = _open(db_url)
    spec, info = pdb.gpu(gpu), pdb.model(model)  # UnknownNameError -> one line with suggestions
    measured = pdb.measured(gpu, model)
    source, note = spec, None
    if not measured:
        source = _reference_gpu(pdb, spec, info.name)
        if source is None:
            raise UserError(
                f"no measurements for {info.name} on {spec.name} in {pdb}, nor on the GPU a run "
                "scales from; a run estimates its time from the ops it runs"
            )
        measured = pdb.measured(source.name, info.name)
    # DDP iterations are per world size: one row each, labelled with it.
    rows = []
    for k, w in measured:
        r = pdb.lookup(source.name, info.name, batch_size, k, world_size=w)
        rows.append([k if w == 1 else f"{k}[world_size={w}]", r.value, r.unit, r.provenance, None])
    if source is not spec:
        note = _scale_to(rows, info, batch_size, source, spec)
    if ("backward", 1) in measured and ARTIFACT_SOURCE in pdb.sources(source.name, info.name, "backward"):
        loop = (
            "The backward row is the shipped loop's: loss, zero_grad, backward and an SGD step; a run "
            "charges it less that loop's loss and per-parameter kernels, which its own loss and optimizer "
            "step replace (docs/time.md)"
        )
        note = f"{note}\n{loop}" if note else loop
    if as_json:
        out: dict[str, Any] = {"model": info.name, "gpu": spec.name, "batch_size": batch_size}
        if source is not spec:
            out["gpu_provenance"] = spec.provenance
            out["measured_on"] = source.name
        out["measurements"] = {
            k: {"value": v, "unit": u, "provenance": p, **({"uncertainty": str(unc)} if unc else {})}
            for k, v, u, p, unc in rows
        }
        if note:
            out["note"] = note
        click.echo(json.dumps(out, indent=2))
        return
    title = f"{info.name} on {spec.name} ({spec.short_name}), batch size {batch_size}"
    if source is not spec:
        title += f": not measured on it ({spec.provenance}); from the {source.short_name}'s measurements"
    t = _table(title, [("kind", "left"), ("value", "right"), ("unit", "left"), ("provenance", "left")])
    for k, v, u, p, unc in rows:
        style = {"measured": "green", "interpolated": "yellow", "extrapolated": "red"}.get(p.split()[0], "magenta")
        t.add_row(k, format_value(v, u), u, f"[{style}]{p}[/{style}]" + (f" {unc}" if unc else ""))
    console.print(t)
    if note:
        console.print(note, highlight=False)


def _reference_gpu(pdb: Any, spec: Any, model: str) -> Any:
    """The GPU whose measurements of ``model`` stand in for ``spec``'s, as ``gpemu run`` picks it
    (:func:`gpemu.reference.reference_gpu`). None: that GPU has none of ``model``."""
    from gpemu.reference import measured_on, reference_gpu

    found = reference_gpu(pdb, spec)
    if found is None or found.name == spec.name:
        return None
    return measured_on(pdb, (found,), model, "forward", "backward")


def _scale_to(rows: list[list[Any]], info: Any, batch: int, source: Any, spec: Any) -> str | None:
    """Carry ``source``'s forward/backward times in ``rows`` to ``spec`` in place (the cost
    model's ratio of the model's ops on both GPUs, as `gpemu run` does); label the other rows as
    ``source``'s. Returns a line for what could not be done."""
    from gpemu.costmodel import default_model, gpu_sheet
    from gpemu.costmodel.model import dominant_mix

    for row in rows:
        row[3] = f"{row[3]} on {source.short_name}"
    try:
        # The op list comes from the repository's plain-PyTorch copies of the database's models
        # (torchvision is not needed); an installed gpemu without the checkout cannot record them.
        from gpemu.profiler.costdata import record_model, repo_models

        builder = repo_models().get(info.name)
        if builder is None:
            raise ImportError(f"examples/tvmodels/ has no {info.name}")
        table = record_model(builder, image=info.input_size or 224)
    except ImportError as exc:
        return (
            f"forward/backward are the {source.short_name}'s: scaling them to the {spec.short_name} needs the "
            f"model's ops ({exc}); `gpemu run --gpu {spec.short_name}` scales them by the ops your script runs"
        )
    cm = default_model()
    sheet, ref_sheet = gpu_sheet(spec), gpu_sheet(source)
    unc = cm.uncertainty(sheet, dominant_mix(table, cm.table_seconds(table, batch, sheet)))
    for row in rows:
        if row[0] in ("forward", "backward"):
            row[1] = cm.transfer_seconds(row[1], table, batch, row[0], ref_sheet, sheet)
            row[3] = f"scaled from {source.short_name}"
            row[4] = unc
    return (
        f"scaled: the {source.short_name}'s measurement x the cost model's {spec.short_name}/{source.short_name} "
        f"ratio for this model's ops (fp32, PyTorch's default TF32 switches)"
        + (f"; {unc} is its cross-validated error on GPUs it was not fitted on" if unc else "")
        + f". The other kinds are the {source.short_name}'s as measured."
    )


@click.group("db")
def db() -> None:
    """Manage the profile database: where it is, build it, export it, import into it."""


@db.command("path")
@_db_option
@_one_line_errors
def db_path(db_url: str | None) -> None:
    """Print the database URL in use (and whether the default file is built yet)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from gpemu.db import db_location
    from gpemu.units import redact_url

    cfg = _config(db_url)
    url = db_location(cfg)
    try:
        make_url(url)
    except ArgumentError:
        raise UserError(
            f"--db {redact_url(url)!r} is not a SQLAlchemy URL; use e.g. sqlite:////path/to/profiles.sqlite "
            "or postgresql+psycopg://user@host/db"
        ) from None
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
        counts = {
            "gpus": len(pdb.gpus()),
            "models": len(pdb.models()),
            "measurements": pdb.count(),
            "distributions": len(pdb.distributions()),
        }
        where = str(path)
    click.echo(
        f"{where}: {counts['gpus']} GPUs, {counts['models']} models, "
        f"{counts['measurements']} measurements, {counts['distributions']} distributions"
    )


@db.command("export")
@click.argument("path", type=click.Path(dir_okay=True, file_okay=True, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["json", "csv"]),
    default=None,
    help="json: one file; csv: a directory of CSV files (default: json if PATH ends in .json).",
)
@click.option("--gpu", "gpu_names", multiple=True, help="Only this GPU (repeatable).")
@click.option("--model", "model_names", multiple=True, help="Only this model (repeatable).")
@_db_option
@_one_line_errors
def db_export(
    path: Path, fmt: str | None, gpu_names: tuple[str, ...], model_names: tuple[str, ...], db_url: str | None
) -> None:
    """Write the database (or part of it) to PATH as JSON or CSV."""
    from gpemu.db.io import export_db

    counts = export_db(_open(db_url), path, fmt, gpus=gpu_names or None, models=model_names or None)
    click.echo(
        f"exported {counts['gpus']} GPUs, {counts['models']} models, {counts['measurements']} "
        f"measurements, {counts['distributions']} distributions, {counts['op_curves']} op curves "
        f"({counts['op_measurements']} kernels), {counts['host_records']} host records to {path}"
    )


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
    click.echo(
        f"imported {report.gpus} GPUs, {report.models} models, {report.measurements} measurements, "
        f"{report.distributions} distributions, {report.op_curves} op curves ({report.op_measurements} "
        f"kernels), {report.host_records} host records from {path}"
    )
    if report.rejected:
        click.echo(f"rejected {len(report.rejected)} rows:", err=True)
        for r in report.rejected[:show_rejected]:
            reason = r.reason if len(r.reason) <= 300 else r.reason[:300] + "..."
            click.echo(f"  {r.where}: {reason}", err=True)
        if len(report.rejected) > show_rejected:
            click.echo(f"  ... and {len(report.rejected) - show_rejected} more", err=True)
        raise click.exceptions.Exit(1)
