"""The same work costs the same emulated GPU time however the emulator runs it: a model replayed
by the fast paths, run op by op (``--no-replay``) or with real values (``--values real``, which runs
every op) is charged the GPU time of its ops."""

from __future__ import annotations

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock


def _step_gpu_seconds(replay: bool, values: str = "placeholders") -> float:
    """GPU seconds charged by the last of a few AdamW steps of a small MLP (an unknown model:
    priced by the ops it runs)."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=replay, values=values)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        x, y = torch.randn(128, 64, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
        for _ in range(4):  # (recorded, then replayed)
            torch.cuda.synchronize()
            first = len(rt.recorder.spans)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            torch.cuda.synchronize()
        return sum(s.end - s.start for s in list(rt.recorder.spans)[first:])
    finally:
        gpemu.unpatch()


@pytest.mark.slow
def test_a_replayed_step_costs_the_gpu_time_of_its_ops():
    # The replay charges the model's forward and backward as the cost model's passes (the calibration
    # hosts' issue time included, with no modelled host); op by op the same passes are charged: before,
    # only their kernels (0.054 ms against 0.277 replayed, the replayed backward 12x its kernels).
    replayed, op_by_op = _step_gpu_seconds(True), _step_gpu_seconds(False)
    assert replayed == pytest.approx(op_by_op, rel=0.02)


@pytest.mark.slow
def test_a_step_with_real_values_costs_the_gpu_time_of_the_replayed_step():
    assert _step_gpu_seconds(False, values="real") == pytest.approx(_step_gpu_seconds(True), rel=0.02)
