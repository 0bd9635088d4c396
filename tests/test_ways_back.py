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
        "item": lambda: s.item(),
        "bool": lambda: bool(s),
        "float": lambda: float(s),
        "int": lambda: int(s),
        "cpu": lambda: x.cpu(),
        "to-cpu": lambda: x.to("cpu"),
        "tolist": lambda: x.tolist(),
        "format": lambda: f"{s:.3f}",
        "repr": lambda: repr(x),
        "numpy-after-cpu": lambda: x.cpu().numpy(),
    }
    for name, way in ways.items():
        end = _busy(rt)
        way()
        assert rt.test_clock.now() >= end, name  # the host waited until the GPU work was done


def test_placeholder_values_have_right_shape_dtype_and_are_zero(rt):
    from gpemu.hostvalues import SHADOW_MAX_ELEMENTS

    w = torch.nn.Linear(5, 70).cuda().weight  # a model's parameter: no known values
    x = torch.randn(3, 5).cuda() @ w.T
    host = x.cpu()
    assert host.shape == (3, 70) and host.dtype == torch.float32 and host.device.type == "cpu"
    assert torch.count_nonzero(host) == 0
    big = torch.randn(SHADOW_MAX_ELEMENTS + 1).cuda()  # above the limit: unknown too
    assert torch.count_nonzero(big.cpu()) == 0
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


def test_values_a_program_decides_on_are_real(rt):
    """Host-made data up to gpemu.hostvalues.SHADOW_MAX_ELEMENTS keeps its values through ops and
    round trips; values made from scalars alone on the device are known too; so data-dependent
    Python takes the branch it takes on a GPU."""
    g = torch.Generator()
    g.manual_seed(7)
    state = g.get_state()  # 5,056 bytes: what accelerate broadcasts to keep samplers in step
    back = state.to("cuda").cpu()
    assert torch.equal(back, state)
    g.set_state(back)  # a real mt19937 state, not zeros

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, mask):
            if bool((x.new_ones(3) == 1).all()) and bool(mask.all()):  # HF-style mask check
                return self.lin(x)
            return x.detach()  # the wrong branch: no gradient

    model = Branchy().cuda()
    mask = torch.ones(2, 16, dtype=torch.long).cuda()  # a padding mask from the host
    out = model(torch.zeros(2, 4, device="cuda"), mask)
    assert out.requires_grad
    out.sum().backward()
    assert (torch.arange(6, device="cuda").reshape(2, 3).sum(0) == torch.tensor([3, 5, 7], device="cuda")).all().item()


def test_zeroed_gradients_become_unknown_when_backward_accumulates(rt):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.zeros(4, 8, device="cuda")
    for _ in range(6):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # zero_(): known zeros ...
        assert all(p.grad.sum().item() == 0 for p in model.parameters())
    model(x).sum().backward()  # ... accumulated into: unknown again (no host computation)
    from gpemu.device import host_shadow

    assert all(host_shadow(p.grad) is None for p in model.parameters())
    from gpemu.fastpaths import optimizer as ofp

    assert ofp.fast_path_info()["fast"] >= 3  # optimizer steps still skipped
