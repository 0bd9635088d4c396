"""The torch.cuda / torch.accelerator / torch.backends surface on emulated GPUs.

Each entry point a training script or library touches is called the way they call it, against
a real gpemu.patch() (real profile database, real time engine on a virtual clock).
"""

from __future__ import annotations

import threading

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.config import ConfigError

SIX_GPUS = ("V100", "A100", "K80", "M40", "P100", "RTX6000")


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def rt4(clock: VirtualClock):
    return gpemu.patch(gpu="V100", num_gpus=4, clock=clock)


# ------------------------------------------------------------------ devices
def test_availability_and_count(rt4) -> None:
    assert torch.cuda.is_available() is True
    assert torch.cuda.device_count() == 4
    assert torch.cuda.is_initialized() is False  # lazily, like CUDA
    torch.cuda.init()
    assert torch.cuda.is_initialized() is True
    assert torch.cuda.get_device_name() == "Tesla V100-PCIE-32GB"
    assert torch.cuda.get_device_name(torch.device("cuda:3")) == "Tesla V100-PCIE-32GB"


def test_properties_have_real_compute_capabilities() -> None:
    gpemu.patch(device_gpus=SIX_GPUS)
    expected = {"V100": (7, 0), "A100": (8, 0), "K80": (3, 7), "M40": (5, 2), "P100": (6, 0), "RTX6000": (7, 5)}
    assert torch.cuda.device_count() == 6
    for i, short in enumerate(SIX_GPUS):
        props = torch.cuda.get_device_properties(i)
        assert (props.major, props.minor) == expected[short], short
        assert torch.cuda.get_device_capability(f"cuda:{i}") == expected[short]
        spec = gpemu.current().gpus[i]
        assert props.total_memory == spec.memory_bytes
        assert props.multi_processor_count == spec.sm_count > 0
        assert props.name == spec.name
        assert "total_memory=" in repr(props)
    # bf16/tf32 follow the capability of the current device.
    torch.cuda.set_device(1)
    assert torch.cuda.is_tf32_supported() is True
    torch.cuda.set_device(0)
    assert torch.cuda.is_tf32_supported() is False


def test_current_device_is_per_thread_and_contexts_restore(rt4) -> None:
    torch.cuda.set_device(2)
    assert torch.cuda.current_device() == 2
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(torch.cuda.current_device()))
    t.start()
    t.join()
    assert other == [0]  # a new thread starts on device 0, like CUDA
    with torch.cuda.device(1):
        assert torch.cuda.current_device() == 1
        with torch.cuda.device("cuda:3"):
            assert torch.cuda.current_device() == 3
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 2
    torch.cuda.set_device(torch.device("cuda", 0))
    torch.cuda.set_device(-1)  # negative: a no-op, as in torch
    assert torch.cuda.current_device() == 0


def test_bad_device_arguments_raise_clear_errors(rt4) -> None:
    with pytest.raises(RuntimeError, match="invalid device ordinal.*0..3"):
        torch.cuda.set_device(4)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.get_device_properties("cuda:7")
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.set_device("cpu")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        with torch.cuda.device(9):
            pass


def test_patch_without_arguments_reads_the_environment(monkeypatch) -> None:
    # What a k8s emuGPU allocation or `gpemu run` leaves for a script that calls gpemu.patch().
    monkeypatch.setenv("GPEMU_GPUS", "P100,A100")
    gpemu.patch()
    assert torch.cuda.device_count() == 2
    assert torch.cuda.get_device_name(0) == "Tesla P100-PCIE-16GB"
    assert torch.cuda.get_device_capability(1) == (8, 0)


def test_bad_configuration_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="did you mean 'V100'"):
        gpemu.patch(gpu="V10")
    with pytest.raises(ConfigError, match="num_gpus must be an integer from 1 to 64"):
        gpemu.patch(gpu="V100", num_gpus=0)
    assert not gpemu.is_patched() and torch.cuda.is_available() is False


# ------------------------------------------------------------------ streams and events
def test_streams_events_and_synchronize(rt4, clock: VirtualClock) -> None:
    engine = rt4.engine
    assert torch.cuda.Stream is type(torch.cuda.current_stream())
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() == side
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda.current_stream().enqueue(0.25, "op", "work")
        end.record()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with pytest.raises(RuntimeError, match="not ready"):  # like CUDA: sync before elapsed_time
        start.elapsed_time(end)
    before = clock.now()
    assert not side.query()
    torch.cuda.synchronize()  # the host waits (on the virtual clock) until the GPU work is done
    assert clock.now() - before == pytest.approx(0.25, rel=1e-6)
    assert side.query()
    assert start.elapsed_time(end) == pytest.approx(250.0, rel=1e-6)
    torch.cuda.set_stream(side)
    assert torch.cuda.current_stream() == side
    torch.cuda.set_stream(torch.cuda.default_stream())
    assert engine.stream(0) == torch.cuda.default_stream(0)
    assert torch.cuda.is_current_stream_capturing() is False


def test_utilization_is_the_busy_share_of_the_last_second(rt4, clock: VirtualClock) -> None:
    assert torch.cuda.utilization(0) == 0
    stream = torch.cuda.current_stream(0)
    stream.enqueue(0.25, "op", "a")
    torch.cuda.Stream(0).enqueue(0.25, "op", "overlapping, other stream")  # overlaps: counts once
    torch.cuda.synchronize(0)
    clock.advance(0.5)
    stream.enqueue(0.25, "op", "b")
    torch.cuda.synchronize(0)
    assert torch.cuda.utilization(0) == 50  # busy 0.25 + 0.25 s of the last 1 s
    assert torch.cuda.utilization(1) == 0
    clock.advance(2.0)
    assert torch.cuda.utilization(0) == 0


# ------------------------------------------------------------------ torch.accelerator
def test_accelerator_surface(rt4, clock: VirtualClock) -> None:
    acc = torch.accelerator
    assert acc.is_available() and acc.device_count() == 4
    assert acc.current_accelerator() == torch.device("cuda")
    assert acc.current_accelerator(check_available=True).type == "cuda"
    acc.set_device_index(3)
    assert acc.current_device_index() == 3 == torch.cuda.current_device()
    with acc.device_index(1):
        assert acc.current_device_index() == 1
    assert acc.current_device_index() == 3
    stream = acc.current_stream()
    assert stream.is_capturing() is False
    stream.enqueue(0.1, "op", "x")
    before = clock.now()
    acc.synchronize()
    assert clock.now() - before == pytest.approx(0.1, rel=1e-6)
    free, total = acc.get_memory_info()
    assert total == rt4.gpus[3].memory_bytes and 0 < free <= total
    assert acc.memory_allocated() == 0 and acc.max_memory_allocated() == 0
    assert torch.float16 in acc.get_device_capability()["supported_dtypes"]


# ------------------------------------------------------------------ memory statistics
def test_memory_statistics_follow_the_tracker(rt4) -> None:
    tracker = rt4.memory[1]
    block = tracker.allocate(300 << 20)
    assert torch.cuda.memory_allocated(1) == tracker.allocated >= 300 << 20
    assert torch.cuda.memory_allocated(0) == 0
    assert torch.cuda.memory_reserved(1) >= torch.cuda.memory_allocated(1)
    del block
    assert torch.cuda.memory_allocated(1) == 0
    assert torch.cuda.max_memory_allocated(1) >= 300 << 20
    assert torch.cuda.max_memory_reserved(1) >= 300 << 20
    stats = torch.cuda.memory_stats(1)
    assert stats["allocated_bytes.all.peak"] == torch.cuda.max_memory_allocated(1)
    assert "reserved_bytes.all.current" in stats and "num_ooms" in stats
    summary = torch.cuda.memory_summary(1)
    assert "Allocated memory" in summary and "Tesla V100" in summary
    torch.cuda.reset_peak_memory_stats(1)
    assert torch.cuda.max_memory_allocated(1) == 0
    free, total = torch.cuda.mem_get_info(1)
    assert total == rt4.gpus[1].memory_bytes
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(1) == 0
    torch.cuda.reset_max_memory_allocated()
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError


def test_emulated_tensors_are_counted_and_oom_is_torchs(rt4) -> None:
    x = torch.empty(256, 1024, 1024, device="cuda:2")  # 1 GiB
    assert torch.cuda.memory_allocated(2) >= 1 << 30
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(40 << 30, dtype=torch.uint8, device="cuda:2")
    del x
    assert torch.cuda.memory_allocated(2) == 0
    assert torch.cuda.memory_stats(2)["num_ooms"] >= 1


# ------------------------------------------------------------------ seeding
def test_lazy_calls_run_at_initialisation(rt4) -> None:
    ran: list[str] = []
    torch.cuda._lazy_call(lambda: ran.append("queued"))
    torch.cuda._lazy_call(lambda: ran.append("seed"), seed=True)  # seeding is emulated directly
    assert ran == []
    torch.cuda.current_device()  # first CUDA use initialises
    assert ran == ["queued"]
    torch.cuda._lazy_call(lambda: ran.append("now"))
    assert ran == ["queued", "now"]


def test_seeding_after_initialisation_does_not_crash(rt4) -> None:
    torch.cuda.init()
    assert torch.cuda.is_initialized()
    torch.manual_seed(1234)  # real torch crashes here once is_initialized() says True
    assert torch.cuda.initial_seed() == 1234
    torch.cuda.manual_seed(7)
    assert torch.cuda.initial_seed() == 7
    torch.cuda.set_device(1)
    assert torch.cuda.initial_seed() == 1234  # manual_seed only touched device 0
    state = torch.cuda.get_rng_state()
    torch.cuda.seed()
    assert torch.cuda.initial_seed() != 1234
    torch.cuda.set_rng_state(state)
    assert torch.cuda.initial_seed() == 1234
    states = torch.cuda.get_rng_state_all()
    assert len(states) == 4 and all(s.dtype == torch.uint8 for s in states)
    torch.cuda.set_rng_state_all(states)
    with pytest.raises(ValueError, match="16 bytes"):
        torch.cuda.set_rng_state(torch.zeros(3))
    with torch.random.fork_rng(devices=[0, 1]):
        torch.cuda.manual_seed_all(99)
    assert torch.cuda.initial_seed() == 1234  # fork_rng restored the emulated state


# ------------------------------------------------------------------ backends
def test_backends_flags(rt4) -> None:
    assert torch.backends.cudnn.is_available() is True
    assert isinstance(torch.backends.cudnn.version(), int) and torch.backends.cudnn.version() >= 8000
    assert torch.backends.cuda.is_built() is True
    old = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = False
        assert torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
        assert torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = old[0], old[1]
        torch.backends.cuda.matmul.allow_tf32 = old[2]
        torch.backends.cudnn.allow_tf32 = True


def test_sync_debug_mode(rt4) -> None:
    assert torch.cuda.get_sync_debug_mode() == 0
    torch.cuda.set_sync_debug_mode("warn")
    assert torch.cuda.get_sync_debug_mode() == 1
    with pytest.raises(RuntimeError, match="expected one of"):
        torch.cuda.set_sync_debug_mode("loud")


def test_nvtx_ranges(rt4) -> None:
    assert torch.cuda.nvtx.range_push("forward") == 0
    assert torch.cuda.nvtx.range_push("inner") == 1
    assert torch.cuda.nvtx.range_pop() == 1
    assert torch.cuda.nvtx.range_pop() == 0
    with torch.cuda.nvtx.range("block"):
        pass


# ------------------------------------------------------------------ GradScaler / optimizers
def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=2),
        lambda: torch.cuda.amp.GradScaler(init_scale=1024.0, growth_interval=2),
    ],
)
def test_grad_scaler_stays_enabled_and_grows_on_schedule(rt4, make) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns() if False else _no_disable_warning():
        scaler = make()
    assert scaler.is_enabled()
    scales = []
    for _ in range(4):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(8, 32, device="cuda")).float().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [1024.0, 2048.0, 2048.0, 4096.0]
    state = scaler.state_dict()
    assert state["scale"] == 4096.0 and state["_growth_tracker"] == 0
    fresh = torch.amp.GradScaler("cuda")
    fresh.load_state_dict(state)
    assert fresh.get_scale() == 4096.0
    scaler.update(new_scale=10.0)
    assert scaler.get_scale() == 10.0
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()


def test_grad_scaler_unscales_in_one_memory_bound_kernel_and_leaves_cpu_scalers_to_torch(rt4) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    scaler.scale(model(torch.randn(8, 32, device="cuda")).float().mean()).backward()
    scaler.unscale_(opt)
    spans = [s for s in rt4.recorder.spans if s.name == "amp unscale"]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(spans) == 1  # read and write every gradient once, at the GPU's memory bandwidth
    assert spans[0].end - spans[0].start == pytest.approx(2 * grad_bytes / rt4.gpus[0].memory_bandwidth)
    # A CPU scaler in the same run is torch's own: its scale is a real tensor that grows.
    cpu = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1)
    w = torch.nn.Parameter(torch.ones(3))
    cpu_opt = torch.optim.SGD([w], lr=0.1)
    cpu.scale((w * 2).sum()).backward()
    cpu.step(cpu_opt)
    cpu.update()
    assert cpu.get_scale() == 8.0 and "_gpemu_mirror" not in cpu.__dict__
    assert w.grad is not None and torch.equal(w.grad, torch.full((3,), 2.0))  # torch unscaled it in place
    assert torch.allclose(w.detach(), torch.full((3,), 0.8))


class _no_disable_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.records = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [r for r in self.records if "disabl" in str(r.message)], [str(r.message) for r in self.records]
        return False


def test_adam_and_adamw_take_the_accelerator_path(rt4) -> None:
    model = _model()
    for opt in (torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.AdamW(model.parameters(), lr=1e-3)):
        loss = model(torch.randn(8, 32, device="cuda")).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_recurrent_layers_run_without_cudnn_warnings():
    import warnings

    import torch

    import gpemu

    gpemu.patch(gpu="V100", summary=False)
    lstm = torch.nn.LSTM(10, 20).cuda()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = lstm(torch.randn(5, 3, 10).cuda())
        out.sum().backward()
    assert out.shape == (5, 3, 20) and out.is_cuda
    assert not [w for w in caught if "cuDNN" in str(w.message)]
