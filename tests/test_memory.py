"""Memory accounting of emulated GPUs: storages, views, frees, rounding, peaks, OOM and recovery."""

from __future__ import annotations

import gc

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.memory import MemoryTracker, round_size
from gpemu.units import format_bytes

pytestmark = pytest.mark.gpus(2)  # (the rt fixture's run: tests/conftest.py)


def test_tracker_rounding_reserved_peak_and_stats():
    m = MemoryTracker(0, 64 * 2**20)
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024 and round_size(0) == 0
    a = m.allocate(100)
    b = m.allocate(3 * 2**20)
    assert m.allocated == 512 + 3 * 2**20
    assert m.reserved == 4 * 2**20  # 2 MiB segments
    del b
    assert m.allocated == 512 and m.reserved == 4 * 2**20  # the cache keeps the segment
    assert m.peak_allocated == 512 + 3 * 2**20
    m.reset_peak()
    assert m.peak_allocated == 512
    m.empty_cache()
    assert m.reserved == 2 * 2**20
    s = m.stats()
    assert s["allocated_bytes.all.current"] == 512 and s["allocation.all.current"] == 1
    assert s["reserved_bytes.all.peak"] == 4 * 2**20
    del a
    assert m.allocated == 0 and m.num_allocs == 0


def test_views_share_one_block_and_frees_happen_when_last_tensor_dies(rt):
    mem = rt.memory[0]
    base = mem.allocated
    x = torch.empty(1024, 1024, device="cuda")  # 4 MiB
    assert mem.allocated - base == 4 * 2**20
    views = [x[1:], x.view(-1), x.t(), x.detach(), x[::2, ::2]]
    assert mem.allocated - base == 4 * 2**20
    y = x + 1  # a new storage
    assert mem.allocated - base == 8 * 2**20
    del x
    assert mem.allocated - base == 8 * 2**20  # views keep the storage alive
    del views
    assert mem.allocated - base == 4 * 2**20
    x2 = y.add_(1)  # in place: same storage
    assert x2 is y and mem.allocated - base == 4 * 2**20
    del y, x2
    gc.collect()
    assert mem.allocated == base


def test_saved_activations_live_until_backward(rt):
    mem = rt.memory[0]
    w = torch.randn(256, 256, requires_grad=True, device="cuda")
    x = torch.randn(128, 256, device="cuda")
    base = mem.allocated
    h = torch.tanh(x @ w)  # tanh saves its output for backward
    loss = (h * h).sum()
    del h
    held = mem.allocated - base
    assert held >= 128 * 256 * 4  # activations kept by the graph
    loss.backward()
    del loss
    gc.collect()
    assert mem.allocated - base == 256 * 256 * 4  # only w.grad remains


def test_oom_raises_cuda_message_and_recovery_works(rt):
    mem = rt.memory[1]
    cap = mem.capacity
    keep = torch.empty(int(cap * 0.6) // 4, device="cuda:1")
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        torch.empty(int(cap * 0.5) // 4, device="cuda:1")
    msg = str(info.value)
    assert msg.startswith("CUDA out of memory. Tried to allocate ")
    assert "GPU 1 has a total capacity of" in msg and "is allocated by PyTorch" in msg
    assert format_bytes(cap) in msg
    assert mem.num_ooms == 1
    # Catch, free, retry smaller: works, memory really freed.
    del keep
    ok = torch.empty(int(cap * 0.5) // 4, device="cuda:1")
    assert ok.shape[0] == int(cap * 0.5) // 4


def test_training_oom_on_large_batch_then_smaller_batch_succeeds(rt):
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10)).cuda()
    mem = rt.memory[0]
    start = mem.allocated

    def step(batch):
        out = model(torch.empty(batch, 4096, device="cuda"))
        out.sum().backward()

    huge = mem.capacity // (4096 * 4)  # one activation alone fills the GPU
    with pytest.raises(torch.cuda.OutOfMemoryError):
        step(huge)
    gc.collect()
    assert mem.allocated == start  # nothing leaked from the failed attempt
    step(64)
    assert model[0].weight.grad.shape == (4096, 4096)


def test_memory_samples_are_recorded_at_module_boundaries(rt):
    model = torch.nn.Linear(64, 64).cuda()
    n = len(rt.recorder.memory)
    model(torch.empty(8, 64, device="cuda")).sum().backward()
    assert len(rt.recorder.memory) > n
    assert all(s.device == 0 for s in rt.recorder.memory[n:])


def test_memory_samples_show_a_peak_reached_between_samples(rt):
    # A transient allocation between two module calls (an optimizer's temporaries) is freed before
    # the next sample: the samples (trace, plot) must still reach the summary's peak.
    model = torch.nn.Linear(64, 64).cuda()
    model(torch.empty(8, 64, device="cuda"))
    n = len(rt.recorder.memory)
    temp = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del temp
    model(torch.empty(8, 64, device="cuda"))
    mem = rt.memory[0]
    shown = [s.allocated for s in rt.recorder.memory[n:] if s.device == 0]
    assert max(shown) == mem.peak_allocated >= 64 << 20
    assert shown[-1] < 64 << 20  # then the use at the sample (the transient is gone)
    # Shown once: a later sample with no new peak adds only the current use.
    k = len(rt.recorder.memory)
    model(torch.empty(8, 64, device="cuda"))
    assert max(s.allocated for s in rt.recorder.memory[k:]) < 64 << 20
    # After reset_peak_memory_stats, a smaller transient peak shows too.
    torch.cuda.reset_peak_memory_stats()
    temp = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    del temp
    k = len(rt.recorder.memory)
    model(torch.empty(8, 64, device="cuda"))
    assert max(s.allocated for s in rt.recorder.memory[k:]) >= 32 << 20


def test_capacity_comes_from_the_gpu_spec_and_fraction_limits_it(rt):
    mem = rt.memory[0]
    assert mem.capacity == mem.total == rt.gpus[0].memory_bytes
    mem.set_fraction(0.25)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="limited to"):
        torch.empty(int(mem.total * 0.3) // 4, device="cuda")
    with pytest.raises(ValueError, match="Allowed range"):
        mem.set_fraction(1.5)


def test_bad_capacity_is_rejected():
    with pytest.raises(ValueError, match="capacity must be positive"):
        MemoryTracker(0, 0)


def test_profiled_mode_uses_the_databases_peak_for_identified_models():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    tvmodels = pytest.importorskip("tvmodels")
    # a datasheet GPU (no rows of its own) takes its reference GPU's peak, as `gpemu show` says
    for gpu, measured_on in (("V100", "V100"), ("H100", "A100")):
        rt = gpemu.patch(gpu=gpu, summary=False, memory="profiled", clock=VirtualClock())
        try:
            model = tvmodels.resnet18().cuda()
            mem = rt.memory[0]
            x = torch.empty(8, 3, 224, 224, device="cuda")
            for _ in range(2):  # recorded, then replayed
                mem.reset_peak()
                model(x).sum().backward()
                db_peak = rt.db.lookup(measured_on, "resnet18", 8, "peak_memory").value
                assert mem.peak_allocated >= db_peak
                assert mem.peak_allocated < db_peak * 1.5
        finally:
            gpemu.unpatch()


def test_peak_scope_measures_the_inside_alone_and_keeps_the_outer_peak() -> None:
    m = MemoryTracker(0, 64 * 2**20)
    big = m.allocate(8 * 2**20)
    del big  # the tracker's peak is now 8 MiB, above anything below
    kept = m.allocate(2**20)
    with m.peak_scope() as scope:
        tmp = m.allocate(3 * 2**20)
        del tmp
    assert scope.peak == 4 * 2**20  # 1 MiB kept + 3 MiB for a moment, not the old 8 MiB
    assert m.peak_allocated == 8 * 2**20
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with m.peak_scope() as scope:
            m.allocate(2**20)
            m.allocate(128 * 2**20)
    assert scope.peak >= 2**20 and m.peak_allocated == 8 * 2**20
    del kept
