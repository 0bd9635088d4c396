"""``ProfileDB``: name resolution, lookups with provenance, and the write API of the profiler.

Lookups run at model-identification time, not per op; each (GPU, model, kind) series is read
once and kept in memory, so repeated lookups cost microseconds.
"""

from __future__ import annotations

import json
import math
import numbers
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeGuard

import numpy as np
from sqlalchemy import Engine, Table, func, insert, select, update
from sqlalchemy.engine import Connection

from . import schema as S
from .records import (
    BATCH_INDEPENDENT,
    KIND_UNITS,
    KINDS,
    GpuSpec,
    Lookup,
    Measurement,
    MissingMeasurementError,
    ModelInfo,
    UnknownNameError,
    check_batch_size,
    check_kind,
    normalize_name,
)

__all__ = [
    "ProfileDB",
    "clean_measurement",
    "measurement_row",
    "gpu_row",
    "spec_from_row",
    "check_generation",
    "model_row",
    "upsert",
    "is_int",
    "is_number",
]

# Said with every unknown-GPU error: how a GPU the database lacks gets in.
ADD_GPU_HINT = "add one from its datasheet with `gpemu gpus add` (see docs/adding.md)"

# Fraction of the profiled points (the largest batch sizes) a beyond-range linear fit uses.
_EXTRAPOLATION_FRACTION = 0.25


@dataclass(frozen=True)
class _Names:
    gpus: dict[int, GpuSpec]
    gpu_keys: dict[str, int]  # normalize_name(name or alias) -> id
    models: dict[int, ModelInfo]
    model_keys: dict[str, int]  # lower-case name -> id


class ProfileDB:
    """The profile database: GPUs, models, measurements and sampled distributions."""

    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        self._lock = threading.Lock()
        self._names_cache: _Names | None = None
        self._series: dict[tuple[int, int, str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._sources: dict[tuple[int, int, str, int], set[str]] = {}
        # (series key, above range?) -> (slope, intercept) of the extrapolation line
        self._fits: dict[tuple[tuple[int, int, str, int], bool], tuple[float, float]] = {}
        self._dists: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"ProfileDB({self.engine.url.render_as_string(hide_password=True)!r})"

    # ------------------------------------------------------------------ names
    def _names(self) -> _Names:
        """GPUs and models by id and by lookup key, swapped in as one object so a write on
        another thread (which drops it) never leaves a reader with half a cache."""
        names = self._names_cache
        if names is not None:
            return names
        with self._lock:
            if self._names_cache is not None:
                return self._names_cache
            with self.engine.connect() as conn:
                grows = conn.execute(select(S.gpus)).mappings().all()
                mrows = conn.execute(select(S.models)).mappings().all()
            names = _Names({}, {}, {}, {})
            for r in grows:
                spec = spec_from_row(r)
                names.gpus[r["id"]] = spec
                for n in (spec.name, *spec.aliases):
                    names.gpu_keys.setdefault(normalize_name(n), r["id"])
            for r in mrows:
                info = ModelInfo(
                    name=r["name"],
                    class_name=r["class_name"],
                    param_count=int(r["param_count"]),
                    param_bytes=int(r["param_bytes"]),
                    buffer_bytes=int(r["buffer_bytes"]),
                    fwd_flops_per_sample=r["fwd_flops_per_sample"],
                    fwd_bwd_flops_per_sample=r["fwd_bwd_flops_per_sample"],
                    fingerprint=r["fingerprint"],
                    input_size=r["input_size"],
                )
                names.models[r["id"]] = info
                names.model_keys[info.name.lower()] = r["id"]
            self._names_cache = names
            return names

    def invalidate(self) -> None:
        """Forget what this object cached of the database: for writers that go to its tables
        directly (an import), so that the next lookup reads what they wrote."""
        with self._lock:
            self._names_cache = None
            self._series.clear()
            self._sources.clear()
            self._fits.clear()
            self._dists.clear()

    def gpu_row_id(self, name: str) -> int | None:
        """The id of the GPU row this name or alias means (as :meth:`gpu` matches it), or None."""
        return self._names().gpu_keys.get(normalize_name(name))

    def model_row_id(self, name: str) -> int | None:
        """The id of the model row this name means (as :meth:`model` matches it), or None."""
        return self._names().model_keys.get(name.strip().lower())

    def _gpu_id(self, name: str) -> int:
        names = self._names()
        if isinstance(name, GpuSpec):
            name = name.name
        if not isinstance(name, str):
            raise ValueError(f"GPU name must be a string such as 'V100', got {name!r}")
        gid = names.gpu_keys.get(normalize_name(name))
        if gid is None:
            specs = list(names.gpus.values())
            if not specs:
                raise UnknownNameError(
                    "GPU", name, [f"(none: the database {self._where()} is empty; run `gpemu db init`)"]
                )
            every = [n for s in specs for n in (s.name, *s.aliases)]
            raise UnknownNameError("GPU", name, [s.short_name for s in specs], extra_keys=every, hint=ADD_GPU_HINT)
        return gid

    def _model_id(self, name: str) -> int:
        names = self._names()
        if isinstance(name, ModelInfo):
            name = name.name
        if not isinstance(name, str):
            raise ValueError(f"model name must be a string such as 'resnet50', got {name!r}")
        mid = names.model_keys.get(name.strip().lower())
        if mid is None:
            valid = sorted(m.name for m in names.models.values())
            raise UnknownNameError("model", name, valid or [f"(none: the database {self._where()} is empty)"])
        return mid

    def _where(self) -> str:
        return self.engine.url.render_as_string(hide_password=True)

    def gpu(self, name: str) -> GpuSpec:
        """The GPU with this name or alias (case, spaces, '_' and '-' do not matter)."""
        gid = self._gpu_id(name)
        return self._names().gpus[gid]

    def gpus(self) -> list[GpuSpec]:
        return sorted(self._names().gpus.values(), key=lambda s: s.short_name.lower())

    def model(self, name: str) -> ModelInfo:
        """The model with this name (case-insensitive)."""
        mid = self._model_id(name)
        return self._names().models[mid]

    def models(self) -> list[ModelInfo]:
        return sorted(self._names().models.values(), key=lambda m: m.name)

    def models_by_structure(self, class_name: str, param_count: int) -> list[ModelInfo]:
        """Models whose nn.Module class name and parameter count both match exactly."""
        return sorted(
            (
                m
                for m in self._names().models.values()
                if m.class_name == class_name and m.param_count == int(param_count)
            ),
            key=lambda m: m.name,
        )

    # ------------------------------------------------------------------ measurements
    def _load_series(self, gid: int, mid: int, kind: str, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        key = (gid, mid, kind, world_size)
        hit = self._series.get(key)
        if hit is not None:
            return hit
        m = S.measurements
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(m.c.batch_size, m.c.value, m.c.source)
                .where(m.c.gpu_id == gid, m.c.model_id == mid, m.c.kind == kind, m.c.world_size == world_size)
                .order_by(m.c.batch_size)
            ).all()
        series = (np.array([r[0] for r in rows], dtype=float), np.array([r[1] for r in rows], dtype=float))
        if rows:  # absent series are not cached: the profiler may add them later
            self._series[key] = series
            self._sources[key] = {r[2] or "" for r in rows}
        return series

    def series(self, gpu: str, model: str, kind: str, world_size: int = 1) -> list[tuple[float, float]]:
        """The measured (batch size, value) points, by batch size; empty when none."""
        check_kind(kind)
        b, v = self._load_series(self._gpu_id(gpu), self._model_id(model), kind, world_size)
        return [(float(x), float(y)) for x, y in zip(b, v, strict=False)]

    def has(self, gpu: str, model: str, kind: str, world_size: int = 1) -> bool:
        check_kind(kind)
        return len(self._load_series(self._gpu_id(gpu), self._model_id(model), kind, world_size)[0]) > 0

    def kinds(self, gpu: str, model: str, world_size: int | None = 1) -> list[str]:
        """The kinds measured for this GPU and model (at this world size; None: any), KINDS order."""
        return sorted(
            {k for k, _ in self.measured(gpu, model) if world_size is None or _ == world_size}, key=KINDS.index
        )

    def measured(self, gpu: str, model: str) -> list[tuple[str, int]]:
        """Every (kind, world_size) with measurements for this GPU and model, KINDS order."""
        gid, mid = self._gpu_id(gpu), self._model_id(model)
        m = S.measurements
        with self.engine.connect() as conn:
            present = conn.execute(
                select(m.c.kind, m.c.world_size).where(m.c.gpu_id == gid, m.c.model_id == mid).distinct()
            ).all()
        return sorted(((k, int(w)) for k, w in present if k in KIND_UNITS), key=lambda kw: (KINDS.index(kw[0]), kw[1]))

    def sources(self, gpu: str, model: str, kind: str, world_size: int = 1) -> set[str]:
        """The source tags of the measurements of ``kind`` for this GPU and model (see
        :data:`~gpemu.db.records.ARTIFACT_SOURCE`); empty when none."""
        check_kind(kind)
        key = (self._gpu_id(gpu), self._model_id(model), kind, world_size)
        self._load_series(*key)
        return set(self._sources.get(key, ()))

    def lookup(self, gpu: str, model: str, batch_size: int, kind: str, world_size: int = 1) -> Lookup:
        """Value of ``kind`` for ``model`` on ``gpu`` at ``batch_size``, with its provenance.

        measured: a profiled batch size; interpolated: piecewise-linear between the two
        neighbouring profiled sizes (small models are far from linear in batch size);
        extrapolated: outside the profiled range, a least-squares line through the nearest
        quarter of the points, never below zero (memory: never below the parameters' bytes).
        """
        check_kind(kind)
        bs = check_batch_size(batch_size)
        gid, mid = self._gpu_id(gpu), self._model_id(model)
        xs, ys = self._load_series(gid, mid, kind, world_size)
        unit = KIND_UNITS[kind]
        if len(xs) == 0:
            have = self.kinds(gpu, model)
            raise MissingMeasurementError(
                f"no {kind} measurements for {self.model(model).name} on {self.gpu(gpu).name}"
                + (f" (world size {world_size})" if world_size != 1 else "")
                + f"; measured kinds for this pair: {', '.join(have) or 'none'}"
            )
        if kind in BATCH_INDEPENDENT or (len(xs) == 1 and xs[0] == 0):
            return Lookup(float(ys[-1]), unit, "measured")
        i = int(np.searchsorted(xs, bs))
        if i < len(xs) and xs[i] == bs:
            return Lookup(float(ys[i]), unit, "measured")
        if xs[0] < bs < xs[-1]:
            return Lookup(float(np.interp(bs, xs, ys)), unit, "interpolated")
        above = bs > xs[-1]
        fit = self._fits.get(((gid, mid, kind, world_size), above))
        if fit is None:
            fit = self._fits[((gid, mid, kind, world_size), above)] = _extrapolation_line(xs, ys, above)
        # Memory never goes below the parameters' bytes (they stay on the GPU); time never below 0.
        floor = float(self._names().models[mid].param_bytes) if unit == "bytes" else 0.0
        return Lookup(float(max(fit[0] * bs + fit[1], floor)), unit, "extrapolated")

    def distribution(self, name: str) -> np.ndarray:
        """Samples of a named distribution (e.g. 'decode-dali', seconds per batch), recorded order."""
        hit = self._dists.get(name)
        if hit is not None:
            return hit.copy()
        d = S.distributions
        with self.engine.connect() as conn:
            row = conn.execute(select(d.c.samples_json).where(d.c.name == name)).first()
            if row is None:
                valid = sorted(conn.execute(select(d.c.name)).scalars())
                raise UnknownNameError("distribution", name, valid)
        arr = np.asarray(json.loads(row[0]), dtype=float)
        self._dists[name] = arr
        return arr.copy()

    def distributions(self) -> list[tuple[str, str, int, str]]:
        """(name, unit, sample count, description) of every distribution."""
        d = S.distributions
        with self.engine.connect() as conn:
            rows = conn.execute(select(d.c.name, d.c.unit, d.c.samples_json, d.c.description).order_by(d.c.name)).all()
        return [(r[0], r[1], len(json.loads(r[2])), r[3]) for r in rows]

    def count(self, kind: str | None = None) -> int:
        """Number of measurement rows (of one kind, or all)."""
        m = S.measurements
        q = select(func.count()).select_from(m)
        if kind is not None:
            q = q.where(m.c.kind == check_kind(kind))
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar_one())

    def measurement_counts(self) -> dict[str, int]:
        """Measurement rows per GPU name (GPUs without any are absent): which GPUs are measured."""
        m, g = S.measurements, S.gpus
        with self.engine.connect() as conn:
            rows = conn.execute(select(g.c.name, func.count()).join(m, m.c.gpu_id == g.c.id).group_by(g.c.name)).all()
        return {name: int(n) for name, n in rows}

    def measured_gpus(self) -> list[GpuSpec]:
        """The GPUs with forward measurements of at least one model (what a model-level fit can use)."""
        m = S.measurements
        with self.engine.connect() as conn:
            ids = set(conn.execute(select(m.c.gpu_id).where(m.c.kind == "forward").distinct()).scalars())
        names = self._names()
        return sorted((names.gpus[i] for i in ids if i in names.gpus), key=lambda s: s.short_name.lower())

    def meta(self) -> dict[str, str]:
        with self.engine.connect() as conn:
            return {k: v for k, v in conn.execute(select(S.meta.c.key, S.meta.c.value)).all()}

    # ------------------------------------------------------------------ writes (profiler, import)
    def add_gpu(self, spec: GpuSpec) -> None:
        """Insert or update a GPU (matched by name)."""
        if not isinstance(spec, GpuSpec):
            raise TypeError(f"add_gpu takes a GpuSpec, got {type(spec).__name__}")
        check_generation(spec)
        with self.engine.begin() as conn:
            upsert(conn, S.gpus, [gpu_row(spec)], ("name",))
        self.invalidate()

    def add_model(self, info: ModelInfo) -> None:
        """Insert or update a model (matched by name)."""
        if not isinstance(info, ModelInfo):
            raise TypeError(f"add_model takes a ModelInfo, got {type(info).__name__}")
        with self.engine.begin() as conn:
            upsert(conn, S.models, [model_row(info)], ("name",))
        self.invalidate()

    def add_measurements(self, rows: Iterable[Measurement | Mapping[str, Any]]) -> int:
        """Upsert measurements in one transaction (all or none). Returns the number written.

        GPUs and models must exist already (add_gpu / add_model first).
        """
        prepared = []
        for n, row in enumerate(rows, 1):
            try:
                m = clean_measurement(row)
            except ValueError as exc:
                raise ValueError(f"measurement {n}: {exc}") from None
            prepared.append(measurement_row(m, self._gpu_id(m["gpu"]), self._model_id(m["model"])))
        with self.engine.begin() as conn:
            upsert(conn, S.measurements, prepared, ("gpu_id", "model_id", "kind", "batch_size", "world_size"))
        self._series.clear()
        self._fits.clear()
        return len(prepared)

    def add_distribution(
        self, name: str, unit: str, samples: Sequence[float], *, source: str = "", description: str = ""
    ) -> None:
        """Insert or replace a named sampled distribution."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError("distribution name must be a non-empty string such as 'decode-dali'")
        if unit not in ("seconds", "bytes"):
            raise ValueError(f"distribution unit must be 'seconds' or 'bytes', got {unit!r}")
        arr = np.asarray(samples, dtype=float)
        if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"distribution {name!r} needs a non-empty list of finite values >= 0")
        with self.engine.begin() as conn:
            upsert(
                conn,
                S.distributions,
                [
                    {
                        "name": name,
                        "unit": unit,
                        "samples_json": json.dumps(arr.tolist()),
                        "source": source,
                        "description": description,
                    }
                ],
                ("name",),
            )
        self._dists.pop(name, None)

    def close(self) -> None:
        self.engine.dispose()


def _extrapolation_line(xs: np.ndarray, ys: np.ndarray, above: bool) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the quarter of the points nearest
    the side being extrapolated (at least two points); through the origin for a single point."""
    n = len(xs)
    if n == 1:
        return (float(ys[0] / xs[0]), 0.0) if xs[0] > 0 else (0.0, float(ys[0]))
    k = max(2, int(math.ceil(n * _EXTRAPOLATION_FRACTION)))
    sel = slice(n - k, n) if above else slice(0, k)
    slope, intercept = np.polyfit(xs[sel], ys[sel], 1)
    return float(slope), float(intercept)


def is_int(x: Any) -> TypeGuard[int]:
    """An integer, not a bool (numpy integers too)."""
    # type() first: the ABC isinstance check is slow across an import's many rows.
    return type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Integral))


def is_number(x: Any) -> TypeGuard[float]:
    """A real number, not a bool (numpy scalars too)."""
    return type(x) is float or type(x) is int or (not isinstance(x, bool) and isinstance(x, numbers.Real))


MEASUREMENT_FIELDS = tuple(Measurement.__dataclass_fields__)
_DEFAULTS = {name: f.default for name, f in Measurement.__dataclass_fields__.items() if name != "metadata"}


def clean_measurement(row: Measurement | Mapping[str, Any]) -> dict[str, Any]:
    """Check one measurement; returns its fields with the unit filled in. ValueError says what is wrong."""
    if isinstance(row, Measurement):
        d = {f: getattr(row, f) for f in MEASUREMENT_FIELDS}
    elif isinstance(row, Mapping):
        unknown = [k for k in row if k not in Measurement.__dataclass_fields__]
        if unknown:
            raise ValueError(
                f"unknown field(s) {', '.join(sorted(unknown))}; valid fields: {', '.join(MEASUREMENT_FIELDS)}"
            )
        missing = [f for f in ("gpu", "model", "kind", "batch_size", "value") if row.get(f) in (None, "")]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        d = {**_DEFAULTS, "metadata": None, **row}
    else:
        raise ValueError(f"expected a Measurement or a mapping, got {type(row).__name__}")
    kind = check_kind(d["kind"])
    bs = d["batch_size"]
    if not is_int(bs):
        raise ValueError(f"batch_size must be an integer, got {bs!r}")
    if kind in BATCH_INDEPENDENT:
        if bs != 0:
            raise ValueError(f"{kind} does not depend on the batch size: store it with batch_size 0, got {bs}")
    elif bs < 1:
        raise ValueError(f"batch_size must be >= 1 for {kind}, got {bs}")
    ws = d["world_size"]
    if not is_int(ws) or ws < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {ws!r}")
    v = d["value"]
    if not is_number(v) or not math.isfinite(v) or v < 0:
        raise ValueError(f"value must be a finite number >= 0, got {v!r}")
    unit = KIND_UNITS[kind]
    if d["unit"] is not None and d["unit"] != unit:
        raise ValueError(f"{kind} is stored in {unit}, got unit {d['unit']!r}")
    for fname in ("std", "p50", "p90", "p99"):
        x = d[fname]
        if x is not None and (not is_number(x) or not math.isfinite(x) or x < 0):
            raise ValueError(f"{fname} must be a finite number >= 0 or empty, got {x!r}")
    n = d["samples"]
    if n is not None and (not is_int(n) or n < 1):
        raise ValueError(f"samples must be an integer >= 1 or empty, got {n!r}")
    meta = d["metadata"]
    if meta is not None and not isinstance(meta, Mapping):
        raise ValueError(f"metadata must be a mapping (JSON object), got {type(meta).__name__}")
    for fname in ("gpu", "model"):
        if not isinstance(d[fname], str):
            raise ValueError(f"{fname} must be a name (string), got {d[fname]!r}")
    d.update(
        kind=kind,
        unit=unit,
        batch_size=int(bs),
        world_size=int(ws),
        value=float(v),
        source=d["source"] or "",
        metadata=dict(meta) if meta else {},
    )
    return d


def measurement_row(m: Measurement | Mapping[str, Any], gpu_id: int, model_id: int) -> dict[str, Any]:
    """A validated measurement (or the dict clean_measurement made) as a measurements-table row."""
    d = m if isinstance(m, dict) else {f: getattr(m, f) for f in MEASUREMENT_FIELDS}
    row = {f: d[f] for f in MEASUREMENT_FIELDS if f not in ("gpu", "model", "metadata")}
    row["gpu_id"], row["model_id"] = gpu_id, model_id
    row["metadata_json"] = json.dumps(d["metadata"], sort_keys=True) if d["metadata"] else "{}"
    return row


def gpu_row(s: GpuSpec) -> dict[str, Any]:
    row = asdict(s)
    row["aliases"] = json.dumps(list(s.aliases))
    cc = s.compute_capability
    row["compute_capability"] = f"{cc[0]}.{cc[1]}" if cc else None
    return row


def spec_from_row(r: Mapping[Any, Any]) -> GpuSpec:
    """A gpus-table row (a mapping of its columns) as a GpuSpec; columns a row lacks are unknown."""

    def opt(col: str) -> Any:
        v = r.get(col)
        return None if v is None else float(v)

    return GpuSpec(
        name=r["name"],
        aliases=tuple(json.loads(r["aliases"] or "[]")),
        memory_bytes=int(r["memory_bytes"]),
        fp32_flops=r["fp32_flops"],
        fp16_flops=r["fp16_flops"],
        memory_bandwidth=r["memory_bandwidth"],
        host_link_bandwidth_pinned=r["host_link_bandwidth_pinned"],
        host_link_bandwidth_pageable=r["host_link_bandwidth_pageable"],
        sm_count=int(r["sm_count"]),
        generation=r.get("generation") or None,
        compute_capability=r.get("compute_capability") or None,
        fp64_flops=opt("fp64_flops"),
        fp16_nontensor_flops=opt("fp16_nontensor_flops"),
        tf32_tensor_flops=opt("tf32_tensor_flops"),
        fp16_tensor_flops=opt("fp16_tensor_flops"),
        bf16_tensor_flops=opt("bf16_tensor_flops"),
        pcie_gen=None if r.get("pcie_gen") is None else int(r["pcie_gen"]),
        nvlink_bandwidth=opt("nvlink_bandwidth"),
        source=r.get("source") or "",
        provenance=r.get("provenance") or "user",
    )


def check_generation(spec: GpuSpec) -> GpuSpec:
    """``spec`` if its generation is one the cost model knows (or unknown); ValueError naming the
    valid ones otherwise. (Imports the cost model's GPU table: not for hot paths.)"""
    if spec.generation is not None:
        from gpemu.costmodel.gpus import GENERATIONS as valid

        if spec.generation not in valid:
            raise ValueError(
                f"GpuSpec.generation of {spec.name!r} must be one of {', '.join(valid)}, got {spec.generation!r}"
            )
    return spec


def model_row(m: ModelInfo) -> dict[str, Any]:
    return asdict(m)


def upsert(
    conn: Connection, table: Table, rows: Sequence[Any], key: Sequence[str], columns: Sequence[str] | None = None
) -> None:
    """Insert rows, updating those whose ``key`` columns already exist (idempotent writes).

    Rows are dicts, or tuples in ``columns`` order (cheaper for bulk loads).
    """
    if not rows:
        return
    dialect = conn.dialect.name
    if columns is None:
        cols = list(rows[0])
        tuples = None
    else:
        cols = list(columns)
        tuples = rows
    if dialect == "sqlite":
        # One prepared statement through the DB-API: ~10x faster than SQLAlchemy's executemany
        # for the hundreds of thousands of rows an import carries.
        sets = ", ".join(f"{c}=excluded.{c}" for c in cols if c not in key)
        sql = (
            f"INSERT INTO {table.name} ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))}) "
            f"ON CONFLICT ({', '.join(key)}) DO " + (f"UPDATE SET {sets}" if sets else "NOTHING")
        )
        if tuples is None:
            tuples = [tuple(r[c] for c in cols) for r in rows]
        driver = conn.connection.driver_connection
        if driver is None:  # (SQLAlchemy hands a live connection's; None only once it is closed)
            raise RuntimeError(f"the connection to {conn.engine.url!r} is closed")
        driver.executemany(sql, tuples)
        return
    if tuples is not None:
        rows = [dict(zip(cols, t, strict=False)) for t in tuples]
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        for start in range(0, len(rows), 5000):
            stmt = pg_insert(table)
            stmt = stmt.on_conflict_do_update(
                index_elements=list(key), set_={c: stmt.excluded[c] for c in cols if c not in key}
            )
            conn.execute(stmt, rows[start : start + 5000])
        return
    # Portable fallback for other databases: one lookup per row.
    for row in rows:
        cond = [table.c[k] == row[k] for k in key]
        found = conn.execute(select(table.c[key[0]]).where(*cond)).first()
        if found is None:
            conn.execute(insert(table), [row])
        else:
            conn.execute(update(table).where(*cond).values(**{c: v for c, v in row.items() if c not in key}))
