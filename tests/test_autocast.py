"""autocast('cuda') dtype behaviour on emulated tensors (CUDA's op lists)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_autocast_op_lists(rt):
    lin = nn.Linear(8, 4).cuda()
    conv = nn.Conv2d(3, 4, 3).cuda()
    x = torch.randn(16, 8, device="cuda")
    img = torch.randn(2, 3, 8, 8, device="cuda")
    with torch.autocast("cuda"):
        out = lin(x)
        assert out.dtype == torch.float16  # lower precision list
        assert conv(img).dtype == torch.float16
        assert (x @ x.T).dtype == torch.float16 and torch.mm(x, x.T).dtype == torch.float16
        assert torch.softmax(out, 1).dtype == torch.float32  # fp32 list
        assert (
            torch.nn.functional.cross_entropy(out, torch.zeros(16, dtype=torch.long, device="cuda")).dtype
            == torch.float32
        )
        assert torch.nn.functional.layer_norm(out, (4,)).dtype == torch.float32
        assert torch.cat([out, x[:, :4]]).dtype == torch.float32  # promote to widest
        assert (out + 1).dtype == torch.float16  # others: run in input dtype
        with torch.autocast("cuda", enabled=False):
            assert lin(x).dtype == torch.float32
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert lin(x).dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(torch.sigmoid(out.float()), torch.zeros(16, 4, device="cuda"))
    assert lin(x).dtype == torch.float32  # outside: back to normal


def test_autocast_training_grads_keep_parameter_dtype(rt):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(3):
        with torch.autocast("cuda"):
            out = model(torch.randn(4, 8, device="cuda"))
            loss = torch.nn.functional.cross_entropy(out, torch.zeros(4, dtype=torch.long, device="cuda"))
        assert out.dtype == torch.float16 and loss.dtype == torch.float32
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        for p in model.parameters():
            assert p.grad.dtype == torch.float32 and p.grad.shape == p.shape
    assert scaler.get_scale() == 65536.0  # known value: finite grads, no growth before 2000 steps


def test_parameter_casts_are_cached_within_a_region(rt):
    lin = nn.Linear(64, 64).cuda()
    mem = rt.memory[0]
    x = torch.randn(4, 64, device="cuda")
    with torch.autocast("cuda"):
        lin(x)
        after_first = mem.allocated
        torch.nn.functional.linear(x, lin.weight)  # weight's fp16 copy reused
        torch.nn.functional.linear(x, lin.weight)
        assert mem.allocated <= after_first + 2 * 512
