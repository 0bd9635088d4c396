"""GPU-side preprocessing: sampled GPU time, memory plateau, CPU share, plug-in use."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.integrations.gpu_preprocessing import (
    DALI_MEMORY_CURVE,
    MEMORY_PROFILE,
    GpuPreprocess,
    MemoryCurve,
    burn_cpu,
    record_distribution,
)


def _patch(**kw):
    clock = VirtualClock()
    return gpemu.patch(gpu="V100", clock=clock, **kw), clock


@pytest.mark.parametrize("name", ["decode-dali", "norm-ffcv"])
def test_sampled_gpu_time_reproduces_the_stored_distribution(name: str) -> None:
    from scipy.stats import ks_2samp

    rt, clock = _patch()
    stored = rt.db.distribution(name)
    prep = GpuPreprocess(name, seed=1, memory=None)
    t0 = clock.now()
    for _ in prep.wrap(range(3000)):
        pass
    assert clock.now() == t0  # the host never waited: the work is queued on the stream
    spans = [s for s in rt.recorder.spans if s.kind == "preprocess"]
    assert len(spans) == 3000 and all(s.name == name for s in spans)
    durations = np.array([s.end - s.start for s in spans])
    # Spans are back to back on the stream (each starts when the previous ends).
    assert np.allclose([b.start for b in spans[1:]], [a.end for a in spans[:-1]])
    stat = ks_2samp(durations, stored).statistic
    assert stat < 0.05, stat
    for q in (10, 50, 90, 99):
        assert np.percentile(durations, q) == pytest.approx(np.percentile(stored, q), rel=0.1)
    assert rt.recorder.counters["preprocess_seconds"] == pytest.approx(durations.sum())
    torch.cuda.synchronize()
    assert clock.now() - t0 == pytest.approx(durations.sum())


def test_memory_grows_to_the_measured_plateau() -> None:
    rt, _ = _patch()
    curve = MemoryCurve.from_samples(rt.db.distribution(MEMORY_PROFILE), batch_size=64)
    assert [i for i, _ in curve.steps] == [i for i, _ in DALI_MEMORY_CURVE.steps]
    assert [f for _, f in curve.steps] == pytest.approx([f for _, f in DALI_MEMORY_CURVE.steps], abs=1e-4)
    assert curve.plateau_bytes == DALI_MEMORY_CURVE.plateau_bytes
    base = torch.cuda.memory_allocated()
    prep = GpuPreprocess("decode-dali", seed=0)
    held = []
    batch = torch.empty(64, 3, 8, 8)
    for _ in range(1200):
        prep(batch)
        held.append(torch.cuda.memory_allocated() - base)
    plateau = curve.plateau_bytes
    assert held[0] == pytest.approx(0.124 * plateau, rel=0.01)
    assert held[2] == pytest.approx(0.923 * plateau, rel=0.01)
    assert all(b >= a for a, b in zip(held, held[1:], strict=False))  # never shrinks
    assert held[1126] < plateau * 0.99 and held[1127] == pytest.approx(plateau, rel=0.001)
    assert held[-1] == held[1127]  # plateau
    assert prep.memory_bytes == pytest.approx(plateau, rel=0.001)
    prep.close()
    assert torch.cuda.memory_allocated() - base == 0


def test_memory_scales_with_batch_size_and_can_run_out() -> None:
    _patch()
    small = GpuPreprocess("norm-ffcv", seed=0)
    small(torch.empty(32, 3, 4, 4))
    assert small.memory_bytes == pytest.approx(0.124 * DALI_MEMORY_CURVE.plateau_bytes / 2, rel=0.01)
    huge = GpuPreprocess("decode-dali", memory=10**12)  # 1 TB plateau: more than a V100 has
    with pytest.raises(torch.cuda.OutOfMemoryError):
        for _ in range(3):
            huge(None)


def test_cpu_share_burns_real_cpu_and_shortens_gpu_part() -> None:
    rt, _ = _patch()
    samples = [0.04] * 10
    prep = GpuPreprocess(samples, cpu_share=0.5, cpu_threads=2, memory=None)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(5):
        prep(None)
    cpu_used, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert wall >= 5 * 0.02 * 0.99  # the host did the CPU part itself
    # Real CPU was burnt (a sleep would use ~0); generous: this machine's cores are shared.
    assert cpu_used >= 5 * 0.02 * 0.2
    spans = [s for s in rt.recorder.spans if s.kind == "preprocess"]
    assert [round(s.end - s.start, 9) for s in spans] == [0.02] * 5
    assert rt.recorder.counters["preprocess_cpu_seconds"] == pytest.approx(0.1)


def test_user_recorded_distribution_is_sampled() -> None:
    rt, _ = _patch()
    record_distribution("resize-mine", [0.001, 0.002, 0.003], description="my resize")
    prep = GpuPreprocess("resize-mine", memory=None, seed=3)
    for _ in range(60):
        prep(None)
    assert set(np.round(prep.sampled, 6)) == {0.001, 0.002, 0.003}


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="cpu_share"):
        GpuPreprocess(cpu_share=1.5)
    with pytest.raises(ValueError, match="cpu_threads"):
        GpuPreprocess(cpu_threads=0)
    with pytest.raises(ValueError, match="memory"):
        GpuPreprocess(memory="lots")
    with pytest.raises(RuntimeError, match="gpemu.patch"):
        GpuPreprocess()(None)
    _patch()
    with pytest.raises(ValueError, match="decode-dali"):  # unknown name lists the valid ones
        GpuPreprocess("decode-dally")(None)


@pytest.mark.parametrize("threads", [1, 2])
def test_burn_cpu_keeps_threads_busy(threads: int) -> None:
    wall0 = time.perf_counter()
    burn_cpu(0.05, threads=threads)
    assert time.perf_counter() - wall0 >= 0.05  # it returns at its wall-clock deadline, not before
    # Busy, not sleeping: the process accumulates CPU time whenever the scheduler lets it run.
    # On loaded, shared cores that may be a small share of the wall time, so keep burning until
    # 50 ms of CPU have been used (a sleeping implementation stays near zero for the whole 30 s).
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while time.process_time() - cpu0 < 0.05 and time.perf_counter() - wall0 < 30:
        burn_cpu(0.05, threads=threads)
    assert time.process_time() - cpu0 >= 0.05
