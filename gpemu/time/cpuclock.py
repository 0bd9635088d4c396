"""Virtual host time: each thread's clock advances by the CPU time it spends, and jumps.

Note: why CPU time. On a busy machine a thread also waits for a core, and those waits are noise
of the host the emulator runs on, not of the program it emulates (16 ranks on 2 cores each wait
~7/8 of the time). A thread's CPU time (``time.thread_time``) is what its own work costs on a
core of its own; waiting on something else (a lock, a pipe, a GPU deadline, another rank) adds
nothing by itself: the waits gpemu models move the clock explicitly (:meth:`CpuTimeClock.wait_until`
jumps to a deadline, :meth:`~CpuTimeClock.advance` adds a sleep or a modelled cost), and blocking
file I/O inside a data fetch is measured and added (:class:`BlockedTime`).

Threads: every thread keeps its own lane (its own CPU time plus its own jumps), as threads on
cores of their own would; a new thread starts at the latest time any thread of the process has
read. A forked child (a DataLoader worker) continues from its parent's time at the fork.

Times are in ``time.perf_counter`` seconds (the same on every process of this host), so ranks
compare their times directly when they meet.

Note: why a clock starts real. Until its process first uses the emulated GPU (its first jump or
:meth:`CpuTimeClock.start`) a clock reads the real ``perf_counter``: a process that never does
(a launcher such as torchrun's agent, a helper) meets other processes only in real time (a
rendezvous across nodes compares heartbeats' timestamps and waits with timeouts), and a program's
clock then goes on from the real time of its first GPU work, never backwards.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["CpuTimeClock", "BlockedTime", "process_clock", "set_process_clock"]

_thread_time = time.thread_time
_perf = time.perf_counter


class _Lane:
    """One thread's place on the virtual timeline: ``base`` plus the thread's CPU time since
    ``cpu0``."""

    __slots__ = ("base", "cpu0")

    def __init__(self, base: float) -> None:
        self.base = base
        self.cpu0 = _thread_time()


class _Lanes(threading.local):
    lane: _Lane | None = None


class CpuTimeClock:
    """Virtual time driven by the CPU time of each thread (see the module's docstring).

    Same interface as :class:`gpemu.clock.RealClock` (``now``, ``wait_until``, ``sleep``), but
    waiting jumps instead of sleeping, so an hour of emulated GPU time passes as fast as the host
    can issue it."""

    virtual = True  # waits jump (the time engine and the sharing timeline ask)

    def __init__(self, start: float | None = None) -> None:
        """``start``: the virtual time at once (None: real time until :meth:`start`)."""
        self._lanes = _Lanes()
        self.started = start is not None
        self.latest = float(start) if start is not None else _perf()  # the latest time a thread read
        self._fork_at = self.latest
        # What a forked child continues from: the forking thread's time (the time engine makes
        # it the host's time on the emulated timeline, the emulator's own time forgiven).
        self.fork_reading: Callable[[], float] = self.now
        _CLOCKS.add(self)

    def _lane(self) -> _Lane:
        lane = self._lanes.lane
        if lane is None:
            lane = self._lanes.lane = _Lane(self.latest)
        return lane

    def start(self) -> None:
        """Start virtual time now, at the real time now (a no-op once started)."""
        if not self.started:
            self._lanes = _Lanes()  # every thread's lane starts here
            self.latest = max(self.latest, _perf())
            self.started = True

    def now(self) -> float:
        """The calling thread's virtual time (the real time before :meth:`start`)."""
        if not self.started:
            t = _perf()
            if t > self.latest:
                self.latest = t
            return t
        lane = self._lanes.lane
        if lane is None:
            lane = self._lanes.lane = _Lane(self.latest)
        t = lane.base + (_thread_time() - lane.cpu0)
        if t > self.latest:
            self.latest = t
        return t

    def wait_until(self, deadline: float) -> None:
        """The calling thread waits until ``deadline``: its time jumps there (no real wait)."""
        self.start()
        lane = self._lane()
        cpu = _thread_time()
        if deadline > lane.base + (cpu - lane.cpu0):
            lane.base, lane.cpu0 = deadline, cpu
            if deadline > self.latest:
                self.latest = deadline

    def advance(self, seconds: float) -> float:
        """The calling thread spends ``seconds`` (a sleep, a modelled cost); returns its new time."""
        if not seconds >= 0:
            raise ValueError(f"a clock cannot go back in time (advance by {seconds!r} s)")
        self.start()
        self._lane().base += seconds
        return self.now()

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    # ------------------------------------------------------------------ processes
    def _before_fork(self) -> None:
        self._fork_at = self.fork_reading()

    def _after_fork_in_child(self) -> None:
        # The forking thread goes on in the child with a fresh CPU-time clock (and is the only
        # thread there): it continues from the parent's time at the fork.
        self._lanes = _Lanes()
        self._lanes.lane = _Lane(self._fork_at)
        self.latest = self._fork_at


# Every clock of this process, for the fork hooks (registered once: os.register_at_fork has no
# way to unregister).
_CLOCKS: weakref.WeakSet[CpuTimeClock] = weakref.WeakSet()


def _before_fork() -> None:
    for clock in list(_CLOCKS):
        clock._before_fork()


def _after_fork_in_child() -> None:
    for clock in list(_CLOCKS):
        clock._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)

_process_clock: CpuTimeClock | None = None


def process_clock() -> CpuTimeClock:
    """This process's virtual clock (made on first use, real until started)."""
    global _process_clock
    if _process_clock is None:
        _process_clock = CpuTimeClock()
    return _process_clock


def set_process_clock(clock: CpuTimeClock | None) -> None:
    """Make ``clock`` this process's virtual clock (None: a fresh one on next use)."""
    global _process_clock
    _process_clock = clock


class _Mark(NamedTuple):
    wall: float
    cpu: float
    queued: float


class BlockedTime:
    """The calling thread's time blocked (off a core, not waiting for one) since :meth:`start`:
    real time minus CPU time minus run-queue time. Blocking file I/O shows here; waiting for a
    core does not. Reads ``/proc/thread-self/schedstat`` (Linux); elsewhere it measures 0."""

    __slots__ = ("_mark",)

    def __init__(self) -> None:
        self._mark = self._read()

    @staticmethod
    def _read() -> _Mark:
        queued = 0.0
        try:
            with open("/proc/thread-self/schedstat", "rb") as f:
                queued = int(f.read().split()[1]) * 1e-9
        except (OSError, IndexError, ValueError):
            return _Mark(0.0, 0.0, 0.0)
        return _Mark(_perf(), _thread_time(), queued)

    def start(self) -> None:
        self._mark = self._read()

    def seconds(self) -> float:
        """Blocked seconds since the last :meth:`start` (or since made)."""
        now, then = self._read(), self._mark
        if not then.wall or not now.wall:
            return 0.0
        return max(0.0, (now.wall - then.wall) - (now.cpu - then.cpu) - (now.queued - then.queued))

    @staticmethod
    def available() -> bool:
        """Whether this system tells run-queue time apart (else blocked I/O is not counted)."""
        return os.path.exists("/proc/thread-self/schedstat")
