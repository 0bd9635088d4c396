"""Where each host thread stands on the emulated timeline, and the emulator's own time.

``HostTime.now()`` is the host's time on the emulated timeline: the clock minus the host time
forgiven, never before the deadline of this thread's last sync wait. Two kinds of host time are
forgiven, because a real GPU program would not spend them:

- **The emulator's own work.** On a real GPU the work the emulator does instead (dispatching a
  replayed model, copying, stepping an optimizer) is the framework's and the driver's, issued in
  microseconds; here it can take tens of microseconds, more on a slow or busy host. So at every
  outermost entry into emulator code that runs no user code (an emulated op, a replayed module,
  a copy, a fast-path loss, backward, optimizer step or zero_grad, a sync point), the host's
  emulated time is frozen at the entry: work enqueued inside is issued then, and the time spent
  inside is forgiven when the outermost entry leaves. A wait inside counts (it is the GPU's
  time) and restarts the entry after it. User code called from inside (hooks, a module's
  forward on a recording pass, Python autograd Functions' backward) runs between
  :meth:`HostTime.suspend` and :meth:`HostTime.resume`, and counts. :meth:`HostTime.call` is
  the one way in for code that wraps a call; :meth:`HostTime.enter` / :meth:`HostTime.leave`
  for the rest.
- **Waking up late.** The OS wakes a waiting thread after its deadline; a real CUDA sync
  returns within microseconds. See :meth:`HostTime.waited`.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from ..clock import REAL, Clock, RealClock
from ..recorder import Recorder

if TYPE_CHECKING:  # pragma: no cover
    from .profiling import TimeMap

__all__ = ["HostState", "HostTime", "MAX_FORGIVEN_LATENESS", "MAX_FORGIVEN_WORK", "LONG_WAIT_S"]

_append = list.append  # records are appended as plain tuples (see gpemu.recorder.Records)
_R = TypeVar("_R")

# A wake-up later than this is not forgiven (something other than scheduling noise held us).
MAX_FORGIVEN_LATENESS = 0.05
# The emulator's own host time forgiven per emulator entry at most: a longer stretch is
# something else (the process held by the OS for that long, a full garbage collection) and
# counts, as it would on a real GPU.
MAX_FORGIVEN_WORK = 0.05
# On a shared VM the first microseconds after a wait of a millisecond or more run with cold
# caches (here: a return + call path of 0.3 us warm takes 2-4 us), so the return allowance is
# calibrated for short and for long waits separately (gpemu.time.allowance).
LONG_WAIT_S = 1e-3  # a wait at least this long gets the long-wait allowance


class HostState:
    """One host thread's place on the emulated timeline (``HostTime.local.host``).

    ``now()`` is ``clock - late`` (never below ``floor``), except inside the emulator's own code
    (``depth > 0``), where it stays at ``entry - late``: the host's time is frozen at the moment
    the program called the emulator. (A plain object with slots: an attribute of a
    ``threading.local`` costs ~0.5 us to read here.)"""

    __slots__ = (
        "late",
        "floor",
        "wait_deadline",
        "allowance",
        "scope",
        "depth",
        "entry",
        "current",
        "enter_stack",
        "launching",
        "in_setup",
        "direct_backward",
    )

    def __init__(self) -> None:
        self.late = 0.0  # forgiven host time: now() = clock - late
        self.floor = float("-inf")  # now() never reads below the last waited deadline
        self.wait_deadline: float | None = None  # the wait settle() may still forgive (None: none)
        self.allowance = 0.0  # return allowance of that wait
        self.scope = 0  # charged_scope depth (gpemu.time.engine)
        self.depth = 0  # emulator entries open (0: the program's own code)
        self.entry = 0.0  # clock reading when the outermost one began (or its last wait ended)
        self.current: dict | None = None  # device -> this thread's current stream (None: defaults)
        self.enter_stack: list | None = None  # streams replaced by `with stream:` blocks
        self.launching = False  # inside one launch (a CUDA graph replay): ops cost no issue time
        self.in_setup = False  # inside a set-up call
        # Running a backward pass's nodes without the autograd engine (gpemu.fastpaths.backward):
        # their ops are backward work although no engine graph task is current.
        self.direct_backward = False


class PerThread(threading.local):
    """``HostTime.local``: ``.host`` is the calling thread's :class:`HostState`."""

    def __init__(self) -> None:
        self.host = HostState()


class HostTime:
    """The host threads' emulated time on one clock.

    ``return_allowance``: host seconds after each sync wait that are the emulator's own return
    path (from its last clock reading back to the program) plus its entry path (from the
    program's next enqueue call to the clock reading there), ``(after a wait shorter than
    LONG_WAIT_S, after a longer one)``; see :meth:`waited`."""

    def __init__(self, clock: Clock, recorder: Recorder, return_allowance: tuple[float, float]) -> None:
        self.clock = clock
        self.recorder = recorder
        self.return_allowance = return_allowance
        # The hot paths read the clock through this: perf_counter itself for a RealClock (one
        # call less on the paths whose length is the emulator's overhead).
        self.read_clock: Callable[[], float] = time.perf_counter if type(clock) is RealClock else clock.now
        # Per thread: .host, the calling thread's HostState (read it once per call: see HostState).
        self.local = PerThread()
        self.wake_late_s = 0.0  # wake-up lateness forgiven (the recorder's "wake_late_s")
        # Modelled framework host time charged (gpemu.time.launch; the recorder's "host_issue_s")
        self.issued_s = 0.0
        # On virtual time (a clock whose waits jump) the emulator's own time is CPU time, never
        # the OS holding the process: all of it is forgiven, however long an entry takes.
        self.virtual = bool(getattr(clock, "virtual", False))
        self.max_forgiven_work = float("inf") if self.virtual else MAX_FORGIVEN_WORK
        self.started_wall = REAL.perf_counter()  # real time at the start (the speed-up of a virtual run)
        # While the torch profiler records on virtual time: its (real, virtual) samples
        # (gpemu.time.profiling), taken where the two part: leaving emulator code, after waits.
        self.time_map: TimeMap | None = None
        recorder.add_source(self._counters)
        if self.virtual:
            _FORKED_FRESH.add(self)

    def _counters(self) -> list[tuple[str, float]]:
        counters = [("wake_late_s", self.wake_late_s)] if self.wake_late_s else []
        if self.issued_s:
            counters.append(("host_issue_s", self.issued_s))
        return counters

    # ------------------------------------------------------------------ the emulator's own time
    def enter(self) -> None:
        """The calling thread enters the emulator's own code (nests; see :meth:`leave`)."""
        local = self.local.host
        if local.depth:
            local.depth += 1
        else:
            local.entry = self.read_clock()
            local.depth = 1

    def leave(self) -> None:
        """The calling thread leaves the emulator's own code: when the outermost entry leaves,
        the host time since it began (or since its last wait ended) is forgiven."""
        local = self.local.host
        depth = local.depth
        if depth > 1:
            local.depth = depth - 1
        elif depth == 1:
            local.depth = 0
            spent = self.read_clock() - local.entry
            if spent > 0:
                cap = self.max_forgiven_work
                local.late += spent if spent < cap else cap
            if self.time_map is not None:
                self.time_map.sample(self)

    def call(self, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` as emulator work: an outermost entry when the thread is in the
        program's own code, a plain call when already inside the emulator (the hot paths' form
        of ``enter(); try: fn() finally: leave()``)."""
        local = self.local.host
        if local.depth:
            return fn(*args)
        local.entry = self.read_clock()
        local.depth = 1
        try:
            return fn(*args)
        finally:
            if local.depth == 1:  # (leave() written out for the usual outermost exit)
                local.depth = 0
                spent = self.read_clock() - local.entry
                if spent > 0:
                    cap = self.max_forgiven_work
                    local.late += spent if spent < cap else cap
                if self.time_map is not None:
                    self.time_map.sample(self)
            else:
                self.leave()

    def setup_call(self, fn: Callable[..., _R], *args: Any) -> _R:
        """``fn(*args)`` as the emulator's one-time set-up (a first use's imports, recording the
        ops of a measured loop, database look-ups): like :meth:`call`, but forgiven however long
        it takes. The cap on an entry (``max_forgiven_work``) tells the OS holding the process
        from the emulator's own work; set-up is known to be the emulator's, and on a busy host it
        takes seconds (a first measured model's call read 0.7-1.2 s in its CUDA events)."""
        local = self.local.host
        if not local.depth:
            return self.call(self.setup_call, fn, *args)
        if local.in_setup:  # (inside another set-up: its span counts once)
            return fn(*args)
        local.in_setup = True
        start = self.read_clock()
        try:
            return fn(*args)
        finally:
            local.in_setup = False
            # Forgiven whole at once (from its start, or from the end of a wait inside it: a wait is
            # never forgiven): the entry's start moves past it, so the entry's own capped time,
            # forgiven when it ends, excludes it; the host's time inside the entry stays as it was.
            setup = self.read_clock() - (start if start > local.entry else local.entry)
            local.late += setup
            local.entry += setup

    def suspend(self) -> int:
        """User code runs now (a hook, a module's own forward): the emulator's time so far is
        forgiven and the host's time counts again until :meth:`resume` with the returned value."""
        local = self.local.host
        depth = local.depth
        if depth:
            local.depth = 0
            spent = self.read_clock() - local.entry
            if spent > 0:
                cap = self.max_forgiven_work
                local.late += spent if spent < cap else cap
        return depth

    def resume(self, depth: int, at: float | None = None) -> None:
        """Back in the emulator's own code after :meth:`suspend` (``at``: the clock reading it
        resumes from, default now)."""
        if depth:
            local = self.local.host
            local.entry = self.read_clock() if at is None else at
            local.depth = depth

    @contextmanager
    def emulator_work(self) -> Iterator[None]:
        """``with host.emulator_work():`` :meth:`enter` ... :meth:`leave`."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @contextmanager
    def program_work(self) -> Iterator[None]:
        """``with host.program_work():`` :meth:`suspend` ... :meth:`resume` (user code inside
        emulator code)."""
        depth = self.suspend()
        try:
            yield
        finally:
            self.resume(depth)

    @contextmanager
    def one_launch(self) -> Iterator[None]:
        """Inside, the work this thread enqueues is one launch (a CUDA graph replay): its ops cost
        the modelled host no issue time of their own (gpemu.time.launch)."""
        local = self.local.host
        outer = local.launching
        local.launching = True
        try:
            yield
        finally:
            local.launching = outer

    @property
    def in_emulator(self) -> bool:
        """True while the calling thread runs emulator code (its host time frozen)."""
        return self.local.host.depth > 0

    # ------------------------------------------------------------------ reading and waiting
    def now(self) -> float:
        """The host's time on the emulated timeline: the clock minus the host time forgiven
        (the emulator's own, and at this thread's last sync wait, see :meth:`waited`), never
        before that wait's deadline; frozen inside emulator code."""
        local = self.local.host
        t = (local.entry if local.depth else self.read_clock()) - local.late
        return t if t > local.floor else local.floor

    def wait_until(self, deadline: float, device: int, reason: str) -> None:
        """The host waits until ``deadline`` (the GPU's time, not the emulator's: inside an
        emulator entry it counts, and the entry restarts when it ends)."""
        local = self.local.host
        depth = local.depth
        start = self.read_clock()
        if depth:  # (suspend: the emulator's time so far is forgiven, the wait counts)
            local.depth = 0
            spent = start - local.entry
            if spent > 0:
                cap = self.max_forgiven_work
                local.late += spent if spent < cap else cap
        if self.time_map is not None:  # (both sides of a jump)
            self.time_map.sample(self)
        self.clock.wait_until(deadline)
        last = self.waited(deadline, start, device, reason)
        if depth:  # (resume from the wait's last reading)
            local.entry = last
            local.depth = depth

    def waited(self, deadline: float, start: float, device: int, reason: str) -> float:
        """Book-keeping after the host waited until ``deadline``; returns its last clock reading.

        The OS wakes us after the deadline (a sleep overshoots; on a loaded machine the spin is
        preempted). A real CUDA sync returns within microseconds, so that lateness is the
        emulator's, not the program's: the host's emulated time stays on the deadline and the
        lateness never delays later GPU work. So is the emulator's own path back to the program
        after its last clock reading and, at the program's next enqueue, its path to the clock
        reading there: ``return_allowance`` more is forgiven, and the host's emulated time stands
        on the deadline (``floor``) until that allowance is used up, so a query/event/enqueue
        right after the sync still sees the waited-for work complete and nothing starts before
        it. Host time beyond that counts normally (the program's own time)."""
        clock_now = self.read_clock
        woke = clock_now()
        _append(self.recorder.waits, (device, reason, start, woke))
        local = self.local.host
        local.wait_deadline = deadline
        local.floor = deadline
        # Lateness is the wake-up's only after a real sleep: a deadline the clock had already
        # passed when the wait began (the emulated timeline behind the clock by forgiven emulator
        # time) is no wake-up late, and forgiving that lag again would keep every later sync from
        # waiting (a program syncing each step printed steps faster than the emulated GPU ran).
        due = deadline if deadline > start else start
        late = woke - due
        if late > 0:
            self.wake_late_s += late
        allowance = local.allowance = self.return_allowance[deadline - start >= LONG_WAIT_S]
        # Measured after our own book-keeping, so that is forgiven too: the program's next
        # action happens at the deadline on the emulated timeline. (The first statements after
        # a wait run with cold caches on a shared machine, ~5-10 us each: the book-keeping
        # above is done before the final reading, so it costs nothing.)
        last = clock_now()
        if self.virtual:
            # On virtual time the clock's lead over the deadline is the emulator's own time (the
            # clock jumped to a later deadline; an earlier one it had passed by forgiven work):
            # the host stands on the deadline, and work forgiven before the wait stays forgiven
            # (re-aligning on the clock made a value run's CPU compute count at every sync whose
            # GPU work was shorter than it: gpemu.device.values).
            local.late = last - deadline if last > deadline else 0.0
            if self.time_map is not None:
                self.time_map.sample(self)
            return last
        late = last - due
        if late > MAX_FORGIVEN_LATENESS:
            late = MAX_FORGIVEN_LATENESS
        local.late = (late if late > 0 else 0.0) + allowance
        if self.time_map is not None:
            self.time_map.sample(self)
        return last

    def settle(self) -> None:
        """Called by emulator code on its way back to the program right after a sync wait (e.g.
        ``.item()`` after computing the placeholder value) when it runs outside an emulator
        entry (whose leaving does this): the host time since the wait ended was the emulator's,
        so the program's next action still happens at the deadline on the emulated timeline
        (plus ``return_allowance`` for the rest of the way back). A no-op unless this thread's
        last sync waited."""
        local = self.local.host
        deadline = local.wait_deadline
        if deadline is None or local.depth:
            return
        late = self.read_clock() - deadline
        if late > MAX_FORGIVEN_LATENESS:
            late = MAX_FORGIVEN_LATENESS
        late += local.allowance
        if late > local.late:
            local.late = late

    def forget_wait(self) -> None:
        """Start a new settle() scope: only a wait after this call may be forgiven."""
        self.local.host.wait_deadline = None

    # ------------------------------------------------------------------ the program's host time
    def charge_host(self, seconds: float) -> None:
        """The calling thread's program spends ``seconds`` of modelled host time (what a real
        framework would spend issuing work, which the emulator does in less): its time on the
        emulated timeline moves on by that much, on the real clock and on virtual time alike.

        Note: the place for a host model's per-op issue time (docs/time.md, "Virtual time"):
        charged here, it is the program's time like its own CPU time, so work it issues
        afterwards starts later and a sync point waits from there."""
        if not seconds >= 0:
            raise ValueError(f"modelled host time must be >= 0 seconds, got {seconds!r}")
        self.issued_s += seconds
        if self.time_map is None:  # (the usual case, written out: a replay's every call)
            self.local.host.late -= seconds
        else:
            self.jump(lambda: setattr(self.local.host, "late", self.local.host.late - seconds))

    def jump(self, move: Callable[[], object]) -> None:
        """``move()`` moves the calling thread's time at once (a sleep, a modelled cost): the
        torch profiler's samples, when it records, see both sides (gpemu.time.profiling)."""
        tmap = self.time_map
        if tmap is not None:
            tmap.sample(self)
        move()
        if tmap is not None:
            tmap.sample(self)

    def arrive(self, at: float, reason: str) -> None:
        """The calling thread receives something that was ready at ``at`` (a batch, the last rank
        at a barrier): when that is later than its time, it waited for it until then."""
        if at > self.now():
            self.enter()
            try:
                self.wait_until(at, self.current_device_index(), reason)
            finally:
                self.leave()

    def current_device_index(self) -> int:
        """The device a host wait is recorded against (the engine knows the thread's device)."""
        return 0

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): the forking thread starts afresh at the time
        its clock continues from (see gpemu.time.cpuclock), nothing forgiven yet."""
        self.local.host = HostState()


# Engines on virtual time, whose forked children start their host state afresh.
_FORKED_FRESH: weakref.WeakSet[HostTime] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for host in list(_FORKED_FRESH):
        host._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
