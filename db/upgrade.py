"""Keeping the user's rows when the default database changes: carried into a new file, or the
shipped rows refreshed around them in place.

Two ways a default database file changes, both under the data directory's build lock
(:mod:`gpemu.db.build`):

* :func:`carry_over` copies the user's rows from an older file (another schema's file, or a
  damaged one) into a freshly built one that nobody has opened yet;
* :func:`refresh_in_place` refreshes the shipped rows of the live file (new shipped data,
  ``gpemu db init --force``) inside one SQLite write transaction: processes writing at the same
  time wait on SQLite's own lock and then write into the same file, so no acknowledged row can
  land in a file that is about to be replaced (a rename under an open connection also leaves its
  rollback journal pointing at the wrong file: "disk I/O error"). A copy of the file from
  before is taken first (:func:`backup`).

Shipped measurements carry the source tag ``gpemu-artifact``; everything else is the user's:
measurements with another source (imported, profiled), GPUs, models and distributions the
shipped data does not have, and tables gpemu.db does not own (the profiler's limits). A user's
measurement wins over a shipped one with the same key.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

from . import schema as S
from .records import ARTIFACT_SOURCE, normalize_name

__all__ = ["RebuildReport", "carry_over", "refresh_in_place", "backup", "BACKUP_SUFFIX"]

BACKUP_SUFFIX = ".previous"  # the file as it was before the last refresh
_NAMED_TABLES = ("gpus", "models", "distributions")
_SHIPPED_TABLES = {t.name for t in S.metadata.sorted_tables}
_LABELS = {"gpus": "GPU(s)", "models": "model(s)", "measurements": "measurement(s)", "distributions": "distribution(s)"}


@dataclasses.dataclass
class RebuildReport:
    """What a build, rebuild or refresh of the default database did with the user's rows."""

    path: Path
    why: str  # "shipped data a -> b", "gpemu db init --force", "its meta table could not be read", ...
    how: str = "rebuilt"  # "rebuilt", "refreshed in place", "built"
    kept: dict[str, int] = dataclasses.field(default_factory=dict)  # the user's rows, per table
    shadowed: list[str] = dataclasses.field(default_factory=list)  # user's versions of shipped names
    conflicts: list[str] = dataclasses.field(default_factory=list)  # user's aliases now naming shipped GPUs
    backup: Path | None = None
    source: Path | None = None  # the older file rows were carried from (a new schema's first build)
    unreadable: str | None = None  # why the old file could not be read (nothing carried over)

    def message(self) -> str:
        head = f"profile database {self.path} {self.how} ({self.why})"
        if self.unreadable is not None:
            return (
                f"{head}: the old file could not be read ({self.unreadable}); it is kept as {self.backup}, "
                "nothing was carried over from it"
            )
        kept = ", ".join(f"{n} {_LABELS.get(t, t)}" for t, n in self.kept.items() if n) or "no rows of your own"
        out = f"{head}: kept {kept}" + (f" from {self.source}" if self.source else "")
        if self.shadowed:
            # (the old row differs from the new shipped one: the user changed it, or the shipped
            # facts changed since; gpus and models rows carry no source to tell which)
            more = f" and {len(self.shadowed) - 5} more" if len(self.shadowed) > 5 else ""
            out += (
                f"; the new shipped data replaces the old file's rows for {', '.join(self.shadowed[:5])}{more}"
                " (your changes, or facts an earlier gpemu shipped)"
            )
        if self.conflicts:
            out += "; the alias " + "; the alias ".join(self.conflicts)
        if self.source:
            out += " (that file is left as it was, for the gpemu releases that use it)"
        if self.backup is None:
            return out
        if self.how == "refreshed in place":
            return out + f"; a copy from before is kept as {self.backup}"
        return out + f"; the old file is kept as {self.backup}"


def _uri(path: Path, readonly: bool = False) -> str:
    # as_uri() percent-encodes '#', '?' and spaces, which a raw "file:" URI would misread.
    return f"{path.resolve().as_uri()}{'?mode=ro' if readonly else ''}"


def _columns(con: sqlite3.Connection, schema: str, table: str) -> list[str]:
    return [r[1] for r in con.execute(f'PRAGMA {schema}.table_info("{table}")')]


def _tables(con: sqlite3.Connection, schema: str) -> dict[str, str]:
    return {r[0]: r[1] for r in con.execute(f"SELECT name, sql FROM {schema}.sqlite_master WHERE type='table'")}


def backup(path: Path) -> Path:
    """A consistent copy of the live database ``path`` (SQLite's backup API, under a read lock) as
    ``<name>.previous``, replacing the copy of the refresh before."""
    target = path.with_name(path.name + BACKUP_SUFFIX)
    tmp = path.with_name(path.name + BACKUP_SUFFIX + ".building")
    src = sqlite3.connect(_uri(path, readonly=True), uri=True, timeout=60)
    try:
        dst = sqlite3.connect(tmp)
        try:
            src.backup(dst)
        finally:
            dst.close()
    finally:
        src.close()
    tmp.replace(target)
    return target


# ---------------------------------------------------------------------------------------------
# a fresh file: the user's rows copied in from an older one
# ---------------------------------------------------------------------------------------------
def carry_over(old: Path, new: Path, report: RebuildReport) -> None:
    """Copy the user's rows from ``old`` into ``new`` (freshly built, not yet published); an old
    file that cannot be read sets ``report.unreadable`` instead."""
    con = sqlite3.connect(_uri(new), uri=True, timeout=60)  # uri: ATTACH takes one too
    try:
        con.execute("ATTACH DATABASE ? AS old", (_uri(old, readonly=True),))
        with con:  # one transaction: a consistent snapshot of the old file (shared lock held)
            report.kept = _copy_user_rows(con, report.shadowed)
            report.conflicts = _alias_conflicts(con)
    except sqlite3.Error as exc:
        report.kept, report.shadowed, report.conflicts = {}, [], []
        report.unreadable = str(exc)
    finally:
        con.close()


def _copy_user_rows(con: sqlite3.Connection, shadowed: list[str]) -> dict[str, int]:
    """Within one transaction on the new file (``main``) with the old one attached as ``old``."""
    old_tables = _tables(con, "old")
    missing = [t for t in ("gpus", "models", "measurements") if t not in old_tables]
    if missing:
        raise sqlite3.DatabaseError(f"no table {', '.join(missing)}")
    kept: dict[str, int] = {}
    for table in _NAMED_TABLES:  # GPUs, models and distributions the shipped data does not have
        if table not in old_tables:
            continue
        cols = [c for c in _columns(con, "main", table) if c != "id" and c in _columns(con, "old", table)]
        names = ", ".join(cols)
        kept[table] = con.execute(
            f"INSERT INTO main.{table} ({names}) SELECT {names} FROM old.{table} "
            f"WHERE name NOT IN (SELECT name FROM main.{table})"
        ).rowcount
        shadowed += _differing(con, "old", "main", table, cols)
    kept["measurements"] = _copy_measurements(con, "old", "main", user_rows=True, replace=True)
    kept.update(_copy_foreign_tables(con, old_tables))
    return kept


def _differing(con: sqlite3.Connection, old: str, new: str, table: str, cols: list[str]) -> list[str]:
    """Names in both ``old`` and ``new`` whose rows differ (shipped names the user had changed)."""
    cmp = " OR ".join(f"o.{c} IS NOT n.{c}" for c in cols if c != "name")
    return [
        r[0] for r in con.execute(f"SELECT o.name FROM {old}.{table} o JOIN {new}.{table} n USING (name) WHERE {cmp}")
    ]


def _copy_measurements(con: sqlite3.Connection, src: str, dst: str, user_rows: bool, replace: bool) -> int:
    """Measurements of ``src`` (the user's, or the shipped ones) into ``dst``, matched to ``dst``'s
    ids by GPU and model name. ``replace``: a copied row wins over one with the same key."""
    cols = [
        c
        for c in _columns(con, dst, "measurements")
        if c not in ("id", "gpu_id", "model_id") and c in _columns(con, src, "measurements")
    ]
    sets = ", ".join(f"{c}=excluded.{c}" for c in cols if c not in ("kind", "batch_size", "world_size"))
    on_conflict = f"DO UPDATE SET {sets}" if replace else "DO NOTHING"
    return con.execute(
        f"INSERT INTO {dst}.measurements (gpu_id, model_id, {', '.join(cols)}) "
        f"SELECT ng.id, nm.id, {', '.join(f'm.{c}' for c in cols)} FROM {src}.measurements m "
        f"JOIN {src}.gpus og ON og.id = m.gpu_id JOIN {src}.models om ON om.id = m.model_id "
        f"JOIN {dst}.gpus ng ON ng.name = og.name JOIN {dst}.models nm ON nm.name = om.name "
        f"WHERE m.source {'IS NOT' if user_rows else 'IS'} ? "
        f"ON CONFLICT (gpu_id, model_id, kind, batch_size, world_size) {on_conflict}",
        (ARTIFACT_SOURCE,),
    ).rowcount


def _copy_foreign_tables(con: sqlite3.Connection, old_tables: dict[str, str]) -> dict[str, int]:
    """Tables gpemu.db does not own (e.g. the profiler's profile_limits): copied whole."""
    kept: dict[str, int] = {}
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


def _alias_conflicts(con: sqlite3.Connection) -> list[str]:
    """A user's GPU alias that now names a shipped GPU (e.g. your "H100" before gpemu shipped one)."""
    conflicts: list[str] = []
    shipped: dict[str, str] = {}
    for name, aliases, prov in con.execute("SELECT name, aliases, provenance FROM main.gpus ORDER BY id"):
        for n in (name, *json.loads(aliases or "[]")):
            key = normalize_name(n)
            if prov == "datasheet":
                shipped.setdefault(key, name)
            elif key in shipped:
                conflicts.append(f"{n!r} of {name} now names the shipped {shipped[key]} (use {name!r})")
    return conflicts


# ---------------------------------------------------------------------------------------------
# the live file: shipped rows refreshed around the user's, in one write transaction
# ---------------------------------------------------------------------------------------------
def refresh_in_place(live: Path, fresh: Path, report: RebuildReport) -> None:
    """Replace the shipped rows of ``live`` with those of ``fresh`` (a file holding only the shipped
    data) in one write transaction, keeping every row of the user's. ``live`` keeps its inode:
    writers of other processes wait on SQLite's lock meanwhile and then write into it."""
    report.how = "refreshed in place"
    report.backup = backup(live)
    con = sqlite3.connect(_uri(live), uri=True, timeout=60, isolation_level=None)
    try:
        con.execute("ATTACH DATABASE ? AS new", (_uri(fresh, readonly=True),))
        con.execute("BEGIN IMMEDIATE")  # the write lock: other writers wait, readers go on meanwhile
        try:
            report.shadowed = _refresh_named(con)
            con.execute("DELETE FROM main.measurements WHERE source IS ?", (ARTIFACT_SOURCE,))
            _copy_measurements(con, "new", "main", user_rows=False, replace=False)
            con.execute(
                "INSERT INTO main.meta (key, value) SELECT key, value FROM new.meta WHERE true "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value"
            )
            report.kept = _user_rows(con)
            report.conflicts = _alias_conflicts(con)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.close()


def _refresh_named(con: sqlite3.Connection) -> list[str]:
    """Shipped GPUs, models and distributions written over the live ones of the same name (their
    ids stay, so the user's measurements of a shipped GPU keep pointing at it)."""
    shadowed: list[str] = []
    for table in _NAMED_TABLES:
        cols = [c for c in _columns(con, "main", table) if c != "id" and c in _columns(con, "new", table)]
        shadowed += _differing(con, "main", "new", table, cols)
        sets = ", ".join(f"{c} = excluded.{c}" for c in cols if c != "name")
        con.execute(
            f"INSERT INTO main.{table} ({', '.join(cols)}) SELECT {', '.join(cols)} FROM new.{table} WHERE true "
            f"ON CONFLICT (name) DO UPDATE SET {sets}"
        )
    return shadowed


def _user_rows(con: sqlite3.Connection) -> dict[str, int]:
    """How many rows of the live file are the user's (what a refresh kept)."""
    kept = {
        table: con.execute(
            f"SELECT count(*) FROM main.{table} WHERE name NOT IN (SELECT name FROM new.{table})"
        ).fetchone()[0]
        for table in _NAMED_TABLES
    }
    kept["measurements"] = con.execute(
        "SELECT count(*) FROM main.measurements WHERE source IS NOT ?", (ARTIFACT_SOURCE,)
    ).fetchone()[0]
    for table, sql in _tables(con, "main").items():
        if table not in _SHIPPED_TABLES and not table.startswith("sqlite_") and sql:
            kept[f"row(s) of {table}"] = con.execute(f'SELECT count(*) FROM main."{table}"').fetchone()[0]
    return kept
