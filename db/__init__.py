"""gpemu.db: the profile database (measurements of real GPUs) and its lookups.

    from gpemu.db import open_profile_db
    db = open_profile_db(EmuConfig.from_env())
    db.lookup("V100", "resnet50", 128, "forward")   # Lookup(value=0.1193..., unit='seconds', provenance='measured')

See docs/database.md and the contract in docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .records import (
    ARTIFACT_SOURCE,
    BATCH_INDEPENDENT,
    KIND_UNITS,
    KINDS,
    MEMORY_KINDS,
    PROVENANCES,
    TIME_KINDS,
    GpuSpec,
    Lookup,
    Measurement,
    MissingMeasurementError,
    ModelInfo,
    UnknownNameError,
)

if TYPE_CHECKING:
    from gpemu.config import EmuConfig

    from .lookup import ProfileDB

__all__ = [
    "open_profile_db",
    "db_location",
    "ProfileDB",
    "GpuSpec",
    "ModelInfo",
    "Lookup",
    "Measurement",
    "UnknownNameError",
    "MissingMeasurementError",
    "KINDS",
    "KIND_UNITS",
    "TIME_KINDS",
    "MEMORY_KINDS",
    "BATCH_INDEPENDENT",
    "PROVENANCES",
    "ARTIFACT_SOURCE",
]


def db_location(config: EmuConfig) -> str:
    """The SQLAlchemy URL the config names: ``config.db_url`` or the per-user SQLite default."""
    if config.db_url:
        return config.db_url
    from .build import default_db_path, sqlite_url

    return sqlite_url(default_db_path(config.default_data_dir))


def open_profile_db(config: EmuConfig) -> ProfileDB:
    """Open the profile database ``config`` names.

    Without ``config.db_url`` this is the default SQLite file in ``config.default_data_dir``,
    built from the shipped data on first use (safe when many processes do it at once). A
    ``db_url`` is opened as is (tables created when missing); fill it with ``gpemu db init``
    or ``gpemu db import``.
    """
    from .build import ensure_default_db, open_url, sqlite_url

    if config.db_url:
        return open_url(config.db_url)
    path = ensure_default_db(config.default_data_dir)
    return open_url(sqlite_url(path))


def __getattr__(name: str) -> type:  # ProfileDB without importing SQLAlchemy at package import
    if name == "ProfileDB":
        from .lookup import ProfileDB

        return ProfileDB
    raise AttributeError(f"module 'gpemu.db' has no attribute {name!r}")
