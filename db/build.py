"""Build the profile database from the shipped data, and open it safely from many processes.

The default database is one SQLite file in ``EmuConfig.default_data_dir``. DataLoader workers
and DDP ranks all call ``gpemu.patch()`` at the same moment, so the first build happens under
an exclusive file lock, into a temporary file that is atomically renamed into place: a reader
never sees a half-built database, and only one process builds it. A database built by another
schema or data version is rebuilt the same way (readers holding the old file keep reading it).
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import fcntl
import functools
import gzip
import hashlib
import io
import json
import os
import sqlite3
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import Engine, create_engine, event, insert, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool, StaticPool

from . import schema as S
from .lookup import ProfileDB, gpu_row, model_row, upsert
from .records import KIND_UNITS, ModelInfo
from .specs import SHIPPED_GPUS

__all__ = [
    "DEFAULT_DB_NAME",
    "data_version",
    "default_db_path",
    "ensure_default_db",
    "load_shipped",
    "make_engine",
    "open_url",
    "sqlite_url",
]

DEFAULT_DB_NAME = "profiles.sqlite"
_DATA_FILES = ("measurements.csv.gz", "models.csv", "distributions.json.gz")
# Per row a short tag (277k copies); the full citation is stored once, in the meta table.
_ROW_SOURCE = "gpemu-artifact"
_SOURCE = "GPEmu artifact (Wang et al., PVLDB 18(6), 2025, doi:10.14778/3725688.3725716)"


def _data_path(name: str) -> Any:
    return resources.files("gpemu.db").joinpath("data", name)


@functools.lru_cache(maxsize=1)
def data_version() -> str:
    """Hash of the shipped data files: a changed file means default databases get rebuilt."""
    h = hashlib.sha256()
    for name in _DATA_FILES:
        h.update(name.encode())
        h.update(_data_path(name).read_bytes())
    return h.hexdigest()[:16]


def default_db_path(data_dir: Path) -> Path:
    return Path(data_dir) / DEFAULT_DB_NAME


def sqlite_url(path: str | Path) -> str:
    """SQLAlchemy URL of a SQLite file; escapes '#', '?' and '%' that a plain f-string would not."""
    return URL.create("sqlite", database=str(Path(path).resolve())).render_as_string()


def make_engine(url: str) -> Engine:
    """An engine that is safe after fork (no pooled connections crossing processes)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database in (None, "", ":memory:"):
            # One shared connection, or every checkout would see a fresh empty database.
            return create_engine(url, poolclass=StaticPool, connect_args={"check_same_thread": False})
        engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": 60})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def open_url(url: str) -> ProfileDB:
    """Open any SQLAlchemy URL, creating the tables if missing (an empty database stays empty)."""
    engine = make_engine(url)
    try:
        S.metadata.create_all(engine)
        with engine.begin() as conn:
            found = conn.execute(select(S.meta.c.value).where(S.meta.c.key == "schema_version")).scalar()
            if found is None:
                conn.execute(insert(S.meta), [{"key": "schema_version", "value": str(S.SCHEMA_VERSION)}])
            elif int(found) != S.SCHEMA_VERSION:
                raise ValueError(
                    f"profile database {make_url(url).render_as_string(hide_password=True)} has schema version "
                    f"{found}, this gpemu uses {S.SCHEMA_VERSION}; export it with the gpemu that made it, "
                    "then import it into a new database"
                )
    except Exception:
        engine.dispose()
        raise
    return ProfileDB(engine, url)


def load_shipped(engine: Engine) -> dict[str, int]:
    """Write the shipped GPUs, models, measurements and distributions (upsert: idempotent)."""
    S.metadata.create_all(engine)

    models = _read_models()
    with engine.begin() as conn:
        upsert(conn, S.gpus, [gpu_row(s) for s in SHIPPED_GPUS], ("name",))
        upsert(conn, S.models, [model_row(m) for m in models], ("name",))
        gpu_ids = {}
        for gid, name, aliases in conn.execute(select(S.gpus.c.id, S.gpus.c.name, S.gpus.c.aliases)):
            gpu_ids[name] = gid
            for a in json.loads(aliases):
                gpu_ids.setdefault(a, gid)
        model_ids = dict((n, i) for i, n in conn.execute(select(S.models.c.id, S.models.c.name)))
        rows = _measurement_rows(gpu_ids, model_ids)
        upsert(conn, S.measurements, rows, ("gpu_id", "model_id", "kind", "batch_size", "world_size"),
               columns=_MEASUREMENT_COLUMNS)
        dists = json.loads(gzip.decompress(_data_path("distributions.json.gz").read_bytes()))
        upsert(conn, S.distributions, [{
            "name": d["name"], "unit": d["unit"], "samples_json": json.dumps(d["samples"]),
            "source": d["source"], "description": d["description"],
        } for d in dists], ("name",))
        meta = {
            "schema_version": str(S.SCHEMA_VERSION),
            "data_version": data_version(),
            "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "source": _SOURCE,
        }
        upsert(conn, S.meta, [{"key": k, "value": v} for k, v in meta.items()], ("key",))
    return {"gpus": len(SHIPPED_GPUS), "models": len(models), "measurements": len(rows), "distributions": len(dists)}


def _read_models() -> list[ModelInfo]:
    text = _data_path("models.csv").read_text()
    out = []
    for r in csv.DictReader(io.StringIO(text)):
        out.append(ModelInfo(
            name=r["model"], class_name=r["class"], param_count=int(r["params"]),
            param_bytes=int(r["param_bytes"]), buffer_bytes=int(r["buffer_bytes"]),
            fwd_flops_per_sample=float(r["fwd_flops_bs1"]), fwd_bwd_flops_per_sample=float(r["fwd_bwd_flops_bs1"]),
            fingerprint=None, input_size=int(r["input_size"]),
        ))
    return out


_MEASUREMENT_COLUMNS = ("gpu_id", "model_id", "kind", "batch_size", "world_size", "value", "unit", "source",
                        "metadata_json")


def _measurement_rows(gpu_ids: dict[str, int], model_ids: dict[str, int]) -> list[tuple[Any, ...]]:
    """Shipped measurements as tuples in _MEASUREMENT_COLUMNS order, sorted by the unique key
    (inserting in index order keeps SQLite's B-tree appends cheap)."""
    text = gzip.decompress(_data_path("measurements.csv.gz").read_bytes()).decode()
    capacity = {gpu_ids[s.name]: s.memory_bytes for s in SHIPPED_GPUS}
    # The artifact fills large batch sizes from the authors' regression; beyond the board's
    # memory the real GPU would have run out of memory.
    over = '{"note": "above the GPU memory capacity: authors\' regression fill-in, OOM on the real GPU"}'
    rows = []
    reader = csv.reader(io.StringIO(text))
    next(reader)
    for gpu, model, kind, bs, value in reader:
        gid = gpu_ids[gpu]
        v = float(value)
        note = over if kind == "peak_memory" and v > capacity[gid] else "{}"
        rows.append((gid, model_ids[model], kind, int(bs), 1, v, KIND_UNITS[kind], _ROW_SOURCE, note))
    rows.sort(key=lambda r: r[:4])
    return rows


def _current_versions(path: Path) -> tuple[str | None, str | None]:
    """(schema_version, data_version) stored in a database file, or Nones if unreadable."""
    try:
        # as_uri() percent-encodes '#', '?' and spaces, which a raw "file:" URI would misread.
        con = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=60)
        try:
            meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
        finally:
            con.close()
    except sqlite3.Error:
        return None, None
    return meta.get("schema_version"), meta.get("data_version")


def _is_current(path: Path) -> bool:
    return path.exists() and _current_versions(path) == (str(S.SCHEMA_VERSION), data_version())


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_default_db(data_dir: Path, *, force: bool = False) -> Path:
    """Build (or rebuild when outdated) the default SQLite database; returns its path."""
    data_dir = Path(data_dir)
    path = default_db_path(data_dir)
    if not force and _is_current(path):
        return path
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the gpemu data directory {data_dir}: {exc}; set GPEMU_DATA_DIR "
                         "to a writable directory or GPEMU_DB to a database URL") from None
    try:
        return _build_locked(data_dir, path, force)
    except PermissionError as exc:
        raise ValueError(f"cannot build the profile database in {data_dir}: {exc}; set GPEMU_DATA_DIR to a "
                         "writable directory or GPEMU_DB to a database URL") from None


def _build_locked(data_dir: Path, path: Path, force: bool) -> Path:
    with _exclusive(data_dir / (DEFAULT_DB_NAME + ".lock")):
        if not force and _is_current(path):  # another process built it while we waited
            return path
        fd, tmp = tempfile.mkstemp(prefix=DEFAULT_DB_NAME + ".", suffix=".building", dir=data_dir)
        os.close(fd)
        try:
            engine = make_engine(sqlite_url(tmp))

            @event.listens_for(engine, "connect")
            def _fast_build(dbapi_conn: Any, _record: Any) -> None:
                # Nobody else sees this file until the rename, so durability per statement is
                # wasted work; the rename publishes it whole.
                dbapi_conn.execute("PRAGMA synchronous=OFF")
                dbapi_conn.execute("PRAGMA journal_mode=OFF")

            try:
                load_shipped(engine)
            finally:
                engine.dispose()
            with open(tmp, "rb+") as fh:  # on disk before it gets its public name
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes it private; others only read it
            os.replace(tmp, path)  # atomic: readers see the old file or the complete new one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path
