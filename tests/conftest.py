"""Shared test setup.

Every test session builds the default profile database once, in its own data directory
(GPEMU_DATA_DIR), so tests never touch the user's ~/.local/share/gpemu and child processes
started by tests (``gpemu run``) find the same database.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _gpemu_data_dir(tmp_path_factory: pytest.TempPathFactory):
    data_dir = tmp_path_factory.mktemp("gpemu-data")
    old = os.environ.get("GPEMU_DATA_DIR")
    os.environ["GPEMU_DATA_DIR"] = str(data_dir)
    yield data_dir
    if old is None:
        os.environ.pop("GPEMU_DATA_DIR", None)
    else:
        os.environ["GPEMU_DATA_DIR"] = old


@pytest.fixture(autouse=True)
def _always_unpatch():
    """A failing test must not leave torch patched for the next one."""
    yield
    import gpemu

    gpemu.unpatch()
