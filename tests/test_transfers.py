"""Host<->GPU copy time: who waits, how long, and model moves charged once (virtual clock)."""

from __future__ import annotations

import pytest
import torch

import gpemu
from examples import tvmodels
from gpemu.clock import VirtualClock
from gpemu.transfers import COPY_LATENCY_SECONDS, host_to_device_seconds

MB4 = 1000 * 1000  # fp32 elements: 4 MB


def _patch(**kw):
    clock = VirtualClock()
    rt = gpemu.patch(gpu="P100", clock=clock, **kw)
    return rt, clock


def _spans(rt, kind="transfer"):
    return [s for s in rt.recorder.spans if s.kind == kind]


def test_pageable_copy_blocks_host_for_bandwidth_time() -> None:
    rt, clock = _patch()
    spec = rt.gpus[0]
    x = torch.randn(MB4)
    t0 = clock.now()
    y = x.cuda()
    expected = COPY_LATENCY_SECONDS + 4e6 / spec.host_link_bandwidth_pageable
    assert y.device.type == "cuda"
    assert clock.now() - t0 == pytest.approx(expected, rel=1e-9)
    assert [w.reason for w in rt.recorder.waits] == ["pageable-copy"]
    c = rt.recorder.counters
    assert c["h2d_bytes"] == 4e6 and c["h2d_pageable_bytes"] == 4e6 and c["h2d_copies"] == 1


def test_pinned_non_blocking_copy_is_only_queued() -> None:
    rt, clock = _patch()
    spec = rt.gpus[0]
    x = torch.randn(MB4).pin_memory()
    t0 = clock.now()
    y = x.cuda(non_blocking=True)
    assert clock.now() == t0  # the host went on
    pinned = COPY_LATENCY_SECONDS + 4e6 / spec.host_link_bandwidth_pinned
    (span,) = _spans(rt)
    assert span.name == "h2d pinned" and span.end - span.start == pytest.approx(pinned)
    torch.cuda.synchronize()
    assert clock.now() == pytest.approx(t0 + pinned)
    assert rt.recorder.counters["h2d_pinned_bytes"] == 4e6
    # The same copy blocking (non_blocking=False) waits, but at pinned speed.
    t1 = clock.now()
    x.cuda()
    assert clock.now() - t1 == pytest.approx(pinned)
    assert y.shape == x.shape


def test_pinned_is_faster_than_pageable_by_the_bandwidth_ratio() -> None:
    rt, _ = _patch()
    spec = rt.gpus[0]
    x = torch.randn(64 * MB4 // 4)
    pinned, prov = host_to_device_seconds(rt, x, 0, pinned=True)
    pageable, _ = host_to_device_seconds(rt, x, 0, pinned=False)
    assert prov == "estimated"
    ratio = (pageable - COPY_LATENCY_SECONDS) / (pinned - COPY_LATENCY_SECONDS)
    assert ratio == pytest.approx(spec.host_link_bandwidth_pinned / spec.host_link_bandwidth_pageable)


def test_input_batch_of_identified_model_uses_profiled_transfer() -> None:
    rt, clock = _patch(model="alexnet")
    spec = rt.gpus[0]
    measured = rt.db.lookup("P100", "alexnet", 64, "h2d_transfer")
    batch = torch.randn(64, 3, 224, 224)
    pageable, prov = host_to_device_seconds(rt, batch, 0, pinned=False)
    assert (pageable, prov) == (measured.value, measured.provenance)
    pinned, _ = host_to_device_seconds(rt, batch, 0, pinned=True)
    assert pinned == pytest.approx(measured.value * spec.host_link_bandwidth_pageable / spec.host_link_bandwidth_pinned)
    # Cross-check against the artifact's copies inside real training loops with pinned loaders
    # (AlexNet, P100, batch 64: median 3.2 ms).
    in_loop = float(torch.tensor(rt.db.distribution("iter-alexnet-batch64-p100-transfer")).median())
    assert pinned == pytest.approx(in_loop, rel=0.10)
    # Batch sizes between profiled points interpolate; other shapes use bandwidth.
    _, prov = host_to_device_seconds(rt, torch.empty(0, 3, 224, 224), 0, pinned=False)
    assert prov == "estimated"
    t0 = clock.now()
    batch.cuda()
    assert clock.now() - t0 == pytest.approx(measured.value)


def test_a_datasheet_gpu_copies_as_its_reference_gpu_measured() -> None:
    """An H100 has no rows: its input batches and model move cost what they cost on its reference
    GPU, the A100 (what `gpemu show --gpu H100` prints), and a pinned copy uses the H100's link."""
    clock = VirtualClock()
    rt = gpemu.patch(gpu="H100", clock=clock, model="alexnet")
    spec = rt.gpus[0]
    assert not rt.db.has(spec.name, "alexnet", "h2d_transfer")
    measured = rt.db.lookup("A100", "alexnet", 64, "h2d_transfer")
    batch = torch.randn(64, 3, 224, 224)
    pageable, prov = host_to_device_seconds(rt, batch, 0, pinned=False)
    assert (pageable, prov) == (measured.value, f"{measured.provenance} on A100")
    pinned, _ = host_to_device_seconds(rt, batch, 0, pinned=True)
    assert pinned == pytest.approx(measured.value * spec.host_link_bandwidth_pageable / spec.host_link_bandwidth_pinned)
    t0 = clock.now()
    torch.nn.Linear(10, 10).cuda()
    assert clock.now() - t0 == pytest.approx(rt.db.lookup("A100", "alexnet", 1, "model_transfer").value)
    # other shapes than the dataset's inputs: bandwidth, as on any GPU
    assert host_to_device_seconds(rt, torch.empty(8, 1000), 0, pinned=False)[1] == "estimated"


def test_non_blocking_copy_is_ordered_on_its_stream_and_overlaps_on_another() -> None:
    rt, clock = _patch()
    engine = rt.engine
    x = torch.randn(MB4).pin_memory()
    compute_end = engine.stream(0).enqueue(0.050, "forward", "queued compute")
    x.cuda(non_blocking=True)
    same = _spans(rt)[-1]
    assert same.start == pytest.approx(compute_end)  # waits for the compute ahead of it
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.cuda(non_blocking=True)
    other = _spans(rt)[-1]
    assert other.stream != same.stream
    assert other.start == pytest.approx(clock.now()) and other.end < compute_end  # overlaps compute
    # A pageable copy first waits for everything queued on its stream (CUDA's stream sync).
    t0 = clock.now()
    torch.randn(MB4).cuda()
    assert clock.now() > t0 + 0.050


def test_model_move_is_charged_once_from_the_database() -> None:
    rt, clock = _patch(model="alexnet")
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
    t0 = clock.now()
    model.cuda()
    assert all(p.device.type == "cuda" for p in model.parameters())
    spans = _spans(rt)
    assert len(spans) == 1 and spans[0].name.startswith("model h2d")
    expected = rt.db.lookup("P100", "alexnet", 1, "model_transfer").value
    assert clock.now() - t0 == pytest.approx(expected)
    assert "h2d_copies" not in rt.recorder.counters  # no per-tensor charge inside the move
    model.cuda()  # already there: nothing moves, nothing charged
    assert len(_spans(rt)) == 1


def test_unknown_model_move_uses_bandwidth_and_back_to_host_once() -> None:
    rt, clock = _patch()
    spec = rt.gpus[0]
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10))
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    t0 = clock.now()
    model.to("cuda")
    expected = 4 * COPY_LATENCY_SECONDS + nbytes / spec.host_link_bandwidth_pageable
    assert clock.now() - t0 == pytest.approx(expected)
    assert rt.recorder.counters["model_transfer_bytes"] == nbytes
    t1 = clock.now()
    model.cpu()
    assert all(p.device.type == "cpu" for p in model.parameters())
    d2h = [s for s in _spans(rt) if s.name.startswith("model d2h")]
    assert len(d2h) == 1 and not [s for s in _spans(rt) if s.name == "d2h"]
    assert clock.now() - t1 == pytest.approx(expected)
    model.to("cuda")
    model.to("cpu")
    assert len([s for s in _spans(rt) if s.name.startswith("model d2h")]) == 2


def test_device_to_host_copy_waits_and_counts() -> None:
    rt, clock = _patch()
    spec = rt.gpus[0]
    y = torch.randn(MB4).pin_memory().cuda(non_blocking=True)
    t0 = clock.now()
    host = y.cpu()
    assert host.device.type == "cpu" and host.shape == (MB4,)
    pinned = COPY_LATENCY_SECONDS + 4e6 / spec.host_link_bandwidth_pinned
    d2h = COPY_LATENCY_SECONDS + 4e6 / spec.host_link_bandwidth_pageable
    # .cpu() waits for the queued h2d copy, then its own copy.
    assert clock.now() - t0 == pytest.approx(pinned + d2h)
    assert rt.recorder.counters["d2h_bytes"] == 4e6


def test_unpatch_restores_module_moves() -> None:
    originals = (torch.nn.Module.to, torch.nn.Module.cpu, torch.nn.Module.cuda)
    _patch()
    assert torch.nn.Module.cpu is not originals[1]
    gpemu.unpatch()
    assert (torch.nn.Module.to, torch.nn.Module.cpu, torch.nn.Module.cuda) == originals


def test_input_copy_cost_follows_the_model_moved_after_earlier_copies() -> None:
    # Copy costs are cached per input shape; moving a model decides which measured copy applies,
    # so a copy made before the move (bandwidth estimate) must not stick after it.
    rt, clock = _patch()
    batch = torch.randn(8, 3, 224, 224)
    before = clock.now()
    batch.cuda()
    estimated = clock.now() - before
    assert estimated == pytest.approx(host_to_device_seconds(rt, batch, 0, pinned=False)[0])
    tvmodels.MODELS["squeezenet1_1"]().cuda()  # identified by structure as the dataset model
    measured = rt.db.lookup("P100", "squeezenet1_1", 8, "h2d_transfer").value
    assert measured != pytest.approx(estimated)
    before = clock.now()
    batch.cuda()
    assert clock.now() - before == pytest.approx(measured)


def test_autograd_zeros_for_an_unused_function_output_move_without_a_copy() -> None:
    """Autograd makes the zero gradient of an unused custom Function output on the emulated
    tensor's C++ device (meta); a real GPU makes it on the device: `.to('cuda')` copies nothing."""
    rt, clock = _patch()
    seen = []

    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, ga, gb):
            seen.append(gb.device.type)
            gb = gb.to("cuda")
            return ga * 2 + gb * 3

    x = torch.randn(64, 64).cuda().requires_grad_()
    a, _b = Two.apply(x)
    before = dict(rt.recorder.counters)
    a.sum().backward()
    assert seen and x.grad is not None and x.grad.is_cuda
    after = rt.recorder.counters
    assert after.get("h2d_copies", 0) == before.get("h2d_copies", 0)  # no host->device copy
    assert not [w for w in rt.recorder.waits if w.reason == "pageable-copy"][1:]  # only x's own
