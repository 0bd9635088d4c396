"""Virtual time (``clock="virtual"``): each thread's CPU time, waits that jump, the program's
clocks on the emulated timeline (docs/time.md, "Virtual time")."""

from __future__ import annotations

import datetime
import pickle
import threading
import time

import pytest

from gpemu.clock import REAL
from gpemu.time.cpuclock import BlockedTime, CpuTimeClock


def _spin(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


# ------------------------------------------------------------------ the clock
def test_a_thread_advances_by_its_cpu_time_and_jumps_to_deadlines():
    clock = CpuTimeClock(start=100.0)
    t0 = clock.now()
    REAL.sleep(0.05)  # blocked, not on a core: no time passes
    assert clock.now() - t0 < 0.01
    _spin(0.02)
    assert 0.02 <= clock.now() - t0 < 0.05
    clock.wait_until(t0 + 10.0)  # a wait jumps, at once
    assert t0 + 10.0 <= clock.now() < t0 + 10.01
    clock.wait_until(t0 + 5.0)  # never back
    assert clock.now() >= t0 + 10.0
    after = clock.advance(2.5)
    assert after >= t0 + 12.5
    with pytest.raises(ValueError, match="back in time"):
        clock.advance(-1)


def test_threads_keep_their_own_lanes_and_start_at_the_latest_time():
    clock = CpuTimeClock(start=0.0)
    clock.wait_until(50.0)
    seen: dict[str, float] = {}

    def helper() -> None:
        seen["start"] = clock.now()  # starts where the process's latest reading was
        clock.wait_until(80.0)  # its own wait moves only its own lane
        seen["end"] = clock.now()

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert 50.0 <= seen["start"] < 50.01 and seen["end"] >= 80.0
    assert clock.now() < 50.01  # the main thread was not moved by the helper's wait


def test_blocked_time_counts_blocking_but_not_cpu():
    blocked = BlockedTime()
    if not BlockedTime.available():
        pytest.skip("no /proc/thread-self/schedstat here")
    _spin(0.01)
    assert blocked.seconds() < 0.008
    blocked.start()
    REAL.sleep(0.05)
    assert 0.04 < blocked.seconds() < 0.2


# ------------------------------------------------------------------ a run on virtual time
def _virtual_run(**settings):
    import gpemu

    return gpemu.patch(gpu="V100", summary=False, clock="virtual", **settings)


def test_gpu_waits_sleeps_and_readings_are_on_the_emulated_timeline():
    import torch

    rt = _virtual_run()
    real0 = REAL.perf_counter()
    p0, m0, w0 = time.perf_counter(), time.monotonic(), time.time()
    stream = rt.engine.default_stream(0)
    stream.enqueue(30.0, "op", "thirty seconds of GPU work")
    torch.cuda.synchronize()
    time.sleep(100.0)  # returns at once, the program's time moves on
    p1, m1, w1 = time.perf_counter(), time.monotonic(), time.time()
    assert REAL.perf_counter() - real0 < 2.0
    for a, b in ((p0, p1), (m0, m1), (w0, w1)):
        assert 130.0 <= b - a < 131.0
    assert abs(time.time_ns() / 1e9 - time.time()) < 0.01
    now = datetime.datetime.now()
    assert type(now) is datetime.datetime.__mro__[1]  # a plain datetime
    assert isinstance(now, datetime.datetime) and abs(now.timestamp() - time.time()) < 0.01
    assert pickle.loads(pickle.dumps(now)) == now  # pickles as datetime.datetime, unpickles plain
    assert datetime.datetime(2020, 1, 2).year == 2020


def test_unpatch_restores_the_real_clocks():
    import gpemu

    originals = {name: getattr(time, name) for name in ("time", "perf_counter", "monotonic", "sleep", "time_ns")}
    real_datetime = datetime.datetime
    _virtual_run()
    assert time.perf_counter is not originals["perf_counter"] and datetime.datetime is not real_datetime
    gpemu.unpatch()
    assert {name: getattr(time, name) for name in originals} == originals
    assert datetime.datetime is real_datetime
    assert real_datetime not in __import__("copyreg").dispatch_table


def test_a_gpu_bound_loop_reads_its_gpu_time_whatever_the_host_does():
    """Per-iteration times of a GPU-bound loop are its GPU time plus the few microseconds of CPU
    the loop itself spends between a sync and the next enqueue: the host's work while the GPU
    runs (here a 3 ms busy wait per step) hides behind it, and the host's real speed and load do
    not enter."""
    import torch

    rt = _virtual_run()
    stream = rt.engine.default_stream(0)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        stream.enqueue(0.25, "forward", "step")
        _spin(0.003)  # host work while the GPU runs
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    assert times == pytest.approx([0.25] * 5, abs=2e-4)


def test_modelled_host_time_and_the_emulators_own_time():
    """charge_host() moves the program's time (a host model's issue time); the emulator's own
    CPU time is forgiven however long an entry takes."""
    rt = _virtual_run()
    engine = rt.engine
    t0 = time.perf_counter()
    engine.charge_host(0.5)
    assert 0.5 <= time.perf_counter() - t0 < 0.51
    t1 = time.perf_counter()
    with engine.emulator_work():
        _spin(0.08)  # longer than the real clock's 50 ms cap on forgiven work
    assert time.perf_counter() - t1 < 0.005
    with pytest.raises(ValueError, match="modelled host time"):
        engine.charge_host(-1.0)


def test_the_summary_says_virtual_time_and_the_speed_up():
    import torch

    from gpemu.observe import format_summary, summary

    rt = _virtual_run()
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 64).cuda()).sum().backward()
        opt.step()
    rt.engine.default_stream(0).enqueue(60.0, "op", "a minute")
    torch.cuda.synchronize()
    s = summary()
    assert s["clock"] == "virtual" and s["run_s"] > 60.0 and 0 < s["wall_s"] < 30.0
    text = format_summary(s)
    assert "every time in this summary is virtual" in text and "of real time (" in text


# ------------------------------------------------------------------ ranks meet on virtual time
def _straggler_rank(rank: int, port: int, out_dir: str, data_dir: str) -> None:
    import json
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    import gpemu

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GPEMU_DATA_DIR=data_dir)
    rt = gpemu.patch(gpu="V100", num_gpus=2, summary=False, clock="virtual")
    dist.init_process_group("nccl", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    grads = torch.ones(1 << 20, device="cuda")  # 4 MiB
    stream = rt.engine.default_stream(rank)
    dist.barrier()
    steps = []
    for step in range(3):
        t0 = time.perf_counter()
        stream.enqueue(0.1, "backward", "step")
        if rank == 1 and step == 1:
            time.sleep(0.5)  # a straggler: its host is late by half a second
        dist.all_reduce(grads)
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
    if rank == 0:
        time.sleep(2.0)  # rank 0 reaches the barrier late: rank 1 waits for it there
    dist.barrier()
    out = {"steps": steps, "after_barrier": time.perf_counter()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()
    gpemu.unpatch()


@pytest.mark.torchrun
def test_two_gloo_ranks_meet_on_virtual_time_and_a_straggler_slows_both(tmp_path, _gpemu_data_dir):
    """Two real processes in a gloo group on virtual time: rank 1's host is late by
    0.5 s in step 1, so both ranks' step 1 lasts 0.4 s longer than their others (the all-reduce
    ends at the latest arrival plus its price), and a barrier releases both at the later rank's
    time, whatever the real order in which they got there."""
    import json

    import torch.multiprocessing as mp

    from gpemu.ports import free_port

    args = (free_port(), str(tmp_path), str(_gpemu_data_dir))
    mp.spawn(_straggler_rank, args=args, nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    comm = r0["steps"][0] - 0.1
    assert 0 < comm < 0.01  # the all-reduce's price, exposed after the step's GPU work
    for r in (r0, r1):
        assert r["steps"][1] - r["steps"][0] == pytest.approx(0.4, abs=1e-3)
        assert r["steps"][2] == pytest.approx(r["steps"][0], abs=1e-3)
    assert r0["steps"] == pytest.approx(r1["steps"], abs=1e-3)
    assert r1["after_barrier"] == pytest.approx(r0["after_barrier"], abs=1e-3)


# ------------------------------------------------------------------ DataLoader workers
class _SlowDataset:
    """Each sample costs ``cpu_s`` of CPU and ``blocked_s`` of blocking I/O (a real sleep)."""

    def __init__(self, cpu_s: float, blocked_s: float, n: int = 64) -> None:
        self.cpu_s, self.blocked_s, self.n = cpu_s, blocked_s, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        _spin(self.cpu_s)
        REAL.sleep(self.blocked_s)
        return torch.zeros(4)


def _iteration_times(rt, loader, gpu_s: float) -> list[float]:
    stream = rt.engine.default_stream(0)
    marks = []
    for batch in loader:
        batch.cuda()
        stream.enqueue(gpu_s, "forward", "step")
        torch_sync()
        marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def torch_sync() -> None:
    import torch

    torch.cuda.synchronize()


@pytest.mark.subprocess
@pytest.mark.parametrize("pin_memory", [False, True])
def test_dataloader_workers_deliver_batches_on_virtual_time(pin_memory):
    """Two workers, each batch costing 2 x (10 ms CPU + 5 ms blocking I/O) = 30 ms of worker time:
    with 5 ms of GPU work a step the loop is data-bound at one batch per 15 ms (two workers), on
    virtual time, whatever the real machine does; with 40 ms of GPU work a step it is GPU-bound.
    The counts are CPU and blocked time, so two workers on a loaded 2-core host give the same."""
    from torch.utils.data import DataLoader

    rt = _virtual_run()
    rt.engine.default_stream(0).enqueue(0.001, "op", "the program has used the GPU")
    data = _SlowDataset(cpu_s=0.010, blocked_s=0.005)
    loader = DataLoader(data, batch_size=2, num_workers=2, pin_memory=pin_memory, persistent_workers=True)
    data_bound = _iteration_times(rt, loader, 0.005)[6:]
    assert sum(data_bound) / len(data_bound) == pytest.approx(0.015, rel=0.15)
    gpu_bound = _iteration_times(rt, loader, 0.040)[6:]
    # (plus the loop's own host time after each sync: taking a batch, ~1 ms of CPU here)
    assert 0.040 < sum(gpu_bound) / len(gpu_bound) < 0.043
    assert any(w.reason == "data" for w in rt.recorder.waits)  # the program waited for batches


def test_a_fetch_in_the_program_counts_its_blocking_io():
    """num_workers=0: the program fetches itself; its CPU and its blocking I/O both count."""
    from torch.utils.data import DataLoader

    rt = _virtual_run()
    loader = DataLoader(_SlowDataset(cpu_s=0.002, blocked_s=0.010, n=8), batch_size=2)
    times = _iteration_times(rt, loader, 0.001)
    if BlockedTime.available():
        assert sum(times) / len(times) == pytest.approx(0.001 + 2 * 0.012, rel=0.2)


# ------------------------------------------------------------------ libraries built on the clocks
@pytest.mark.compat
def test_tqdm_hf_trainer_and_lightning_measure_virtual_time():
    """The real libraries under `gpemu run --clock virtual` (tests/compat/virtual_clock.py): three
    steps of 20 s of the program's time each read 60 s in tqdm, the Trainer's train_runtime and
    Lightning's Timer, in a fraction of that of real time; the run's first line says what
    virtual time models."""
    import json
    import subprocess
    from pathlib import Path

    script = Path(__file__).parent / "compat" / "virtual_clock.py"
    t0 = REAL.perf_counter()
    proc = subprocess.run(
        ["gpemu", "run", "--gpu", "A100", "--clock", "virtual", "--no-summary", "--", "python", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    wall = REAL.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.startswith("[gpemu] virtual time: each process's host time is the CPU time")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 60.0 <= out["tqdm"]["elapsed"] < 62.0 and out["tqdm"]["rate"] == pytest.approx(0.05, rel=0.03)
    assert 60.0 <= out["hf_train_runtime"] < 62.0
    assert 60.0 <= out["lightning_train"] < 62.0
    assert wall < 60.0


def test_torch_profiler_timestamps_are_virtual(tmp_path):
    """The torch profiler's events and Chrome trace span the program's virtual time: three steps
    with a second's sleep after each (virtual: no real time) span two seconds between the first
    step's op and the last's."""
    import json

    import torch
    from torch.profiler import ProfilerActivity, profile

    _virtual_run()
    w, x = torch.randn(64, 64).cuda(), torch.randn(8, 64).cuda()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(x, w).sum().item()
            time.sleep(1.0)
    ops = [e for e in prof.events() if e.name == "aten::mm" and e.cpu_parent is None]
    assert len(ops) == 3
    assert ops[2].time_range.start - ops[0].time_range.start == pytest.approx(2e6, rel=0.01)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    mm = sorted(e["ts"] for e in doc["traceEvents"] if e.get("name") == "aten::mm")
    assert doc["gpemuClock"] == "virtual" and mm[-1] - mm[0] == pytest.approx(2e6, rel=0.01)


# ------------------------------------------------------------------ the setting
def test_the_clock_setting_travels_and_bad_values_say_what_is_valid():
    import gpemu
    from gpemu.clock import VirtualClock
    from gpemu.config import ConfigError, EmuConfig

    config = EmuConfig.from_env({"GPEMU_CLOCK": " Virtual "})
    assert config.virtual_time and "clock=virtual" in config.describe()
    env = config.to_env()
    assert env["GPEMU_CLOCK"] == "virtual" and EmuConfig.from_env(env) == config
    assert EmuConfig() == EmuConfig(clock="real") == EmuConfig(clock=VirtualClock())  # a test's clock object
    assert "GPEMU_CLOCK" not in EmuConfig(clock=VirtualClock()).to_env()  # (stays in its process)
    with pytest.raises(ConfigError, match="clock must be one of real, virtual, got 'fast'"):
        EmuConfig.from_env({"GPEMU_CLOCK": "fast"})
    _virtual_run()
    with pytest.raises(RuntimeError, match="time_mode='real' asked, 'virtual' in use"):
        gpemu.patch(gpu="V100", summary=False)
