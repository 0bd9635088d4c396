"""``gpemu profile``: measure models on a real GPU (or the CPU) into the profile database."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from .ops import OpsReport
    from .runner import ProfileOptions, ProfileReport
    from .store import ProfileStore

__all__ = ["profile", "parse_memory_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_memory_size(text: str) -> int:
    """``'200MiB'`` -> 209715200; plain numbers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise click.BadParameter(
            f"{text!r} is not a memory size; use a number with an optional unit, e.g. 200MiB, 1.5GiB, 4GB, 1048576"
        )
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise click.BadParameter(f"memory size must be at least 1 byte, got {text!r}")
    return value


def _memory_option(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    return None if value is None else parse_memory_size(value)


@click.command("profile", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME|module:callable",
    help="Model to profile (repeatable): a torchvision name (resnet50), or a factory "
    "module:callable returning a module or (module, sample_batch); NAME=module:callable "
    "stores it under NAME.",
)
@click.option(
    "--gpu-name",
    default="auto",
    show_default=True,
    help="Name to store the measurements under; auto: what torch.cuda.get_device_name reports ('cpu' on the CPU).",
)
@click.option(
    "--device", default="cuda", show_default=True, help="cuda, cuda:N, or cpu (tests the pipeline without a GPU)."
)
@click.option(
    "--batch-sizes",
    default="default",
    show_default=True,
    help="Batch sizes: '1-16,32,64', 'pow2', 'dense:1-16+step:16', 'default' (1-16,24,32,48,...,256).",
)
@click.option(
    "--max-batch-size",
    default=256,
    show_default=True,
    type=click.IntRange(1),
    help="Upper end of open-ended sweeps (pow2, step:S).",
)
@click.option("--input-shape", default=None, metavar="C,H,W", help="Shape of one input sample [3,224,224].")
@click.option("--input-dtype", default="float32", show_default=True, help="float32, float16, bfloat16, int64, ...")
@click.option(
    "--num-classes",
    default=None,
    type=click.IntRange(1),
    help="Classes of a classifier (passed to factories that take it).",
)
@click.option(
    "--warmup",
    default=3,
    show_default=True,
    type=click.IntRange(0),
    help="Iterations run first and not recorded (the first ones are slow).",
)
@click.option(
    "--iterations", default=20, show_default=True, type=click.IntRange(1), help="Recorded iterations per batch size."
)
@click.option(
    "--optimizer",
    default="sgd",
    show_default=True,
    type=click.Choice(["sgd", "adam", "adamw"]),
    help="Optimizer whose step is timed (SGD has momentum 0.9).",
)
@click.option(
    "--memory-limit",
    default=None,
    callback=_memory_option,
    metavar="SIZE",
    help="Treat more than SIZE (e.g. 200MiB) as out of memory: a smaller GPU, or an OOM test on the CPU.",
)
@click.option(
    "--ddp-world-sizes",
    default="auto",
    show_default=True,
    help="World sizes for DDP iteration times: '2,4', 'none', or auto (2..number of GPUs; none on the CPU).",
)
@click.option("--ddp-batch-sizes", default=None, help="Per-GPU batch sizes for DDP [same as --batch-sizes].")
@click.option(
    "--db",
    "db_url",
    default=None,
    metavar="URL",
    help="SQLAlchemy URL of the profile database [your default database].",
)
@click.option(
    "--resume/--force",
    default=True,
    show_default=True,
    help="--resume skips (model, batch size) units already in the database; --force measures them again.",
)
@click.option(
    "--export",
    "export_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="After profiling, write this GPU's measurements to FILE (FILE.json, or a directory of CSV files; "
    "the `gpemu db export` format). Alone: the whole database, or --gpu-name's GPU.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar (log lines only).")
@click.option(
    "--ops",
    "ops_mode",
    is_flag=True,
    help="Instead of models: time single kernels of every op class (matrix multiply, convolutions, "
    "normalisation, elementwise, ...) over a range of sizes and fit this GPU's curves for the "
    "cost model, which then prices unmeasured models on this GPU from them. Needs a CUDA GPU.",
)
@click.option(
    "--classes",
    "op_classes",
    multiple=True,
    metavar="NAMES",
    help="With --ops: only these op classes (repeatable or comma-separated): gemm, conv1x1, "
    "conv_spatial, conv_strided, conv_grouped, conv_depthwise, norm, elementwise, reduction, "
    "pooling, copy; or the groups conv, compute, memory, all [all].",
)
@click.option(
    "--quick",
    is_flag=True,
    help="With --ops: about five sizes per op class, 1 warm-up and at most 5 samples per kernel "
    "(a minute or less on a GPU; a coarser fit).",
)
@click.option(
    "--host-side",
    is_flag=True,
    help="Instead of models: time this host issuing work to the GPU (eager PyTorch's host time per op of a "
    "forward and of a backward pass, and per kernel launch; the median of --iterations samples, 3 to 15) and "
    "record it as a host that `gpemu run --host db:NAME` models (docs/host-side.md).",
)
@click.option(
    "--host-name",
    default=None,
    metavar="NAME",
    help="With --host-side: the name to record the host under [this machine's host name].",
)
def profile(**given: Any) -> None:
    """Measure models on this machine's GPU into the profile database.

    \b
    For every model and batch size, after warm-up iterations: forward, backward and optimizer-step
    time, host->GPU (pageable and pinned) and GPU->host copy of one input batch, peak and
    persistent memory; once per model the model transfer. Every (model, batch size) is saved
    atomically, so Ctrl-C loses at most the unit in progress and a rerun goes on from there.

    \b
      gpemu profile --model resnet50 --batch-sizes 1-16,32,64,128,256
      gpemu profile --model net=mypkg.models:build_net --input-shape 3,32,32 --num-classes 10
      gpemu profile --device cpu --model mypkg.models:tiny --batch-sizes 1,2,4 --db sqlite:///p.sqlite

    \b
    Calibrating the host model on this GPU's host (--host-side): eager PyTorch's issue time per
    op, recorded under a name that `gpemu run --host db:NAME` then models (`gpemu hosts` lists them).
      gpemu profile --host-side --host-name lab-h100

    \b
    Calibrating the op-level cost model on this GPU (--ops): every op class's kernels are timed
    with CUDA events (--warmup launches first, median of --iterations samples) and a curve per
    op class is fitted and stored; emulating this GPU then prices ops with it.
      gpemu profile --ops                       # the whole sweep (minutes)
      gpemu profile --ops --quick --classes gemm,conv
    """
    from rich.console import Console

    args = _Args(**given)
    console = Console(stderr=True)
    if args.host_side:
        if args.models or args.ops_mode:
            raise click.UsageError("--host-side times the host, not models or kernels: run it on its own")
        _profile_host(args, console)
        return
    if args.host_name is not None:
        raise click.UsageError("--host-name goes with --host-side")
    if args.ops_mode:
        if args.models:
            raise click.UsageError("--ops times single kernels, not models: run --model and --ops separately")
        _profile_ops(args, console)
        return
    if args.op_classes or args.quick:
        raise click.UsageError("--classes and --quick go with --ops")
    if not args.models and not args.export_path:
        raise click.UsageError("nothing to do: give at least one --model to profile, or --export FILE")
    _profile_models(args, console)


@dataclass(frozen=True)
class _Args:
    """What the command line asked for (the options of :func:`profile`, by their names)."""

    models: tuple[str, ...]
    gpu_name: str
    device: str
    batch_sizes: str
    max_batch_size: int
    input_shape: str | None
    input_dtype: str
    num_classes: int | None
    warmup: int
    iterations: int
    optimizer: str
    memory_limit: int | None
    ddp_world_sizes: str
    ddp_batch_sizes: str | None
    db_url: str | None
    resume: bool
    export_path: str | None
    no_progress: bool
    ops_mode: bool = False
    op_classes: tuple[str, ...] = ()
    quick: bool = False
    host_side: bool = False
    host_name: str | None = None

    @property
    def named_gpu(self) -> str | None:
        """The name to store under; None: what the device reports (--gpu-name auto)."""
        name = self.gpu_name.strip()
        return None if name.lower() == "auto" else name


@dataclass(frozen=True)
class _ModelsJob:
    """The models to measure, and the DDP iteration times to add (no world sizes: none)."""

    options: ProfileOptions
    ddp_world_sizes: list[int]
    ddp_batch_sizes: list[int]


def _models_job(args: _Args) -> _ModelsJob | None:
    """The measurement --model asks for, its options checked and its device found (before any
    database work, so that without a GPU the refusal comes first); None without --model."""
    from .device import resolve_device
    from .models import parse_dtype, parse_input_shape
    from .runner import ProfileOptions
    from .sweep import parse_batch_sizes

    sizes = parse_batch_sizes(args.batch_sizes, args.max_batch_size)
    ddp_sizes = parse_batch_sizes(args.ddp_batch_sizes, args.max_batch_size) if args.ddp_batch_sizes else sizes
    shape = parse_input_shape(args.input_shape) if args.input_shape else None
    dtype = parse_dtype(args.input_dtype)
    if not args.models:
        return None
    dev = resolve_device(args.device)
    options = ProfileOptions(
        models=list(args.models),
        batch_sizes=sizes,
        device=dev,
        gpu_name=args.named_gpu,
        input_shape=shape,
        input_dtype=dtype,
        num_classes=args.num_classes,
        warmup=args.warmup,
        iterations=args.iterations,
        optimizer=args.optimizer,
        memory_limit=args.memory_limit,
        force=not args.resume,
    )
    return _ModelsJob(options, _world_sizes(args.ddp_world_sizes, dev), ddp_sizes)


def _profile_models(args: _Args, console: Console) -> None:
    """--model (the models measured into the database) and / or --export."""
    import torch

    from gpemu.cli import UserError

    from .store import ProfileStore

    job = _models_job(args)
    store = ProfileStore.open(args.db_url)
    try:
        gpu = _measure_models(store, job, args.no_progress, console) if job is not None else None
        if args.export_path:
            from .export import export_database

            # After a run: that GPU's measurements (a lab shares its own, not the shipped data).
            only = [gpu] if gpu is not None else [args.named_gpu] if args.named_gpu is not None else None
            n = export_database(store, Path(args.export_path), gpus=only)
            console.print(f"exported {n} measurement(s) to {args.export_path}", highlight=False)
    except torch.OutOfMemoryError as exc:  # outside a unit (e.g. moving the model): one clear line
        raise UserError(f"out of memory before measuring started: {exc}") from None
    finally:
        store.close()


def _measure_models(store: ProfileStore, job: _ModelsJob, no_progress: bool, console: Console) -> str:
    """Every unit of the job (and its DDP units), with progress and a closing line; the name of
    the GPU the rows went to. Ctrl-C exits with 130 (the units finished are saved)."""
    from .runner import Interrupted

    try:
        report = _run_with_progress(store, job.options, no_progress, console)
        ddp_units = 0
        if job.ddp_world_sizes:
            from .ddp import profile_ddp

            ddp_units = profile_ddp(
                store,
                job.options,
                job.ddp_world_sizes,
                job.ddp_batch_sizes,
                log=lambda msg: console.print(msg, highlight=False),
            )
    except Interrupted as exc:
        r = exc.report
        console.print(
            f"[yellow]interrupted[/yellow]: {len(r.measured)} (model, batch size) unit(s) saved this run; "
            f"the database is consistent. Run the same command again to go on from there.",
            highlight=False,
        )
        raise click.exceptions.Exit(130) from None
    lim = f"; {ddp_units} DDP unit(s)" if job.ddp_world_sizes else ""
    lim += "".join(f"; {m}: out of memory at batch {b}" for m, (b, _) in report.limits.items())
    console.print(
        f"[green]done[/green]: {len(report.measured)} unit(s) measured, "
        f"{len(report.skipped)} already in the database, on '{report.gpu}'{lim}",
        highlight=False,
    )
    return report.gpu


def _world_sizes(text: str, dev: torch.device) -> list[int]:
    low = text.strip().lower()
    if low in ("none", "0", ""):
        return []
    if low == "auto":
        if dev.type != "cuda":
            return []
        import torch

        return list(range(2, torch.cuda.device_count() + 1))
    try:
        sizes = sorted({int(x) for x in low.split(",") if x.strip()})
    except ValueError:
        raise click.BadParameter(f"{text!r}: give world sizes like '2,4', 'auto' or 'none'") from None
    if not sizes or min(sizes) < 2:
        raise click.BadParameter(f"{text!r}: DDP world sizes must be 2 or more ('2,4'), or 'auto' / 'none'")
    if dev.type == "cuda":
        import torch

        have = torch.cuda.device_count()
        if max(sizes) > have:
            raise click.BadParameter(f"world size {max(sizes)} needs {max(sizes)} GPUs; this machine has {have}")
    return sizes


def _run_with_progress(store: ProfileStore, opts: ProfileOptions, no_progress: bool, console: Console) -> ProfileReport:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from .runner import profile_models

    def log(msg: str) -> None:
        console.print(msg, highlight=False)

    if no_progress:
        return profile_models(store, opts, log=log)
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("profiling", total=None)

        def advance(desc: str, n: int) -> None:
            bar.update(task, description=desc, advance=n)

        def set_total(total: int) -> None:
            bar.update(task, total=total)

        return profile_models(
            store, opts, progress=advance, set_total=set_total, log=lambda msg: bar.console.print(msg, highlight=False)
        )


def _profile_ops(args: _Args, console: Console) -> None:
    """--ops: this GPU's kernels timed, its op curves fitted and stored, and shown."""
    import torch

    from gpemu.cli import UserError

    from .device import resolve_device
    from .ops import parse_classes
    from .store import ProfileStore

    classes = parse_classes(args.op_classes)
    _check_can_time_kernels(args.device)
    dev = resolve_device(args.device)
    warmup, iterations = args.warmup, args.iterations
    if args.quick:
        warmup, iterations = min(warmup, 1), min(iterations, 5)
    debug = bool((click.get_current_context().find_root().obj or {}).get("debug"))
    store = ProfileStore.open(args.db_url)
    try:
        report = _time_kernels(store, dev, classes, warmup, iterations, args, console)
    except torch.OutOfMemoryError as exc:
        raise UserError(f"out of memory while timing kernels: {exc}; try --quick or fewer --classes") from None
    except RuntimeError as exc:  # a CUDA error: one line unless --debug
        if debug:
            raise
        raise UserError(
            f"op profiling failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    finally:
        store.close()
    _print_curves(report, console)


def _check_can_time_kernels(device: str) -> None:
    """One line (UserError) when --ops cannot run here: on the CPU, without a CUDA GPU, or without
    scipy for the fit (said before minutes of timing, not after)."""
    import torch

    from gpemu.cli import UserError

    # resolve_device's own message offers --device cpu, which --ops has no use for.
    if device.strip().lower() == "cpu":
        raise UserError("--ops times CUDA kernels with CUDA events and needs a GPU; --device cpu is for models only")
    if not torch.cuda.is_available():
        build = (
            "this PyTorch has no CUDA support (CPU build)" if torch.version.cuda is None else "PyTorch sees no CUDA GPU"
        )
        raise UserError(
            f"gpemu profile --ops times kernels on the GPU it calibrates, but {build}; run it on "
            "that GPU's machine (to try it without one: gpemu run --gpu V100 -- gpemu profile --ops --quick)"
        )
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        raise UserError(
            "gpemu profile --ops fits the measured kernels with scipy, which is not installed: "
            "pip install 'gpemu[profile]'"
        ) from None


def _time_kernels(
    store: ProfileStore,
    dev: torch.device,
    classes: Sequence[str],
    warmup: int,
    iterations: int,
    args: _Args,
    console: Console,
) -> OpsReport:
    """The sweep timed and fitted (:func:`gpemu.profiler.ops.profile_ops`), behind a progress bar
    unless --no-progress."""
    from .ops import profile_ops

    name, quick = args.named_gpu, args.quick
    if args.no_progress:
        return profile_ops(
            store, dev, name, classes, quick, warmup, iterations, log=lambda m: console.print(m, highlight=False)
        )
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("kernels", total=None)
        return profile_ops(
            store,
            dev,
            name,
            classes,
            quick,
            warmup,
            iterations,
            progress=lambda key: bar.update(task, description=key, advance=1),
            set_total=lambda n: bar.update(task, total=n),
            log=lambda m: bar.console.print(m, highlight=False),
        )


def _print_curves(report: OpsReport, console: Console) -> None:
    """The run's notes, the fitted curves as a table, and the closing line."""
    from rich.table import Table

    for note in report.notes:
        console.print(f"[yellow]note[/yellow]: {note}", highlight=False)
    if report.uncovered:
        console.print(
            f"[yellow]note[/yellow]: {len(report.uncovered)} kernel(s) may include launch gaps "
            f"(the host could not queue ahead of the GPU), e.g. {report.uncovered[0]}",
            highlight=False,
        )
    table = Table(title=f"op curves of {report.gpu}", title_justify="left")
    # Short headers: the curve names must stay whole in an 80-column terminal.
    for col in ("curve", "path", "kernels", "e", "x0 /SM", "p", "rms"):
        table.add_column(col, justify="left" if col in ("curve", "path") else "right", no_wrap=True)
    for c in report.curves:
        table.add_row(
            c.key, c.path, str(c.rows), f"{c.e:.3f}", f"{c.x0:.3g}", f"{c.p:.2f}", f"{100 * c.rms_log_error:.1f}%"
        )
    console.print(table)
    console.print(
        f"[green]done[/green]: {report.measured} kernel(s) timed on '{report.gpu}', "
        f"{len(report.curves)} curve(s) stored; emulating this GPU now prices ops with them",
        highlight=False,
    )


def _profile_host(args: _Args, console: Console) -> None:
    """--host-side: this host's issue times measured on the GPU and recorded under a name."""
    from gpemu import runtime
    from gpemu.cli import UserError
    from gpemu.db.host_records import check_host_name, write_host

    from .device import device_name, resolve_device
    from .hostside import default_host_name, host_record, measure_host_side
    from .store import ProfileStore

    if args.device.strip().lower() == "cpu":
        raise UserError("--host-side times a host issuing work to a CUDA GPU; --device cpu is for models only")
    rt = runtime.current()
    if rt is not None and not rt.config.virtual_time:
        raise UserError(
            "under gpemu, --host-side reads the emulated host's time only on virtual time: "
            "gpemu run --gpu A100 --host h100-xeon --clock virtual -- gpemu profile --host-side"
        )
    name = check_host_name(args.host_name.strip().lower()) if args.host_name is not None else default_host_name()
    dev = resolve_device(args.device)
    store = ProfileStore.open(args.db_url)
    try:
        gpu = args.named_gpu or device_name(dev)
        record = host_record(name, gpu, measure_host_side(dev, samples=max(3, min(args.iterations, 15))))
        record = write_host(store.db.engine, record)
    finally:
        store.close()
    note = "" if record.metadata.get("covered", True) else " (some samples may include waits for the GPU)"
    console.print(
        f"host '{record.name}' ({record.cpu}, torch {record.torch_version}, on {record.gpu}): "
        f"{record.forward_op_s * 1e6:.1f} us per forward op, {record.backward_op_s * 1e6:.1f} us per backward op, "
        f"{record.launch_s * 1e6:.1f} us of it a kernel launch; reference loop {record.reference_ms:.1f} ms{note}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"[green]done[/green]: recorded host '{record.name}'; model it with: gpemu run --host db:{record.name} ...",
        highlight=False,
        soft_wrap=True,
    )
