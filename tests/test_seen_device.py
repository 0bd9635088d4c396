"""The device torch sees where it decides by device: foreach groups (clip_grad_norm_'s
foreach=True, fused and foreach optimizers), fake tensor modes (DTensor's sharding propagation:
fake tensors, no memory) and explicit meta requests (meta tensors, no memory)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock


@pytest.fixture
def rt():
    r = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield r
    gpemu.unpatch()


def test_foreach_clipping_and_optimizers_see_the_emulated_devices() -> None:
    gpemu.patch(gpu="A100", num_gpus=2, summary=False, clock=VirtualClock())
    params = [nn.Parameter(torch.zeros(4, device=f"cuda:{d}")) for d in (0, 1, 0)]
    for p in params:
        p.sum().backward()
    norm = nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    assert norm.device == torch.device("cuda:0") and norm.item() == pytest.approx(12**0.5)
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    groups = _group_tensors_by_device_and_dtype([params, [p.grad for p in params]], with_indices=True)
    assert {k: v[1] for k, v in groups.items()} == {
        (torch.device("cuda:0"), torch.float32): [0, 2],
        (torch.device("cuda:1"), torch.float32): [1],
    }
    for opt in (torch.optim.AdamW(params, fused=True), torch.optim.Adam(params, foreach=True, amsgrad=True)):
        opt.step()
    assert all(p.device.type == "cuda" for p in params)


def test_foreach_norm_of_fsdp2_gradients_sees_the_emulated_device(tmp_path) -> None:
    """FSDP2's gradients are DTensors over emulated tensors: torch's C++ groups them on meta, a
    GPU on cuda. torchtitan clips them with get_total_norm(..., foreach=True)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    gpemu.patch(gpu="H100", summary=False, clock=VirtualClock())
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)).cuda()
        fully_shard(model)
        model(torch.randn(4, 16, device="cuda")).sum().backward()
        grads = [p.grad for p in model.parameters()]
        assert type(grads[0]).__name__ == "DTensor" and grads[0].device == torch.device("cuda:0")
        norm = nn.utils.get_total_norm(grads, 2.0, False, True)
        assert norm.device == torch.device("cuda:0")
        nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    finally:
        dist.destroy_process_group()


def test_factories_under_fake_tensor_mode_make_fake_tensors_and_take_no_memory(rt) -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    x = torch.zeros(256, 256, device="cuda")
    before = torch.cuda.memory_allocated()
    with FakeTensorMode(allow_non_fake_inputs=True):
        made = [
            torch.empty(1024, 1024, device="cuda"),
            torch.empty_strided((64, 64), (64, 1), dtype=torch.bfloat16, device="cuda"),  # DTensor's propagation
            torch.zeros(10, device="cuda:0"),
            torch.arange(10, device="cuda"),
            torch.tensor([1.0, 2.0], device="cuda"),
            torch.zeros(8).cuda(),
            torch.zeros(8).to("cuda"),
            torch.zeros_like(x),
            x.new_empty((1024,)),
            x @ x,
        ]
        with torch.device("cuda"):
            made.append(torch.ones(1024))
        # Fake tensors on cuda for C++ too: the methods that take a device guard (the CPU build
        # has none for CUDA) work as on a GPU: uniform_'s decomposition copies into its tensor.
        made.append(made[0].uniform_(-1, 1))
        made.append(nn.init.kaiming_uniform_(made[1]))
        made.append(made[2].new_tensor([1.0, 2.0]))
        made[2].copy_(made[3].float())
    for t in made:
        assert isinstance(t, FakeTensor) and t.device == torch.device("cuda:0"), t
    assert torch.cuda.memory_allocated() == before
    with FakeTensorMode(), pytest.raises(AssertionError, match="allow_non_fake_inputs"):
        x + 1  # as for a real GPU's tensor


def test_meta_requests_make_meta_tensors(rt) -> None:
    x = torch.zeros(256, 256, device="cuda", requires_grad=True)
    before = torch.cuda.memory_allocated()
    with torch.device("meta"):
        layer = nn.Linear(512, 512)
    made = [
        layer.weight,
        x.to("meta"),
        x.to(device="meta", dtype=torch.float16),
        torch.empty_like(x, device="meta"),
        x.new_empty((1024,), device="meta"),
        torch.empty(1024, device="meta"),
    ]
    for t in made:
        assert t.device.type == "meta" and type(t) in (torch.Tensor, nn.Parameter), t
    assert made[2].dtype == torch.float16
    assert torch.cuda.memory_allocated() == before
    (x * 2).sum().backward()  # torch's own "same device" (the wrapper's meta) stays emulated
    assert x.grad is not None and x.grad.device == torch.device("cuda:0")
