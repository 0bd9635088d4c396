"""Emulated GPU time: virtual streams, events and sync points (component ``gpemu.engine``).

The model is CUDA's: the host *enqueues* GPU work and runs ahead; a stream executes its work in
order, each item starting when both the stream is free and the work was enqueued
(``start = max(now, busy_until)``). The host only waits at sync points (``synchronize``,
``.item()``, blocking copies, ``Event.synchronize``), and then until an ABSOLUTE deadline (the
stream's ``busy_until``), so the emulator's own host time is hidden behind emulated GPU time
exactly as a real program's is, and sleep overshoot never accumulates.

A GPU time *backend* (the sharing client) can replace local deadline arithmetic: work is then
collected per device and handed, at the configured granularity, to a per-device worker thread
that calls ``backend.run(device, seconds, peak_bytes, kind)`` (which blocks while the sharing
manager runs other jobs). The host still runs ahead; sync points wait for the worker.

``VirtualStream`` and ``EmuEvent`` are shaped like ``torch.cuda.Stream`` / ``torch.cuda.Event``;
the torch.cuda surface (:mod:`gpemu.cuda_api`) hands them out, and reads user device arguments.
This module knows nothing of the rest of gpemu: it is given its clock, recorder, memory
trackers and a way to read the host thread's current device.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .clock import Clock, RealClock
from .config import GRANULARITIES
from .devices import check_ordinal
from .recorder import Recorder

_append = list.append  # records are appended as plain tuples (see gpemu.recorder.Records)

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = [
    "TimeEngine",
    "VirtualStream",
    "EmuEvent",
    "GpuTimeBackend",
    "install",
    "calibrate_return_allowance",
]
# A wake-up later than this is not forgiven (something other than scheduling noise held us).
_MAX_FORGIVEN_LATENESS = 0.05
# The emulator's own host time forgiven per emulator entry (see TimeEngine.enter) at most: a
# longer stretch is something else (the process held by the OS for that long, a full garbage
# collection) and counts, as it would on a real GPU.
_MAX_FORGIVEN_WORK = 0.05
# The return allowance (see calibrate_return_allowance). On a shared VM the first microseconds
# after a wait of a millisecond or more run with cold caches (here: a return + call path of
# 0.3 us warm takes 2-4 us), so it is calibrated for short and for long waits separately.
_LONG_WAIT_S = 1e-3  # a wait at least this long gets the long-wait allowance
# Calibration (rounds, wait length, quantile taken). Long waits: the lower quartile, because the
# cold-cache cost varies with the machine's load (0.6-0.9 us median here when quiet, 1.2-2.6 us
# under load): the allowance should not exceed what the program will really see.
_CAL_SHORT = (200, 5e-6, 0.5)  # ~2 ms in all
_CAL_LONG = (30, 2e-3, 0.25)  # ~60 ms in all, once per process
_MAX_ALLOWANCE = 20e-6  # a sane bound when the machine is too loaded to measure
_calibrated: tuple[float, float] | None = None


class HostState:
    """One host thread's place on the emulated timeline (``TimeEngine.local.host``).

    ``engine.now()`` is ``clock - late`` (never below ``floor``), except inside the emulator's
    own code (``depth > 0``, see :meth:`TimeEngine.enter`), where it stays at ``entry - late``:
    the host's time is frozen at the moment the program called the emulator. (A plain object
    with slots: an attribute of a ``threading.local`` costs ~0.5 us to read here.)"""

    __slots__ = ("late", "floor", "wait_deadline", "allowance", "scope", "depth", "entry", "current", "enter_stack")

    def __init__(self) -> None:
        self.late = 0.0  # forgiven host time: engine.now() = clock - late
        self.floor = float("-inf")  # engine.now() never reads below the last waited deadline
        self.wait_deadline: float | None = None  # the wait settle() may still forgive (None: none)
        self.allowance = 0.0  # return allowance of that wait
        self.scope = 0  # charged_scope depth
        self.depth = 0  # emulator entries open (0: the program's own code)
        self.entry = 0.0  # clock reading when the outermost one began (or its last wait ended)
        self.current: dict | None = None  # device -> this thread's current stream (None: defaults)
        self.enter_stack: list | None = None  # streams replaced by `with stream:` blocks


class PerThread(threading.local):
    """``TimeEngine.local``: ``.host`` is the calling thread's :class:`HostState`."""

    def __init__(self) -> None:
        self.host = HostState()


class GpuTimeBackend(Protocol):
    """Something that 'runs' GPU time for this job, e.g. a sharing manager client."""

    def run(self, device: int, seconds: float, peak_bytes: int, kind: str) -> None: ...


# ---------------------------------------------------------------------------------------------
# the return allowance
# ---------------------------------------------------------------------------------------------
def _measure_return_path(rounds: int, wait: float, quantile: float) -> float:
    """Host time (that quantile over ``rounds``) of the engine's own return path after a real
    wait of ``wait`` seconds plus its enqueue entry path (the caller's own time between the two
    is left out)."""
    eng = TimeEngine(1, Recorder(), clock=RealClock(), return_allowance=0.0)
    enqueue, synchronize, local = eng.default_stream(0).enqueue, eng.synchronize, eng.local.host
    spans = eng.recorder.spans
    perf = time.perf_counter
    paths = []
    for _ in range(rounds):
        deadline = enqueue(wait, "op", "calibration")
        synchronize(0, "calibration")
        back = perf()  # the program has control again
        call = perf()  # the program calls enqueue
        enqueue(1e-9, "op", "calibration")
        if local.wait_deadline != deadline or local.late >= _MAX_FORGIVEN_LATENESS:
            continue  # it did not wait, or it was held too long to tell
        # Without an allowance, late = settle's reading - deadline and the span's enqueue time is
        # the enqueue's reading - late: both readings are recovered exactly.
        settled = deadline + local.late
        read = spans[-1].enqueued_at + local.late
        paths.append((back - settled) + (read - call))
    paths.sort()
    value = paths[int(len(paths) * quantile)] if paths else 0.0
    return min(max(value, 0.0), _MAX_ALLOWANCE)


def calibrate_return_allowance(refresh: bool = False) -> tuple[float, float]:
    """``(after a short wait, after a long wait)``: the emulator's own host time per sync wait
    that a real GPU would not show as idle, measured once per process on the real clock.

    A scratch engine (no allowance) enqueues work, synchronizes (a real wait) and enqueues again,
    200 rounds with waits of 5 us and 30 rounds with waits of 2 ms. Each round measures the
    sync's return path (its last clock reading -> back in the caller) and the next enqueue's
    entry path (called -> its clock reading), with ``perf_counter`` marks in between so the
    caller's own time is not in it (the marks' own call and return, ~0.05 us warm, are). The
    allowances are the median after short waits and the lower quartile after long ones: the
    time a minimal program spends in emulator code after a sync on this machine, erring low."""
    global _calibrated
    if _calibrated is None or refresh:
        _calibrated = (_measure_return_path(*_CAL_SHORT), _measure_return_path(*_CAL_LONG))
    return _calibrated


# ---------------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------------
class TimeEngine:
    """All streams of all emulated devices of one run, and the host's sync points."""

    def __init__(
        self,
        num_devices: int,
        recorder: Recorder | None = None,
        clock: Clock | None = None,
        granularity: str = "iteration",
        return_allowance: float | tuple[float, float] | None = None,
        memory: Sequence[Any] | None = None,
        current_device: Callable[[], int] | None = None,
    ) -> None:
        """``return_allowance``: host seconds after each sync wait that are the emulator's own
        return path (from its last clock reading back to the program) plus its entry path (from
        the program's next enqueue call to the clock reading there); see :meth:`_waited`. One
        value, or ``(after a wait shorter than 1 ms, after a longer one)``. None: calibrated
        once per process on a real clock (:func:`calibrate_return_allowance`), 0 on any other
        clock (virtual clocks are exact). ``memory``: the devices' memory trackers (a backend is
        told each device's peak bytes). ``current_device``: the calling thread's current device
        (streams and events used without a device), device 0 when not given."""
        if not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        if return_allowance is not None:
            pair = return_allowance if isinstance(return_allowance, tuple) else (return_allowance,) * 2
            if len(pair) != 2 or not all(isinstance(v, (int, float)) and 0 <= v <= _MAX_ALLOWANCE for v in pair):
                raise ValueError(
                    f"return_allowance must be seconds in [0, {_MAX_ALLOWANCE}] or a pair of "
                    f"them (short wait, long wait), got {return_allowance!r}"
                )
        self.num_devices = num_devices
        self.recorder = recorder if recorder is not None else Recorder()
        self.wake_late_s = 0.0  # wake-up lateness forgiven (the recorder's "wake_late_s")
        self.recorder.add_source(self._counters)
        self.clock: Clock = clock if clock is not None else RealClock()
        # The hot paths read the clock through this: perf_counter itself for a RealClock (one
        # call less on the paths whose length is the emulator's overhead).
        self.read_clock: Callable[[], float] = time.perf_counter if type(self.clock) is RealClock else self.clock.now
        if return_allowance is None:
            pair = calibrate_return_allowance() if type(self.clock) is RealClock else (0.0, 0.0)
        self.return_allowance: tuple[float, float] = (float(pair[0]), float(pair[1]))
        self.granularity = granularity
        self._lock = threading.Lock()
        # Per thread: .host, the calling thread's HostState (read it once per call: see HostState).
        self.local = PerThread()
        # Latest end of any work on each device (all streams): a device sync waits for this.
        self._device_busy = [0.0] * num_devices
        self._next_stream_id = [1] * num_devices
        self._stream_type: type[VirtualStream] = VirtualStream
        self._default = [VirtualStream(self, d, 0, 0) for d in range(num_devices)]
        self._backend: GpuTimeBackend | None = None
        self._workers: dict[int, _BackendWorker] = {}
        self._pending: list[list[tuple]] = [[] for _ in range(num_devices)]
        self._backward_since_mark = [False] * num_devices
        self._memory = memory
        self.current_device: Callable[[], int] = current_device if current_device is not None else (lambda: 0)

    # ------------------------------------------------------------------ streams
    def check_device(self, device: int) -> int:
        return check_ordinal(device, self.num_devices)

    def set_stream_type(self, stream_type: type[VirtualStream]) -> None:
        """Make every stream of this engine (the default streams too) an instance of
        ``stream_type``, a :class:`VirtualStream` subclass (the torch.cuda surface's
        ``torch.cuda.Stream``, so ``isinstance(torch.cuda.current_stream(), torch.cuda.Stream)``
        holds). Only before any work is enqueued."""
        if any(s.busy_until for s in self._default):
            raise RuntimeError("gpemu: stream type changed after GPU work was enqueued")
        self._stream_type = stream_type
        self._default = [VirtualStream.make(stream_type, self, d, 0, 0) for d in range(self.num_devices)]

    def default_stream(self, device: int) -> VirtualStream:
        return self._default[self.check_device(device)]

    def next_stream_id(self, device: int) -> int:
        """A new stream id on ``device`` (0 is the default stream)."""
        self.check_device(device)
        with self._lock:
            sid = self._next_stream_id[device]
            self._next_stream_id[device] = sid + 1
        return sid

    def new_stream(self, device: int, priority: int = 0) -> VirtualStream:
        return VirtualStream.make(self._stream_type, self, device, priority, self.next_stream_id(device))

    def stream(self, device: int) -> VirtualStream:
        """The calling thread's current stream on ``device`` (default stream unless set)."""
        current = self.local.host.current
        if current is not None:
            s = current.get(device)
            if s is not None:
                return s
        return self._default[device]

    def set_stream(self, stream: VirtualStream) -> VirtualStream:
        """Make ``stream`` current on its device for this thread; returns the previous one."""
        if not isinstance(stream, VirtualStream) or stream._engine is not self:
            raise TypeError(f"expected a gpemu stream of this run, got {stream!r}")
        current = self.local.host.current
        if current is None:
            current = self.local.host.current = {}
        previous = current.get(stream.device_index, self._default[stream.device_index])
        current[stream.device_index] = stream
        return previous

    @contextmanager
    def use_stream(self, stream: VirtualStream | None) -> Iterator[VirtualStream | None]:
        """``with engine.use_stream(s):`` work enqueued on s's device goes to s (torch.cuda.stream)."""
        if stream is None:  # torch.cuda.stream(None) is a no-op
            yield None
            return
        previous = self.set_stream(stream)
        try:
            yield stream
        finally:
            self.set_stream(previous)

    # ------------------------------------------------------------------ the emulator's own time
    # The emulator's own host time is not on the emulated host timeline. On a real GPU the work
    # the emulator does instead (dispatching a replayed model, copying, stepping an optimizer)
    # is the framework's and the driver's, issued in microseconds; here it can take tens of
    # microseconds, more on a slow or busy host. So at every outermost entry into emulator code
    # that runs no user code (an emulated op, a replayed module, a copy, a fast-path loss,
    # backward, optimizer step or zero_grad, a sync point, a freed tensor's memory), the host's
    # emulated time is frozen at the entry: work enqueued inside is issued then, and the time
    # spent inside is forgiven when the outermost entry leaves (added to ``host.late``). A wait
    # inside counts (it is the GPU's time) and restarts the entry after it. User code called
    # from inside (hooks, a module's forward on a recording pass, Python autograd Functions'
    # backward) runs between :meth:`suspend` and :meth:`resume`, and counts.
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
        depth = local.depth - 1
        if depth > 0:
            local.depth = depth
        elif depth == 0:
            local.depth = 0
            spent = self.read_clock() - local.entry
            if spent > 0:
                local.late += spent if spent < _MAX_FORGIVEN_WORK else _MAX_FORGIVEN_WORK

    def suspend(self) -> int:
        """User code runs now (a hook, a module's own forward): the emulator's time so far is
        forgiven and the host's time counts again until :meth:`resume` with the returned value."""
        local = self.local.host
        depth = local.depth
        if depth:
            local.depth = 0
            spent = self.read_clock() - local.entry
            if spent > 0:
                local.late += spent if spent < _MAX_FORGIVEN_WORK else _MAX_FORGIVEN_WORK
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
        """``with engine.emulator_work():`` :meth:`enter` ... :meth:`leave`."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @contextmanager
    def program_work(self) -> Iterator[None]:
        """``with engine.program_work():`` :meth:`suspend` ... :meth:`resume` (user code inside
        emulator code)."""
        depth = self.suspend()
        try:
            yield
        finally:
            self.resume(depth)

    @property
    def in_emulator(self) -> bool:
        """True while the calling thread runs emulator code (its host time frozen)."""
        return self.local.host.depth > 0

    # ------------------------------------------------------------------ sync points
    def now(self) -> float:
        """The host's time on the emulated timeline: the clock minus the host time forgiven
        (the emulator's own, see :meth:`enter`, and at this thread's last sync wait, see
        :meth:`_waited`), never before that wait's deadline; frozen inside emulator code."""
        local = self.local.host
        t = (local.entry if local.depth else self.read_clock()) - local.late
        return t if t > local.floor else local.floor

    def _waited(self, deadline: float, start: float, device: int, reason: str) -> float:
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
        allowance = local.allowance = self.return_allowance[deadline - start >= _LONG_WAIT_S]
        # Measured after our own book-keeping, so that is forgiven too: the program's next
        # action happens at the deadline on the emulated timeline. (The first statements after
        # a wait run with cold caches on a shared machine, ~5-10 us each: the book-keeping
        # above is done before the final reading, so it costs nothing.)
        last = clock_now()
        late = last - due
        if late > _MAX_FORGIVEN_LATENESS:
            late = _MAX_FORGIVEN_LATENESS
        local.late = (late if late > 0 else 0.0) + allowance
        return last

    def settle(self) -> None:
        """Called by emulator code on its way back to the program right after a sync wait (e.g.
        ``.item()`` after computing the placeholder value) when it runs outside an emulator
        entry (:meth:`enter`, whose leaving does this): the host time since the wait ended
        was the emulator's, so the program's next action still happens at the deadline on the
        emulated timeline (plus ``return_allowance`` for the rest of the way back). A no-op
        unless this thread's last :meth:`synchronize` waited."""
        local = self.local.host
        deadline = local.wait_deadline
        if deadline is None or local.depth:
            return
        late = self.read_clock() - deadline
        if late > _MAX_FORGIVEN_LATENESS:
            late = _MAX_FORGIVEN_LATENESS
        late += local.allowance
        if late > local.late:
            local.late = late

    def forget_wait(self) -> None:
        """Start a new settle() scope: only a wait after this call may be forgiven."""
        self.local.host.wait_deadline = None

    def _counters(self) -> list[tuple[str, float]]:
        return [("wake_late_s", self.wake_late_s)] if self.wake_late_s else []

    def device_busy_until(self, device: int) -> float:
        return self._device_busy[device]

    def synchronize(self, device: int | None = None, reason: str = "synchronize") -> None:
        """Host waits until every stream of ``device`` (all devices when None) is idle."""
        self.enter()
        try:
            devices = range(self.num_devices) if device is None else (self.check_device(device),)
            # settle() forgives only the time since a wait of THIS call (not since an older wait).
            self.local.host.wait_deadline = None
            for d in devices:
                self._wait_device(d, self._device_busy[d], reason)
        finally:
            self.leave()

    def _wait_device(self, device: int, deadline: float, reason: str) -> None:
        """The host waits for ``device`` until ``deadline`` (or, with a backend, until its
        worker is idle). The wait is the GPU's time, not the emulator's: inside an emulator
        entry it counts, and the entry restarts when it ends."""
        if self._backend is not None:
            self._flush(device)
            worker = self._workers.get(device)
            if worker is not None:
                depth = self.suspend()
                start = self.clock.now()
                try:
                    worker.wait_idle()
                finally:
                    end = self.clock.now()
                    self.resume(depth, end)
                if end > start:
                    self.recorder.host_wait(device, "sharing", start, end)
            return
        if deadline > self.now():
            self._wait_until(deadline, device, reason)

    def _wait_until(self, deadline: float, device: int, reason: str) -> None:
        local = self.local.host
        depth = local.depth
        start = self.read_clock()
        if depth:  # (suspend: the emulator's time so far is forgiven, the wait counts)
            local.depth = 0
            spent = start - local.entry
            if spent > 0:
                local.late += spent if spent < _MAX_FORGIVEN_WORK else _MAX_FORGIVEN_WORK
        self.clock.wait_until(deadline)
        last = self._waited(deadline, start, device, reason)
        if depth:  # (resume from the wait's last reading)
            local.entry = last
            local.depth = depth

    def enqueue_wait(self, stream: VirtualStream, seconds: float, kind: str, name: str, reason: str) -> None:
        """``stream.enqueue(seconds, kind, name)`` then ``stream.synchronize(reason)`` in one
        call: a blocking copy (every pageable input batch)."""
        if self._backend is not None:
            stream.enqueue(seconds, kind, name)
            stream.synchronize(reason)
            return
        self.enter()
        try:
            end = self._enqueue(stream, seconds, kind, name, 0)
            self.local.host.wait_deadline = None
            if end > self.now():
                self._wait_until(end, stream.device_index, reason)
        finally:
            self.leave()

    # ------------------------------------------------------------------ enqueue
    def _enqueue(
        self,
        stream: VirtualStream,
        seconds: float,
        kind: str,
        name: str,
        peak_bytes: int,
        at: float | None = None,
        now: float | None = None,
    ) -> float:
        if now is None:
            # Read the host's time first: the emulator's own checks below are not the program's.
            local = self.local.host
            now = (local.entry if local.depth else self.read_clock()) - local.late
            if now < local.floor:
                now = local.floor
        if at is not None and at < now:
            now = at
        if seconds < 0 or seconds != seconds:
            raise ValueError(f"GPU work must take a non-negative time, got {seconds!r} s for {kind} {name!r}")
        device = stream.device_index
        if kind == "backward":
            self._backward_since_mark[device] = True
        if self._backend is not None:
            return self._enqueue_backend(stream, seconds, kind, name, peak_bytes, now)
        with self._lock:
            start = stream.busy_until if stream.busy_until > now else now
            end = start + seconds
            stream.busy_until = end
            if end > self._device_busy[device]:
                self._device_busy[device] = end
        if seconds > 0:
            _append(self.recorder.spans, (device, stream.stream_id, kind, name, start, end, now))
        return end

    # ------------------------------------------------------------------ charged scopes
    @contextmanager
    def charged_scope(self) -> Iterator[None]:
        """Inside, per-op time is already covered by a whole-module or optimizer charge, so
        :func:`gpemu.costs.op_seconds` returns 0 (no double counting)."""
        self.local.host.scope += 1
        try:
            yield
        finally:
            self.local.host.scope -= 1

    @property
    def in_charged_scope(self) -> bool:
        return self.local.host.scope > 0

    @contextmanager
    def uncharged(self) -> Iterator[None]:
        """Inside, a charged scope of this thread is suspended (the op cache prices an op's own
        cost while a module charge covers it)."""
        local = self.local.host
        depth, local.scope = local.scope, 0
        try:
            yield
        finally:
            local.scope = depth

    def enter_charged(self) -> None:
        """Open a charged scope that is closed by :meth:`exit_charged` (for callbacks that cannot
        use the ``with`` form, e.g. around an autograd backward pass)."""
        self.local.host.scope += 1

    def exit_charged(self) -> None:
        local = self.local.host
        if local.scope > 0:
            local.scope -= 1

    def set_charged(self, on: bool) -> None:
        """This thread is (or is no longer) inside one charge, regardless of what was open before:
        for hook pairs that an exception between them could leave unbalanced (an optimizer step
        that raised must not leave every later op uncharged)."""
        self.local.host.scope = 1 if on else 0

    # ------------------------------------------------------------------ iterations
    def note_backward(self, device: int) -> None:
        """A backward pass ran on ``device`` (also one charged op by op, whose spans are ops):
        the next optimizer step ends an iteration."""
        self._backward_since_mark[device] = True

    def end_iteration(self, device: int) -> None:
        """An optimizer step finished on ``device``: mark an iteration (at the GPU time its work
        ends) and hand the iteration's work to a backend when one is plugged in."""
        if not self._backward_since_mark[device]:
            # e.g. a second optimizer in the same iteration, or steps without backward
            return
        self._backward_since_mark[device] = False
        if self._backend is not None and self.granularity == "iteration":
            self._flush(device)
        t = max(self.now(), self._device_busy[device])
        self.recorder.iteration(device, t)

    # ------------------------------------------------------------------ backend
    @property
    def backend(self) -> GpuTimeBackend | None:
        return self._backend

    def set_backend(self, backend: GpuTimeBackend | None) -> None:
        """Route GPU time through ``backend.run(...)`` (None: back to local deadlines).

        Pending local work is waited for first so no time is lost or counted twice."""
        if backend is not None and not callable(getattr(backend, "run", None)):
            raise TypeError("a GPU time backend needs a run(device, seconds, peak_bytes, kind) method")
        self.synchronize(None, "backend-switch")
        self.close()
        self._backend = backend

    def close(self) -> None:
        """Stop backend workers (after finishing what they hold)."""
        workers, self._workers = self._workers, {}
        for w in workers.values():
            w.stop()

    def _enqueue_backend(
        self, stream: VirtualStream, seconds: float, kind: str, name: str, peak_bytes: int, now: float
    ) -> float:
        device = stream.device_index
        self._pending[device].append((stream.stream_id, seconds, kind, name, now, peak_bytes))
        if self.granularity == "forward-backward" and kind == "backward":
            self._flush(device)
        # An estimate only: the backend decides when the work really ends.
        return max(now, stream.busy_until) + seconds

    def _flush(self, device: int) -> int:
        """Hand pending work of ``device`` to its backend worker; returns the worker's ticket."""
        with self._lock:
            items, self._pending[device] = self._pending[device], []
            worker = self._workers.get(device)
            if worker is None:
                worker = self._workers[device] = _BackendWorker(self, device, self._backend)
        if not items:
            return worker.last_ticket
        label = items[0][2] if all(it[2] == items[0][2] for it in items) else self.granularity
        return worker.submit(items, label, self._peak_bytes(device))

    def _peak_bytes(self, device: int) -> int:
        """The device's tracked peak allocation (0 without memory trackers)."""
        trackers = self._memory
        if trackers and device < len(trackers):
            return int(trackers[device].peak_allocated)
        return 0

    def _backend_done(self, device: int, end: float) -> None:
        with self._lock:
            if end > self._device_busy[device]:
                self._device_busy[device] = end
            for s in (self._default[device],):
                if end > s.busy_until:
                    s.busy_until = end


class _BackendWorker:
    """Runs one device's GPU work through a backend, in order, off the host thread."""

    def __init__(self, engine: TimeEngine, device: int, backend: GpuTimeBackend) -> None:
        self.engine = engine
        self.device = device
        self.backend = backend
        self.queue: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.last_ticket = 0
        self.done_ticket = 0
        self.done_at: dict[int, float] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=f"gpemu-gpu{device}-backend", daemon=True)
        self.thread.start()

    def submit(self, items: list[tuple], label: str, device_peak: int = 0) -> int:
        with self.cond:
            self.last_ticket += 1
            ticket = self.last_ticket
        self.queue.put((ticket, items, label, device_peak))
        return ticket

    def _loop(self) -> None:
        clock, rec = self.engine.clock, self.engine.recorder
        while True:
            job = self.queue.get()
            if job is None:
                return
            ticket, items, label, device_peak = job
            seconds = sum(it[1] for it in items)
            peak = max(max((it[5] for it in items), default=0), device_peak)
            t0 = clock.now()
            try:
                self.backend.run(self.device, seconds, peak, label)
            except BaseException as exc:  # surfaced to the host at its next wait
                self.error = exc
            t1 = clock.now()
            # Lay the items out inside the granted window, in proportion to their length.
            scale = (t1 - t0) / seconds if seconds > 0 else 0.0
            t = t0
            for sid, secs, kind, name, enq, _ in items:
                if secs > 0:
                    rec.span(self.device, sid, kind, name, t, t + secs * scale, enq)
                t += secs * scale
            self.engine._backend_done(self.device, t1)
            with self.cond:
                self.done_ticket = ticket
                self.done_at[ticket] = t1
                if len(self.done_at) > 4096:  # events only need recent tickets
                    for k in sorted(self.done_at)[:2048]:
                        del self.done_at[k]
                self.cond.notify_all()

    def wait(self, ticket: int) -> float:
        with self.cond:
            while self.done_ticket < ticket and self.error is None:
                self.cond.wait(0.5)
        if self.error is not None:
            err, self.error = self.error, None
            if isinstance(err, torch.cuda.OutOfMemoryError):
                # A sharing manager's memory refusal reaches user code as a real CUDA OOM.
                raise err
            raise RuntimeError(f"gpemu: the GPU time backend failed: {err!r}") from err
        return self.done_at.get(ticket, self.engine.clock.now())

    def wait_idle(self) -> None:
        self.wait(self.last_ticket)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# streams and events, shaped like torch.cuda.Stream / torch.cuda.Event
# ---------------------------------------------------------------------------------------------
class VirtualStream:
    """One emulated CUDA stream: in-order GPU work with a ``busy_until`` deadline.

    Made by the engine (:meth:`TimeEngine.new_stream`); user code constructs them as
    ``torch.cuda.Stream(device=None, priority=0)``, a subclass the torch.cuda surface defines.
    """

    __slots__ = ("_engine", "device_index", "priority", "stream_id", "busy_until", "__weakref__")

    def __init__(self, engine: TimeEngine, device: int, priority: int, stream_id: int) -> None:
        self._init(engine, device, priority, stream_id)

    @staticmethod
    def make(cls: type[VirtualStream], engine: TimeEngine, device: int, priority: int, stream_id: int) -> VirtualStream:
        """A stream of class ``cls`` (a subclass with its own constructor) without calling it."""
        s = cls.__new__(cls)
        s._init(engine, device, priority, stream_id)
        return s

    def _init(self, engine: TimeEngine, device: int, priority: int, stream_id: int) -> None:
        self._engine = engine
        self.device_index = device
        self.priority = int(priority)
        self.stream_id = stream_id
        self.busy_until = 0.0

    # -------------------------------------------------------------- engine-level API
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def enqueue(self, seconds: float, kind: str, name: str, peak_bytes: int = 0, at: float | None = None) -> float:
        """Append GPU work taking ``seconds``; returns the (emulated) GPU time it ends. Never blocks.

        ``at``: the host time (``engine.now()``) the work was really issued, when that was
        earlier than now: e.g. a module call's first kernel is issued microseconds into the call,
        before the emulator's own book-keeping for it (later values count as now)."""
        # The host's time is read here, first: the rest of the entry path is the emulator's.
        eng = self._engine
        local = eng.local.host
        now = (local.entry if local.depth else eng.read_clock()) - local.late
        if now < local.floor:
            now = local.floor
        return eng._enqueue(self, seconds, kind, name, peak_bytes, at, now)

    def synchronize(self, reason: str = "stream-synchronize") -> None:
        """Host waits until this stream's work is done (absolute deadline)."""
        # (with a backend the device's worker decides when the work ends; the deadline is unused)
        eng = self._engine
        local = eng.local.host
        outer = not local.depth
        if outer:
            local.entry = eng.read_clock()
            local.depth = 1
        try:
            local.wait_deadline = None
            eng._wait_device(self.device_index, self.busy_until, reason)
        finally:
            if outer:
                eng.leave()

    def query(self) -> bool:
        """True when all work enqueued on this stream has completed."""
        eng = self._engine
        if eng._backend is not None:
            w = eng._workers.get(self.device_index)
            return not eng._pending[self.device_index] and (w is None or w.done_ticket >= w.last_ticket)
        return self.busy_until <= eng.now()

    def wait_event(self, event: EmuEvent) -> None:
        """Work enqueued later on this stream starts only after ``event`` (GPU side; host goes on)."""
        if not isinstance(event, EmuEvent):
            raise TypeError(f"wait_event expects a torch.cuda.Event, got {type(event).__name__}")
        if event._time is None and event._ticket is None:
            return  # CUDA: waiting on a never-recorded event is a no-op
        eng = self._engine
        if eng._backend is not None:
            # One backend queue per device runs its streams in order; cross-device order is kept
            # by waiting on the host (an approximation documented in docs/time.md).
            if event._device != self.device_index:
                event.synchronize()
            return
        with eng._lock:
            if event._time > self.busy_until:
                self.busy_until = event._time
                # The wait is work of this device too: a device sync waits for it (an event of
                # another device can lie beyond everything enqueued here).
                if event._time > eng._device_busy[self.device_index]:
                    eng._device_busy[self.device_index] = event._time

    def wait_stream(self, stream: VirtualStream) -> None:
        """Later work on this stream waits for all work already enqueued on ``stream``."""
        self.wait_event(stream.record_event())

    def record_event(self, event: EmuEvent | None = None) -> EmuEvent:
        event = EmuEvent(self._engine) if event is None else event
        event.record(self)
        return event

    # -------------------------------------------------------------- torch.cuda.Stream surface
    @property
    def cuda_stream(self) -> int:
        # A stable fake handle: 0 for the default stream, like CUDA's legacy default stream.
        return 0 if self.stream_id == 0 else (self.device_index << 32) | self.stream_id

    @property
    def device_type(self) -> int:
        return 1  # c10::DeviceType::CUDA

    def __enter__(self) -> VirtualStream:
        prev = self._engine.set_stream(self)
        stack = self._engine.local.host.enter_stack
        if stack is None:
            stack = self._engine.local.host.enter_stack = []
        stack.append(prev)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._engine.set_stream(self._engine.local.host.enter_stack.pop())

    def is_capturing(self) -> bool:
        """No CUDA graph capture in emulation (Adam/AdamW ask the current stream)."""
        return False

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, VirtualStream)
            and other._engine is self._engine
            and other.device_index == self.device_index
            and other.stream_id == self.stream_id
        )

    def __hash__(self) -> int:
        return hash((id(self._engine), self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.cuda_stream:#x}>"


class EmuEvent:
    """An emulated ``torch.cuda.Event``: marks a point in a stream's GPU time.

    ``elapsed_time`` is in milliseconds of *emulated GPU time* between two recorded events.
    ``home``: the engine whose current stream ``record()``/``wait()`` without a stream use (user
    code constructs ``torch.cuda.Event(...)``, a subclass the torch.cuda surface binds to its run).
    """

    def __init__(
        self,
        home: TimeEngine,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        if interprocess:
            raise ValueError(
                "gpemu: interprocess CUDA events cannot be shared between emulated "
                "processes; use enable_timing/blocking only"
            )
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self.interprocess = False
        self._home = home
        self._engine: TimeEngine | None = None
        self._device: int | None = None
        self._time: float | None = None  # GPU time the event completes (local mode)
        self._ticket: int | None = None  # backend mode: worker ticket that completes it

    def record(self, stream: VirtualStream | None = None) -> None:
        """Mark the point after all work currently enqueued on ``stream`` (current stream if None)."""
        if stream is None:
            home = self._home
            stream = home.stream(home.current_device())
        if not isinstance(stream, VirtualStream):
            raise TypeError(f"Event.record expects a torch.cuda.Stream, got {type(stream).__name__}")
        eng = stream._engine
        self._engine, self._device = eng, stream.device_index
        if eng._backend is not None:
            ticket = eng._flush(stream.device_index)
            worker = eng._workers[stream.device_index]
            with worker.cond:
                idle = worker.done_ticket >= ticket
            # Nothing outstanding: the event completes now; else when its ticket's work ends.
            self._time, self._ticket = (eng.clock.now(), None) if idle else (None, ticket)
            return
        self._ticket = None
        self._time = max(eng.now(), stream.busy_until)

    def query(self) -> bool:
        if self._engine is None:
            return True  # CUDA: an unrecorded event counts as complete
        if self._ticket is not None:
            w = self._engine._workers.get(self._device)
            return w is None or w.done_ticket >= self._ticket
        return self._time <= self._engine.now()

    def synchronize(self) -> None:
        """Host waits until the event has completed."""
        eng = self._engine
        if eng is None:
            return
        if self._ticket is not None:
            w = eng._workers.get(self._device)
            if w is not None:
                start = eng.clock.now()
                self._time = w.wait(self._ticket)
                eng.recorder.host_wait(self._device, "sharing", start, eng.clock.now())
            else:
                self._time = eng.clock.now()
            self._ticket = None
            return
        eng.enter()
        try:
            if self._time > eng.now():
                eng._wait_until(self._time, self._device, "event")
        finally:
            eng.leave()

    def wait(self, stream: VirtualStream | None = None) -> None:
        """Make ``stream`` (current stream if None) wait for this event on the GPU side."""
        if stream is None:
            home = self._home
            stream = home.stream(home.current_device())
        stream.wait_event(self)

    def elapsed_time(self, end_event: EmuEvent) -> float:
        """Milliseconds of emulated GPU time from this event to ``end_event``."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._engine is None or end_event._engine is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            # as CUDA's cudaErrorNotReady: the caller must synchronize first
            raise RuntimeError(
                "CUDA error: device not ready (gpemu: synchronize the end event before calling elapsed_time)"
            )
        if self._ticket is not None:
            self.synchronize()
        if end_event._ticket is not None:
            end_event.synchronize()
        return (end_event._time - self._time) * 1000.0

    @property
    def cuda_event(self) -> int:
        return id(self)

    @property
    def event_id(self) -> int:
        return id(self)

    def ipc_handle(self) -> bytes:
        raise RuntimeError("gpemu: interprocess CUDA events are not emulated")

    def __repr__(self) -> str:
        state = "unrecorded" if self._engine is None else f"cuda:{self._device}"
        return f"<torch.cuda.Event {state}>"


# ---------------------------------------------------------------------------------------------
# component install
# ---------------------------------------------------------------------------------------------
def install(rt: Runtime) -> None:
    """Create the run's engine (``rt.engine``) on the configured clock (``config.clock``: tests
    use :class:`gpemu.clock.VirtualClock`) with the configured return allowance and spin margin
    (``config.tuning``)."""
    tuning = rt.config.tuning
    clock = rt.config.clock if rt.config.clock is not None else RealClock(tuning.spin_margin)
    engine = TimeEngine(
        rt.num_devices,
        rt.recorder,
        clock=clock,
        granularity=rt.config.sharing_granularity,
        return_allowance=tuning.return_allowance,
        memory=rt.memory,
        current_device=lambda: rt.current_device,
    )
    rt.engine = engine
    rt.patcher.on_restore(engine.close)
