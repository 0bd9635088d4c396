"""Export a profile database to JSON or CSV, and import such files with per-row validation.

Formats (both carry every table, so an export imported into an empty database reproduces it):
- JSON: one file ``{"format": "gpemu-profile-db", "schema_version", "gpus": [...], "models": [...],
  "measurements": {"columns": [...], "rows": [[...], ...]}, "distributions": [...],
  "op_measurements": [...], "op_curves": [...], "host_records": [...]}`` (``op_*``: ``gpemu profile
  --ops``, a GPU's own calibration, :mod:`gpemu.db.op_measurements`, keyed by GPU name;
  ``host_records``: ``gpemu profile --host-side``, a GPU host's issue times,
  :mod:`gpemu.db.host_records`, keyed by host name).
- CSV: a directory with ``gpus.csv``, ``models.csv``, ``measurements.csv``, ``distributions.csv``,
  ``op_measurements.csv``, ``op_curves.csv``, ``host_records.csv``.
Import also takes a single ``measurements.csv``-style file (columns gpu, model, kind,
batch_size, value and optionally the rest) for GPUs and models the database already knows.

Import never stops at a bad row: it writes every valid row (an upsert, so importing twice
changes nothing) and reports each rejected row with its reason.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import select

from . import schema as S
from .host_records import HostRecord, check_host_name, read_hosts, write_host
from .lookup import (
    ProfileDB,
    check_generation,
    clean_measurement,
    gpu_row,
    is_int,
    is_number,
    measurement_row,
    model_row,
    upsert,
)
from .op_measurements import OpCurveRow, OpMeasurement, op_gpus, read_curves, read_measurements, stamps, write_curves
from .op_measurements import write_measurements as write_op_measurements
from .records import GpuSpec, Measurement, ModelInfo, UnknownNameError, normalize_name

__all__ = ["export_db", "import_path", "gpu_json", "ImportReport", "Rejected", "MEASUREMENT_COLUMNS", "FORMAT_NAME"]

FORMAT_NAME = "gpemu-profile-db"
MEASUREMENT_COLUMNS = [f.name for f in fields(Measurement)]
_GPU_COLUMNS = [f.name for f in fields(GpuSpec)]
_MODEL_COLUMNS = [f.name for f in fields(ModelInfo)]
_DIST_COLUMNS = ["name", "unit", "samples", "source", "description"]
_OPTIONAL_FLOATS = ("std", "p50", "p90", "p99")
_OP_COLUMNS = ["gpu"] + [f.name for f in fields(OpMeasurement)] + ["measured_at"]
_CURVE_COLUMNS = ["gpu"] + [f.name for f in fields(OpCurveRow)] + ["fitted_at"]
_OP_PATHS = ("simt", "tensor", "memory")
_HOST_COLUMNS = [f.name for f in fields(HostRecord)]


@dataclass
class Rejected:
    where: str  # "file:line" or "section #n"
    reason: str


@dataclass
class ImportReport:
    gpus: int = 0
    models: int = 0
    measurements: int = 0
    distributions: int = 0
    op_measurements: int = 0
    op_curves: int = 0
    host_records: int = 0
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return sum(
            (
                self.gpus,
                self.models,
                self.measurements,
                self.distributions,
                self.op_measurements,
                self.op_curves,
                self.host_records,
            )
        )


# ---------------------------------------------------------------------------------- export
def _dump(db: ProfileDB, gpus: Iterable[str] | None, models: Iterable[str] | None) -> dict[str, Any]:
    # Same order as a full export, so a partial export re-exported compares equal.
    gpu_specs = sorted({db.gpu(g) for g in gpus}, key=lambda s: s.short_name.lower()) if gpus else db.gpus()
    model_infos = sorted({db.model(m) for m in models}, key=lambda m: m.name) if models else db.models()
    gpu_names = {s.name for s in gpu_specs}
    model_names = {m.name for m in model_infos}
    m, g, mo = S.measurements, S.gpus, S.models
    cols = [m.c[c] for c in MEASUREMENT_COLUMNS if c not in ("gpu", "model", "metadata")]
    q = (
        select(g.c.name, mo.c.name, m.c.metadata_json, *cols)
        .join(g, g.c.id == m.c.gpu_id)
        .join(mo, mo.c.id == m.c.model_id)
        .order_by(g.c.name, mo.c.name, m.c.kind, m.c.world_size, m.c.batch_size)
    )
    rows = []
    names = ["gpu", "model", "metadata"] + [c.name for c in cols]
    order = [names.index(c) for c in MEASUREMENT_COLUMNS]
    with db.engine.connect() as conn:
        for r in conn.execute(q):
            if r[0] in gpu_names and r[1] in model_names:
                cells = list(r)
                cells[2] = json.loads(cells[2] or "{}")
                rows.append([cells[i] for i in order])
        dists = conn.execute(select(S.distributions).order_by(S.distributions.c.name)).mappings().all()
    ops, curves = [], []
    for gpu in op_gpus(db.engine):
        if gpus and gpu not in gpu_names:
            continue
        measured, fitted = stamps(db.engine, gpu)
        ops += [
            {"gpu": gpu, **asdict(r), "measured_at": measured.get((r.key, r.path, r.dtype, r.shape))}
            for r in read_measurements(db.engine, gpu)
        ]
        curves += [
            {"gpu": gpu, **asdict(c), "fitted_at": fitted.get((c.key, c.path))} for c in read_curves(db.engine, gpu)
        ]
    return {
        "format": FORMAT_NAME,
        "schema_version": S.SCHEMA_VERSION,
        "gpus": [gpu_json(s) for s in gpu_specs],
        "models": [asdict(mi) for mi in model_infos],
        "measurements": {"columns": MEASUREMENT_COLUMNS, "rows": rows},
        "distributions": [
            {
                "name": d["name"],
                "unit": d["unit"],
                "samples": json.loads(d["samples_json"]),
                "source": d["source"],
                "description": d["description"],
            }
            for d in dists
        ],
        "op_measurements": ops,
        "op_curves": curves,
        "host_records": [asdict(h) for h in read_hosts(db.engine) if not gpus or _gpu_name(db, h.gpu) in gpu_names],
    }


def _gpu_name(db: ProfileDB, name: str) -> str | None:
    """The database's name of GPU ``name`` (None: unknown), for a partial export's host records."""
    try:
        return db.gpu(name).name
    except UnknownNameError:
        return None


def gpu_json(spec: GpuSpec) -> dict[str, Any]:
    """A GPU as a JSON object (the export format's ``gpus`` entries; `gpemu gpus --json`)."""
    d = asdict(spec)
    d["aliases"] = list(spec.aliases)
    d["compute_capability"] = list(spec.compute_capability) if spec.compute_capability else None
    return d


def export_db(
    db: ProfileDB,
    path: str | Path,
    fmt: str | None = None,
    *,
    gpus: Iterable[str] | None = None,
    models: Iterable[str] | None = None,
) -> dict[str, int]:
    """Write the database (or only some GPUs / models) to ``path``; returns row counts.

    ``fmt`` is "json" or "csv"; by default a path ending in .json gets JSON, anything else a
    CSV directory.
    """
    path = Path(path)
    fmt = fmt or ("json" if path.suffix.lower() == ".json" else "csv")
    if fmt not in ("json", "csv"):
        raise ValueError(f"export format must be 'json' or 'csv', got {fmt!r}")
    data = _dump(db, gpus, models)
    if fmt == "json":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, separators=(",", ":")))
    else:
        if path.exists() and not path.is_dir():
            raise ValueError(
                f"CSV export writes a directory of CSV files, but {path} is a file; "
                "name a directory, or a .json file for JSON"
            )
        path.mkdir(parents=True, exist_ok=True)
        _write_csv(path / "gpus.csv", _GPU_COLUMNS, [[_gpu_cell(c, g[c]) for c in _GPU_COLUMNS] for g in data["gpus"]])
        _write_csv(path / "models.csv", _MODEL_COLUMNS, [[m[c] for c in _MODEL_COLUMNS] for m in data["models"]])
        meta_i = MEASUREMENT_COLUMNS.index("metadata")
        _write_csv(
            path / "measurements.csv",
            MEASUREMENT_COLUMNS,
            [
                [json.dumps(v, sort_keys=True) if i == meta_i else v for i, v in enumerate(r)]
                for r in data["measurements"]["rows"]
            ],
        )
        _write_csv(
            path / "distributions.csv",
            _DIST_COLUMNS,
            [[json.dumps(d[c]) if c == "samples" else d[c] for c in _DIST_COLUMNS] for d in data["distributions"]],
        )
        _write_csv(
            path / "op_measurements.csv",
            _OP_COLUMNS,
            [
                [json.dumps(r[c], sort_keys=True) if c == "metadata" else r[c] for c in _OP_COLUMNS]
                for r in data["op_measurements"]
            ],
        )
        _write_csv(path / "op_curves.csv", _CURVE_COLUMNS, [[r[c] for c in _CURVE_COLUMNS] for r in data["op_curves"]])
        _write_csv(
            path / "host_records.csv",
            _HOST_COLUMNS,
            [
                [json.dumps(r[c], sort_keys=True) if c == "metadata" else r[c] for c in _HOST_COLUMNS]
                for r in data["host_records"]
            ],
        )
    return {
        "gpus": len(data["gpus"]),
        "models": len(data["models"]),
        "measurements": len(data["measurements"]["rows"]),
        "distributions": len(data["distributions"]),
        "op_measurements": len(data["op_measurements"]),
        "op_curves": len(data["op_curves"]),
        "host_records": len(data["host_records"]),
    }


def _gpu_cell(column: str, value: Any) -> Any:
    if column == "aliases":
        return json.dumps(value)
    if column == "compute_capability" and value:
        return f"{value[0]}.{value[1]}"
    return value


def _write_csv(path: Path, header: list[str], rows: Iterable[list[Any]]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for r in rows:
            # None -> empty cell; floats keep repr precision (exact round trip).
            w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in r])


# ---------------------------------------------------------------------------------- import
def import_path(db: ProfileDB, path: str | Path) -> ImportReport:
    """Import a JSON export, a CSV export directory, or one measurements CSV file.

    A file that cannot be read as one of these is a ValueError naming what is wrong; inside a
    readable file every bad row is rejected on its own (see :class:`ImportReport`)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(
            f"nothing to import: {path} does not exist (give a .json export, a CSV export "
            "directory, or a measurements .csv file)"
        )
    if path.is_dir():
        sections = _read_csv_dir(path)
    elif path.suffix.lower() == ".json":
        sections = _read_json(path)
    elif path.suffix.lower() == ".csv":
        sections = {
            "gpus": [],
            "models": [],
            "measurements": _csv_rows(path, _parse_measurement_cells),
            "distributions": [],
        }
    else:
        raise ValueError(f"cannot import {path}: expected a .json export, a CSV export directory, or a .csv file")
    return _import_sections(db, sections)


def _read_json(path: Path) -> dict[str, list[tuple[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text, so not a gpemu JSON export") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path} nests JSON arrays or objects too deeply to be a gpemu export") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ValueError(f'{path} is not a gpemu profile database export (expected "format": "{FORMAT_NAME}")')
    version = data.get("schema_version", S.SCHEMA_VERSION)
    # Older exports are read as they are (fields added since have defaults); newer ones are refused.
    if not (isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= S.SCHEMA_VERSION):
        hint = (
            "it was written by a newer gpemu: upgrade gpemu (pip install -U gpemu) to import it, or export "
            "it again with that gpemu as CSV (`gpemu db export DIR --format csv`), which this one reads"
            if isinstance(version, int) and not isinstance(version, bool) and version > S.SCHEMA_VERSION
            else f"this gpemu reads exports with schema_version 1 to {S.SCHEMA_VERSION}"
        )
        raise ValueError(f"{path} has schema_version {_quote(version)}; {hint}")
    for name in ("gpus", "models", "distributions", "op_measurements", "op_curves", "host_records"):
        if not isinstance(data.get(name, []), list):
            raise ValueError(f'{path}: "{name}" must be a list of objects, got {type(data[name]).__name__}')
    meas = data.get("measurements", {"columns": MEASUREMENT_COLUMNS, "rows": []})
    cols = meas.get("columns") if isinstance(meas, dict) else None
    rows = meas.get("rows", []) if isinstance(meas, dict) else None
    if not (isinstance(cols, list) and all(isinstance(c, str) for c in cols) and isinstance(rows, list)):
        raise ValueError(
            f'{path}: "measurements" must be an object with "columns" (a list of column names) '
            f'and "rows" (a list of value lists), got {_quote(meas)}'
        )
    return {
        "gpus": [(f"{path.name} gpus #{i}", g) for i, g in enumerate(data.get("gpus", []), 1)],
        "models": [(f"{path.name} models #{i}", m) for i, m in enumerate(data.get("models", []), 1)],
        "measurements": [
            (
                f"{path.name} measurements #{i}",
                dict(zip(cols, r, strict=False))
                if isinstance(r, list) and len(r) == len(cols)
                else ValueError(f"a row must be a list of {len(cols)} values (the columns), got {_quote(r)}"),
            )
            for i, r in enumerate(rows, 1)
        ],
        "distributions": [
            (f"{path.name} distributions #{i}", d) for i, d in enumerate(data.get("distributions", []), 1)
        ],
        **{
            name: [(f"{path.name} {name} #{i}", d) for i, d in enumerate(data.get(name, []), 1)]
            for name in ("op_measurements", "op_curves", "host_records")
        },
    }


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _read_csv_dir(path: Path) -> dict[str, list[tuple[str, Any]]]:
    expected = (
        "gpus.csv",
        "models.csv",
        "measurements.csv",
        "distributions.csv",
        "op_measurements.csv",
        "op_curves.csv",
        "host_records.csv",
    )
    if not any((path / f).exists() for f in expected):
        raise ValueError(f"{path} holds none of {', '.join(expected)} (is it a `gpemu db export` directory?)")

    def rows(name: str, parse: Any) -> list[tuple[str, Any]]:
        return _csv_rows(path / name, parse) if (path / name).exists() else []

    return {
        "gpus": rows("gpus.csv", _parse_gpu_cells),
        "models": rows("models.csv", _parse_model_cells),
        "measurements": rows("measurements.csv", _parse_measurement_cells),
        "distributions": rows("distributions.csv", _parse_dist_cells),
        "op_measurements": rows("op_measurements.csv", _parse_op_cells),
        "op_curves": rows("op_curves.csv", _parse_op_cells),
        "host_records": rows("host_records.csv", _parse_host_cells),
    }


def _csv_rows(path: Path, parse: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    line_no = 1
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            for line_no, cells in enumerate(reader, 2):
                where = f"{path.name}:{line_no}"
                try:
                    out.append((where, parse({k: v for k, v in cells.items() if k is not None})))
                except (ValueError, RecursionError) as exc:
                    out.append(
                        (
                            where,
                            exc
                            if isinstance(exc, ValueError)
                            else ValueError("a JSON cell nests arrays or objects too deeply"),
                        )
                    )  # reported as rejected
    except csv.Error as exc:
        # The reader cannot resynchronise after this (e.g. a field over its 128 KiB limit).
        raise ValueError(
            f"{path.name}:{line_no + 1}: not a readable CSV file ({exc}); a gpemu export has no "
            "field longer than 128 KiB and no NUL bytes"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text, so not a gpemu CSV export") from None
    return out


def _metadata(v: str) -> dict:
    """A CSV row's ``metadata`` cell: a JSON object (empty: none)."""
    try:
        return json.loads(v or "{}")
    except json.JSONDecodeError:
        raise ValueError(f"metadata must be a JSON object, got {v!r}") from None


def _num(text: str, what: str, integer: bool = False) -> Any:
    try:
        if integer:
            f = float(text)
            if not math.isfinite(f) or f != int(f):
                raise ValueError
            return int(f)
        return float(text)
    except ValueError:
        raise ValueError(f"bad {what} {text!r}: expected {'an integer' if integer else 'a number'}") from None


def _parse_measurement_cells(c: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in c.items():
        v = (v or "").strip()
        if v == "":
            continue
        if k in ("batch_size", "world_size", "samples"):
            out[k] = _num(v, k.replace("_", " "), integer=True)
        elif k in ("value", *_OPTIONAL_FLOATS):
            out[k] = _num(v, k)
        elif k == "metadata":
            try:
                out[k] = json.loads(v)
            except json.JSONDecodeError:
                raise ValueError(f"metadata must be a JSON object, got {v!r}") from None
        else:
            out[k] = v
    return out


def _parse_gpu_cells(c: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: (v or "").strip() for k, v in c.items()}
    try:
        out["aliases"] = json.loads(c.get("aliases") or "[]")
    except json.JSONDecodeError:
        raise ValueError(f'aliases must be a JSON list of names such as ["V100"], got {c.get("aliases")!r}') from None
    for k in ("memory_bytes", "sm_count"):
        out[k] = _num(c.get(k, ""), k, integer=True)
    for k in (
        "fp32_flops",
        "fp16_flops",
        "memory_bandwidth",
        "host_link_bandwidth_pinned",
        "host_link_bandwidth_pageable",
    ):
        out[k] = _num(c.get(k, ""), k)
    # Optional since schema 2: an empty cell (or a missing column) is "not known".
    for k in (
        "fp64_flops",
        "fp16_nontensor_flops",
        "tf32_tensor_flops",
        "fp16_tensor_flops",
        "bf16_tensor_flops",
        "nvlink_bandwidth",
    ):
        out[k] = _num(out[k], k) if out.get(k) else None
    out["pcie_gen"] = _num(out["pcie_gen"], "pcie_gen", integer=True) if out.get("pcie_gen") else None
    for k in ("generation", "compute_capability"):
        out[k] = out.get(k) or None
    if not out.get("provenance"):
        out.pop("provenance", None)
    return out


def _parse_model_cells(c: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = dict(c)
    for k in ("param_count", "param_bytes", "buffer_bytes"):
        out[k] = _num(c.get(k, ""), k, integer=True)
    for k in ("fwd_flops_per_sample", "fwd_bwd_flops_per_sample"):
        out[k] = _num(c.get(k, ""), k)
    out["input_size"] = _num(c["input_size"], "input_size", integer=True) if c.get("input_size") else None
    out["fingerprint"] = c.get("fingerprint") or None
    return out


def _parse_op_cells(c: dict[str, str]) -> dict[str, Any]:
    """A row of op_measurements.csv / op_curves.csv: numbers as numbers (checked on import)."""
    out: dict[str, Any] = {}
    for k, v in c.items():
        v = (v or "").strip()
        if k in ("samples", "sm_count", "rows"):
            out[k] = _num(v, k.replace("_", " "), integer=True)
        elif k in ("work", "z", "seconds", "peak", "e", "x0", "p", "k0", "h", "rms_log_error"):
            out[k] = _num(v, k)
        elif k in ("p10", "p90"):
            out[k] = _num(v, k) if v else None
        elif k == "metadata":
            out[k] = _metadata(v)
        else:
            out[k] = v or None
    return out


def _finite(d: dict[str, Any], names: Iterable[str], low: float, strict: bool) -> None:
    for k in names:
        v = d.get(k)
        if not (is_number(v) and math.isfinite(v) and (v > low if strict else v >= low)):
            raise ValueError(f"{k} must be a finite number {'>' if strict else '>='} {low:g}, got {_quote(v)}")


def _op_fields(raw: Any, columns: list[str], what: str, stamp: str) -> tuple[str, str | None, dict[str, Any]]:
    """(GPU name, time stamp, the rest) of an op_measurements / op_curves row, its key and path checked."""
    d = dict(_only(raw, columns, what))
    gpu, when = d.pop("gpu", None), d.pop(stamp, None)
    if not isinstance(gpu, str) or not gpu.strip():
        raise ValueError("needs the GPU's name (gpu)")
    key = d.get("key")
    if not (isinstance(key, str) and key.count(".") == 1 and key.split(".")[1] in ("fwd", "bwd") and key.split(".")[0]):
        raise ValueError(f"key must be a curve key such as 'gemm.fwd' or 'norm.bwd', got {_quote(key)}")
    if d.get("path") not in _OP_PATHS:
        raise ValueError(f"path must be one of {', '.join(_OP_PATHS)}, got {_quote(d.get('path'))}")
    if when is not None and not isinstance(when, str):
        raise ValueError(f"{stamp} must be a time stamp string, got {_quote(when)}")
    return gpu.strip(), when, d


def _int_at_least(d: dict[str, Any], names: Iterable[str], low: int) -> None:
    for k in names:
        v = d.get(k)
        if not (is_int(v) and v >= low):
            raise ValueError(f"{k} must be an integer >= {low}, got {_quote(v)}")


def _op_measurement(raw: Any) -> tuple[str, str | None, OpMeasurement]:
    gpu, when, d = _op_fields(raw, _OP_COLUMNS, "op measurement", "measured_at")
    for k in ("dtype", "shape", "op"):
        if not isinstance(d.get(k), str) or not d[k]:
            raise ValueError(f"{k} must be a non-empty string, got {_quote(d.get(k))}")
    _finite(d, ("work", "z"), 0.0, strict=False)
    _finite(d, ("seconds", "peak"), 0.0, strict=True)
    _finite(d, [k for k in ("p10", "p90") if d.get(k) is not None], 0.0, strict=False)
    _int_at_least(d, ("samples", "sm_count"), 1)
    if not isinstance(d.get("metadata", {}), dict):
        raise ValueError(f"metadata must be an object, got {_quote(d.get('metadata'))}")
    return gpu, when, OpMeasurement(**d)


def _op_curve(raw: Any) -> tuple[str, str | None, OpCurveRow]:
    gpu, when, d = _op_fields(raw, _CURVE_COLUMNS, "op curve", "fitted_at")
    _finite(d, ("e", "x0", "p"), 0.0, strict=True)
    _finite(d, ("k0", "h", "rms_log_error"), 0.0, strict=False)
    _int_at_least(d, ("rows",), 1)
    return gpu, when, OpCurveRow(**d)


def _parse_host_cells(c: dict[str, str]) -> dict[str, Any]:
    """A row of host_records.csv: numbers as numbers, metadata as JSON (checked on import)."""
    out: dict[str, Any] = {}
    for k, v in c.items():
        v = (v or "").strip()
        if k in ("forward_op_s", "backward_op_s", "launch_s", "reference_ms"):
            out[k] = _num(v, k)
        elif k == "metadata":
            out[k] = _metadata(v)
        else:
            out[k] = v
    return out


def _host_record(raw: Any) -> HostRecord:
    """One imported host record, its name, texts and figures checked."""
    d = dict(_only(raw, _HOST_COLUMNS, "host record"))
    name = d.get("name")
    check_host_name(name if isinstance(name, str) else repr(name))
    for k in ("cpu", "torch_version", "gpu", "measured_at"):
        if not isinstance(d.get(k, ""), str):
            raise ValueError(f"{k} must be a string, got {_quote(d.get(k))}")
    _finite(d, ("forward_op_s", "backward_op_s", "reference_ms"), 0.0, strict=True)
    _finite(d, ("launch_s",), 0.0, strict=False)
    if not isinstance(d.get("metadata", {}), dict):
        raise ValueError(f"metadata must be an object, got {_quote(d.get('metadata'))}")
    for k in ("cpu", "torch_version", "gpu"):
        d.setdefault(k, "")
    return HostRecord(**d)


def _parse_dist_cells(c: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = dict(c)
    try:
        out["samples"] = json.loads(c.get("samples") or "")
    except json.JSONDecodeError:
        raise ValueError("samples must be a JSON list of numbers") from None
    return out


_Row = TypeVar("_Row")


def _accepted(
    rows: Iterable[tuple[str, Any]],
    parse: Callable[[Any], _Row],
    report: ImportReport,
    what: str,
    errors: tuple[type[Exception], ...] = (TypeError, ValueError),
) -> list[_Row]:
    """``parse`` of every row it accepts; each row it refuses (or that could not be read: an
    exception in its place) is reported as rejected, its reason after ``what``."""
    out = []
    for where, raw in rows:
        try:
            if isinstance(raw, Exception):
                raise raw
            out.append(parse(raw))
        except errors as exc:
            report.rejected.append(Rejected(where, f"{what}{exc}"))
    return out


def _import_sections(db: ProfileDB, sections: dict[str, list[tuple[str, Any]]]) -> ImportReport:
    """Every valid row of every section written (GPUs and models first: measurements refer to
    them), every other row reported with its reason."""
    report = ImportReport()
    # Which GPU each name and alias already means: an imported GPU may not take another's name
    # (lookups resolve to the first GPU with a name, so the import's alias would silently be dead).
    owner = {normalize_name(n): s.name for s in db.gpus() for n in (s.name, *s.aliases)}
    described = (TypeError, ValueError, AttributeError)
    gpu_rows = _accepted(sections["gpus"], lambda raw: _gpu(raw, owner), report, "bad GPU spec: ", described)
    model_rows = _accepted(sections["models"], _model, report, "bad model info: ", described)
    if gpu_rows or model_rows:
        with db.engine.begin() as conn:
            upsert(conn, S.gpus, gpu_rows, ("name",))
            upsert(conn, S.models, model_rows, ("name",))
        db.invalidate()
    report.gpus, report.models = len(gpu_rows), len(model_rows)
    prepared = _accepted(sections["measurements"], _MeasurementRows(db), report, "")
    dist_rows = _accepted(sections["distributions"], _distribution, report, "bad distribution: ")
    # A GPU's own calibration (gpemu profile --ops): keyed by GPU name, like the tables themselves;
    # written per (GPU, time stamp) so an import keeps when each row was measured or fitted.
    ops = _by_gpu_and_time(
        _accepted(sections.get("op_measurements", []), _op_measurement, report, "bad op measurement: ")
    )
    curves = _by_gpu_and_time(_accepted(sections.get("op_curves", []), _op_curve, report, "bad op curve: "))
    with db.engine.begin() as conn:
        upsert(conn, S.measurements, prepared, ("gpu_id", "model_id", "kind", "batch_size", "world_size"))
        upsert(conn, S.distributions, dist_rows, ("name",))
    for (gpu, when), op_rows in ops.items():
        report.op_measurements += write_op_measurements(db.engine, gpu, op_rows, when)
    for (gpu, when), curve_rows in curves.items():
        report.op_curves += write_curves(db.engine, gpu, curve_rows, when)
    # A GPU host's issue times (gpemu profile --host-side), keyed by host name; stamps kept.
    for host in _accepted(sections.get("host_records", []), _host_record, report, "bad host record: "):
        write_host(db.engine, host)
        report.host_records += 1
    db.invalidate()
    report.measurements, report.distributions = len(prepared), len(dist_rows)
    return report


def _gpu(raw: Any, owner: dict[str, str]) -> dict[str, Any]:
    """The gpus-table row of one imported GPU; its names join ``owner`` (normalised name ->
    the GPU it means), and a name another GPU already has is refused."""
    spec = check_generation(GpuSpec(**_only(raw, _GPU_COLUMNS, "GPU")))
    for n in (spec.name, *spec.aliases):
        if owner.setdefault(normalize_name(n), spec.name) != spec.name:
            raise ValueError(f"{n!r} already names {owner[normalize_name(n)]}; give {spec.name} another alias")
    return gpu_row(spec)


def _model(raw: Any) -> dict[str, Any]:
    return model_row(ModelInfo(**_only(raw, _MODEL_COLUMNS, "model")))


class _MeasurementRows:
    """Measurements as rows of the measurements table, their GPU and model resolved to the
    database's rows (names resolved once per GPU: an import may hold thousands of rows each)."""

    def __init__(self, db: ProfileDB) -> None:
        self.db = db
        self.gpu_ids: dict[str, int | None] = {}

    def __call__(self, raw: Any) -> dict[str, Any]:
        m = clean_measurement(raw)
        if m["gpu"] not in self.gpu_ids:
            self.gpu_ids[m["gpu"]] = self.db.gpu_row_id(m["gpu"])
        gid = self.gpu_ids[m["gpu"]]
        if gid is None:
            raise ValueError(f"unknown GPU {m['gpu']!r} and the import has no spec for it")
        mid = self.db.model_row_id(m["model"])
        if mid is None:
            raise ValueError(f"unknown model {m['model']!r} and the import has no info for it")
        return measurement_row(m, gid, mid)


def _distribution(raw: Any) -> dict[str, Any]:
    """The distributions-table row of one imported distribution (finite samples >= 0)."""
    d = _only(raw, _DIST_COLUMNS, "distribution")
    samples = d.get("samples")
    if d.get("unit") not in ("seconds", "bytes"):
        raise ValueError(f"unit must be 'seconds' or 'bytes', got {d.get('unit')!r}")
    if (
        not isinstance(d.get("name"), str)
        or not d["name"].strip()
        or not isinstance(samples, list)
        or not samples
        or not all(is_number(x) and math.isfinite(x) and x >= 0 for x in samples)
    ):
        raise ValueError("needs a name and a non-empty list of finite sample values >= 0")
    return {
        "name": d["name"],
        "unit": d["unit"],
        "samples_json": json.dumps(samples),
        "source": d.get("source") or "",
        "description": d.get("description") or "",
    }


def _by_gpu_and_time(rows: Iterable[tuple[str, str | None, _Row]]) -> dict[tuple[str, str | None], list[_Row]]:
    """Op rows grouped by (GPU name, time stamp), the unit they are written in."""
    out: dict[tuple[str, str | None], list[_Row]] = {}
    for gpu, when, row in rows:
        out.setdefault((gpu, when), []).append(row)
    return out


def _only(raw: Any, allowed: list[str], what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"expected an object of {what} fields, got {type(raw).__name__}")
    unknown = set(raw) - set(allowed)
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
    return raw
