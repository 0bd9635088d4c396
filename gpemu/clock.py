"""Host clocks for emulated GPU time.

Every emulated GPU deadline is an ABSOLUTE point on one clock (``time.perf_counter``), and the
host waits until that point, never "for a duration". Waiting for durations lets each sleep's
overshoot (≈ 80-100 µs here) pile up over thousands of iterations; waiting until an absolute
deadline makes one late wake-up cost nothing on the next one.

A wait sleeps coarsely until ``spin_margin`` before the deadline (the OS may wake us late, so
we re-check and sleep again while far away), then spins on ``perf_counter`` for the last
stretch, which ends within a few microseconds of the deadline.

:class:`VirtualClock` has the same interface with a manual notion of time, so tests can check
deadlines exactly and instantly.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = [
    "Clock",
    "RealClock",
    "VirtualClock",
    "wait_until",
    "now",
    "DEFAULT_SPIN_MARGIN",
    "REAL",
    "VIRTUAL_TIME_NOTE",
]

# How long before a deadline we stop sleeping and start spinning. time.sleep overshoots by
# ~0.1 ms median on a quiet machine; 1 ms leaves room for a busier one without burning much CPU.
DEFAULT_SPIN_MARGIN = 1e-3


# The first line of a run on virtual time (`gpemu run --clock virtual`, or patch(clock="virtual")):
# what its times model and what they do not (docs/time.md, "Virtual time", says it at length).
VIRTUAL_TIME_NOTE = (
    "virtual time: each process's host time is the CPU time its threads spend (plus blocking file "
    "I/O in data fetches), never waiting for a core; GPU waits, sleeps and waits for other ranks or "
    "batches jump to their deadline. Not modelled: contention for this host's disk, memory "
    "bandwidth and network, and time a thread spends blocked outside those waits"
)


class RealTime:
    """The host's real clocks and sleep, as they were when gpemu was imported: a run on virtual
    time replaces ``time.perf_counter``, ``time.sleep``, ... for the program (gpemu.time.virtual),
    while the emulator's own real waits (a sharing manager's deadlines, broker timeouts) keep
    reading the real ones from here."""

    perf_counter = staticmethod(time.perf_counter)
    monotonic = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)
    time = staticmethod(time.time)  # (last: the name shadows the module in this class body)


REAL = RealTime()


class Clock(Protocol):
    """What the time engine needs from a clock."""

    def now(self) -> float: ...

    def wait_until(self, deadline: float) -> None: ...


class RealClock:
    """``time.perf_counter`` with deadline waits (coarse sleep, then spin)."""

    virtual = False  # waits take real time

    def __init__(self, spin_margin: float = DEFAULT_SPIN_MARGIN) -> None:
        if spin_margin < 0:
            raise ValueError(f"spin_margin must be >= 0 seconds, got {spin_margin!r}")
        self.spin_margin = spin_margin

    @staticmethod
    def now() -> float:
        return REAL.perf_counter()

    def wait_until(self, deadline: float) -> None:
        perf = REAL.perf_counter
        margin = self.spin_margin
        remaining = deadline - perf()
        # Several coarse sleeps: one sleep may return early (signals) or very late under load;
        # re-checking keeps us from spinning for long stretches.
        while remaining > margin:
            REAL.sleep(remaining - margin)
            remaining = deadline - perf()
        while perf() < deadline:
            pass

    def sleep(self, seconds: float) -> None:
        self.wait_until(REAL.perf_counter() + seconds)


class VirtualClock:
    """A clock that only moves when someone waits on it (or calls :meth:`advance`).

    ``wait_until`` jumps straight to the deadline, so tests of sync-point semantics run
    instantly and compare times exactly. ``waits`` lists every deadline waited for.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()
        self.waits: list[tuple[float, float]] = []  # (from, to) of each wait that moved time

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Let host time pass (e.g. the host computing something); returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go back in time (advance by {seconds!r} s)")
        with self._lock:
            self._now += seconds
            return self._now

    def wait_until(self, deadline: float) -> None:
        with self._lock:
            if deadline > self._now:
                self.waits.append((self._now, deadline))
                self._now = deadline

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)


_REAL = RealClock()


def now() -> float:
    """The engine's time base (``time.perf_counter`` seconds)."""
    return REAL.perf_counter()


def wait_until(deadline: float) -> None:
    """Block the calling thread until ``perf_counter() >= deadline`` (no accumulated error)."""
    _REAL.wait_until(deadline)
