"""The time engine: all streams of all emulated devices of one run, and the host's sync points.

The model is CUDA's: the host *enqueues* GPU work and runs ahead; a stream executes its work in
order; the host only waits at sync points (``synchronize``, ``.item()``, blocking copies,
``Event.synchronize``), and then until an ABSOLUTE deadline, so sleep overshoot never
accumulates. The engine is the host's emulated time (:class:`gpemu.time.host.HostTime`, which it
extends) plus the streams: it validates and routes every piece of work to its timeline strategy
(:mod:`gpemu.time.timeline`: local deadline arithmetic, or a sharing manager's backend).

This package knows nothing of the rest of gpemu: it is given its clock, recorder, memory
trackers and a way to read the host thread's current device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..clock import Clock, RealClock
from ..config import GRANULARITIES
from ..devices import check_ordinal
from ..recorder import Recorder
from .allowance import MAX_ALLOWANCE, calibrate_return_allowance
from .capture import BACKWARD_MARK, ITERATION_END, StreamCapture, capture_refusal
from .host import HostTime
from .launch import HostModel
from .streams import VirtualStream
from .timeline import GpuTimeBackend, LocalTimeline, SharedTimeline, Timeline, bad_duration

__all__ = ["TimeEngine"]


class TimeEngine(HostTime):
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
        """``return_allowance``: see :class:`HostTime`; one value, or ``(after a wait shorter
        than 1 ms, after a longer one)``. None: calibrated once per process on a real clock
        (:func:`gpemu.time.allowance.calibrate_return_allowance`), 0 on any other clock (virtual
        clocks are exact). ``memory``: the devices' memory trackers (a backend is told each
        device's peak bytes). ``current_device``: the calling thread's current device (streams
        and events used without a device), device 0 when not given."""
        if not isinstance(num_devices, int) or num_devices < 1:
            raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
        clock = clock if clock is not None else RealClock()
        super().__init__(clock, recorder if recorder is not None else Recorder(), _allowance(return_allowance, clock))
        self.num_devices = num_devices
        self.granularity = granularity
        self._lock = threading.Lock()
        # Latest end of any work on each device (all streams): a device sync waits for this.
        self._busy = [0.0] * num_devices
        self._next_stream_id = [1] * num_devices
        self._stream_type: type[VirtualStream] = VirtualStream
        self._default = [VirtualStream(self, d, 0, 0) for d in range(num_devices)]
        self._backend: GpuTimeBackend | None = None
        self._backward_since_mark = [False] * num_devices
        self.timeline: Timeline = LocalTimeline(self, self.recorder, self._busy, self._backward_since_mark)
        self._memory = memory
        self.current_device: Callable[[], int] = current_device if current_device is not None else (lambda: 0)
        # CUDA graph captures under way, by stream (replaced, never changed in place: the hot
        # paths read it without the lock).
        self.captures: dict[VirtualStream, StreamCapture] = {}
        # The modelled host (gpemu.time.launch; None: GPU time only): its issue time per op
        # (``op_issue_s``, what an op's enqueue charges the host) and the bounded launch queue.
        self.host_model: HostModel | None = None
        self.op_issue_s = 0.0
        self.backward_issue_s = 0.0  # (the same for an op of a backward pass)

    def set_host_model(self, model: HostModel | None) -> None:
        """Model the host that issues the work (see :mod:`gpemu.time.launch`): each op charged
        with ``issue=engine.op_issue_s`` (``backward_issue_s`` in a backward pass) costs the host
        that much first, and a stream holds at
        most ``model.queue_depth`` unfinished launches before the host waits. None: off."""
        self.host_model = model
        self.op_issue_s = model.op_s if model is not None else 0.0
        self.backward_issue_s = model.backward_op_s if model is not None else 0.0
        self.timeline.queue_depth = model.queue_depth if model is not None else 0

    def launch_seconds(self, ops: int, launches: int | None = None) -> float:
        """The modelled host seconds to issue ``ops`` ops launching ``launches`` kernels (0 with
        no host model): what a replay or a fused fast path charges for the ops it stands for."""
        model = self.host_model
        return model.issue_seconds(ops, launches) if model is not None else 0.0

    def enqueue_pass(
        self,
        device: int,
        seconds: float,
        kernels: float,
        kind: str,
        name: str,
        at: float | None = None,
        issue: float = 0.0,
    ) -> None:
        """Charge a pass charged as one piece (a replayed or measured module call): ``seconds``
        from its first issue to its GPU's end (the cost model's queue of host issue and kernels),
        ``kernels`` of it the GPU's work, ``issue`` the modelled host's time to issue its ops.

        Without a host model the span is the whole pass (its issue gaps are the calibration
        hosts', priced as GPU time: ``--host none``). With one the GPU runs the kernels alone: they
        start when the host has issued far enough for the queue to run without a stall
        (``seconds - kernels`` after the first issue, the lead the queue needs), and the host
        spends its issue time meanwhile, so the pass ends where the queue did and the GPU's busy
        time is its kernels'; they take as many places in the launch queue as the issue time
        stands for ops."""
        stream = self.stream(device)
        if not self.op_issue_s:  # (no modelled host: the span is the whole pass)
            stream.enqueue(seconds, kind, name, 0, at)
            if issue > 0:
                self.charge_host(issue)
            return
        modelled = not self.captures and not self.local.host.launching
        lead = min(seconds - kernels, issue) if modelled and seconds > kernels else 0.0
        end = stream.enqueue(seconds - lead, kind, name, 0, None if at is None else at + lead, lead)
        if modelled and issue:
            # its kernels take their places in the launch queue: as many as its issue time stands for
            per_op = self.backward_issue_s if kind == "backward" else self.op_issue_s
            self.timeline.hold_launches(stream, end - (seconds - lead), end, round(issue / per_op))
        if issue > lead:
            self.charge_host(issue - lead)

    def current_device_index(self) -> int:
        return self.current_device()

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
        if not isinstance(stream, VirtualStream) or stream.engine is not self:
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

    def push_stream(self, stream: VirtualStream) -> None:
        """``with stream:``: make it current, remembering the one it replaces (:meth:`pop_stream`)."""
        prev = self.set_stream(stream)
        host = self.local.host
        if host.enter_stack is None:
            host.enter_stack = []
        host.enter_stack.append(prev)

    def pop_stream(self) -> None:
        stack = self.local.host.enter_stack
        if stack:
            self.set_stream(stack.pop())

    # ------------------------------------------------------------------ work and waits
    def enqueue(
        self,
        stream: VirtualStream,
        seconds: float,
        kind: str,
        name: str,
        peak_bytes: int = 0,
        at: float | None = None,
        now: float | None = None,
    ) -> float:
        """Add ``seconds`` of GPU work to ``stream`` (:meth:`VirtualStream.enqueue` reads the
        host's time first and passes it as ``now``); returns when it ends."""
        if now is None:
            # Read the host's time first: the emulator's own checks below are not the program's.
            local = self.local.host
            now = (local.entry if local.depth else self.read_clock()) - local.late
            if now < local.floor:
                now = local.floor
        if self.captures:
            capture = self.captures.get(stream)
            if capture is not None:  # a capturing stream records its work; nothing runs now
                if seconds < 0 or seconds != seconds:
                    raise bad_duration(seconds, kind, name)
                capture.record(seconds, kind, name, peak_bytes)
                return now if now > stream.busy_until else stream.busy_until
        return self.timeline.enqueue(stream, seconds, kind, name, peak_bytes, now, at)

    def enqueue_wait(self, stream: VirtualStream, seconds: float, kind: str, name: str, reason: str) -> None:
        """``stream.enqueue(seconds, kind, name)`` then ``stream.synchronize(reason)`` in one
        call: a blocking copy (every pageable input batch)."""
        if self.captures:
            self.refuse_if_capturing(reason)
        self.timeline.enqueue_wait(stream, seconds, kind, name, reason)

    def device_busy_until(self, device: int) -> float:
        return self._busy[device]

    def synchronize(self, device: int | None = None, reason: str = "synchronize") -> None:
        """Host waits until every stream of ``device`` (all devices when None) is idle."""
        if self.captures:
            self.refuse_if_capturing(reason)
        self.enter()
        try:
            devices = range(self.num_devices) if device is None else (self.check_device(device),)
            # settle() forgives only the time since a wait of THIS call (not since an older wait).
            self.local.host.wait_deadline = None
            wait_device = self.timeline.wait_device
            for d in devices:
                busy = self._busy[d]
                wait_device(d, busy, reason)
                # (waited for or not: a loop's sync point, where the summary counts iterations of a
                # loop without optimizer steps)
                now = self.now()
                self.recorder.sync_point(d, reason, now if now > busy else busy)
        finally:
            self.leave()

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
        the next optimizer step ends an iteration. Captured as a mark while this thread's stream
        on ``device`` is capturing (its replays note it)."""
        if self.captures:
            capture = self.capture_here(device)
            if capture is not None:
                capture.record(0.0, BACKWARD_MARK, "")
                return
        self._backward_since_mark[device] = True

    def end_iteration(self, device: int) -> None:
        """An optimizer step finished on ``device``: mark an iteration (at the GPU time its work
        ends) and hand the iteration's work to a backend when one is plugged in. Captured as a
        mark while this thread's stream on ``device`` is capturing (its replays end the iteration)."""
        if self.captures:
            capture = self.capture_here(device)
            if capture is not None:
                capture.record(0.0, ITERATION_END, "")
                return
        if not self._backward_since_mark[device]:
            # e.g. a second optimizer in the same iteration, or steps without backward
            return
        self._backward_since_mark[device] = False
        self.timeline.iteration_ended(device)
        now, busy = self.now(), self._busy[device]
        self.recorder.iteration(device, now if now > busy else busy)

    # ------------------------------------------------------------------ CUDA graph capture
    def begin_capture(self, stream: VirtualStream, mode: str = "global") -> StreamCapture:
        """From now on, work enqueued on ``stream`` is recorded instead of run, and sync points
        are refused as CUDA refuses them (``mode``: ``"global"``, ``"thread_local"`` or
        ``"relaxed"``, see :mod:`gpemu.time.capture`) until :meth:`end_capture`."""
        if not isinstance(stream, VirtualStream) or stream.engine is not self:
            raise TypeError(f"expected a gpemu stream of this run, got {stream!r}")
        if stream.stream_id == 0:
            raise RuntimeError(
                "CUDA graphs must be captured on a non-default stream. "
                "(However, after capture, it's ok to replay them on the default stream.)"
            )
        capture = StreamCapture(stream, mode)
        with self._lock:
            if stream in self.captures:
                raise RuntimeError(f"Cannot begin a CUDA graph capture on {stream!r}: it is already capturing")
            self.captures = {**self.captures, stream: capture}
        return capture

    def end_capture(self, stream: VirtualStream) -> StreamCapture:
        """Stop :meth:`begin_capture` on ``stream``; returns what it recorded."""
        with self._lock:
            capture = self.captures.get(stream)
            if capture is None:
                raise RuntimeError(f"Called capture_end on {stream!r}, which is not capturing")
            self.captures = {s: c for s, c in self.captures.items() if c is not capture}
        return capture

    def capture_of(self, stream: VirtualStream) -> StreamCapture | None:
        """The capture under way on ``stream`` (None: it runs its work)."""
        captures = self.captures
        return captures.get(stream) if captures else None

    def capture_here(self, device: int) -> StreamCapture | None:
        """The capture under way on the calling thread's current stream of ``device``."""
        return self.capture_of(self.stream(device)) if self.captures else None

    def refuse_if_capturing(self, reason: str) -> None:
        """A sync point (``reason``): raise CUDA's error, and invalidate the captures concerned,
        when a capture under way forbids waiting in this thread."""
        captures = self.captures
        if not captures:
            return
        me = threading.get_ident()
        refusing = [c for c in captures.values() if c.refuses(me)]
        for capture in refusing:
            capture.invalid = capture.invalid or reason
        if refusing:
            raise capture_refusal(reason)

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
        seen = self._backward_since_mark
        if backend is None:
            self.timeline = LocalTimeline(self, self.recorder, self._busy, seen)
            self.set_host_model(self.host_model)
        else:
            self.timeline = SharedTimeline(
                self, self.recorder, self._busy, seen, backend, self.granularity, self.default_stream, self._peak_bytes
            )

    def close(self) -> None:
        """Stop backend workers (after finishing what they hold)."""
        self.timeline.close()

    def _peak_bytes(self, device: int) -> int:
        """The device's tracked peak allocation (0 without memory trackers)."""
        trackers = self._memory
        if trackers and device < len(trackers):
            return int(trackers[device].peak_allocated)
        return 0


def _allowance(value: float | tuple[float, float] | None, clock: Clock) -> tuple[float, float]:
    """The return allowance pair for ``value`` (see :meth:`TimeEngine.__init__`)."""
    if value is None:
        return calibrate_return_allowance() if type(clock) is RealClock else (0.0, 0.0)
    pair = value if isinstance(value, tuple) else (value, value)
    if len(pair) != 2 or not all(isinstance(v, (int, float)) and 0 <= v <= MAX_ALLOWANCE for v in pair):
        raise ValueError(
            f"return_allowance must be seconds in [0, {MAX_ALLOWANCE}] or a pair of them (short wait, long wait), "
            f"got {value!r}"
        )
    return (float(pair[0]), float(pair[1]))
