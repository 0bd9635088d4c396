"""Evaluation as real CUDA torch runs it: a measured model's first no_grad / inference_mode call
at a new batch size, views in inference_mode of tensors made outside it, and the price of a
first call under autocast whatever its grad mode (issue 28)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpemu
from examples import tvmodels
from gpemu.clock import VirtualClock
from gpemu.costmodel import measured_loop


@pytest.fixture
def rt():
    r = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield r
    gpemu.unpatch()


def _spans(rt, kind: str) -> list:
    return [s for s in rt.recorder.spans if s.kind == kind]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_first_evaluation_call_of_a_measured_model_at_a_new_batch_size(rt, mode) -> None:
    """The measured backward is priced without the measured loop's loss, recorded on the meta
    device at each new batch size: that recording ran a backward under the caller's no_grad."""
    measured_loop.measured_loss_ops.cache_clear()
    model = tvmodels.resnet18().cuda().eval()
    with mode():
        out = model(torch.zeros(13, 3, 224, 224, device="cuda"))
    assert out.shape == (13, 1000)
    assert [s.name for s in _spans(rt, "forward")] == ["resnet18"]  # its measured forward


def test_views_in_inference_mode_of_tensors_made_outside_it(rt) -> None:
    x = torch.zeros(4, 8, device="cuda")
    w = nn.Parameter(torch.zeros(8, 8, device="cuda"))
    with torch.inference_mode():
        views = [x.view(32), x.t(), x[1], x.expand(2, 4, 8), x.detach(), w.t(), w.detach(), x.narrow(0, 1, 2)]
        composite = [x.T, x.flatten(), x.reshape(2, 16)]
        made_inside = torch.zeros(3, device="cuda")
        made_inside.view(3, 1)
    for v in views:
        assert not v.is_inference()  # a view of a normal tensor stays normal, as on CUDA
    x.add_(1)  # outside: the views share their base's version counter
    assert all(v._version == x._version for v in views if v.data_ptr() == x.data_ptr())
    assert all(not v.is_inference() for v in composite) and made_inside.is_inference()


@pytest.mark.slow
def test_autocast_price_does_not_depend_on_the_first_calls_mode() -> None:
    """Below autograd (inference_mode) composite ops reach the emulated dispatch whole (conv2d,
    batch_norm); a CUDA tensor runs them as their parts, and so are they priced."""
    prices = []
    for mode in ("grad", "no_grad", "inference_mode"):
        rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
        model = tvmodels.resnet18().cuda().eval()
        x = torch.zeros(16, 3, 224, 224, device="cuda")
        ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
        with ctx(), torch.autocast("cuda", dtype=torch.float16):
            model(x)
        (fwd,) = _spans(rt, "forward")
        prices.append(fwd.end - fwd.start)
        gpemu.unpatch()
    assert prices[1] == pytest.approx(prices[0], rel=1e-9) and prices[2] == pytest.approx(prices[0], rel=1e-9)
