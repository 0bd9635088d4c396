"""A run on virtual time (``clock="virtual"``): the program's clocks read the emulated host time.

Note: what is patched and why. The time engine runs on a :class:`~.cpuclock.CpuTimeClock` (each
thread's CPU time, waits jump), so an emulated GPU wait returns at once. A program also reads the
time itself (a step timer, tqdm's rate, a Trainer's ``train_runtime``, a log line's timestamp):
those readings must come from the same timeline, or it would print the host's real time beside
an emulated GPU that ran an hour in a minute. So :class:`ProgramClocks` replaces ``time.time``,
``perf_counter``, ``monotonic`` (and their ``_ns`` forms), ``time.sleep`` and ``datetime.now``
for the program, in the ``time`` module and in every copy a module made with ``from time import
...`` (third-party and the program's own modules; not the standard library's, whose real
timeouts stay real, nor gpemu's), and maps the torch profiler's timestamps (:mod:`.profiling`).
All of it through ``rt.patcher``: ``gpemu.unpatch()`` restores it.

- A reading is the calling thread's host time on the emulated timeline (``engine.now()``: its CPU
  time, the emulator's own time forgiven, waits jumped), shifted so each clock keeps its own
  base (``time.time`` stays seconds since the epoch).
- ``time.sleep(s)`` advances the thread's time by ``s`` and returns at once, in a process that has
  issued emulated GPU work; before that (a launcher such as torchrun's agent, a helper) it sleeps
  for real, so a loop polling with ``sleep`` does not spin.
- gpemu's own threads (named ``gpemu-*``: sharing backends, heartbeats) read real time.
- ``datetime.datetime`` becomes a subclass whose ``now``/``utcnow`` read the virtual time; every
  datetime it makes is a plain one (``isinstance`` and pickling behave as before). A compiled
  extension module imported during the run (pandas') binds the real class: its static types
  subclass the class it finds at import, which must be the C type they were compiled against.
"""

from __future__ import annotations

import copyreg
import datetime as _datetime_module
import functools
import importlib.machinery
import numbers
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..clock import REAL, VIRTUAL_TIME_NOTE
from .cpuclock import BlockedTime, CpuTimeClock, process_clock

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime
    from .engine import TimeEngine

__all__ = ["ProgramClocks", "make_clock", "install", "RealDatetime", "datetime_class"]

RealDatetime = _datetime_module.datetime

# Modules whose references to the time functions stay real: the standard library (its timeouts
# are real waits: threading, queue, multiprocessing, subprocess) and the emulator's own machinery.
_KEEP_REAL = frozenset(getattr(sys, "stdlib_module_names", ())) | {"gpemu", "pika", "_pytest", "pytest", "pluggy"}


def make_clock(origin: float | None) -> CpuTimeClock:
    """This process's virtual clock: started at the run's ``origin`` plus the CPU time this
    process has spent so far (as if it started then, on a core of its own), or at the real time
    now without an origin; the same clock again when this process made one before."""
    start = origin + time.process_time() if origin is not None else REAL.perf_counter()
    return process_clock(start)


class ProgramClocks:
    """The program's clocks on virtual time (see the module's docstring)."""

    def __init__(self, engine: TimeEngine, clock: CpuTimeClock, has_work: Callable[[], bool]) -> None:
        self.engine = engine
        self.clock = clock
        self.has_work = has_work  # whether this process has issued emulated GPU work
        perf = REAL.perf_counter()
        # Each clock keeps its base: reading = host time + (that clock - perf_counter) at patch.
        self.monotonic_offset = REAL.monotonic() - perf
        self.wall_offset = REAL.time() - perf
        self._threads = threading.local()

    def _program_thread(self) -> bool:
        """False on gpemu's own threads (they keep real time)."""
        flag = getattr(self._threads, "program", None)
        if flag is None:
            flag = self._threads.program = not threading.current_thread().name.startswith("gpemu-")
        return flag

    # ------------------------------------------------------------------ readings
    def perf_counter(self) -> float:
        return self.engine.now() if self._program_thread() else REAL.perf_counter()

    def monotonic(self) -> float:
        return self.engine.now() + self.monotonic_offset if self._program_thread() else REAL.monotonic()

    def time(self) -> float:
        return self.engine.now() + self.wall_offset if self._program_thread() else REAL.time()

    def perf_counter_ns(self) -> int:
        return int(self.perf_counter() * 1e9)

    def monotonic_ns(self) -> int:
        return int(self.monotonic() * 1e9)

    def time_ns(self) -> int:
        return int(self.time() * 1e9)

    def sleep(self, seconds: float) -> None:
        """Advance this thread's virtual time by ``seconds`` and return at once (see the module's
        docstring for when it sleeps for real)."""
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
            REAL.sleep(seconds)  # (time.sleep's own TypeError)
            return
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        if not self._program_thread() or not self.has_work():
            REAL.sleep(seconds)
            return
        self.engine.jump(lambda: self.clock.advance(seconds))
        REAL.sleep(0)  # let other threads run, as a sleep does

    def table(self) -> dict[str, Callable[..., Any]]:
        """``time`` module attribute -> its replacement."""
        return {
            "perf_counter": self.perf_counter,
            "perf_counter_ns": self.perf_counter_ns,
            "monotonic": self.monotonic,
            "monotonic_ns": self.monotonic_ns,
            "time": self.time,
            "time_ns": self.time_ns,
            "sleep": self.sleep,
        }


class _DatetimeType(type):
    """Plain datetimes are instances of the virtual ``datetime.datetime`` (and it of them)."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, RealDatetime)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, RealDatetime)


def datetime_class(now: Callable[[], float]) -> type[RealDatetime]:
    """``datetime.datetime`` whose ``now()`` / ``utcnow()`` read ``now()`` (epoch seconds); it
    makes plain datetimes (``today()`` reads ``time.time``, already virtual)."""

    class datetime(RealDatetime, metaclass=_DatetimeType):  # noqa: N801 (the name it stands in for)
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if cls is stand_in:
                return RealDatetime(*args, **kwargs)
            return RealDatetime.__new__(cls, *args, **kwargs)  # a program's own subclass

        @classmethod
        def now(cls, tz: _datetime_module.tzinfo | None = None) -> Any:
            return RealDatetime.fromtimestamp(now(), tz)

        @classmethod
        def utcnow(cls) -> Any:
            return RealDatetime.fromtimestamp(now(), _datetime_module.timezone.utc).replace(tzinfo=None)

    stand_in = datetime
    datetime.__module__ = "datetime"
    datetime.__qualname__ = "datetime"
    return datetime


class _CompiledImport:
    """One of ``ExtensionFileLoader``'s methods (creating, executing a module), run with the real
    ``datetime.datetime`` in its module: Cython's ``cimport datetime`` reads the class there and
    lays its own static types (pandas' ``NaT``, ``Timestamp``) out on it; on the stand-in (a heap
    type) they crash."""

    def __init__(self, original: Callable[..., Any], virtual: type) -> None:
        self.original = original
        self.virtual = virtual

    def __get__(self, loader: Any, owner: type | None = None) -> Callable[..., Any]:
        return functools.partial(self.call, loader)

    def call(self, loader: Any, *args: Any) -> Any:
        with _RealDatetimeWhile(self.virtual):
            return self.original(loader, *args)


class _RealDatetimeWhile:
    """``datetime.datetime`` is the real class inside the block (where it was the stand-in)."""

    def __init__(self, virtual: type) -> None:
        self.swapped = _datetime_module.datetime is virtual
        self.virtual = virtual

    def __enter__(self) -> None:
        if self.swapped:
            setattr(_datetime_module, "datetime", RealDatetime)  # noqa: B010 (the module's own name)

    def __exit__(self, *exc: object) -> None:
        if self.swapped:
            setattr(_datetime_module, "datetime", self.virtual)  # noqa: B010


def _program_modules() -> list[ModuleType]:
    """Loaded modules that are neither the standard library's nor the emulator's own."""
    out = []
    for name, mod in list(sys.modules.items()):
        if mod is None or name.partition(".")[0] in _KEEP_REAL:
            continue
        out.append(mod)
    return out


def _patch_time(rt: Runtime, clocks: ProgramClocks, modules: Iterable[ModuleType]) -> None:
    table = clocks.table()
    pairs = []
    for name, new in table.items():
        original = getattr(time, name)
        pairs.append((original, new))
        rt.patcher.replace(time, name, new)
    rt.patcher.replace_everywhere_many(pairs, modules=modules)


def _patch_datetime(rt: Runtime, clocks: ProgramClocks, modules: Iterable[ModuleType]) -> None:
    virtual = datetime_class(clocks.time)
    rt.patcher.replace(_datetime_module, "datetime", virtual)
    loader = importlib.machinery.ExtensionFileLoader
    for name in ("create_module", "exec_module"):
        rt.patcher.replace(loader, name, _CompiledImport(getattr(loader, name), virtual))
    rt.patcher.replace_everywhere(RealDatetime, virtual, modules=modules)
    # A plain datetime pickles as `datetime.datetime`, which is now the stand-in: pickle its state
    # through the stand-in (which unpickles into a plain datetime anywhere).
    previous = copyreg.dispatch_table.get(RealDatetime)
    copyreg.dispatch_table[RealDatetime] = lambda d: (virtual, d.__reduce__()[1])

    def restore() -> None:
        if previous is None:
            copyreg.dispatch_table.pop(RealDatetime, None)
        else:
            copyreg.dispatch_table[RealDatetime] = previous

    rt.patcher.on_restore(restore)


def install(rt: Runtime, clock: CpuTimeClock) -> None:
    """Put the program's clocks on virtual time (the engine already runs on ``clock``)."""
    engine = rt.engine
    spans = rt.recorder.spans
    clocks = ProgramClocks(engine, clock, lambda: len(spans) > 0)
    modules = _program_modules()
    _patch_time(rt, clocks, modules)
    _patch_datetime(rt, clocks, modules)
    from . import dataloader, profiling

    dataloader.install(rt, clock)
    profiling.install(rt, clocks.wall_offset)
    if not rt.config.enable:  # (under `gpemu run` the launcher said it, once for the whole run)
        rt.say_once(VIRTUAL_TIME_NOTE)
    if not BlockedTime.available():
        rt.say_once("virtual time: this system does not tell blocked time from waiting for a core: file I/O in "
                    "data fetches is not counted")  # fmt: skip
