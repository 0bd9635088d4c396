"""Emulated GPU time (component ``gpemu.time``): the host's place on the emulated timeline,
virtual streams and events, sync points, and how enqueued work becomes time.

Rooms: :mod:`~gpemu.time.host` (each host thread's emulated time; the emulator's own time,
forgiven), :mod:`~gpemu.time.timeline` (local deadline arithmetic, or a sharing manager's
backend), :mod:`~gpemu.time.streams` (``torch.cuda.Stream`` / ``Event`` shapes),
:mod:`~gpemu.time.engine` (the run's :class:`TimeEngine`), :mod:`~gpemu.time.capture` (CUDA
graph capture: a capturing stream records its work), :mod:`~gpemu.time.allowance` (the return
allowance, measured once per process).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..clock import RealClock
from .allowance import calibrate_return_allowance
from .capture import BACKWARD_MARK, CAPTURE_INVALIDATED, ITERATION_END, CapturedWork, StreamCapture
from .engine import TimeEngine
from .host import HostState, HostTime
from .streams import EmuEvent, VirtualStream
from .timeline import EventMark, GpuTimeBackend

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = [
    "TimeEngine",
    "HostTime",
    "HostState",
    "VirtualStream",
    "EmuEvent",
    "EventMark",
    "GpuTimeBackend",
    "StreamCapture",
    "CapturedWork",
    "BACKWARD_MARK",
    "ITERATION_END",
    "CAPTURE_INVALIDATED",
    "install",
    "calibrate_return_allowance",
]


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
