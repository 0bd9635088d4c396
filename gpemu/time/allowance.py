"""The return allowance: the emulator's own host time per sync wait that a real GPU would not
show as idle, measured once per process on the real clock (see
:meth:`gpemu.time.host.HostTime.waited`)."""

from __future__ import annotations

import time

from ..clock import RealClock
from ..recorder import Recorder
from .host import MAX_FORGIVEN_LATENESS

__all__ = ["calibrate_return_allowance", "MAX_ALLOWANCE"]

# Calibration (rounds, wait length, quantile taken). Long waits: the lower quartile, because the
# cold-cache cost varies with the machine's load (0.6-0.9 us median here when quiet, 1.2-2.6 us
# under load): the allowance should not exceed what the program will really see.
_CAL_SHORT = (200, 5e-6, 0.5)  # ~2 ms in all
_CAL_LONG = (30, 2e-3, 0.25)  # ~60 ms in all, once per process
MAX_ALLOWANCE = 20e-6  # a sane bound when the machine is too loaded to measure

_calibrated: tuple[float, float] | None = None


def _measure_return_path(rounds: int, wait: float, quantile: float) -> float:
    """Host time (that quantile over ``rounds``) of the engine's own return path after a real
    wait of ``wait`` seconds plus its enqueue entry path (the caller's own time between the two
    is left out)."""
    from .engine import TimeEngine  # (the engine calibrates itself through this module)

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
        if local.wait_deadline != deadline or local.late >= MAX_FORGIVEN_LATENESS:
            continue  # it did not wait, or it was held too long to tell
        # Without an allowance, late = settle's reading - deadline and the span's enqueue time is
        # the enqueue's reading - late: both readings are recovered exactly.
        settled = deadline + local.late
        read = spans[-1].enqueued_at + local.late
        paths.append((back - settled) + (read - call))
    paths.sort()
    value = paths[int(len(paths) * quantile)] if paths else 0.0
    return min(max(value, 0.0), MAX_ALLOWANCE)


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
