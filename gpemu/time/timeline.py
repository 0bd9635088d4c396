"""How enqueued GPU work becomes time: the timeline strategies of the time engine.

The engine hands every piece of GPU work, every host wait and every event to one
:class:`Timeline`:

- :class:`LocalTimeline` (the default): CUDA's model as deadline arithmetic. A stream executes its
  work in order, each item starting when both the stream is free and the work was enqueued
  (``start = max(now, busy_until)``); the host waits until an ABSOLUTE deadline, so the
  emulator's own host time is hidden behind emulated GPU time exactly as a real program's is.
- :class:`SharedTimeline`: a GPU time *backend* (the sharing client) decides when work runs. Work
  is collected per device and handed, at the configured granularity, to a per-device worker
  thread that calls ``backend.run(device, seconds, peak_bytes, kind)`` (which blocks while the
  sharing manager runs other jobs). The host still runs ahead; sync points wait for the worker.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from ..recorder import Recorder
from .host import HostTime

if TYPE_CHECKING:  # pragma: no cover
    from .streams import VirtualStream

__all__ = ["Timeline", "LocalTimeline", "SharedTimeline", "GpuTimeBackend", "Grant", "EventMark", "PendingWork"]

_append = list.append  # records are appended as plain tuples (see gpemu.recorder.Records)


class GpuTimeBackend(Protocol):
    """Something that 'runs' GPU time for this job, e.g. a sharing manager client. On virtual
    time it is called with ``at`` (the job's virtual time when it sends the work) and returns the
    :class:`Grant` (a backend without virtual time is called without it and returns None)."""

    def run(self, device: int, seconds: float, peak_bytes: int, kind: str) -> Grant | None: ...


class Grant(NamedTuple):
    """Where a backend ran a piece of work on the virtual timeline."""

    start: float
    end: float


@dataclass
class EventMark:
    """Where a recorded event stands: the GPU time it completes (``time``), or, on a shared
    timeline with work still outstanding, the worker ticket whose end completes it."""

    device: int
    time: float | None
    ticket: int | None = None


class PendingWork(NamedTuple):
    """One piece of GPU work waiting for a backend worker."""

    stream_id: int
    seconds: float
    kind: str
    name: str
    enqueued_at: float
    peak_bytes: int


class Timeline(Protocol):
    """What the engine asks of a timeline strategy."""

    queue_depth: int  # unfinished launches a stream holds before the host waits (0: unbounded)

    def enqueue(
        self, stream: VirtualStream, seconds: float, kind: str, name: str, peak_bytes: int, now: float, at: float | None
    ) -> float:
        """Add work issued at host time ``now`` (``at``: earlier, when it really was); returns
        when it ends (an estimate when shared). Refuses a negative or NaN duration."""
        ...

    def wait_device(self, device: int, deadline: float, reason: str) -> None:
        """The host waits for every stream of ``device`` (up to ``deadline``)."""
        ...

    def enqueue_wait(self, stream: VirtualStream, seconds: float, kind: str, name: str, reason: str) -> None:
        """A blocking piece of work: enqueue, then wait for it."""
        ...

    def hold_launches(self, stream: VirtualStream, start: float, end: float, launches: int) -> None:
        """The work just enqueued on ``stream`` (from ``start`` to ``end``) stands for ``launches``
        kernels (a replayed pass): they take as many places in the stream's launch queue, ending
        one after another across it."""
        ...

    def stream_done(self, stream: VirtualStream) -> bool: ...

    def mark(self, stream: VirtualStream) -> EventMark:
        """An event recorded on ``stream`` now."""
        ...

    def mark_done(self, mark: EventMark) -> bool: ...

    def wait_mark(self, mark: EventMark) -> None:
        """The host waits until the event has completed (``mark.time`` set afterwards)."""
        ...

    def stream_waits_for(self, stream: VirtualStream, mark: EventMark) -> None:
        """Later work on ``stream`` starts only after the event (GPU side; the host goes on)."""
        ...

    def iteration_ended(self, device: int) -> None: ...

    def close(self) -> None: ...


def _wait_for_time(host: HostTime, mark: EventMark) -> None:
    """The host waits until the GPU time ``mark`` completes (an emulator entry)."""
    host.enter()
    try:
        if mark.time is not None and mark.time > host.now():
            host.wait_until(mark.time, mark.device, "event")
    finally:
        host.leave()


def bad_duration(seconds: float, kind: str, name: str) -> ValueError:
    return ValueError(f"GPU work must take a non-negative time, got {seconds!r} s for {kind} {name!r}")


class LocalTimeline:
    """Deadline arithmetic on the host's clock (see the module's docstring).

    ``busy``: the latest end of any work on each device (all streams); ``backward_seen``: whether
    a backward ran on each device since the last iteration mark; both shared with the engine."""

    def __init__(self, host: HostTime, recorder: Recorder, busy: list[float], backward_seen: list[bool]) -> None:
        self.host = host
        self.recorder = recorder
        self.busy = busy
        self.backward_seen = backward_seen
        self.lock = threading.Lock()
        # Unfinished launches a stream holds before the host waits (0: unbounded; set by the
        # engine's host model, gpemu.time.launch).
        self.queue_depth = 0

    def enqueue(
        self, stream: VirtualStream, seconds: float, kind: str, name: str, peak_bytes: int, now: float, at: float | None
    ) -> float:
        # (the whole of an enqueue: the per-kernel path, one call from the stream)
        if at is not None and at < now:
            now = at
        if seconds < 0 or seconds != seconds:
            raise bad_duration(seconds, kind, name)
        device = stream.device_index
        if self.queue_depth:
            now = self.admit(stream, now)
        if kind == "backward":
            self.backward_seen[device] = True
        with self.lock:
            start = stream.busy_until if stream.busy_until > now else now
            end = start + seconds
            stream.busy_until = end
            if end > self.busy[device]:
                self.busy[device] = end
        if seconds > 0:
            _append(self.recorder.spans, (device, stream.stream_id, kind, name, start, end, now))
        if self.queue_depth:
            launches = stream.launches
            if launches is not None:
                launches.append(end)
        return end

    def hold_launches(self, stream: VirtualStream, start: float, end: float, launches: int) -> None:
        held = stream.launches
        if not self.queue_depth or held is None or launches <= 1 or not held or held[-1] != end:
            return
        held.pop()
        n = min(launches, self.queue_depth)  # (older places than a full queue's never block)
        step = (end - start) / launches
        held.extend(end - (n - 1 - i) * step for i in range(n))

    def admit(self, stream: VirtualStream, now: float) -> float:
        """A launch on ``stream`` at host time ``now``: when the stream's launch queue already
        holds ``queue_depth`` unfinished kernels, the host waits until the oldest of them ends
        (as cudaLaunchKernel blocks); returns the host time the launch happens."""
        launches = stream.launches
        if launches is None:
            launches = stream.launches = deque()
        if len(launches) < self.queue_depth:  # (room, whatever has ended: nothing to drop yet)
            return now
        while launches and launches[0] <= now:
            launches.popleft()
        if len(launches) >= self.queue_depth:
            free_at = launches[len(launches) - self.queue_depth]
            self.host.wait_until(free_at, stream.device_index, "launch-queue")
            now = self.host.now()
            while launches and launches[0] <= now:
                launches.popleft()
        return now

    def wait_device(self, device: int, deadline: float, reason: str) -> None:
        if deadline > self.host.now():
            self.host.wait_until(deadline, device, reason)

    def enqueue_wait(self, stream: VirtualStream, seconds: float, kind: str, name: str, reason: str) -> None:
        host = self.host
        local = host.local.host
        host.enter()
        try:
            if stream.engine.captures:
                end = stream.enqueue(seconds, kind, name)
            else:  # (straight to the timeline: no host model or capture applies to a blocking copy's enqueue)
                end = self.enqueue(stream, seconds, kind, name, 0, host.now(), None)
            local.wait_deadline = None  # (forget_wait: settle() forgives this wait only)
            if end > host.now():
                host.wait_until(end, stream.device_index, reason)
        finally:
            host.leave()

    def stream_done(self, stream: VirtualStream) -> bool:
        return stream.busy_until <= self.host.now()

    def mark(self, stream: VirtualStream) -> EventMark:
        now = self.host.now()
        return EventMark(stream.device_index, now if now > stream.busy_until else stream.busy_until)

    def mark_done(self, mark: EventMark) -> bool:
        return mark.time is None or mark.time <= self.host.now()

    def wait_mark(self, mark: EventMark) -> None:
        _wait_for_time(self.host, mark)

    def stream_waits_for(self, stream: VirtualStream, mark: EventMark) -> None:
        t = mark.time
        if t is None:
            return
        with self.lock:
            if t > stream.busy_until:
                stream.busy_until = t
                # The wait is work of this device too: a device sync waits for it (an event of
                # another device can lie beyond everything enqueued here).
                if t > self.busy[stream.device_index]:
                    self.busy[stream.device_index] = t

    def iteration_ended(self, device: int) -> None:
        pass

    def close(self) -> None:
        pass


class SharedTimeline:
    """GPU time run by a backend, one worker thread per device (see the module's docstring).

    ``default_stream``: the engine's default stream of a device (its ``busy_until`` follows the
    granted work); ``peak_bytes``: a device's tracked peak allocation (told to the backend)."""

    def __init__(
        self,
        host: HostTime,
        recorder: Recorder,
        busy: list[float],
        backward_seen: list[bool],
        backend: GpuTimeBackend,
        granularity: str,
        default_stream: Callable[[int], VirtualStream],
        peak_bytes: Callable[[int], int],
    ) -> None:
        self.host = host
        self.recorder = recorder
        self.busy = busy
        self.backward_seen = backward_seen
        self.backend = backend
        self.granularity = granularity
        self.default_stream = default_stream
        self.peak_bytes = peak_bytes
        self.lock = threading.Lock()
        self.pending: list[list[PendingWork]] = [[] for _ in busy]
        self.workers: dict[int, BackendWorker] = {}
        # Not bounded: the backend decides when work runs, so a launch's end is not known here.
        self.queue_depth = 0
        # On virtual time the backend says where it ran the work (a Grant) and the host's time
        # jumps there when it waits; on real time the host waits for the worker for real.
        self.virtual = host.virtual

    def enqueue(
        self, stream: VirtualStream, seconds: float, kind: str, name: str, peak_bytes: int, now: float, at: float | None
    ) -> float:
        if at is not None and at < now:
            now = at
        if seconds < 0 or seconds != seconds:
            raise bad_duration(seconds, kind, name)
        device = stream.device_index
        if kind == "backward":
            self.backward_seen[device] = True
        self.pending[device].append(PendingWork(stream.stream_id, seconds, kind, name, now, peak_bytes))
        if self.granularity == "forward-backward" and kind == "backward":
            self.flush(device)
        # An estimate only: the backend decides when the work really ends.
        return max(now, stream.busy_until) + seconds

    def flush(self, device: int) -> int:
        """Hand pending work of ``device`` to its backend worker; returns the worker's ticket."""
        with self.lock:
            items, self.pending[device] = self.pending[device], []
            worker = self.workers.get(device)
            if worker is None:
                worker = self.workers[device] = BackendWorker(self, device)
        if not items:
            return worker.last_ticket
        label = items[0].kind if all(it.kind == items[0].kind for it in items) else self.granularity
        # (on virtual time: the host's time when it hands the work over, the request's send time)
        return worker.submit(items, label, self.peak_bytes(device), self.host.now())

    def wait_device(self, device: int, deadline: float, reason: str) -> None:
        # (the worker decides when the work ends; the deadline is unused)
        self.flush(device)
        worker = self.workers.get(device)
        if worker is None:
            return
        host = self.host
        if self.virtual:  # the real wait for the manager's answer counts nothing; its time does
            done = worker.wait(worker.last_ticket)
            if done > host.now():
                host.wait_until(done, device, "sharing")
            return
        depth = host.suspend()
        start = host.clock.now()
        try:
            worker.wait_idle()
        finally:
            end = host.clock.now()
            host.resume(depth, end)
        if end > start:
            self.recorder.host_wait(device, "sharing", start, end)

    def enqueue_wait(self, stream: VirtualStream, seconds: float, kind: str, name: str, reason: str) -> None:
        stream.enqueue(seconds, kind, name)
        stream.synchronize(reason)

    def hold_launches(self, stream: VirtualStream, start: float, end: float, launches: int) -> None:
        pass  # (the launch queue is not bounded here: see queue_depth)

    def stream_done(self, stream: VirtualStream) -> bool:
        device = stream.device_index
        w = self.workers.get(device)
        return not self.pending[device] and (w is None or w.done_ticket >= w.last_ticket)

    def mark(self, stream: VirtualStream) -> EventMark:
        device = stream.device_index
        ticket = self.flush(device)
        worker = self.workers[device]
        with worker.cond:
            idle = worker.done_ticket >= ticket
        # Nothing outstanding: the event completes now; else when its ticket's work ends.
        now = self.host.now() if self.virtual else self.host.clock.now()
        return EventMark(device, now, None) if idle else EventMark(device, None, ticket)

    def mark_done(self, mark: EventMark) -> bool:
        if mark.ticket is None:
            return mark.time is None or mark.time <= self.host.now()
        w = self.workers.get(mark.device)
        return w is None or w.done_ticket >= mark.ticket

    def wait_mark(self, mark: EventMark) -> None:
        if mark.ticket is None:
            _wait_for_time(self.host, mark)
            return
        w = self.workers.get(mark.device)
        clock = self.host.clock
        if self.virtual:
            mark.time = w.wait(mark.ticket) if w is not None else self.host.now()
            mark.ticket = None
            _wait_for_time(self.host, mark)
            return
        if w is not None:
            start = clock.now()
            mark.time = w.wait(mark.ticket)
            self.recorder.host_wait(mark.device, "sharing", start, clock.now())
        else:
            mark.time = clock.now()
        mark.ticket = None

    def stream_waits_for(self, stream: VirtualStream, mark: EventMark) -> None:
        # One backend queue per device runs its streams in order; cross-device order is kept by
        # waiting on the host (an approximation documented in docs/time.md).
        if mark.device != stream.device_index:
            self.wait_mark(mark)

    def iteration_ended(self, device: int) -> None:
        if self.granularity == "iteration":
            self.flush(device)

    def worker_done(self, device: int, end: float) -> None:
        """A worker finished granted work on ``device`` at ``end``."""
        with self.lock:
            if end > self.busy[device]:
                self.busy[device] = end
            s = self.default_stream(device)
            if end > s.busy_until:
                s.busy_until = end

    def close(self) -> None:
        """Stop backend workers (after finishing what they hold)."""
        workers, self.workers = self.workers, {}
        for w in workers.values():
            w.stop()


class _Submitted(NamedTuple):
    """One hand-over of work to a backend worker."""

    ticket: int
    items: Sequence[PendingWork]
    label: str
    device_peak: int
    at: float  # the host's time when it handed the work over


class BackendWorker:
    """Runs one device's GPU work through a backend, in order, off the host thread."""

    def __init__(self, timeline: SharedTimeline, device: int) -> None:
        self.timeline = timeline
        self.device = device
        self.queue: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.last_ticket = 0
        self.done_ticket = 0
        self.done_at: dict[int, float] = {}
        self.free_at = float("-inf")  # virtual time: when the last granted work ended
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=f"gpemu-gpu{device}-backend", daemon=True)
        self.thread.start()

    def submit(self, items: Sequence[PendingWork], label: str, device_peak: int = 0, at: float = 0.0) -> int:
        """Queue ``items`` for the backend (``at``: the host's time when it handed them over)."""
        with self.cond:
            self.last_ticket += 1
            ticket = self.last_ticket
        self.queue.put(_Submitted(ticket, items, label, device_peak, at))
        return ticket

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            ticket, items, label, device_peak, at = job
            end = self._run_virtual(items, label, device_peak, at) if self.timeline.virtual else None
            if end is None:
                end = self._run(items, label, device_peak)
            self.timeline.worker_done(self.device, end)
            with self.cond:
                self.done_ticket = ticket
                self.done_at[ticket] = end
                if len(self.done_at) > 4096:  # events only need recent tickets
                    for k in sorted(self.done_at)[:2048]:
                        del self.done_at[k]
                self.cond.notify_all()

    def _run(self, items: Sequence[PendingWork], label: str, device_peak: int) -> float:
        """One granted run of ``items``; returns when it ended. The items are laid out inside
        the granted window, in proportion to their length."""
        timeline = self.timeline
        clock, rec = timeline.host.clock, timeline.recorder
        seconds = sum(it.seconds for it in items)
        peak = max(max((it.peak_bytes for it in items), default=0), device_peak)
        t0 = clock.now()
        try:
            timeline.backend.run(self.device, seconds, peak, label)
        except BaseException as exc:  # surfaced to the host at its next wait
            self.error = exc
        t1 = clock.now()
        scale = (t1 - t0) / seconds if seconds > 0 else 0.0
        t = t0
        for it in items:
            if it.seconds > 0:
                rec.span(self.device, it.stream_id, it.kind, it.name, t, t + it.seconds * scale, it.enqueued_at)
            t += it.seconds * scale
        return t1

    def _run_virtual(self, items: Sequence[PendingWork], label: str, device_peak: int, at: float) -> float | None:
        """On virtual time: the request is sent at the later of the host's hand-over and the end
        of the previous request (one at a time), and the items are laid out in the granted
        window; None when the backend gave no grant (then timed on the clock, as on real time)."""
        timeline = self.timeline
        seconds = sum(it.seconds for it in items)
        peak = max(max((it.peak_bytes for it in items), default=0), device_peak)
        sent = max(at, self.free_at)
        try:
            grant = timeline.backend.run(self.device, seconds, peak, label, at=sent)  # type: ignore[call-arg]
        except BaseException as exc:  # surfaced to the host at its next wait
            self.error = exc
            return sent
        if grant is None:
            return None
        self.free_at = grant.end
        scale = (grant.end - grant.start) / seconds if seconds > 0 else 0.0
        t = grant.start
        for it in items:
            if it.seconds > 0:
                end = t + it.seconds * scale
                timeline.recorder.span(self.device, it.stream_id, it.kind, it.name, t, end, it.enqueued_at)
            t += it.seconds * scale
        return grant.end

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
        return self.done_at.get(ticket, self.timeline.host.clock.now())

    def wait_idle(self) -> None:
        self.wait(self.last_ticket)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)
