"""``gpemu profile --export FILE``: the database in the format ``gpemu db export`` writes."""

from __future__ import annotations

from pathlib import Path

from .store import ProfileStore

__all__ = ["export_database"]


def export_database(store: ProfileStore, path: Path) -> int:
    """Write every GPU, model and measurement to ``path`` (.csv or .json); returns the row count."""
    try:
        from gpemu.db.exchange import export_file  # gpemu.db owns the format
    except ImportError as exc:
        raise ValueError(f"exporting needs gpemu.db's export, which this installation lacks ({exc})") from None
    return export_file(store.db, path)
