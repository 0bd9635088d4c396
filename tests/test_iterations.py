"""The summary's iterations for any loop shape: optimizer steps after a backward pass however it
ran (mnist_forward_forward calls each layer's forward itself), else the sync points that follow
GPU work (evaluation and benchmark loops)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock
from gpemu.observe import marks_at_syncs, records_from_runtime
from gpemu.recorder import GpuSpan, SyncPoint


@pytest.fixture
def rt():
    r = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield r
    gpemu.unpatch()


def test_iterations_of_a_loop_without_optimizer_end_at_its_syncs(rt) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).cuda()
    x = torch.zeros(32, 64, device="cuda")
    with torch.no_grad():
        for _ in range(5):
            out = model(x)
            out.argmax(1).sum().item()  # the loop's sync point
            torch.cuda.synchronize()  # a second one, with no GPU work since: the same iteration
    records = records_from_runtime(rt)
    assert len(records.iterations) == 5
    assert not list(rt.recorder.iterations)  # (no optimizer marked any)


def test_marks_at_syncs_follow_work_since_the_previous_mark() -> None:
    spans = [GpuSpan(0, 0, "op", "mm", 0.0, 1.0, 0.0), GpuSpan(0, 0, "transfer", "h2d", 2.0, 3.0, 2.0)]
    spans.append(GpuSpan(0, 0, "forward", "m", 4.0, 5.0, 4.0))
    syncs = [SyncPoint(0, "item", t) for t in (1.5, 1.6, 3.5, 5.5)] + [SyncPoint(0, "calibration", 6.0)]
    assert [m.time for m in marks_at_syncs(spans, syncs, 0)] == [1.5, 5.5]
    assert marks_at_syncs(spans, syncs, 1) == []


def test_steps_of_a_loop_without_module_calls_are_iterations(rt) -> None:
    """mnist_forward_forward: each layer calls its own forward and has its own optimizer; the
    backward passes never go through a module's __call__."""

    class Layer(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(x @ self.weight.T + self.bias)

    layers = [Layer(64, 64).cuda() for _ in range(2)]
    x = torch.zeros(32, 64, device="cuda")
    for layer in layers:
        opt = torch.optim.Adam(layer.parameters())
        for _ in range(3):
            loss = layer.forward(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        x = layer.forward(x).detach()
    assert len(rt.recorder.iterations) == 6
