"""Virtual streams, events and sync points, on a virtual clock (exact, instant)."""

from __future__ import annotations

import threading
import time

import pytest

from gpemu.clock import VirtualClock
from gpemu.recorder import Recorder
from gpemu.time import EmuEvent, TimeEngine, VirtualStream


@pytest.fixture
def eng():
    return TimeEngine(2, Recorder(), clock=VirtualClock(start=100.0))


def test_host_runs_ahead_until_a_sync_point(eng):
    s = eng.default_stream(0)
    clock = eng.clock
    end1 = s.enqueue(0.010, "forward", "m")
    end2 = s.enqueue(0.020, "backward", "m")
    assert (end1, end2) == pytest.approx((100.010, 100.030))
    assert clock.now() == 100.0  # enqueue never blocks
    assert not s.query()
    clock.advance(0.005)  # host does other work meanwhile: hidden behind GPU time
    eng.synchronize(0, "item")
    assert clock.now() == pytest.approx(100.030)
    assert s.query()
    wait = eng.recorder.waits[-1]
    assert wait.reason == "item" and wait.start == pytest.approx(100.005) and wait.end == pytest.approx(100.030)
    kinds = [(sp.kind, sp.start, sp.end, sp.enqueued_at) for sp in eng.recorder.spans]
    assert kinds == [
        ("forward", 100.0, pytest.approx(100.010), 100.0),
        ("backward", pytest.approx(100.010), pytest.approx(100.030), 100.0),
    ]


def test_idle_gpu_starts_work_when_enqueued(eng):
    s = eng.default_stream(0)
    s.enqueue(0.010, "forward", "m")
    eng.clock.advance(1.0)  # GPU idle long before the next enqueue
    end = s.enqueue(0.010, "forward", "m")
    assert end == pytest.approx(101.010)


def test_sync_with_no_pending_work_does_not_wait(eng):
    eng.synchronize(None, "synchronize")
    assert eng.recorder.waits == [] and eng.clock.now() == 100.0


def test_device_sync_waits_for_all_streams_of_that_device_only(eng):
    side = eng.new_stream(0)
    other_dev = eng.default_stream(1)
    side.enqueue(0.5, "op", "a")
    other_dev.enqueue(2.0, "op", "b")
    eng.synchronize(0, "synchronize")
    assert eng.clock.now() == pytest.approx(100.5)
    eng.synchronize(None, "synchronize")
    assert eng.clock.now() == pytest.approx(102.0)


def test_streams_run_concurrently_and_wait_on_events(eng):
    main, side = eng.default_stream(0), eng.new_stream(0)
    assert side.stream_id != main.stream_id
    main.enqueue(0.100, "forward", "a")
    ev = EmuEvent(eng, enable_timing=True)
    ev.record(main)
    side.enqueue(0.030, "transfer", "copy")  # independent: starts now
    assert side.busy_until == pytest.approx(100.030)
    side.wait_event(ev)  # GPU-side dependency, host does not wait
    assert eng.clock.now() == 100.0
    end = side.enqueue(0.010, "op", "after")
    assert end == pytest.approx(100.110)


def test_wait_stream_and_unrecorded_event_noop(eng):
    a, b = eng.default_stream(0), eng.new_stream(0)
    b.wait_event(EmuEvent(eng))  # never recorded: no-op
    assert b.busy_until == 0.0
    a.enqueue(0.2, "op", "x")
    b.wait_stream(a)
    assert b.enqueue(0.1, "op", "y") == pytest.approx(100.3)


def test_event_elapsed_time_is_emulated_gpu_ms(eng):
    s = eng.default_stream(0)
    start, end = EmuEvent(eng, enable_timing=True), EmuEvent(eng, enable_timing=True)
    start.record(s)
    s.enqueue(0.0125, "forward", "m")
    end.record(s)
    assert not end.query()
    with pytest.raises(RuntimeError, match="not ready"):
        start.elapsed_time(end)
    end.synchronize()
    assert eng.clock.now() == pytest.approx(100.0125)
    assert start.elapsed_time(end) == pytest.approx(12.5)
    assert eng.recorder.waits[-1].reason == "event"


def test_elapsed_time_requires_timing_and_recording(eng):
    s = eng.default_stream(0)
    a, b = EmuEvent(eng), EmuEvent(eng)
    a.record(s)
    b.record(s)
    with pytest.raises(RuntimeError, match="enable_timing"):
        a.elapsed_time(b)
    c, d = EmuEvent(eng, enable_timing=True), EmuEvent(eng, enable_timing=True)
    with pytest.raises(RuntimeError, match="recorded"):
        c.elapsed_time(d)
    assert c.query()  # unrecorded counts as complete, like CUDA


def test_current_stream_is_thread_local_and_scoped(eng):
    side = eng.new_stream(1)
    assert eng.stream(1) is eng.default_stream(1)
    seen = []
    with eng.use_stream(side):
        assert eng.stream(1) is side
        assert eng.stream(0) is eng.default_stream(0)
        t = threading.Thread(target=lambda: seen.append(eng.stream(1)))
        t.start()
        t.join()
    assert seen == [eng.default_stream(1)]
    assert eng.stream(1) is eng.default_stream(1)


def test_bad_input_is_refused_clearly(eng):
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        eng.default_stream(5)
    with pytest.raises(ValueError, match="non-negative"):
        eng.default_stream(0).enqueue(-1.0, "op", "x")
    with pytest.raises(ValueError, match="granularity"):
        TimeEngine(1, granularity="epoch")


def test_iteration_marks_only_after_backward(eng):
    s = eng.default_stream(0)
    s.enqueue(0.01, "forward", "m")
    eng.end_iteration(0)  # no backward yet: not an iteration
    s.enqueue(0.02, "backward", "m")
    s.enqueue(0.001, "optimizer", "SGD")
    eng.end_iteration(0)
    eng.end_iteration(0)  # a second optimizer in the same iteration
    marks = eng.recorder.iterations
    assert len(marks) == 1 and marks[0].time == pytest.approx(100.031)


class _Backend:
    """A stand-in sharing manager that grants GPU time after the job's own time (real waits)."""

    def __init__(self):
        self.calls = []

    def run(self, device, seconds, peak_bytes, kind):
        self.calls.append((device, round(seconds, 6), peak_bytes, kind))
        time.sleep(seconds)


def test_backend_gets_one_request_per_iteration_and_host_runs_ahead():
    eng = TimeEngine(1, Recorder())  # real clock: the backend sleeps for real
    backend = _Backend()
    eng.set_backend(backend)
    s = eng.default_stream(0)
    t0 = time.perf_counter()
    s.enqueue(0.010, "forward", "m", peak_bytes=100)
    s.enqueue(0.020, "backward", "m", peak_bytes=300)
    s.enqueue(0.001, "optimizer", "SGD")
    eng.end_iteration(0)
    assert not s.query()  # handed to the backend, host not blocked
    eng.synchronize(0, "item")
    assert time.perf_counter() - t0 >= 0.031
    assert backend.calls == [(0, 0.031, 300, "iteration")]
    assert s.query()
    kinds = [sp.kind for sp in eng.recorder.spans]
    assert kinds == ["forward", "backward", "optimizer"]
    assert any(w.reason == "sharing" for w in eng.recorder.waits)
    eng.close()


def test_backend_event_timing_and_errors_surface():
    eng = TimeEngine(1, Recorder())
    eng.set_backend(_Backend())
    s = eng.default_stream(0)
    a, b = EmuEvent(eng, enable_timing=True), EmuEvent(eng, enable_timing=True)
    a.record(s)
    s.enqueue(0.015, "forward", "m")
    b.record(s)
    b.synchronize()
    assert a.elapsed_time(b) >= 15.0 * 0.95

    class Broken:
        def run(self, *args):
            raise ConnectionError("manager gone")

    eng.set_backend(Broken())
    eng.default_stream(0).enqueue(0.01, "forward", "m")
    with pytest.raises(RuntimeError, match="backend failed"):
        eng.synchronize(0, "item")
    eng.close()
    with pytest.raises(TypeError, match="run"):
        eng.set_backend(object())


def test_engine_streams_are_made_by_the_engine():
    eng = TimeEngine(2, Recorder(), clock=VirtualClock())
    s = eng.new_stream(1, priority=-1)
    assert isinstance(s, VirtualStream) and s.device_index == 1 and s.priority == -1 and s.stream_id >= 1
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        eng.new_stream(2)


class _LateClock(VirtualClock):
    """Wakes a fixed time after every deadline, like an OS that overshoots each sleep."""

    def __init__(self, overshoot: float):
        super().__init__(start=0.0)
        self.overshoot = overshoot

    def wait_until(self, deadline: float) -> None:
        super().wait_until(deadline + self.overshoot)


def test_wakeup_lateness_does_not_accumulate():
    eng = TimeEngine(1, Recorder(), clock=_LateClock(overshoot=0.001))
    s = eng.default_stream(0)
    for _ in range(10):
        s.enqueue(0.010, "forward", "m")
        eng.synchronize(0, "item")
    # 10 x 10 ms of GPU time; only the last wake-up's 1 ms shows, not 10 x 1 ms
    assert eng.clock.now() == pytest.approx(0.101)
    assert eng.recorder.counters["wake_late_s"] == pytest.approx(0.010)
    # genuine host time after a wake still counts
    eng.clock.advance(0.005)
    assert s.enqueue(0.010, "forward", "m") == pytest.approx(0.115)


# ------------------------------------------------------------------ through gpemu.patch
def _tiny_training_run(rt):
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def test_training_step_runs_ahead_then_item_waits_for_the_gpu():
    import torch

    import gpemu
    from gpemu.clock import VirtualClock

    with gpemu.emulate(gpu="V100", model="resnet50", clock=VirtualClock(), summary=False) as rt:
        eng = rt.engine
        model, opt = _tiny_training_run(rt)
        x = torch.empty(32, 64)
        for _ in range(2):  # first: recording; second: replay
            t0 = eng.now()
            loss = model(x.cuda()).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            queued_until = eng.device_busy_until(0)
            assert eng.now() < queued_until  # host ran ahead of the emulated GPU
            loss.item()  # sync point
            assert eng.now() == pytest.approx(queued_until)
        from gpemu import costs
        from gpemu.identify import identify

        fwd = rt.db.lookup(rt.gpus[0].name, "resnet50", 32, "forward").value
        bwd = rt.db.lookup(rt.gpus[0].name, "resnet50", 32, "backward").value
        # (the shipped backward less its loop's per-parameter kernels, for this module's parameters)
        times = costs.model_times(rt, identify(rt, model), 32, 0)
        assert times.forward == fwd and 0.99 * bwd < times.backward < bwd
        step_kinds = {s.kind for s in rt.recorder.spans if s.start >= t0}
        assert {"forward", "backward", "optimizer"} <= step_kinds
        charged = sum(s.end - s.start for s in rt.recorder.spans if s.start >= t0 and s.kind in ("forward", "backward"))
        assert charged == pytest.approx(times.forward + times.backward)
        assert [m.index for m in rt.recorder.iterations] == [0, 1]


def test_cuda_events_time_emulated_gpu_work():
    import torch

    import gpemu
    from gpemu.clock import VirtualClock

    with gpemu.emulate(gpu="V100", model="resnet50", clock=VirtualClock(), summary=False) as rt:
        model, _ = _tiny_training_run(rt)
        x = torch.empty(64, 64).cuda()
        model(x)  # recording pass
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(x)
        end.record()
        end.synchronize()
        fwd = rt.db.lookup(rt.gpus[0].name, "resnet50", 64, "forward").value
        assert start.elapsed_time(end) == pytest.approx(1e3 * fwd, rel=1e-3)
        side = torch.cuda.Stream()
        assert isinstance(side, VirtualStream) and side.stream_id != 0
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() == side
        assert torch.cuda.current_stream() == rt.engine.default_stream(0)


@pytest.mark.parametrize(
    "granularity, expected",
    [
        ("forward-backward", [(0, 0.003, 0, "forward-backward"), (0, 0.001, 0, "optimizer")]),
        ("sync", [(0, 0.004, 0, "sync")]),
    ],
)
def test_backend_granularity_decides_what_one_request_covers(granularity, expected):
    eng = TimeEngine(1, Recorder(), granularity=granularity)
    backend = _Backend()
    eng.set_backend(backend)
    s = eng.default_stream(0)
    s.enqueue(0.001, "forward", "m")
    s.enqueue(0.002, "backward", "m")
    s.enqueue(0.001, "optimizer", "SGD")
    eng.end_iteration(0)  # not a boundary for these granularities
    eng.synchronize(0, "item")
    assert backend.calls == expected
    eng.close()


# ------------------------------------------------------------------ return allowance
# The emulator's own return path after a sync (after its last clock reading) and the entry path
# of the next enqueue (before its clock reading) are forgiven up to ``return_allowance``; on a
# virtual clock the host time they take is modelled with clock.advance() after the sync returns.
def _allowance_engine(allowance=5e-6, devices=2):
    return TimeEngine(devices, Recorder(), clock=VirtualClock(start=100.0), return_allowance=allowance)


def test_right_after_a_sync_the_waited_work_is_complete_and_nothing_starts_before_it():
    eng = _allowance_engine()
    main, side = eng.default_stream(0), eng.new_stream(0)
    before = EmuEvent(eng, enable_timing=True)
    before.record(main)
    deadline = main.enqueue(0.010, "forward", "m")
    eng.synchronize(0, "item")
    # Emulated host time stands on the deadline (never before it) while the allowance lasts.
    assert eng.now() == deadline and eng.clock.now() == deadline
    assert main.query() and side.query()
    after = EmuEvent(eng, enable_timing=True)
    after.record(main)
    assert after.query() and after.mark.time == deadline
    assert before.elapsed_time(after) == pytest.approx(10.0)
    eng.clock.advance(3e-6)  # the emulator's return + entry path
    assert side.enqueue(0.001, "op", "x") == pytest.approx(deadline + 0.001)  # starts AT the deadline
    assert eng.recorder.spans[-1].start == deadline
    other = eng.default_stream(1)  # another device, idle all along:
    assert eng.recorder.spans[-1].start >= deadline  # host-issued work after the sync
    assert other.enqueue(0.001, "op", "y") - 0.001 >= deadline


def test_program_time_beyond_the_allowance_still_counts():
    eng = _allowance_engine(allowance=5e-6)
    s = eng.default_stream(0)
    deadline = s.enqueue(0.010, "forward", "m")
    eng.synchronize(0, "item")
    eng.clock.advance(0.002)  # the program's own 2 ms of host work
    start = s.enqueue(0.010, "forward", "m") - 0.010
    assert start == pytest.approx(deadline + 0.002 - 5e-6, abs=1e-12)
    assert eng.now() == pytest.approx(eng.clock.now() - 5e-6, abs=1e-12)


def test_event_synchronize_and_stream_synchronize_get_the_allowance_too():
    eng = _allowance_engine(allowance=4e-6)
    s = eng.default_stream(0)
    s.enqueue(0.005, "forward", "m")
    ev = EmuEvent(eng, enable_timing=True)
    ev.record(s)
    ev.synchronize()
    eng.clock.advance(4e-6)
    assert ev.query() and s.query()
    assert s.enqueue(0.001, "op", "a") == pytest.approx(ev.mark.time + 0.001, abs=1e-12)
    s.synchronize()
    d2 = s.busy_until
    eng.clock.advance(4e-6)
    assert s.enqueue(0.001, "op", "b") == pytest.approx(d2 + 0.001, abs=1e-12)


def test_allowance_for_short_and_long_waits():
    eng = _allowance_engine(allowance=(1e-6, 4e-6))
    s = eng.default_stream(0)
    short = s.enqueue(0.0005, "op", "short")  # a 0.5 ms wait: short-wait allowance
    eng.synchronize(0, "item")
    eng.clock.advance(10e-6)
    assert s.enqueue(0.001, "op", "x") - 0.001 == pytest.approx(short + 9e-6, abs=1e-12)
    long_ = eng.device_busy_until(0) + 0.009  # the host waits ~10 ms: long-wait
    s.enqueue(0.009, "op", "long")
    eng.synchronize(0, "item")
    eng.clock.advance(10e-6)
    assert s.enqueue(0.001, "op", "y") - 0.001 == pytest.approx(long_ + 6e-6, abs=1e-12)


def test_a_settle_after_emulator_work_keeps_the_allowance_on_top():
    eng = _allowance_engine(allowance=2e-6)
    s = eng.default_stream(0)
    deadline = s.enqueue(0.010, "forward", "m")
    eng.synchronize(0, "item")
    eng.clock.advance(30e-6)  # e.g. .item() computing its value
    eng.settle()
    eng.settle()  # twice: no double forgiveness
    eng.clock.advance(2e-6)  # return + entry
    assert eng.now() == deadline
    assert s.enqueue(0.001, "op", "x") == pytest.approx(deadline + 0.001, abs=1e-12)
    eng.clock.advance(1e-3)
    assert eng.now() == pytest.approx(deadline + 1e-3, abs=1e-12)


@pytest.mark.parametrize("path, expected_extra_per_iter", [(3e-6, 0.0), (8e-6, 3e-6)])
def test_ten_thousand_synced_iterations_end_at_the_sum_of_targets(path, expected_extra_per_iter):
    import random

    # Each wait wakes 40 us late (OS), then the emulator's way back + the next enqueue's entry take
    # `path` of host time. Within a 5 us allowance the total is exactly the sum of the targets;
    # beyond it only the excess (not the lateness) is added.
    eng = TimeEngine(1, Recorder(), clock=_LateClock(overshoot=40e-6), return_allowance=5e-6)
    s = eng.default_stream(0)
    rng = random.Random(1)
    targets = [(rng.uniform(0.5e-3, 1.1e-3), rng.uniform(1.2e-3, 2.2e-3)) for _ in range(10_000)]
    for f, b in targets:
        s.enqueue(f, "forward", "m")
        s.enqueue(b, "backward", "m")
        eng.synchronize(0, "item")
        eng.clock.advance(path)
    spans = eng.recorder.spans
    assert all(b.start >= a.end for a, b in zip(spans, spans[1:], strict=False))  # never before previous work
    total = eng.device_busy_until(0) - spans[0].start
    expected = sum(f + b for f, b in targets) + expected_extra_per_iter * (len(targets) - 1)
    assert total == pytest.approx(expected, rel=1e-12, abs=1e-9)
    if path <= 5e-6:
        gaps = [b.start - a.end for a, b in zip(spans, spans[1:], strict=False)]
        assert max(gaps) == 0.0


def test_random_programs_keep_cuda_ordering_with_an_allowance():
    import random

    rng = random.Random(7)
    eng = _allowance_engine(allowance=6e-6)
    streams = [eng.default_stream(0), eng.new_stream(0), eng.default_stream(1)]
    last_end = {id(s): 0.0 for s in streams}
    last_sync_deadline = float("-inf")
    for _ in range(3000):
        op = rng.random()
        s = rng.choice(streams)
        if op < 0.55:
            end = s.enqueue(rng.uniform(0, 2e-4), "op", "w")
            span = eng.recorder.spans[-1] if eng.recorder.spans and eng.recorder.spans[-1].end == end else None
            if span is not None:
                assert span.start >= last_end[id(s)]  # in order on its stream
                assert span.start >= last_sync_deadline  # host-issued after the last sync
            last_end[id(s)] = max(last_end[id(s)], end)
        elif op < 0.7:
            ev = EmuEvent(eng)
            ev.record(s)
            ev.synchronize()
            last_sync_deadline = max(last_sync_deadline, ev.mark.time)
            assert ev.query() and eng.now() >= ev.mark.time
        elif op < 0.8:
            eng.synchronize(s.device_index, "sync")
            last_sync_deadline = max(last_sync_deadline, eng.device_busy_until(s.device_index))
            assert all(x.query() for x in streams if x.device_index == s.device_index)
        elif op < 0.9:
            other = rng.choice(streams)
            ev = other.record_event()
            s.wait_event(ev)
            last_end[id(s)] = max(last_end[id(s)], ev.mark.time)
        assert eng.now() >= last_sync_deadline  # host time never before a waited deadline
        eng.clock.advance(rng.choice((0.0, 1e-6, 4e-6, 2e-5)))


def test_return_allowance_is_validated_and_virtual_clocks_get_none():
    with pytest.raises(ValueError, match="return_allowance"):
        TimeEngine(1, clock=VirtualClock(), return_allowance=-1e-6)
    with pytest.raises(ValueError, match="return_allowance"):
        TimeEngine(1, clock=VirtualClock(), return_allowance=(1e-6, 2e-6, 3e-6))
    with pytest.raises(ValueError, match="return_allowance"):
        TimeEngine(1, clock=VirtualClock(), return_allowance=1.0)
    assert TimeEngine(1, clock=VirtualClock()).return_allowance == (0.0, 0.0)
    assert TimeEngine(1, clock=VirtualClock(), return_allowance=3e-6).return_allowance == (3e-6, 3e-6)


def test_calibrated_allowance_on_the_real_clock_is_a_measured_microsecond_scale_cost():
    from gpemu.clock import RealClock
    from gpemu.time import calibrate_return_allowance

    short, long_ = calibrate_return_allowance()
    # The engine's own return + entry path is a few hundred ns warm, some us after a long wait on a
    # shared VM; generous bounds (the machine is shared): positive, and far below a millisecond.
    assert 0.0 < short <= 20e-6 and 0.0 < long_ <= 20e-6
    eng = TimeEngine(1, Recorder(), clock=RealClock())
    assert eng.return_allowance == (short, long_)  # once per process, reused


def test_patched_item_then_query_event_and_next_step_with_an_allowance():
    import torch

    import gpemu
    from gpemu.clock import VirtualClock

    with gpemu.emulate(
        gpu="V100", model="resnet50", summary=False, clock=VirtualClock(), tuning={"return_allowance": 5e-6}
    ) as rt:
        eng = rt.engine
        assert eng.return_allowance == (5e-6, 5e-6)
        model, opt = _tiny_training_run(rt)
        x = torch.empty(32, 64)
        ends = []
        for _ in range(3):
            loss = model(x.cuda()).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            deadline = eng.device_busy_until(0)
            loss.item()
            ends.append(deadline)
            assert torch.cuda.current_stream().query()
            ev = torch.cuda.Event()
            ev.record()
            assert ev.query() and eng.now() == deadline
            eng.clock.advance(4e-6)  # within the allowance
        fwd = [s for s in rt.recorder.spans if s.kind == "forward"]
        assert fwd[-1].start >= ends[-2] and fwd[-2].start >= ends[-3]


def test_a_device_sync_waits_for_a_cross_device_event_wait(eng):
    a, b = eng.default_stream(0), eng.default_stream(1)
    b.enqueue(0.050, "op", "long on device 1")
    a.wait_event(b.record_event())  # device 0's stream now waits until 100.050
    assert not a.query()
    eng.synchronize(0, "synchronize")  # as cudaDeviceSynchronize: waits for that wait too
    assert eng.clock.now() == pytest.approx(100.050) and a.query()


# ------------------------------------------------------------------ the emulator's own host time
# Inside an emulator entry (engine.enter ... leave) the host's emulated time is frozen at the
# entry: what is enqueued inside is issued then, and the time spent inside is forgiven when the
# outermost entry leaves. User code run from inside (suspend ... resume) counts; waits count.
def test_work_inside_an_emulator_entry_is_issued_at_the_entry_and_its_time_forgiven():
    eng = _allowance_engine(allowance=0.0)
    s = eng.default_stream(0)
    t0 = eng.now()
    eng.enter()
    eng.clock.advance(0.003)  # the emulator's own work
    assert eng.now() == t0 and eng.in_emulator
    s.enqueue(0.001, "op", "a")
    eng.clock.advance(0.002)
    eng.leave()
    assert not eng.in_emulator
    assert eng.recorder.spans[-1].start == t0 and eng.recorder.spans[-1].enqueued_at == t0
    assert eng.now() == pytest.approx(t0, abs=1e-12)  # all 5 ms forgiven
    eng.clock.advance(0.004)  # the program's own work counts
    assert s.enqueue(0.001, "op", "b") == pytest.approx(t0 + 0.005, abs=1e-12)
    assert eng.recorder.spans[-1].enqueued_at == pytest.approx(t0 + 0.004, abs=1e-12)


def test_nested_entries_count_once_and_user_code_inside_counts():
    eng = _allowance_engine(allowance=0.0)
    s = eng.default_stream(0)
    t0 = eng.now()
    with eng.emulator_work():
        eng.clock.advance(0.001)
        with eng.emulator_work():  # nested: still frozen
            eng.clock.advance(0.001)
            s.enqueue(0.0001, "op", "inner")
        assert eng.now() == t0
        with eng.program_work():  # a hook, a module's own forward
            assert not eng.in_emulator
            eng.clock.advance(0.010)
            s.enqueue(0.0001, "op", "user")
        eng.clock.advance(0.002)
        s.enqueue(0.0001, "op", "after")
    inner, user, after = eng.recorder.spans[-3:]
    assert inner.enqueued_at == t0
    assert user.enqueued_at == pytest.approx(t0 + 0.010, abs=1e-12)  # the user's 10 ms count
    assert after.enqueued_at == pytest.approx(t0 + 0.010, abs=1e-12)  # frozen again at resume
    assert eng.now() == pytest.approx(t0 + 0.010, abs=1e-12)


def test_a_wait_inside_an_entry_counts_and_restarts_it():
    eng = _allowance_engine(allowance=0.0)
    s = eng.default_stream(0)
    deadline = s.enqueue(0.020, "forward", "m")
    with eng.emulator_work():
        eng.clock.advance(0.001)
        eng.synchronize(0, "item")  # waits until the deadline
        assert eng.clock.now() == deadline
        eng.clock.advance(0.003)  # computing the value: the emulator's
        assert eng.now() == deadline
        s.enqueue(0.001, "op", "x")
    assert eng.recorder.spans[-1].start == deadline
    assert eng.now() == deadline


def test_emulator_time_forgiven_per_entry_is_bounded_and_threads_are_separate():
    from gpemu.time.host import MAX_FORGIVEN_WORK as _MAX_FORGIVEN_WORK

    eng = _allowance_engine(allowance=0.0)
    t0 = eng.now()
    eng.enter()
    eng.clock.advance(1.0)  # far beyond emulator work: counts
    eng.leave()
    assert eng.now() == pytest.approx(t0 + 1.0 - _MAX_FORGIVEN_WORK, abs=1e-12)
    eng.leave()  # unbalanced: ignored
    assert not eng.in_emulator
    seen = []

    def other():
        seen.append(eng.in_emulator)

    eng.enter()
    th = threading.Thread(target=other)
    th.start()
    th.join()
    eng.leave()
    assert seen == [False]


def test_forgiven_emulator_time_never_lets_a_later_sync_skip_its_wait(eng) -> None:
    # 40 ms of the emulator's own work (a recording pass) is forgiven: the host's emulated time
    # lags the clock by it. A sync whose deadline the clock has already passed must not forgive
    # that lag again as wake-up lateness: every later step, GPU-bound, waits its full GPU time.
    clock, s = eng.clock, eng.stream(0)
    eng.enter()
    clock.advance(0.040)
    eng.leave()
    s.enqueue(0.010, "forward", "recorded step")
    eng.synchronize()
    for _ in range(3):
        t = clock.now()
        s.enqueue(0.020, "forward", "step")
        eng.synchronize()
        assert clock.now() - t == pytest.approx(0.020, abs=1e-6)  # the script's clock sees the GPU's step
