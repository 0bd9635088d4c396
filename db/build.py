"""Build the profile database from the shipped data, and open it safely from many processes.

The default database is one SQLite file per schema version in ``EmuConfig.default_data_dir``,
``profiles-v<schema>.sqlite``: a gpemu of another schema (an older release, which named its file
``profiles.sqlite``, or a newer one) never opens this file, so it can neither wipe it nor misread
it. DataLoader workers and DDP ranks all call ``gpemu.patch()`` at the same moment, so every
build or refresh happens under the data directory's exclusive build lock, and only its holder
writes ``*.building`` files (so a holder removes any it finds: left by a builder killed mid-way).

* **First use** of a schema's file: built from the shipped data into a temporary file, the
  user's rows carried in from the most recently used file of an older schema (which is left as
  it was, for the releases that use it), then published under its name at once (a reader never
  sees a half-built database).
* **New shipped data** (or ``gpemu db init --force``): the live file is refreshed in place in one
  SQLite write transaction, after a backup (:mod:`gpemu.db.upgrade`). Writers of other
  processes wait on SQLite's lock and write into the same file: no acknowledged row is lost.
* **A damaged file** (its ``meta`` cannot be read, or names another schema): rebuilt into a new
  file carrying over what can be read, the old one kept beside it.

Each of these says on stderr what it did with the user's rows.
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
from .records import ARTIFACT_SOURCE, KIND_UNITS, ModelInfo
from .specs import gpu_facts_digest, shipped_gpus
from .upgrade import BACKUP_SUFFIX, RebuildReport, carry_over, refresh_in_place

__all__ = [
    "DEFAULT_DB_NAME",
    "LEGACY_DB_NAME",
    "predecessor",
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

# One file per schema version: a gpemu of another schema never opens (nor rebuilds) this one.
DEFAULT_DB_NAME = f"profiles-v{S.SCHEMA_VERSION}.sqlite"
LEGACY_DB_NAME = "profiles.sqlite"  # the one file of every gpemu before per-schema names
LOCK_NAME = "profiles.build.lock"
_DATA_FILES = ("measurements.csv.gz", "models.csv", "distributions.json.gz")
# Per row a short tag (277k copies); the full citation is stored once, in the meta table.
_ROW_SOURCE = ARTIFACT_SOURCE
_SOURCE = "GPEmu artifact (Wang et al., PVLDB 18(6), 2025, doi:10.14778/3725688.3725716)"


def _data_path(name: str) -> Any:
    return resources.files("gpemu.db").joinpath("data").joinpath(name)


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
    """Build (or refresh when outdated) the default SQLite database; returns its path.

    The user's rows are always kept, and what happened to them is said on stderr."""
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
        report = _build_locked(data_dir, path, force)
    except (PermissionError, sqlite3.OperationalError) as exc:
        raise ValueError(
            f"cannot build the profile database in {data_dir}: {exc}; set GPEMU_DATA_DIR to a "
            "writable directory or GPEMU_DB to a database URL"
        ) from None
    if report is not None:
        print(f"[gpemu] {report.message()}", file=sys.stderr, flush=True)
    return path


def _build_locked(data_dir: Path, path: Path, force: bool) -> RebuildReport | None:
    with _exclusive(data_dir / LOCK_NAME):
        _remove_stale_builds(data_dir)
        schema, version = _current_versions(path) if path.exists() else (None, None)
        if not force and (schema, version) == (str(S.SCHEMA_VERSION), data_version()):
            return None  # another process built it while we waited
        fresh = _build_shipped(data_dir)
        try:
            if not path.exists():
                return _first_build(data_dir, path, fresh)
            if schema == str(S.SCHEMA_VERSION):
                why = (
                    "gpemu db init --force"
                    if version == data_version()
                    else f"shipped data {version} -> {data_version()}"
                )
                report = RebuildReport(path=path, why=why)
                refresh_in_place(path, fresh, report)
                return report
            return _replace_damaged(path, fresh, schema)
        finally:
            with contextlib.suppress(OSError):
                fresh.unlink()


def _remove_stale_builds(data_dir: Path) -> None:
    """``*.building`` files: only the build lock's holder writes them, so any found by the holder
    were left by a build that was killed (kill -9, power loss) and are removed."""
    for stale in data_dir.glob("*.building"):
        with contextlib.suppress(OSError):
            stale.unlink()


def _build_shipped(data_dir: Path) -> Path:
    """A new file in ``data_dir`` holding the shipped data only (not yet under any public name)."""
    fd, tmp = tempfile.mkstemp(prefix=DEFAULT_DB_NAME + ".", suffix=".building", dir=data_dir)
    os.close(fd)
    try:
        engine = make_engine(sqlite_url(tmp))

        @event.listens_for(engine, "connect")
        def _fast_build(dbapi_conn: Any, _record: Any) -> None:
            # Nobody else sees this file until it is published, so durability per statement is
            # wasted work; it is fsynced once before it gets its name.
            dbapi_conn.execute("PRAGMA synchronous=OFF")
            dbapi_conn.execute("PRAGMA journal_mode=OFF")

        try:
            load_shipped(engine)
        finally:
            engine.dispose()
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Path(tmp)


def _publish(fresh: Path, path: Path) -> None:
    """Give the finished file its public name (atomic: readers see no file or the whole one)."""
    with open(fresh, "rb+") as fh:
        os.fsync(fh.fileno())
    os.chmod(fresh, 0o644)  # mkstemp makes it private; others only read it
    os.replace(fresh, path)


def predecessor(data_dir: Path) -> Path | None:
    """The default database of another schema that this one's first build carries rows from: the
    readable file of the newest schema below (or equal to) this one, including the single
    ``profiles.sqlite`` of releases before per-schema names (a per-schema file first, then the
    most recently written, on a tie). None when there is none."""
    usable: list[tuple[int, bool, float, Path]] = []
    for p in [data_dir / LEGACY_DB_NAME, *data_dir.glob("profiles-v*.sqlite")]:
        if p.name == DEFAULT_DB_NAME or not p.is_file():
            continue
        schema, _ = _current_versions(p)
        if schema is not None and schema.isdigit() and int(schema) <= S.SCHEMA_VERSION:
            usable.append((int(schema), p.name != LEGACY_DB_NAME, p.stat().st_mtime, p))
    return max(usable)[3] if usable else None


def _first_build(data_dir: Path, path: Path, fresh: Path) -> RebuildReport | None:
    old = predecessor(data_dir)
    report = None
    if old is not None:
        schema, version = _current_versions(old)
        report = RebuildReport(path=path, why=f"first use of schema {S.SCHEMA_VERSION}", how="built", source=old)
        carry_over(old, fresh, report)
        if report.unreadable is not None:  # (it was readable a moment ago: say so, carry nothing)
            report.backup = old
    _publish(fresh, path)
    return report


def _replace_damaged(path: Path, fresh: Path, schema: str | None) -> RebuildReport:
    why = (
        "its meta table could not be read"
        if schema is None
        else f"it says schema {schema}, its name {S.SCHEMA_VERSION}"
    )
    report = RebuildReport(path=path, why=why)
    carry_over(path, fresh, report)
    report.backup = _keep_old(path, report.unreadable is not None)
    _publish(fresh, path)
    return report


def _keep_old(path: Path, unreadable: bool) -> Path:
    """Keep the old file under a second name (a hard link: ``path`` never disappears)."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    backup = path.with_name(path.name + (f".unreadable-{stamp}" if unreadable else BACKUP_SUFFIX))
    with contextlib.suppress(FileNotFoundError):
        backup.unlink()
    try:
        os.link(path, backup)
    except OSError:  # a file system without hard links
        import shutil

        shutil.copy2(path, backup)
    return backup
