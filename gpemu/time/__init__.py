"""Emulated GPU time (component ``gpemu.time``): the host's place on the emulated timeline,
virtual streams and events, sync points, and how enqueued work becomes time.

Rooms: :mod:`~gpemu.time.host` (each host thread's emulated time; the emulator's own time,
forgiven), :mod:`~gpemu.time.timeline` (local deadline arithmetic, or a sharing manager's
backend), :mod:`~gpemu.time.streams` (``torch.cuda.Stream`` / ``Event`` shapes),
:mod:`~gpemu.time.engine` (the run's :class:`TimeEngine`), :mod:`~gpemu.time.capture` (CUDA
graph capture: a capturing stream records its work), :mod:`~gpemu.time.allowance` (the return
allowance, measured once per process), :mod:`~gpemu.time.launch` (the modelled host: framework
issue time per op, the bounded launch queue). Virtual time (``clock="virtual"``):
:mod:`~gpemu.time.cpuclock` (each thread's CPU time; waits jump), :mod:`~gpemu.time.virtual`
(the program's clocks), :mod:`~gpemu.time.dataloader` (batches carry their ready time),
:mod:`~gpemu.time.profiling` (the torch profiler's timestamps).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..clock import Clock, RealClock
from ..config import costmodel_cache_dir
from .allowance import calibrate_return_allowance
from .capture import BACKWARD_MARK, CAPTURE_INVALIDATED, ITERATION_END, CapturedWork, StreamCapture
from .engine import TimeEngine
from .host import HostState, HostTime
from .launch import RECORDED_PREFIX, HostModel, host_model, recorded_hosts
from .streams import EmuEvent, VirtualStream
from .timeline import EventMark, GpuTimeBackend, Grant
from .virtual import install as install_virtual
from .virtual import make_clock

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime import Runtime

__all__ = [
    "TimeEngine",
    "HostTime",
    "HostModel",
    "host_model",
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
    "Grant",
    "install",
    "calibrate_return_allowance",
]


def install(rt: Runtime) -> None:
    """Create the run's engine (``rt.engine``) on the configured clock (``config.clock``: real,
    virtual (:mod:`gpemu.time.virtual`), or a clock object such as the tests'
    :class:`gpemu.clock.VirtualClock`) with the configured return allowance and spin margin
    (``config.tuning``)."""
    config = rt.config
    tuning = config.tuning
    virtual_clock = make_clock(config.clock_origin) if config.virtual_time else None
    clock: Clock
    if virtual_clock is not None:
        clock = virtual_clock
    elif config.clock is None or isinstance(config.clock, str):
        clock = RealClock(tuning.spin_margin)
    else:
        clock = config.clock
    engine = TimeEngine(
        rt.num_devices,
        rt.recorder,
        clock=clock,
        granularity=rt.config.sharing_granularity,
        return_allowance=tuning.return_allowance,
        memory=rt.memory,
        current_device=lambda: rt.current_device,
    )
    # (a host recorded in the database, --host db:NAME, is read from the run's database)
    recorded = recorded_hosts(rt.db.engine) if config.host.startswith(RECORDED_PREFIX) else None
    engine.set_host_model(host_model(config.host, costmodel_cache_dir(), recorded))
    rt.engine = engine
    rt.patcher.on_restore(engine.close)
    if virtual_clock is not None:
        # The run's records start on the virtual timeline, and a forked child continues from the
        # host's time (the emulator's own forgiven), not from its raw clock.
        rt.recorder.started_at = engine.now()
        virtual_clock.fork_reading = engine.now
        rt.patcher.on_restore(lambda: setattr(virtual_clock, "fork_reading", virtual_clock.now))
        install_virtual(rt, virtual_clock)
