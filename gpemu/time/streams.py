"""Emulated CUDA streams and events, shaped like ``torch.cuda.Stream`` / ``torch.cuda.Event``.

The torch.cuda surface (:mod:`gpemu.cuda_api`) hands out subclasses of these that read user
device arguments; the time engine (:mod:`gpemu.time.engine`) makes the default streams. Work,
waits and events go through the engine's public methods and its timeline strategy
(:mod:`gpemu.time.timeline`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from .timeline import EventMark

if TYPE_CHECKING:  # pragma: no cover
    from .engine import TimeEngine

__all__ = ["VirtualStream", "EmuEvent"]


class VirtualStream:
    """One emulated CUDA stream: in-order GPU work with a ``busy_until`` deadline.

    Made by the engine (:meth:`TimeEngine.new_stream`); user code constructs them as
    ``torch.cuda.Stream(device=None, priority=0)``, a subclass the torch.cuda surface defines.
    """

    __slots__ = ("engine", "device_index", "priority", "stream_id", "busy_until", "launches", "__weakref__")

    def __init__(self, engine: TimeEngine, device: int, priority: int, stream_id: int) -> None:
        self.engine = engine
        self.device_index = device
        self.priority = int(priority)
        self.stream_id = stream_id
        self.busy_until = 0.0
        # When the kernels still in this stream's launch queue end, oldest first (the bounded
        # queue of gpemu.time.launch; None until the first launch with a host model).
        self.launches: deque[float] | None = None

    @staticmethod
    def make(cls: type[VirtualStream], engine: TimeEngine, device: int, priority: int, stream_id: int) -> VirtualStream:
        """A stream of class ``cls`` (a subclass with its own constructor) without calling it."""
        s = cls.__new__(cls)
        VirtualStream.__init__(s, engine, device, priority, stream_id)
        return s

    # -------------------------------------------------------------- engine-level API
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def enqueue(
        self,
        seconds: float,
        kind: str,
        name: str,
        peak_bytes: int = 0,
        at: float | None = None,
        issue: float = 0.0,
    ) -> float:
        """Append GPU work taking ``seconds``; returns the (emulated) GPU time it ends. Blocks
        only when the stream's launch queue is full (or a sharing backend says so).

        ``at``: the host time (``engine.now()``) the work was really issued, when that was
        earlier than now: e.g. a module call's first kernel is issued microseconds into the call,
        before the emulator's own book-keeping for it (later values count as now).
        ``issue``: the modelled host seconds a real framework spends issuing it before the launch
        (``engine.op_issue_s`` for one op, :mod:`gpemu.time.launch`): the program's time moves
        on by that much first, and the work cannot start before (not inside
        :meth:`HostTime.one_launch`: a graph replay's kernels were launched together)."""
        # The host's time is read here, first: the rest of the entry path is the emulator's.
        eng = self.engine
        local = eng.local.host
        base = local.entry if local.depth else eng.read_clock()
        now = base - local.late
        if now < local.floor:
            now = local.floor
        if issue > 0 and not local.launching:
            if eng.time_map is not None:
                eng.time_map.sample(eng)
            now += issue
            eng.issued_s += issue
            local.late = base - now  # (the host now stands at the launch, past any floor)
        if eng.captures:  # (a CUDA graph capture: the engine records the work of a capturing stream)
            return eng.enqueue(self, seconds, kind, name, peak_bytes, at, now)
        return eng.timeline.enqueue(self, seconds, kind, name, peak_bytes, now, at)

    def synchronize(self, reason: str = "stream-synchronize") -> None:
        """Host waits until this stream's work is done (absolute deadline)."""
        eng = self.engine
        if eng.captures:
            eng.refuse_if_capturing(reason)
        local = eng.local.host
        outer = not local.depth
        if outer:
            local.entry = eng.read_clock()
            local.depth = 1
        try:
            local.wait_deadline = None
            eng.timeline.wait_device(self.device_index, self.busy_until, reason)
        finally:
            if outer:
                eng.leave()

    def query(self) -> bool:
        """True when all work enqueued on this stream has completed."""
        return self.engine.timeline.stream_done(self)

    def wait_event(self, event: EmuEvent) -> None:
        """Work enqueued later on this stream starts only after ``event`` (GPU side; host goes on)."""
        if not isinstance(event, EmuEvent):
            raise TypeError(f"wait_event expects a torch.cuda.Event, got {type(event).__name__}")
        mark = event.mark
        if mark is None:
            return  # CUDA: waiting on a never-recorded event is a no-op
        self.engine.timeline.stream_waits_for(self, mark)

    def wait_stream(self, stream: VirtualStream) -> None:
        """Later work on this stream waits for all work already enqueued on ``stream``."""
        self.wait_event(stream.record_event())

    def record_event(self, event: EmuEvent | None = None) -> EmuEvent:
        event = EmuEvent(self.engine) if event is None else event
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
        self.engine.push_stream(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.pop_stream()

    def is_capturing(self) -> bool:
        """Whether a CUDA graph capture is under way on this stream (optimizers ask it)."""
        return self.engine.capture_of(self) is not None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, VirtualStream)
            and other.engine is self.engine
            and other.device_index == self.device_index
            and other.stream_id == self.stream_id
        )

    def __hash__(self) -> int:
        return hash((id(self.engine), self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.cuda_stream:#x}>"


class EmuEvent:
    """An emulated ``torch.cuda.Event``: marks a point in a stream's GPU time.

    ``elapsed_time`` is in milliseconds of *emulated GPU time* between two recorded events.
    ``home``: the engine whose current stream ``record()``/``wait()`` without a stream use (user
    code constructs ``torch.cuda.Event(...)``, a subclass the torch.cuda surface binds to its run).
    ``mark``: where the last recording stands (None: never recorded).
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
        self.home = home
        self.mark: EventMark | None = None
        self._engine: TimeEngine | None = None  # the engine of the stream it was recorded on

    def record(self, stream: VirtualStream | None = None) -> None:
        """Mark the point after all work currently enqueued on ``stream`` (current stream if None)."""
        if stream is None:
            home = self.home
            stream = home.stream(home.current_device())
        if not isinstance(stream, VirtualStream):
            raise TypeError(f"Event.record expects a torch.cuda.Stream, got {type(stream).__name__}")
        self._engine = stream.engine
        self.mark = stream.engine.timeline.mark(stream)

    def query(self) -> bool:
        if self._engine is None or self.mark is None:
            return True  # CUDA: an unrecorded event counts as complete
        return self._engine.timeline.mark_done(self.mark)

    def synchronize(self) -> None:
        """Host waits until the event has completed."""
        if self._engine is None or self.mark is None:
            return
        self._engine.refuse_if_capturing("torch.cuda.Event.synchronize")
        self._engine.timeline.wait_mark(self.mark)

    def wait(self, stream: VirtualStream | None = None) -> None:
        """Make ``stream`` (current stream if None) wait for this event on the GPU side."""
        if stream is None:
            home = self.home
            stream = home.stream(home.current_device())
        stream.wait_event(self)

    def elapsed_time(self, end_event: EmuEvent) -> float:
        """Milliseconds of emulated GPU time from this event to ``end_event``."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.mark is None or end_event.mark is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end_event.query()):
            # as CUDA's cudaErrorNotReady: the caller must synchronize first
            raise RuntimeError(
                "CUDA error: device not ready (gpemu: synchronize the end event before calling elapsed_time)"
            )
        start, end = self.mark, end_event.mark
        if start.ticket is not None:
            self.synchronize()
        if end.ticket is not None:
            end_event.synchronize()
        assert start.time is not None and end.time is not None  # (recorded and complete)
        return (end.time - start.time) * 1000.0

    @property
    def cuda_event(self) -> int:
        return id(self)

    @property
    def event_id(self) -> int:
        return id(self)

    def ipc_handle(self) -> bytes:
        raise RuntimeError("gpemu: interprocess CUDA events are not emulated")

    def __repr__(self) -> str:
        state = "unrecorded" if self.mark is None else f"cuda:{self.mark.device}"
        return f"<torch.cuda.Event {state}>"
