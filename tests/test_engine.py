"""Virtual streams, events and sync points, on a virtual clock (exact, instant)."""

from __future__ import annotations

import threading
import time

import pytest

from gpemu.clock import VirtualClock
from gpemu.engine import EmuEvent, TimeEngine, VirtualStream
from gpemu.recorder import Recorder


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
    assert kinds == [("forward", 100.0, pytest.approx(100.010), 100.0),
                     ("backward", pytest.approx(100.010), pytest.approx(100.030), 100.0)]


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
    ev = EmuEvent(enable_timing=True)
    ev.record(main)
    side.enqueue(0.030, "transfer", "copy")       # independent: starts now
    assert side.busy_until == pytest.approx(100.030)
    side.wait_event(ev)                            # GPU-side dependency, host does not wait
    assert eng.clock.now() == 100.0
    end = side.enqueue(0.010, "op", "after")
    assert end == pytest.approx(100.110)


def test_wait_stream_and_unrecorded_event_noop(eng):
    a, b = eng.default_stream(0), eng.new_stream(0)
    b.wait_event(EmuEvent())  # never recorded: no-op
    assert b.busy_until == 0.0
    a.enqueue(0.2, "op", "x")
    b.wait_stream(a)
    assert b.enqueue(0.1, "op", "y") == pytest.approx(100.3)


def test_event_elapsed_time_is_emulated_gpu_ms(eng):
    s = eng.default_stream(0)
    start, end = EmuEvent(enable_timing=True), EmuEvent(enable_timing=True)
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
    a, b = EmuEvent(), EmuEvent()
    a.record(s)
    b.record(s)
    with pytest.raises(RuntimeError, match="enable_timing"):
        a.elapsed_time(b)
    c, d = EmuEvent(enable_timing=True), EmuEvent(enable_timing=True)
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
    eng.end_iteration(0)                      # no backward yet: not an iteration
    s.enqueue(0.02, "backward", "m")
    s.enqueue(0.001, "optimizer", "SGD")
    eng.end_iteration(0)
    eng.end_iteration(0)                      # a second optimizer in the same iteration
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
    assert not s.query()                      # handed to the backend, host not blocked
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
    a, b = EmuEvent(enable_timing=True), EmuEvent(enable_timing=True)
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


def test_torch_shaped_stream_and_event_need_a_patched_runtime():
    with pytest.raises(RuntimeError, match="not patched"):
        VirtualStream()


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

    with gpemu.emulate(gpu="V100", model="resnet50", extra={"clock": VirtualClock()}, summary=False) as rt:
        eng = rt.state["engine"]
        model, opt = _tiny_training_run(rt)
        x = torch.empty(32, 64)
        for _ in range(2):  # first: recording; second: replay
            t0 = eng.now()
            loss = model(x.cuda()).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            queued_until = eng.device_busy_until(0)
            assert eng.now() < queued_until        # host ran ahead of the emulated GPU
            loss.item()                            # sync point
            assert eng.now() == pytest.approx(queued_until)
        fwd = rt.db.lookup(rt.gpus[0].name, "resnet50", 32, "forward").value
        bwd = rt.db.lookup(rt.gpus[0].name, "resnet50", 32, "backward").value
        step_kinds = {s.kind for s in rt.recorder.spans if s.start >= t0}
        assert {"forward", "backward", "optimizer"} <= step_kinds
        charged = sum(s.end - s.start for s in rt.recorder.spans if s.start >= t0 and s.kind in ("forward", "backward"))
        assert charged == pytest.approx(fwd + bwd)
        assert [m.index for m in rt.recorder.iterations] == [0, 1]


def test_cuda_events_time_emulated_gpu_work():
    import torch

    import gpemu
    from gpemu.clock import VirtualClock

    with gpemu.emulate(gpu="V100", model="resnet50", extra={"clock": VirtualClock()}, summary=False) as rt:
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
        assert torch.cuda.current_stream() == rt.state["engine"].default_stream(0)


@pytest.mark.parametrize("granularity, expected", [
    ("forward-backward", [(0, 0.003, 0, "forward-backward"), (0, 0.001, 0, "optimizer")]),
    ("sync", [(0, 0.004, 0, "sync")]),
])
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
