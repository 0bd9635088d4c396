"""Where profiling results go: the profile database (``gpemu.db``), plus the batch-size limits.

Every (model, batch size) is one call to ``ProfileDB.add_measurements`` (one transaction: all of
the unit's rows or none), so an interrupted run never leaves half a unit behind and a rerun can
tell what is done by looking for the unit's rows.

Limits: when a batch size runs out of memory, the model's limit on that GPU (the smallest batch
size that did not fit, and the largest that did) goes into the table ``profile_limits``, which
this module owns and creates next to gpemu.db's tables (reruns read it), and as a
``max_batch_size`` measurement (largest batch size that fit) so export/import carry it.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, Text, UniqueConstraint, select

from gpemu.config import EmuConfig
from gpemu.db import GpuSpec, Measurement, ModelInfo, ProfileDB, UnknownNameError, open_profile_db

try:  # the set of kinds the database accepts
    from gpemu.db.records import KIND_UNITS as _KIND_UNITS
except ImportError:  # pragma: no cover
    _KIND_UNITS = {}

__all__ = ["ProfileStore", "Limit", "now_iso", "LIMIT_KIND", "PINNED_KIND"]

LIMIT_KIND = "max_batch_size"
PINNED_KIND = "h2d_transfer_pinned"

_limits_meta = MetaData()
profile_limits = Table(
    "profile_limits",
    _limits_meta,
    Column("id", Integer, primary_key=True),
    Column("gpu", String(128), nullable=False),
    Column("model", String(128), nullable=False),
    Column("oom_batch_size", Integer, nullable=False),  # smallest batch size that ran out of memory
    Column("largest_fitting", Integer, nullable=False),  # largest measured batch size that fit (0: none)
    Column("message", Text, nullable=False, default=""),
    Column("measured_at", String(40), nullable=False),
    Column("metadata_json", Text, nullable=False, default="{}"),
    UniqueConstraint("gpu", "model", name="uq_profile_limit"),
)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Limit:
    gpu: str
    model: str
    oom_batch_size: int
    largest_fitting: int
    message: str


class ProfileStore:
    """The profiler's view of the profile database."""

    def __init__(self, db: ProfileDB) -> None:
        self.db = db
        _limits_meta.create_all(db.engine, checkfirst=True)

    @classmethod
    def open(cls, url: str | None) -> ProfileStore:
        """Open the database at SQLAlchemy ``url`` (None: the user's default database)."""
        config = EmuConfig.from_env(db_url=url)
        return cls(open_profile_db(config))

    # ------------------------------------------------------------------ GPUs and models
    def gpu(self, name: str) -> GpuSpec | None:
        try:
            return self.db.gpu(name)
        except UnknownNameError:
            return None

    def model(self, name: str) -> ModelInfo | None:
        try:
            return self.db.model(name)
        except UnknownNameError:
            return None

    def add_gpu(self, spec: GpuSpec) -> None:
        self.db.add_gpu(spec)

    def add_model(self, info: ModelInfo) -> None:
        self.db.add_model(info)

    # ------------------------------------------------------------------ what is done
    def done_batch_sizes(self, gpu: str, model: str, kind: str = "forward", world_size: int = 1) -> set[int]:
        """Batch sizes with a stored ``kind`` row (a unit's rows are written together)."""
        if self.gpu(gpu) is None or self.model(model) is None:
            return set()
        return {int(b) for b, _ in self.db.series(gpu, model, kind, world_size=world_size)}

    def has_model_transfer(self, gpu: str, model: str) -> bool:
        if self.gpu(gpu) is None or self.model(model) is None:
            return False
        return self.db.has(gpu, model, "model_transfer")

    # ------------------------------------------------------------------ writes
    def write_unit(self, rows: Iterable[Measurement]) -> int:
        """Write one unit's rows in one transaction; kinds gpemu.db does not know are dropped
        (their figures stay in the metadata of the rows that are kept)."""
        keep = [r for r in rows if not _KIND_UNITS or r.kind in _KIND_UNITS]
        return self.db.add_measurements(keep)

    def supports_kind(self, kind: str) -> bool:
        return kind in _KIND_UNITS

    def limit(self, gpu: str, model: str) -> Limit | None:
        gpu, model = self._canonical(gpu, model)
        t = profile_limits
        with self.db.engine.connect() as conn:
            row = conn.execute(select(t).where(t.c.gpu == gpu, t.c.model == model)).first()
        if row is None:
            return None
        return Limit(row.gpu, row.model, row.oom_batch_size, row.largest_fitting, row.message)

    def record_limit(
        self,
        gpu: str,
        model: str,
        oom_batch_size: int,
        largest_fitting: int,
        message: str,
        metadata: dict[str, Any],
        extra_rows: Iterable[Measurement] = (),
    ) -> None:
        """Store the model's batch-size limit on this GPU (replacing an older one) atomically
        with ``extra_rows`` when gpemu.db can take them."""
        gpu, model = self._canonical(gpu, model)
        t = profile_limits
        values = {
            "oom_batch_size": oom_batch_size,
            "largest_fitting": largest_fitting,
            "message": message,
            "measured_at": now_iso(),
            "metadata_json": json.dumps(metadata, sort_keys=True, default=str),
        }
        rows = [r for r in extra_rows if r.kind in _KIND_UNITS]
        if rows:
            self.db.add_measurements(rows)
        with self.db.engine.begin() as conn:
            conn.execute(t.delete().where(t.c.gpu == gpu, t.c.model == model))
            conn.execute(t.insert().values(gpu=gpu, model=model, **values))

    def clear_limit(self, gpu: str, model: str) -> None:
        gpu, model = self._canonical(gpu, model)
        t = profile_limits
        with self.db.engine.begin() as conn:
            conn.execute(t.delete().where(t.c.gpu == gpu, t.c.model == model))

    def _canonical(self, gpu: str, model: str) -> tuple[str, str]:
        g, m = self.gpu(gpu), self.model(model)
        return (g.name if g else gpu), (m.name if m else model)

    def close(self) -> None:
        self.db.close()
