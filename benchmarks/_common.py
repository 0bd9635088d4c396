"""What the benchmark scripts share, so that each script is only its measurement.

* :data:`REPO`, the checkout; importing this module puts it first on ``sys.path``, so a script run
  as ``python benchmarks/x.py`` imports ``examples.tvmodels`` or ``tests.compat.scenarios``;
* :func:`machine` (from ``machine.py``): the line each figure is printed beside;
* :func:`progress_bar`: a rich progress bar on stderr, gone when done;
* :func:`database_url`: a ``--db`` argument (a SQLAlchemy URL or a ``gpemu db export``) as a URL.

A script imports it before anything from the repository (a script's own folder is first on
``sys.path``, so this module is found as ``_common``)::

    from _common import REPO, machine, progress_bar
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from machine import machine, reference_loop_ms

if TYPE_CHECKING:
    from rich.progress import Progress

__all__ = ["REPO", "database_url", "machine", "progress_bar", "reference_loop_ms"]

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def progress_bar(description_width: int | None = None, now_field: bool = False) -> Progress:
    """A rich progress bar on stderr, removed when done (the printed figures stay clean).

    ``description_width`` pads each task's description (rows line up); ``now_field`` adds a last
    column showing each task's ``now`` field (say, which case runs now: ``add_task(..., now="")``).
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    description = "{task.description}" if description_width is None else f"{{task.description:<{description_width}}}"
    columns: list[str | ProgressColumn] = [
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    if now_field:
        columns.append(TextColumn("{task.fields[now]}"))
    return Progress(*columns, console=Console(stderr=True), transient=True)


def database_url(p: argparse.ArgumentParser, given: str, folder: Path) -> str:
    """``--db``: a SQLAlchemy URL as given, or a ``gpemu db export`` (JSON file or CSV folder)
    imported into a SQLite file in ``folder``; a missing or unreadable export is one argparse
    error, and rows the import rejected are said in one line."""
    if "://" in given:
        return given
    from gpemu.db.build import open_url, sqlite_url
    from gpemu.db.io import import_path

    if not Path(given).exists():
        p.error(f"--db {given}: no such export file or directory (or give a SQLAlchemy URL)")
    url = sqlite_url(folder / "imported.sqlite")
    try:
        report = import_path(open_url(url), given)
    except ValueError as exc:
        p.error(f"--db {given}: {exc}")
    if report.rejected:
        first = report.rejected[0]
        print(
            f"# {len(report.rejected)} rows of {given} rejected (first: {first.where}: {first.reason}); "
            "`gpemu db import` lists them"
        )
    return url
