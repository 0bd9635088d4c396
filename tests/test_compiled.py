"""torch.compile on emulated GPUs: with CUDA graphs (mode="reduce-overhead"), a warm-up call per
input shape, then each call's kernels as one launch after its input copies; other backends eager.
(The fused kernels of Inductor's modes: tests/test_fusion.py.)"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock
from gpemu.compiled import uses_cuda_graphs

HOST_GAP = 200e-6


class _Layers(torch.nn.Module):
    """Four small layers with host time between them (Python on a real host)."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            self.clock.advance(HOST_GAP)
            x = torch.relu(layer(x))
        return x


@pytest.fixture
def clock():
    return VirtualClock()


@pytest.fixture
def rt(clock):
    rt = gpemu.patch(gpu="A100", summary=False, clock=clock, replay=False)
    yield rt
    gpemu.unpatch()


@pytest.mark.parametrize(
    "settings, graphs",
    [
        ({}, False),
        ({"mode": "reduce-overhead"}, True),
        ({"mode": "max-autotune"}, True),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
        ({"options": {"triton.cudagraphs": True}}, True),
        ({"backend": "cudagraphs"}, True),
        ({"backend": "eager", "mode": "reduce-overhead"}, False),
    ],
)
def test_which_settings_run_cuda_graphs(settings, graphs):
    assert uses_cuda_graphs(settings.get("backend"), settings.get("mode"), settings.get("options")) is graphs


def _calls(rt, fn, x, n):
    """The GPU spans of each of ``n`` calls of ``fn(x)``."""
    out = []
    for _ in range(n):
        first = len(rt.recorder.spans)
        fn(x)
        out.append(rt.recorder.spans[first:])
    return out


def test_reduce_overhead_warms_up_then_launches_each_call_as_one_graph(rt, clock):
    model = _Layers(clock).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    x = torch.empty(64, 512, device="cuda")
    warmup, replay, again = _calls(rt, compiled, x, 3)
    gaps = [b.start - a.end for a, b in pairwise(warmup)]
    assert max(gaps) > HOST_GAP / 2  # warm-up: the kernels wait for the host
    assert [s.name.split(".")[0] for s in replay] == ["copy_"] + ["addmm", "relu"] * 4  # input copy, then the graph
    assert all(b.start == pytest.approx(a.end, abs=1e-12) for a, b in pairwise(replay))
    assert [(s.name, s.end - s.start) for s in again] == [(s.name, s.end - s.start) for s in replay]
    # a new shape warms up again
    (new_shape,) = _calls(rt, compiled, torch.empty(32, 512, device="cuda"), 1)
    assert new_shape[0].name.split(".")[0] == "addmm"


def test_a_compiled_module_is_wrapped_as_torch_wraps_it(rt, clock, capsys):
    model = _Layers(clock).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    assert isinstance(compiled, torch.nn.Module) and compiled._orig_mod is model
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    assert compiled.layers is model.layers
    compiled.eval()
    assert not model.training
    x = torch.empty(8, 512, device="cuda", requires_grad=True)
    for _ in range(3):
        compiled(x).sum().backward()
    assert x.grad is not None and model.layers[0].weight.grad is not None
    assert "CUDA graph replays" in capsys.readouterr().err


def test_compiled_functions_and_module_compile(rt, clock):
    @torch.compile(mode="reduce-overhead")
    def double(x: torch.Tensor) -> torch.Tensor:
        clock.advance(HOST_GAP)
        y = x * 2
        clock.advance(HOST_GAP)
        return y + 1

    x = torch.empty(1024, device="cuda")
    _, replay = _calls(rt, double, x, 2)
    assert [s.name.split(".")[0] for s in replay] == ["copy_", "fused: mul+add"]  # Inductor's one kernel
    assert replay[-1].start == pytest.approx(replay[-2].end, abs=1e-12)

    model = _Layers(clock).cuda()
    model.compile(mode="reduce-overhead")
    _, replay = _calls(rt, model, torch.empty(4, 512, device="cuda"), 2)
    assert all(b.start == pytest.approx(a.end, abs=1e-12) for a, b in pairwise(replay))


def test_a_training_loop_that_marks_its_steps_runs(rt, clock):
    """torch.compiler.cudagraph_mark_step_begin() (called each step with reduce-overhead) imports
    CUDA-only parts of torch's C extension on the CPU build."""
    model = torch.compile(_Layers(clock).cuda(), mode="reduce-overhead")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        model(torch.empty(8, 512, device="cuda")).sum().backward()


def test_other_backends_give_the_model_itself_back(rt, clock, capsys):
    model = _Layers(clock).cuda()
    assert torch.compile(model, backend="eager", mode="reduce-overhead") is model
    assert torch.compile(model, disable=True) is model
    assert "the model runs eagerly" in capsys.readouterr().err
    compiled = torch.compile(model)  # inductor without CUDA graphs: fused kernels (tests/test_fusion.py)
    assert compiled._orig_mod is model and "Inductor's kernels" in capsys.readouterr().err
