"""Build the profile database from the shipped data, and open it safely from many processes.

The default database is one SQLite file in ``EmuConfig.default_data_dir``. DataLoader workers
and DDP ranks all call ``gpemu.patch()`` at the same moment, so the first build happens under
an exclusive file lock, into a temporary file that is atomically renamed into place: a reader
never sees a half-built database, and only one process builds it. A database built by another
schema or data version (or whose ``meta`` cannot be read) is rebuilt the same way (readers
holding the old file keep reading it).

A rebuild never drops a user's row. Shipped measurements carry the source tag
``gpemu-artifact``; everything else in the old file is the user's and is carried into the new
one: measurements with another source (imported, profiled), GPUs, models and distributions the
shipped data does not have, and tables gpemu.db does not own (the profiler's limits). The old
file is kept next to the new one as ``profiles.sqlite.previous`` (one that cannot be read at all
as ``profiles.sqlite.unreadable-<time>``), and the rebuild says on stderr what it did.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime as _dt
import fcntl
import functools
import gzip
import hashlib
import io
import json
import os
import sqlite3
import sys
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, insert, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import NullPool, StaticPool

from . import schema as S
from .lookup import ProfileDB, gpu_row, model_row, upsert
from .records import ARTIFACT_SOURCE, KIND_UNITS, ModelInfo, normalize_name
from .specs import gpu_facts_digest, shipped_gpus

__all__ = [
    "DEFAULT_DB_NAME",
    "data_version",
    "default_db_path",
    "ensure_default_db",
    "load_shipped",
    "make_engine",
    "open_url",
    "sqlite_url",
    "describe_error",
    "DatabaseUnavailable",
    "RebuildReport",
]

DEFAULT_DB_NAME = "profiles.sqlite"
_DATA_FILES = ("measurements.csv.gz", "models.csv", "distributions.json.gz")
# Per row a short tag (277k copies); the full citation is stored once, in the meta table.
_ROW_SOURCE = ARTIFACT_SOURCE
_SOURCE = "GPEmu artifact (Wang et al., PVLDB 18(6), 2025, doi:10.14778/3725688.3725716)"


def _data_path(name: str) -> Any:
    return resources.files("gpemu.db").joinpath("data", name)


@functools.lru_cache(maxsize=1)
def data_version() -> str:
    """Hash of the shipped data files and GPU table: a change means default databases get rebuilt."""
    h = hashlib.sha256()
    for name in _DATA_FILES:
        h.update(name.encode())
        h.update(_data_path(name).read_bytes())
    h.update(b"gpus")  # the GPU rows come from the cost model's datasheet table
    h.update(gpu_facts_digest().encode())
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


class DatabaseUnavailable(ValueError):
    """The profile database cannot be opened or read; the message says why and what to do."""


def describe_error(url: str, exc: BaseException) -> str:
    """One line about ``exc`` raised while using the database at ``url``: no password, no traceback,
    a hint at the fix."""
    from sqlalchemy import exc as sa

    from gpemu.units import redact_url

    where = redact_url(url)
    # The password as redact_url sees it (the URL may not even parse): never echo it.
    creds = url.split("://", 1)[-1].rsplit("@", 1)[0] if "@" in url else ""
    password = creds.split(":", 1)[1] if ":" in creds else None
    cause = getattr(exc, "orig", None) or exc
    text = " ".join((str(cause).strip().splitlines() or [type(cause).__name__])[:1])
    if password:
        text = text.replace(str(password), "***")
    text = text.replace(url, where)[:300]
    if isinstance(exc, sa.NoSuchModuleError) or "Can't load plugin" in text:
        hint = (
            "--db takes a SQLAlchemy URL such as sqlite:////path/to/profiles.sqlite or "
            "postgresql+psycopg://user@host/db (PostgreSQL needs the psycopg driver)"
        )
    elif isinstance(exc, (sa.ArgumentError, ValueError, TypeError)):
        hint = "--db takes a SQLAlchemy URL such as sqlite:////path/to/profiles.sqlite or postgresql+psycopg://user@host/db"
    elif "not a database" in text or "malformed" in text:
        hint = "the file is not an intact SQLite database: point --db elsewhere, or restore it from an export"
    elif isinstance(exc, sa.OperationalError) and url.startswith("sqlite"):
        hint = "check that the file's directory exists and is readable and writable"
    elif isinstance(exc, sa.OperationalError):
        hint = "is the database server running and reachable, and are the user and password right?"
    else:
        hint = "see `gpemu --debug ...` for details"
    return f"cannot use the profile database {where}: {text}; {hint}"


def open_url(url: str) -> ProfileDB:
    """Open any SQLAlchemy URL, creating the tables if missing (an empty database stays empty).

    Raises :class:`DatabaseUnavailable` (a ValueError) for a bad URL, a missing driver, an
    unreachable server or a corrupt file, and ValueError for an unknown schema version."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        engine = make_engine(url)
    except (SQLAlchemyError, ValueError, TypeError) as exc:  # the URL does not parse, or no driver
        raise DatabaseUnavailable(describe_error(url, exc)) from None
    try:
        S.metadata.create_all(engine)
        with engine.begin() as conn:
            found = conn.execute(select(S.meta.c.value).where(S.meta.c.key == "schema_version")).scalar()
            if found is None:
                conn.execute(insert(S.meta), [{"key": "schema_version", "value": str(S.SCHEMA_VERSION)}])
            elif found != str(S.SCHEMA_VERSION):
                where = make_url(url).render_as_string(hide_password=True)
                if not (found.isdigit() and int(found) in S.MIGRATIONS):
                    raise ValueError(
                        f"profile database {where} has schema version {found}, this gpemu uses {S.SCHEMA_VERSION}; "
                        "export it with the gpemu that made it (`gpemu db export FILE.json`), then import it into "
                        "a new database"
                    )
                _migrate(conn, int(found), where)
    except SQLAlchemyError as exc:
        engine.dispose()
        raise DatabaseUnavailable(describe_error(url, exc)) from None
    except Exception:
        engine.dispose()
        raise
    return ProfileDB(engine, url)


def _migrate(conn: Any, version: int, where: str) -> None:
    """Bring a database of an older schema to the current one in place (inside ``conn``'s
    transaction: all or nothing)."""
    from sqlalchemy import update
    from sqlalchemy.exc import SQLAlchemyError

    try:
        while version < S.SCHEMA_VERSION:
            for statement in S.MIGRATIONS[version]:
                conn.exec_driver_sql(statement)
            version += 1
        conn.execute(update(S.meta).where(S.meta.c.key == "schema_version").values(value=str(S.SCHEMA_VERSION)))
    except (SQLAlchemyError, KeyError) as exc:
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:200]
        raise ValueError(
            f"profile database {where} has schema version {version}; upgrading it to "
            f"{S.SCHEMA_VERSION} failed ({cause}): it needs write access, or export it with the gpemu "
            "that made it and import it into a new database"
        ) from None


def load_shipped(engine: Engine) -> dict[str, int]:
    """Write the shipped GPUs, models, measurements and distributions (upsert: idempotent)."""
    S.metadata.create_all(engine)

    models = _read_models()
    with engine.begin() as conn:
        upsert(conn, S.gpus, [gpu_row(s) for s in shipped_gpus()], ("name",))
        upsert(conn, S.models, [model_row(m) for m in models], ("name",))
        gpu_ids = {}
        for gid, name, aliases in conn.execute(select(S.gpus.c.id, S.gpus.c.name, S.gpus.c.aliases)):
            gpu_ids[name] = gid
            for a in json.loads(aliases):
                gpu_ids.setdefault(a, gid)
        model_ids = dict((n, i) for i, n in conn.execute(select(S.models.c.id, S.models.c.name)))
        rows = _measurement_rows(gpu_ids, model_ids)
        upsert(
            conn,
            S.measurements,
            rows,
            ("gpu_id", "model_id", "kind", "batch_size", "world_size"),
            columns=_MEASUREMENT_COLUMNS,
        )
        dists = json.loads(gzip.decompress(_data_path("distributions.json.gz").read_bytes()))
        upsert(
            conn,
            S.distributions,
            [
                {
                    "name": d["name"],
                    "unit": d["unit"],
                    "samples_json": json.dumps(d["samples"]),
                    "source": d["source"],
                    "description": d["description"],
                }
                for d in dists
            ],
            ("name",),
        )
        meta = {
            "schema_version": str(S.SCHEMA_VERSION),
            "data_version": data_version(),
            "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "source": _SOURCE,
        }
        upsert(conn, S.meta, [{"key": k, "value": v} for k, v in meta.items()], ("key",))
    return {"gpus": len(shipped_gpus()), "models": len(models), "measurements": len(rows), "distributions": len(dists)}


def _read_models() -> list[ModelInfo]:
    text = _data_path("models.csv").read_text()
    out = []
    for r in csv.DictReader(io.StringIO(text)):
        out.append(
            ModelInfo(
                name=r["model"],
                class_name=r["class"],
                param_count=int(r["params"]),
                param_bytes=int(r["param_bytes"]),
                buffer_bytes=int(r["buffer_bytes"]),
                fwd_flops_per_sample=float(r["fwd_flops_bs1"]),
                fwd_bwd_flops_per_sample=float(r["fwd_bwd_flops_bs1"]),
                fingerprint=None,
                input_size=int(r["input_size"]),
            )
        )
    return out


_MEASUREMENT_COLUMNS = (
    "gpu_id",
    "model_id",
    "kind",
    "batch_size",
    "world_size",
    "value",
    "unit",
    "source",
    "metadata_json",
)


def _measurement_rows(gpu_ids: dict[str, int], model_ids: dict[str, int]) -> list[tuple[Any, ...]]:
    """Shipped measurements as tuples in _MEASUREMENT_COLUMNS order, sorted by the unique key
    (inserting in index order keeps SQLite's B-tree appends cheap)."""
    text = gzip.decompress(_data_path("measurements.csv.gz").read_bytes()).decode()
    capacity = {gpu_ids[s.name]: s.memory_bytes for s in shipped_gpus()}
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
        con = _open_ro(path)
        try:
            meta = dict(con.execute("SELECT key, value FROM meta").fetchall())
        finally:
            con.close()
    except sqlite3.Error:
        return None, None
    return meta.get("schema_version"), meta.get("data_version")


def _open_ro(path: Path) -> sqlite3.Connection:
    # as_uri() percent-encodes '#', '?' and spaces, which a raw "file:" URI would misread.
    return sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=60)


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
    """Build (or rebuild when outdated) the default SQLite database; returns its path.

    A rebuild carries the user's rows over from the old file and says so on stderr."""
    data_dir = Path(data_dir)
    path = default_db_path(data_dir)
    if not force and _is_current(path):
        return path
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(
            f"cannot create the gpemu data directory {data_dir}: {exc}; set GPEMU_DATA_DIR "
            "to a writable directory or GPEMU_DB to a database URL"
        ) from None
    try:
        path, report = _build_locked(data_dir, path, force)
    except PermissionError as exc:
        raise ValueError(
            f"cannot build the profile database in {data_dir}: {exc}; set GPEMU_DATA_DIR to a "
            "writable directory or GPEMU_DB to a database URL"
        ) from None
    if report is not None:
        print(f"[gpemu] {report.message()}", file=sys.stderr, flush=True)
    return path


@dataclasses.dataclass
class RebuildReport:
    """What a rebuild of the default database did with the old file."""

    path: Path
    why: str  # "shipped data a -> b", "schema 1 -> 2", "its meta table could not be read", "--force"
    kept: dict[str, int] = dataclasses.field(default_factory=dict)  # rows carried over, per table
    shadowed: list[str] = dataclasses.field(default_factory=list)  # user's versions of shipped names
    conflicts: list[str] = dataclasses.field(default_factory=list)  # user's aliases now naming shipped GPUs
    backup: Path | None = None
    unreadable: str | None = None  # why the old file could not be read (nothing carried over)

    def message(self) -> str:
        head = f"profile database {self.path} rebuilt ({self.why})"
        if self.unreadable is not None:
            return (
                f"{head}: the old file could not be read ({self.unreadable}); it is kept as {self.backup}, "
                "nothing was carried over from it"
            )
        label = {
            "gpus": "GPU(s)",
            "models": "model(s)",
            "measurements": "measurement(s)",
            "distributions": "distribution(s)",
        }
        kept = (
            ", ".join(f"{n} {label.get(table, table)}" for table, n in self.kept.items() if n) or "no rows of your own"
        )
        out = f"{head}: kept {kept}"
        if self.shadowed:
            # (the old file's row differs from the new shipped one: the user changed it, or the
            # shipped facts changed since; gpus and models rows carry no source to tell which)
            out += (
                f"; the new shipped data replaces the old file's rows for {', '.join(self.shadowed[:5])}"
                + (f" and {len(self.shadowed) - 5} more" if len(self.shadowed) > 5 else "")
                + " (your changes, or facts an earlier gpemu shipped)"
            )
        if self.conflicts:
            out += "; the alias " + "; the alias ".join(self.conflicts)
        return out + (f"; the old file is kept as {self.backup}" if self.backup else "")


def _build_locked(data_dir: Path, path: Path, force: bool) -> tuple[Path, RebuildReport | None]:
    with _exclusive(data_dir / (DEFAULT_DB_NAME + ".lock")):
        if not force and _is_current(path):  # another process built it while we waited
            return path, None
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
            report = _carry_over(path, Path(tmp), force) if path.exists() else None
            with open(tmp, "rb+") as fh:  # on disk before it gets its public name
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes it private; others only read it
            if report is not None:
                report.backup = _keep_old(path, report.unreadable is not None)
            os.replace(tmp, path)  # atomic: readers see the old file or the complete new one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path, report


def _keep_old(path: Path, unreadable: bool) -> Path:
    """Keep the old file under a second name (a hard link: ``path`` never disappears)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    backup = path.with_name(path.name + (f".unreadable-{stamp}" if unreadable else ".previous"))
    with contextlib.suppress(FileNotFoundError):
        backup.unlink()
    try:
        os.link(path, backup)
    except OSError:  # a file system without hard links
        import shutil

        shutil.copy2(path, backup)
    return backup


_SHIPPED_TABLES = {t.name for t in S.metadata.sorted_tables}


def _carry_over(old: Path, new: Path, force: bool) -> RebuildReport:
    """Copy the user's rows from the old default database into the freshly built one."""
    schema, version = _current_versions(old)
    if force and (schema, version) == (str(S.SCHEMA_VERSION), data_version()):
        why = "gpemu db init --force"
    elif schema is None:
        why = "its meta table could not be read"
    elif schema != str(S.SCHEMA_VERSION):
        why = f"schema {schema} -> {S.SCHEMA_VERSION}"
    else:
        why = f"shipped data {version} -> {data_version()}"
    report = RebuildReport(path=old, why=why)
    con = sqlite3.connect(new.resolve().as_uri(), uri=True, timeout=60)  # uri: ATTACH takes one too
    try:
        con.execute("ATTACH DATABASE ? AS old", (f"{old.resolve().as_uri()}?mode=ro",))
        with con:
            report.kept = _copy_user_rows(con, report.shadowed, report.conflicts)
    except sqlite3.Error as exc:
        report.kept, report.shadowed, report.conflicts = {}, [], []
        report.unreadable = str(exc)
    finally:
        con.close()
    return report


def _columns(con: sqlite3.Connection, schema: str, table: str) -> list[str]:
    return [r[1] for r in con.execute(f'PRAGMA {schema}.table_info("{table}")')]


def _copy_user_rows(con: sqlite3.Connection, shadowed: list[str], conflicts: list[str]) -> dict[str, int]:
    """Within one transaction on the new file (``main``) with the old one attached as ``old``."""
    old_tables = {r[0]: r[1] for r in con.execute("SELECT name, sql FROM old.sqlite_master WHERE type='table'")}
    missing = [t for t in ("gpus", "models", "measurements") if t not in old_tables]
    if missing:
        raise sqlite3.DatabaseError(f"no table {', '.join(missing)}")
    kept: dict[str, int] = {}
    # GPUs, models and distributions the shipped data does not have: the user's own.
    for table in ("gpus", "models", "distributions"):
        if table not in old_tables:
            continue
        cols = [c for c in _columns(con, "main", table) if c != "id" and c in _columns(con, "old", table)]
        names = ", ".join(cols)
        cur = con.execute(
            f"INSERT INTO main.{table} ({names}) SELECT {names} FROM old.{table} "
            f"WHERE name NOT IN (SELECT name FROM main.{table})"
        )
        kept[table] = cur.rowcount
        # Shipped names the user had changed: the shipped version wins; say so.
        cmp = " OR ".join(f"o.{c} IS NOT n.{c}" for c in cols if c != "name")
        shadowed += [
            r[0]
            for r in con.execute(f"SELECT o.name FROM old.{table} o JOIN main.{table} n ON n.name = o.name WHERE {cmp}")
        ]
    # Measurements not from the shipped data, matched to the new ids by GPU and model name.
    cols = [
        c
        for c in _columns(con, "main", "measurements")
        if c not in ("id", "gpu_id", "model_id") and c in _columns(con, "old", "measurements")
    ]
    src = ", ".join(f"m.{c}" for c in cols)
    sets = ", ".join(f"{c}=excluded.{c}" for c in cols if c not in ("kind", "batch_size", "world_size"))
    cur = con.execute(
        f"INSERT INTO main.measurements (gpu_id, model_id, {', '.join(cols)}) "
        f"SELECT ng.id, nm.id, {src} FROM old.measurements m "
        "JOIN old.gpus og ON og.id = m.gpu_id JOIN old.models om ON om.id = m.model_id "
        "JOIN main.gpus ng ON ng.name = og.name JOIN main.models nm ON nm.name = om.name "
        "WHERE m.source IS NOT ? "
        f"ON CONFLICT (gpu_id, model_id, kind, batch_size, world_size) DO UPDATE SET {sets}",
        (_ROW_SOURCE,),
    )
    kept["measurements"] = cur.rowcount
    # A kept GPU's alias that now names a shipped GPU (e.g. your "H100" before gpemu shipped one).
    shipped: dict[str, str] = {}
    for name, aliases, prov in con.execute("SELECT name, aliases, provenance FROM main.gpus ORDER BY id"):
        for n in (name, *json.loads(aliases or "[]")):
            key = normalize_name(n)
            if prov == "datasheet":
                shipped.setdefault(key, name)
            elif key in shipped:
                conflicts.append(f"{n!r} of {name} now names the shipped {shipped[key]} (use {name!r})")
    # Tables gpemu.db does not own (e.g. the profiler's profile_limits): copied whole.
    for table, sql in old_tables.items():
        if table in _SHIPPED_TABLES or table.startswith("sqlite_") or not sql:
            continue
        con.execute(sql)
        for (index_sql,) in con.execute(
            "SELECT sql FROM old.sqlite_master WHERE type='index' AND tbl_name=? AND sql IS NOT NULL", (table,)
        ).fetchall():
            con.execute(index_sql)
        kept[f"row(s) of {table}"] = con.execute(f'INSERT INTO main."{table}" SELECT * FROM old."{table}"').rowcount
    return kept
