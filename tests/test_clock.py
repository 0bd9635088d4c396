"""Deadline waits: absolute deadlines, no accumulated error (virtual and real clock)."""

from __future__ import annotations

import time

import pytest

from gpemu.clock import RealClock, VirtualClock, wait_until


def test_virtual_clock_jumps_to_deadline_and_never_goes_back():
    clock = VirtualClock(start=10.0)
    clock.wait_until(10.5)
    assert clock.now() == 10.5
    clock.wait_until(10.2)  # a deadline in the past does not wait and does not go back
    assert clock.now() == 10.5
    assert clock.waits == [(10.0, 10.5)]
    clock.advance(0.25)
    assert clock.now() == 10.75
    with pytest.raises(ValueError, match="back in time"):
        clock.advance(-1)


def test_real_wait_until_ends_at_or_just_after_the_deadline():
    clock = RealClock()
    lateness = []
    for _ in range(5):
        deadline = time.perf_counter() + 0.004
        clock.wait_until(deadline)
        lateness.append(time.perf_counter() - deadline)
    assert min(lateness) >= 0.0
    # Spinning for the last stretch: far tighter than a plain sleep's ~0.1 ms overshoot. Generous
    # bound because the machine is shared.
    assert sorted(lateness)[len(lateness) // 2] < 0.005


def test_absolute_deadlines_do_not_accumulate_error():
    # 40 consecutive 2.5 ms "iterations" against absolute deadlines: the total ends within a
    # small fraction of one iteration of the target, however late single wake-ups were.
    start = time.perf_counter()
    step = 0.0025
    for i in range(1, 41):
        wait_until(start + i * step)
    total = time.perf_counter() - start
    assert total >= 40 * step
    assert total - 40 * step < 4 * step  # one late final wake at most, not 40


def test_real_clock_rejects_negative_margin():
    with pytest.raises(ValueError, match="spin_margin"):
        RealClock(spin_margin=-1)
