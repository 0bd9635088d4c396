"""Ways back to the host: each is a sync point and follows the placeholder policy."""

from __future__ import annotations

import pytest
import torch

import gpemu
from gpemu.clock import VirtualClock


@pytest.fixture
def rt():
    clock = VirtualClock()
    r = gpemu.patch(gpu="V100", summary=False, clock=clock)
    r.test_clock = clock
    yield r
    gpemu.unpatch()


def _busy(rt, seconds=0.5):
    engine = rt.engine
    return engine.stream(0).enqueue(seconds, "op", "test-kernel")


def test_every_way_back_waits_for_the_gpu(rt):
    x = torch.zeros(4, 4, device="cuda")
    s = x.sum()
    ways = {
        "item": lambda: s.item(), "bool": lambda: bool(s), "float": lambda: float(s), "int": lambda: int(s),
        "cpu": lambda: x.cpu(), "to-cpu": lambda: x.to("cpu"), "tolist": lambda: x.tolist(),
        "format": lambda: f"{s:.3f}", "repr": lambda: repr(x), "numpy-after-cpu": lambda: x.cpu().numpy(),
    }
    for name, way in ways.items():
        end = _busy(rt)
        way()
        assert rt.test_clock.now() >= end, name  # the host waited until the GPU work was done


def test_placeholder_values_have_right_shape_dtype_and_are_zero(rt):
    x = torch.randn(3, 5).cuda() @ torch.randn(5, 70).cuda()  # 210 elements: no known values
    host = x.cpu()
    assert host.shape == (3, 70) and host.dtype == torch.float32 and host.device.type == "cpu"
    assert torch.count_nonzero(host) == 0
    assert x.sum().item() == 0.0
    assert x.to("cpu", torch.float16).dtype == torch.float16
    assert torch.zeros(2, dtype=torch.bool, device="cuda").any().item() is False
    assert isinstance(torch.zeros(3, dtype=torch.long, device="cuda").sum().item(), int)
    assert x.tolist() == [[0.0] * 70] * 3
    assert f"{x.mean():.3f}" == "0.000"
    assert "device='cuda:0'" in repr(x)
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        x.numpy()


def test_known_small_values_propagate(rt):
    step = torch.tensor(3.0, device="cuda")
    step += 1
    assert step.item() == 4.0
    scale = torch.full((), 65536.0, device="cuda")
    assert (scale * 0.5).item() == 32768.0
    v = torch.tensor([1, 2, 3], device="cuda")
    assert (v * 2 + 1).tolist() == [3, 5, 7]
    assert v[1:].sum().item() == 5
    assert int(v.max()) == 3
    # An in-place update from unknown data makes the value unknown (zeros), not stale.
    big = torch.randn(100, device="cuda")
    acc = torch.tensor(1.0, device="cuda")
    acc += big.sum()
    assert acc.item() == 0.0


def test_data_dependent_shapes_assume_everything_selected(rt):
    x = torch.randn(10, 20, device="cuda")  # random: values unknown
    mask = x > 0
    assert x[mask].shape == (200,)
    assert x.nonzero().shape == (200, 2)
    assert torch.masked_select(x, mask).shape == (200,)
    assert torch.unique(x).shape == (200,)
    vals, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)
    assert inverse.shape == x.shape and counts.shape == (200,)
    x[mask] = 0.0  # boolean-mask assignment keeps the shape
    assert x.shape == (10, 20)


def test_data_dependent_shapes_use_known_values(rt):
    labels = torch.tensor([0, 1, 1, 3, 0], device="cuda")
    assert torch.unique(labels).tolist() == [0, 1, 3]
    assert (labels > 0).nonzero().shape == (3, 1)
    assert labels[labels == 1].shape == (2,)


def test_copy_into_host_tensor(rt):
    dst = torch.ones(3)
    dst.copy_(torch.tensor([5.0, 6.0, 7.0], device="cuda"))
    assert dst.tolist() == [5.0, 6.0, 7.0]
