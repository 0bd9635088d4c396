"""The emulated tensor: metadata, devices, ways in, op-metadata cache, autograd, optimizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpemu
from gpemu.device import EmuTensor, cache_info, device_index, to_emulated

pytestmark = pytest.mark.gpus(2)  # (the rt fixture's run: tests/conftest.py)


def test_cuda_tensor_reports_cuda_device_and_keeps_metadata(rt):
    host = torch.randn(8, 3, 5).permute(0, 2, 1)  # non-contiguous host tensor
    x = host.cuda()
    assert isinstance(x, EmuTensor)
    assert x.device == torch.device("cuda", 0)
    assert x.is_cuda and not x.is_meta and x.get_device() == 0
    assert x.shape == host.shape and x.dtype == host.dtype
    y = x.transpose(0, 2)[1:, :, ::2]
    ref = host.transpose(0, 2)[1:, :, ::2]
    assert y.shape == ref.shape
    z = (x.float() * 2).sum(dim=1, keepdim=True)
    assert z.shape == (8, 1, 3) and z.device.type == "cuda"


def test_ops_match_real_metadata(rt):
    a_host, b_host = torch.randn(4, 6), torch.randn(6, 7, dtype=torch.float64)
    a, b = a_host.cuda(), b_host.cuda()
    for f in (
        lambda p, q: p @ q.float(),
        lambda p, q: p.unsqueeze(-1) + q[:1, :6].T.unsqueeze(0).float(),
        lambda p, q: torch.cat([p, p], 1).view(2, -1),
        lambda p, q: p.to(torch.float16).mean(0),
    ):
        got, want = f(a, b), f(a_host, b_host)
        assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride()


def test_mixing_devices_raises_like_cuda_but_allows_cpu_scalars(rt):
    x = torch.ones(3, device="cuda:0")
    y = torch.ones(3, device="cuda:1")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*cuda:0.*cuda:1"):
        x + y
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(3)
    assert (x * torch.tensor(2.0)).device == torch.device("cuda", 0)  # 0-dim CPU scalar is fine


_WAYS_IN = [
    lambda t: t.cuda(),
    lambda t: t.cuda(1),
    lambda t: t.to("cuda"),
    lambda t: t.to("cuda:1"),
    lambda t: t.to(torch.device("cuda", 1)),
    lambda t: t.to(0),
    lambda t: t.to(1),
    lambda t: t.to("cuda", torch.float16),
    lambda t: t.to(device="cuda", dtype=torch.float64, non_blocking=True),
    lambda t: t.to(torch.empty(1, device="cuda:1", dtype=torch.int32)),
    lambda t: t.type("torch.cuda.HalfTensor"),
    lambda t: t.to("cuda", copy=True),
]


def test_ways_in_from_host(rt):
    # One runtime for all forms (patching is the slow part of a test).
    for i, call in enumerate(_WAYS_IN):
        x = call(torch.randn(2, 3))
        assert isinstance(x, EmuTensor) and x.device.type == "cuda", i


def test_to_device_index_and_dtype_details(rt):
    t = torch.randn(2, 3)
    assert t.to(1).device == torch.device("cuda", 1)
    assert t.to("cuda", torch.float16).dtype == torch.float16
    assert t.type("torch.cuda.HalfTensor").dtype == torch.float16
    x = t.cuda()
    assert x.to("cuda") is x and x.cuda() is x and x.to("cuda:0", copy=True) is not x
    assert x.to(1).device.index == 1 and x.to("cuda:1", torch.float16).dtype == torch.float16
    assert x.type() == "torch.cuda.FloatTensor"
    with pytest.raises(ValueError, match="valid CUDA types"):
        x.type("torch.cuda.NopeTensor")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        t.cuda(5)


_FACTORIES = [
    lambda: torch.empty(2, 3, device="cuda"),
    lambda: torch.zeros(2, 3, device="cuda:1"),
    lambda: torch.ones(4, device=torch.device("cuda")),
    lambda: torch.full((2,), 7.0, device="cuda"),
    lambda: torch.rand(3, device="cuda"),
    lambda: torch.randn(3, 3, device="cuda"),
    lambda: torch.randint(0, 10, (5,), device="cuda"),
    lambda: torch.arange(10, device="cuda"),
    lambda: torch.linspace(0, 1, 5, device="cuda"),
    lambda: torch.eye(3, device="cuda"),
    lambda: torch.tensor([1, 2, 3], device="cuda"),
    lambda: torch.as_tensor(np.ones(3), device="cuda"),
    lambda: torch.zeros_like(torch.ones(2), device="cuda"),
    lambda: torch.empty_strided((2, 2), (1, 2), device="cuda"),
    lambda: torch.from_numpy(np.zeros((2, 2), dtype=np.float32)).cuda(),
    lambda: torch.randperm(6, device="cuda"),
]


def test_factories_with_cuda_device(rt):
    for i, make in enumerate(_FACTORIES):
        x = make()
        assert isinstance(x, EmuTensor) and x.device.type == "cuda", i


def test_factory_values_known_for_small_host_data(rt):
    assert torch.arange(5, device="cuda").tolist() == [0, 1, 2, 3, 4]
    assert torch.full((), 65536.0, device="cuda").item() == 65536.0
    assert torch.tensor([1.5, 2.5], device="cuda").sum().item() == 4.0


def test_set_default_device_and_device_context(rt):
    torch.set_default_device("cuda")
    try:
        x = torch.zeros(3)
        lin = torch.nn.Linear(2, 2)
        assert isinstance(x, EmuTensor) and lin.weight.device.type == "cuda"
    finally:
        torch.set_default_device(None)
    assert torch.zeros(2).device.type == "cpu"
    with torch.device("cuda:1"):
        y = torch.ones(2)
    assert y.device == torch.device("cuda", 1)


def test_module_moves_parameters_and_keeps_parameter_type(rt):
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    m.cuda()
    for p in m.parameters():
        assert isinstance(p, EmuTensor) and isinstance(p, torch.nn.Parameter) and p.device.index == 0
    assert all(b.device.type == "cuda" for b in m.buffers())
    m.to(1)
    assert all(p.device.index == 1 for p in m.parameters())
    m.half()
    assert all(p.dtype == torch.float16 and p.device.index == 1 for p in m.parameters())
    m.to("cpu")
    assert all(p.device.type == "cpu" for p in m.parameters())


def test_moving_a_module_counts_its_memory_once(rt):
    mem0 = rt.memory[0]
    before = mem0.allocated
    m = torch.nn.Linear(256, 256).cuda()
    expected = 256 * 256 * 4 + 256 * 4
    assert mem0.allocated - before == expected  # both sizes are multiples of 512
    m.to(1)
    assert mem0.allocated == before and rt.memory[1].allocated >= expected


def test_training_step_autograd_and_optimizers(rt):
    m = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 2)).cuda()
    for opt_cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = opt_cls(m.parameters(), lr=0.1)
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(
                m(torch.randn(16, 10).cuda()), torch.zeros(16, dtype=torch.long).cuda()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        for p in m.parameters():
            assert p.grad is not None and p.grad.shape == p.shape and p.grad.device.type == "cuda"
            for v in opt.state[p].values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert v.device == p.device and v.shape == p.shape


def test_optimizers_take_the_foreach_path(rt):
    from torch.optim.optimizer import _default_to_fused_or_foreach

    p = torch.nn.Parameter(torch.zeros(3, device="cuda"))
    _, foreach = _default_to_fused_or_foreach([p], differentiable=False, use_fused=False)
    assert foreach


def test_grad_flows_back_to_host_tensor(rt):
    w = torch.randn(3, requires_grad=True)
    (w.cuda() * 2).sum().backward()
    assert w.grad is not None and w.grad.shape == (3,) and w.grad.device.type == "cpu"


def test_metadata_cache_hits_on_repeated_ops(rt):
    x = torch.randn(64, 64).cuda()
    x @ x
    n = cache_info()["entries"]
    for _ in range(20):
        torch.relu(x @ x + 1.0)
    grown = cache_info()["entries"] - n
    assert grown <= 3  # relu, add (float value not in key), matmul -> a few entries, not 20x


def test_float_arguments_that_decide_shapes_are_keyed_by_value(rt):
    a = torch.arange(0, 1, 0.25, device="cuda")
    b = torch.arange(0, 1, 0.5, device="cuda")
    assert a.shape == (4,) and b.shape == (2,)
    x = torch.ones(1, 1, 4, 4, device="cuda")
    assert torch.nn.functional.interpolate(x, scale_factor=2.0).shape[-1] == 8
    assert torch.nn.functional.interpolate(x, scale_factor=0.5).shape[-1] == 2


def test_inplace_shape_change_is_refused_clearly(rt):
    x = torch.zeros(3, device="cuda")
    with pytest.raises(NotImplementedError, match="out-of-place"):
        x.unsqueeze_(0)


def test_device_index_parsing():
    assert device_index("cuda:3") == 3 and device_index(torch.device("cuda", 2)) == 2 and device_index(1) == 1
    assert device_index("cpu") is None and device_index(None) is None


def test_unpatch_restores_torch():
    before = (torch.Tensor.to, torch.Tensor.cuda, torch.zeros, torch.nn.Module.__call__, torch.nn.Module.to, torch.load)
    gpemu.patch(gpu="V100", summary=False)
    assert torch.zeros is not before[2]
    gpemu.unpatch()
    after = (torch.Tensor.to, torch.Tensor.cuda, torch.zeros, torch.nn.Module.__call__, torch.nn.Module.to, torch.load)
    assert after == before


def test_to_emulated_requires_runtime():
    with pytest.raises(RuntimeError, match="gpemu is not patched"):
        to_emulated(torch.zeros(2), 0)


def test_common_training_script_calls(rt):
    x = torch.randn(8, 100).cuda()
    y = torch.randint(0, 100, (8,), device="cuda")
    x.record_stream(object())  # accepted (no-op)
    assert x.new_tensor([1, 2]).device.type == "cuda" and x.new_zeros(3).device.type == "cuda"
    assert torch.ones(2).new_zeros(3, device="cuda").device.type == "cuda"
    assert x.argmax(1).eq(y).shape == (8,) and torch.topk(x, 5)[1].shape == (8, 5)
    assert torch.nn.Embedding(100, 16).cuda()(y).shape == (8, 16)
    assert x[torch.tensor([0, 2])].shape == (2, 100)  # CPU index tensor, as CUDA allows
    assert torch.randn(2, 3, 4, 4).cuda().to(memory_format=torch.channels_last).stride() == (48, 1, 12, 3)
    m = torch.nn.Linear(100, 10).cuda()
    m(x).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0).device.type == "cuda"
    import copy

    clone = copy.deepcopy(m)
    assert clone.weight.device.type == "cuda" and clone.weight is not m.weight
    assert isinstance(clone.weight, torch.nn.Parameter)
    with pytest.raises(RuntimeError, match="only dense CPU tensors can be pinned"):
        x.pin_memory()


def test_torch_compile_runs_its_ops_on_emulated_tensors(rt, capsys):
    m = torch.nn.Linear(4, 4).cuda()
    cm = torch.compile(m, mode="max-autotune")
    assert cm(torch.randn(2, 4, device="cuda")).shape == (2, 4)

    @torch.compile(fullgraph=True)
    def f(x):
        return x * 2

    assert f(torch.ones(3, device="cuda")).device.type == "cuda"
    assert "priced as Inductor's kernels" in capsys.readouterr().err


def test_parameters_keep_their_objects_across_moves(rt):
    """Real torch keeps a parameter's Python object on a CPU<->CUDA move, so an optimizer (or a
    GradScaler, a scheduler, an EMA helper) built before `.cuda()` keeps working."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built before the move
    scaler = torch.amp.GradScaler("cuda")
    model.cuda()
    assert all(a is b for a, b in zip(params, model.parameters(), strict=False))
    assert all(isinstance(p, EmuTensor) and isinstance(p, torch.nn.Parameter) and p.is_cuda for p in params)
    x, y = torch.randn(4, 8).cuda(), torch.zeros(4, dtype=torch.long).cuda()
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)  # raised "No inf checks were recorded" when the optimizer held CPU tensors
        scaler.update()
        opt.zero_grad()
    assert all(opt.state[p]["momentum_buffer"].is_cuda for p in params)
    assert sum(1 for s in rt.recorder.spans if s.kind == "optimizer") == 3
    model.cpu()
    assert all(a is b and not b.is_cuda for a, b in zip(params, model.parameters(), strict=False))
    with torch.device("meta"):
        lazy = torch.nn.Linear(3, 3)
    weight = lazy.weight
    lazy.to_empty(device="cuda")
    assert lazy.weight is weight and weight.is_cuda and weight.shape == (3, 3)
