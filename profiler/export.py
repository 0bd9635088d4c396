"""``gpemu profile --export FILE``: measurements in the format ``gpemu db export`` writes, so
``gpemu db import FILE`` reads them on another machine."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .store import ProfileStore

__all__ = ["export_database"]


def export_database(
    store: ProfileStore, path: Path, gpus: Iterable[str] | None = None, models: Iterable[str] | None = None
) -> int:
    """Write the given GPUs' and models' rows (all when None) to ``path``: a .json file, or a
    directory of CSV files for any other name. Returns the number of measurements written."""
    from gpemu.db.io import export_db  # gpemu.db owns the format

    counts = export_db(store.db, path, gpus=list(gpus) if gpus else None, models=list(models) if models else None)
    return int(counts["measurements"])
