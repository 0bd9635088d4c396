"""Per-op kernel measurements of one GPU (``gpemu profile --ops``) and the curves fitted to them.

Two tables, owned by this module and created on first write next to gpemu.db's own:

* ``op_measurements``: one row per timed kernel — the curve key the cost model prices it with
  (``gemm.fwd``, ``conv_spatial.bwd``, ...), the peak path (``simt`` / ``tensor`` / ``memory``),
  its dtype and shape, its work (FLOPs or bytes, as :mod:`gpemu.costmodel` counts them), the
  shape term ``z``, the median seconds (CUDA events) and the peak / SM count the fit divides by.
* ``op_curves``: per (GPU, key, path) the fitted efficiency curve (``e``, ``x0``, ``p``, ``k0``,
  ``h``), the number of rows and the fit's RMS log error. The runtime reads only this table
  (:mod:`gpemu.calibration`), so pricing never needs the fitting code or SciPy.

Why a MetaData of their own rather than gpemu.db's ``schema.metadata``: ``gpemu.db.build``
treats every table on that metadata as *shipped* — recreated empty when the default database is
rebuilt for new shipped data — and copies every other table whole. Measurements a lab took on its
own GPU must survive that rebuild (the profiler's ``profile_limits`` table does the same).

Rows are keyed by GPU name (not ``gpus.id``: ids change when the default database is rebuilt, and
a GPU can be calibrated before the database has a spec for it). Writes are upserts on natural
keys, so re-profiling replaces rows instead of duplicating them.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Column, Engine, Float, Integer, MetaData, String, Table, Text, UniqueConstraint, select

from .schema import has_table

__all__ = [
    "OpMeasurement",
    "OpCurveRow",
    "op_measurements",
    "op_curves",
    "ensure_tables",
    "write_measurements",
    "read_measurements",
    "write_curves",
    "read_curves",
    "op_gpus",
    "stamps",
]

metadata = MetaData()

op_measurements = Table(
    "op_measurements",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("gpu", String(128), nullable=False),
    Column("key", String(64), nullable=False),  # curve key: gemm.fwd, conv_spatial.bwd, norm.fwd, ...
    Column("path", String(16), nullable=False),  # simt | tensor | memory
    Column("dtype", String(16), nullable=False),
    Column("shape", String(128), nullable=False),  # what was run, e.g. "mm 1024x1024x1024"
    Column("op", String(64), nullable=False),  # the aten op's name
    Column("work", Float, nullable=False),  # FLOPs (compute classes) or bytes (the rest)
    Column("z", Float, nullable=False),  # shape term (1/K, or FLOPs per byte; 0: none)
    Column("seconds", Float, nullable=False),  # median kernel time
    Column("p10", Float, nullable=True),
    Column("p90", Float, nullable=True),
    Column("samples", Integer, nullable=False),
    Column("peak", Float, nullable=False),  # FLOP/s or bytes/s the work is divided by
    Column("sm_count", Integer, nullable=False),
    Column("measured_at", String(40), nullable=False),
    Column("metadata_json", Text, nullable=False, default="{}"),
    UniqueConstraint("gpu", "key", "path", "dtype", "shape", name="uq_op_measurement"),
)

op_curves = Table(
    "op_curves",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("gpu", String(128), nullable=False),
    Column("key", String(64), nullable=False),
    Column("path", String(16), nullable=False),
    Column("e", Float, nullable=False),
    Column("x0", Float, nullable=False),
    Column("p", Float, nullable=False),
    Column("k0", Float, nullable=False),
    Column("h", Float, nullable=False),
    Column("rows", Integer, nullable=False),
    Column("rms_log_error", Float, nullable=False),
    Column("fitted_at", String(40), nullable=False),
    UniqueConstraint("gpu", "key", "path", name="uq_op_curve"),
)


@dataclass(frozen=True)
class OpMeasurement:
    """One timed kernel (see the module docstring for the columns)."""

    key: str
    path: str
    dtype: str
    shape: str
    op: str
    work: float
    z: float
    seconds: float
    samples: int
    peak: float
    sm_count: int
    p10: float | None = None
    p90: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OpCurveRow:
    """One fitted curve of one GPU."""

    key: str
    path: str
    e: float
    x0: float
    p: float
    k0: float
    h: float
    rows: int
    rms_log_error: float


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def ensure_tables(engine: Engine) -> None:
    """Create both tables where missing (writers call this; readers never write)."""
    metadata.create_all(engine, checkfirst=True)


def write_measurements(engine: Engine, gpu: str, rows: Iterable[OpMeasurement], stamp: str | None = None) -> int:
    """Store ``rows`` for ``gpu`` in one transaction, replacing rows of the same kernel.
    ``stamp``: when they were measured (default now; an import keeps the export's)."""
    ensure_tables(engine)
    t = op_measurements
    rows = list(rows)
    stamp = stamp or _now()
    with engine.begin() as conn:
        for r in rows:
            conn.execute(
                t.delete().where(
                    t.c.gpu == gpu, t.c.key == r.key, t.c.path == r.path, t.c.dtype == r.dtype, t.c.shape == r.shape
                )
            )
            values = {k: v for k, v in asdict(r).items() if k != "metadata"}
            conn.execute(
                t.insert().values(
                    gpu=gpu,
                    measured_at=stamp,
                    metadata_json=json.dumps(r.metadata, sort_keys=True, default=str),
                    **values,
                )
            )
    return len(rows)


def read_measurements(engine: Engine, gpu: str) -> list[OpMeasurement]:
    """Every stored kernel of ``gpu`` (none when the table does not exist yet)."""
    if not has_table(engine, op_measurements):
        return []
    t = op_measurements
    with engine.connect() as conn:
        found = conn.execute(
            select(t).where(t.c.gpu == gpu).order_by(t.c.key, t.c.path, t.c.work, t.c.dtype, t.c.shape)
        ).all()
    return [
        OpMeasurement(
            key=r.key,
            path=r.path,
            dtype=r.dtype,
            shape=r.shape,
            op=r.op,
            work=r.work,
            z=r.z,
            seconds=r.seconds,
            samples=r.samples,
            peak=r.peak,
            sm_count=r.sm_count,
            p10=r.p10,
            p90=r.p90,
            metadata=json.loads(r.metadata_json or "{}"),
        )
        for r in found
    ]


def write_curves(engine: Engine, gpu: str, curves: Iterable[OpCurveRow], stamp: str | None = None) -> int:
    """Store ``gpu``'s fitted curves, replacing its older curves of the same (key, path).
    ``stamp``: when they were fitted (default now; an import keeps the export's)."""
    ensure_tables(engine)
    t = op_curves
    curves = list(curves)
    stamp = stamp or _now()
    with engine.begin() as conn:
        for c in curves:
            conn.execute(t.delete().where(t.c.gpu == gpu, t.c.key == c.key, t.c.path == c.path))
            conn.execute(t.insert().values(gpu=gpu, fitted_at=stamp, **asdict(c)))
    return len(curves)


def read_curves(engine: Engine, gpu: str) -> list[OpCurveRow]:
    """``gpu``'s fitted curves (none when nothing was calibrated, or the table does not exist)."""
    if not has_table(engine, op_curves):
        return []
    t = op_curves
    with engine.connect() as conn:
        found = conn.execute(select(t).where(t.c.gpu == gpu).order_by(t.c.key, t.c.path)).all()
    return [
        OpCurveRow(
            key=r.key, path=r.path, e=r.e, x0=r.x0, p=r.p, k0=r.k0, h=r.h, rows=r.rows, rms_log_error=r.rms_log_error
        )
        for r in found
    ]


def op_gpus(engine: Engine) -> list[str]:
    """Names of the GPUs with stored kernels or curves."""
    names: set[str] = set()
    for t in (op_measurements, op_curves):
        if has_table(engine, t):
            with engine.connect() as conn:
                names.update(r[0] for r in conn.execute(select(t.c.gpu).distinct()))
    return sorted(names)


def stamps(engine: Engine, gpu: str) -> tuple[dict[tuple, str], dict[tuple, str]]:
    """When each of ``gpu``'s kernels was measured ({(key, path, dtype, shape): time}) and each
    curve fitted ({(key, path): time}): what an export carries beside the rows."""
    measured: dict[tuple, str] = {}
    fitted: dict[tuple, str] = {}
    if has_table(engine, op_measurements):
        t = op_measurements
        with engine.connect() as conn:
            q = select(t.c.key, t.c.path, t.c.dtype, t.c.shape, t.c.measured_at).where(t.c.gpu == gpu)
            for r in conn.execute(q):
                measured[tuple(r[:4])] = r[4]
    if has_table(engine, op_curves):
        t = op_curves
        with engine.connect() as conn:
            for row in conn.execute(select(t.c.key, t.c.path, t.c.fitted_at).where(t.c.gpu == gpu)):
                fitted[tuple(row[:2])] = row[2]
    return measured, fitted
