"""Shared test setup.

Every test session builds the default profile database once, in its own data directory
(GPEMU_DATA_DIR), so tests never touch the user's ~/.local/share/gpemu and child processes
started by tests (``gpemu run``) find the same database.

Markers (registered in setup.cfg) set the slow real-component tests apart, so a developer can run
the fast unit tests alone (README, "Developing"). This file keeps them honest: a test that starts a
child process (a broker, ``gpemu run``, torchrun, a spawned rank, a DataLoader worker, ...) without
one of the CHILD_MARKERS fails at teardown, saying so.
"""

from __future__ import annotations

import os
import resource
import shutil
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

# The CLI's output width follows $COLUMNS (gpemu.cli.make_console); pytest-xdist's workers set it
# to 80, which would wrap the tables the tests read. Tests see output as a log file would.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

# A test that starts a child process must carry one of these (setup.cfg describes each).
CHILD_MARKERS = frozenset({"broker", "torchrun", "postgres", "k8s", "compat", "subprocess"})


@pytest.fixture(scope="session", autouse=True)
def _gpemu_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Generator[object, None, None]:
    data_dir = tmp_path_factory.mktemp("gpemu-data")
    old = os.environ.get("GPEMU_DATA_DIR")
    os.environ["GPEMU_DATA_DIR"] = str(data_dir)
    yield data_dir
    if old is None:
        os.environ.pop("GPEMU_DATA_DIR", None)
    else:
        os.environ["GPEMU_DATA_DIR"] = old


@pytest.fixture
def rt(request: pytest.FixtureRequest) -> Generator[Any, None, None]:
    """A run on emulated V100s and a virtual clock (exact, instant), no summary at exit; as many
    GPUs as the test's ``gpus(n)`` marker says (default 1). Unpatched after the test."""
    import gpemu
    from gpemu.clock import VirtualClock

    marker = request.node.get_closest_marker("gpus")
    num_gpus = int(marker.args[0]) if marker is not None else 1
    yield gpemu.patch(gpu="V100", num_gpus=num_gpus, summary=False, clock=VirtualClock())
    gpemu.unpatch()


@pytest.fixture
def db_copy(tmp_path: Path) -> str:
    """A copy of the session's default database (GPUs known) that a test may write to freely."""
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db

    src = Path(open_profile_db(EmuConfig.from_env()).engine.url.database)
    dst = tmp_path / "profile.sqlite"
    shutil.copy(src, dst)
    return f"sqlite:///{dst}"


@pytest.fixture(autouse=True)
def _always_unpatch() -> Generator[None, None, None]:
    """A failing test must not leave torch patched for the next one."""
    yield
    import gpemu

    gpemu.unpatch()


# CPU seconds of children reaped during a test above which it started "a child process": any
# Python interpreter (``python -c pass`` alone takes ~35 ms here), never the ~1-2 ms of the tools
# that libraries run on their own (ctypes.util.find_library's ldconfig, platform's `file`, git).
CHILD_CPU_S = 0.02


@dataclass(frozen=True)
class ChildrenSeen:
    """What this process can tell about its children at one moment.

    ``reaped_cpu_s`` grows whenever a child of any kind (subprocess, fork, multiprocessing spawn)
    has exited and been waited for: the kernel adds its CPU time. ``alive`` are the children still
    running (or not yet waited for).
    """

    reaped_cpu_s: float
    alive: frozenset[int]

    @classmethod
    def now(cls) -> ChildrenSeen:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        alive = frozenset(p.pid for p in psutil.Process().children())
        return cls(reaped_cpu_s=usage.ru_utime + usage.ru_stime, alive=alive)

    def started_since(self, before: ChildrenSeen) -> bool:
        """Whether a child was started between ``before`` and now.

        A child already alive before (a session-scoped broker) may be stopped and reaped here; that
        reaping is not this test's start, so it only counts when no earlier child went away.
        """
        if self.alive - before.alive:
            return True
        earlier_child_ended = bool(before.alive - self.alive)
        return self.reaped_cpu_s - before.reaped_cpu_s >= CHILD_CPU_S and not earlier_child_ended


_BEFORE = pytest.StashKey[ChildrenSeen]()
_SPAWNED = pytest.StashKey[list[str]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_BEFORE] = ChildrenSeen.now()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield  # pluggy's Result: the report made by pytest
    before = item.stash.get(_BEFORE, None)
    if call.when != "teardown" or before is None:
        return
    if not ChildrenSeen.now().started_since(before):
        return
    item.config.stash.setdefault(_SPAWNED, []).append(item.nodeid)
    marked = CHILD_MARKERS & {m.name for m in item.iter_markers()}
    report = outcome.get_result()
    if not marked and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} started a child process but carries none of the markers "
            f"{', '.join(sorted(CHILD_MARKERS))}: mark it (setup.cfg [tool:pytest] says which is which), "
            "so that the fast subset stays fast"
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """With -v, which tests started a child process (what to mark when a check above fails)."""
    spawned = config.stash.get(_SPAWNED, [])
    if spawned and config.get_verbosity() > 0:
        terminalreporter.write_sep("-", f"{len(spawned)} test(s) started a child process")
        for nodeid in spawned:
            terminalreporter.write_line(nodeid)
