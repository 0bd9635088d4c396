"""CUDA graphs on emulated GPUs: torch's own torch.cuda.graph / make_graphed_callables over the
emulated CUDAGraph: capture records, replay charges the recorded work as one launch, sync points
fail inside a capture, and the graph's pool keeps its memory until the graph goes."""

from __future__ import annotations

import gc
from itertools import pairwise

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock

HOST_GAP = 200e-6  # the host's Python between two kernels of the eager step below


@pytest.fixture
def clock():
    return VirtualClock()


@pytest.fixture
def rt(clock):
    rt = gpemu.patch(gpu="A100", summary=False, clock=clock)
    yield rt
    gpemu.unpatch()


def _mlp(width: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(width, 4 * width, device="cuda"), torch.empty(4 * width, width, device="cuda")


def _step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, clock: VirtualClock) -> torch.Tensor:
    """Three kernels with host time between them (what a Python loop costs on a real host)."""
    h = x @ w1
    clock.advance(HOST_GAP)
    h = torch.relu(h)
    clock.advance(HOST_GAP)
    return h @ w2


def _busy(rt, since: int) -> float:
    return sum(s.end - s.start for s in rt.recorder.spans[since:])


def test_replays_charge_the_captured_kernels_back_to_back(rt, clock):
    w1, w2 = _mlp()
    x = torch.empty(32, 1024, device="cuda")  # kernels of tens of microseconds: launch-bound
    torch.cuda.synchronize()
    first = len(rt.recorder.spans)
    _step(x, w1, w2, clock)  # eager: each kernel waits for the host to issue it
    eager = rt.recorder.spans[first:]
    assert len(eager) == 3 and eager[1].start - eager[0].end > HOST_GAP / 2
    kernels = _busy(rt, first)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        seen = (torch.cuda.is_current_stream_capturing(), torch.cuda.current_stream().is_capturing())
        before = len(rt.recorder.spans)
        static_y = _step(x, w1, w2, clock)
        assert len(rt.recorder.spans) == before  # captured, not run
    assert seen == (True, True) and not torch.cuda.is_current_stream_capturing()
    assert g.captured_seconds == pytest.approx(kernels, rel=1e-9)

    torch.cuda.synchronize()
    t0, first = rt.engine.now(), len(rt.recorder.spans)
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    replayed = rt.recorder.spans[first:]
    assert len(replayed) == 30
    assert all(b.start == pytest.approx(a.end, abs=1e-12) for a, b in pairwise(replayed))  # no gaps
    assert rt.engine.now() - t0 == pytest.approx(10 * kernels, rel=1e-9)
    assert static_y.shape == (32, 1024)


def test_capture_is_refused_on_the_default_stream_and_for_a_second_capture(rt):
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="must be captured on a non-default stream"):
        g.capture_begin()
    x = torch.empty(8, device="cuda")
    with torch.cuda.graph(g):
        x.mul_(2)
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        torch.cuda.CUDAGraph().replay()
    with pytest.raises(RuntimeError, match="Unknown capture error mode"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="loose"):
            pass


@pytest.mark.parametrize("sync", ["item", "synchronize", "host copy", "event"])
def test_sync_points_inside_a_capture_fail_as_on_cuda(rt, sync):
    x = torch.empty(16, device="cuda")
    event = torch.cuda.Event()
    event.record()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="previous error during capture") as failure:
        with torch.cuda.graph(g):
            y = x * 2
            if sync == "item":
                y.sum().item()
            elif sync == "synchronize":
                torch.cuda.synchronize()
            elif sync == "host copy":
                torch.ones(4).cuda()
            else:
                event.synchronize()
    assert "operation not permitted when stream is capturing" in str(failure.value.__context__)
    # (torch's own graph() leaves its side stream current after a failed capture_end, as on CUDA)
    torch.cuda.set_stream(torch.cuda.default_stream())
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):  # the next capture works
        x.add_(1)


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_optimizers_see_the_capture(rt):
    """torch's own check: an optimizer without capturable=True refuses to be captured."""
    p = torch.nn.Parameter(torch.zeros(8, device="cuda"))
    p.grad = torch.zeros(8, device="cuda")
    opt = torch.optim.Adam([p], capturable=False)
    with pytest.raises(RuntimeError, match="capturable"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="relaxed"):
            opt.step()


def test_the_pool_keeps_the_captures_memory_until_the_graph_goes(rt):
    mib = 2**20
    w1, w2 = _mlp()
    x = torch.empty(256, 1024, device="cuda")  # h: 256 x 4096 x 4 = 4 MiB, y: 1 MiB
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.relu(x @ w1) @ w2
    # the static output is allocated; the intermediates' memory stays reserved in the pool
    assert torch.cuda.memory_allocated() - allocated == 1 * mib
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() >= 8 * mib
    for _ in range(5):  # replays allocate nothing: the same static output is overwritten
        g.replay()
    assert torch.cuda.memory_allocated() - allocated == 1 * mib
    # a second graph in the same pool reuses what the pool holds
    reserved = torch.cuda.memory_reserved()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=g.pool()):
        y2 = torch.relu(x @ w1) @ w2
    assert torch.cuda.memory_reserved() == reserved and y2.shape == y.shape
    del g, g2, y, y2
    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() - allocated < 2 * mib


def test_a_pool_out_of_memory_is_a_cuda_oom(rt):
    torch.cuda.set_per_process_memory_fraction(64 * 2**20 / torch.cuda.get_device_properties(0).total_memory)
    x = torch.empty(1024, 1024, device="cuda")  # 4 MiB
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        keep = [x * 2 for _ in range(8)]  # 32 MiB of static outputs, kept by the pool
    del keep
    gc.collect()
    torch.cuda.empty_cache()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(8 * 1024, 1024, device="cuda")  # 32 MiB more: the pool's 32 MiB are not free
    g.reset()
    torch.empty(8 * 1024, 1024, device="cuda")


def test_make_graphed_callables_trains_a_small_model(rt):
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = torch.cuda.make_graphed_callables(model, (torch.empty(32, 256, device="cuda"),))
    iterations = len(rt.recorder.iterations)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        model(torch.empty(32, 256, device="cuda")).sum().backward()
        opt.step()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    torch.cuda.synchronize()
    assert len(rt.recorder.iterations) - iterations == 4


def test_graphed_callables_replay_their_forward_and_backward_graphs():
    """With the module fast paths off, each step runs torch's Graphed autograd function: the
    input copy, the forward graph's replay, the backward graph's replay."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=False)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graphed = torch.cuda.make_graphed_callables(model, (torch.empty(32, 256, device="cuda"),))
    first = len(rt.recorder.spans)
    opt.zero_grad(set_to_none=True)
    graphed(torch.empty(32, 256, device="cuda")).sum().backward()
    opt.step()
    names = [s.name.split(".")[0] for s in rt.recorder.spans[first:]]
    assert names[:4] == ["copy_", "addmm", "relu", "addmm"]  # the static input, then the forward graph
    assert names.count("mm") == 3 and "threshold_backward" in names  # the backward graph
    assert names[-1] == "SGD"


def test_a_captured_training_step_is_an_iteration_at_each_replay(rt):
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.empty(16, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up, as torch's documentation does it
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        model(x).sum().backward()
        opt.step()
    before = len(rt.recorder.iterations)
    for _ in range(3):
        g.replay()
    assert len(rt.recorder.iterations) - before == 3
    assert {s.kind for s in rt.recorder.spans[-3:]} <= {"op", "backward", "optimizer"}


def test_unpatch_restores_torchs_graph_pieces():
    import torch.cuda.graphs as graphs

    originals = (torch.cuda.CUDAGraph, torch.cuda.graph_pool_handle, graphs.graph.default_capture_stream)
    had_host_empty_cache = hasattr(torch._C, "_host_emptyCache")
    gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        torch.empty(4, device="cuda").add_(1)
    handle = torch.cuda.graph_pool_handle()
    assert isinstance(handle, tuple) and len(handle) == 2
    gpemu.unpatch()
    assert (torch.cuda.CUDAGraph, torch.cuda.graph_pool_handle, graphs.graph.default_capture_stream) == originals
    assert hasattr(torch._C, "_host_emptyCache") == had_host_empty_cache
