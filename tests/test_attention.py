"""scaled_dot_product_attention: the kernel a GPU of that generation runs, its memory and time."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpemu
from gpemu.attention import choose_kernel
from gpemu.clock import VirtualClock

ALL_ON = (True, True, True)


@pytest.mark.parametrize("capability, dtype, dims, mask, same, enabled, kernel", [
    ((8, 0), torch.float16, (64, 64), False, True, ALL_ON, "flash"),       # A100, fp16
    ((9, 0), torch.bfloat16, (128, 128), False, True, ALL_ON, "flash"),    # H100, bf16
    ((8, 0), torch.float32, (64, 64), False, True, ALL_ON, "efficient"),   # fp32: no flash
    ((8, 0), torch.float16, (64, 64), True, True, ALL_ON, "efficient"),    # an explicit mask
    ((7, 0), torch.float16, (64, 64), False, True, ALL_ON, "efficient"),   # V100: no flash
    ((7, 0), torch.bfloat16, (64, 64), False, True, ALL_ON, "math"),       # bf16 before Ampere
    ((3, 7), torch.float32, (64, 64), False, True, ALL_ON, "math"),        # K80
    ((8, 0), torch.float16, (64, 64), False, False, ALL_ON, "math"),       # unequal head counts
    ((8, 0), torch.float16, (64, 64), False, True, (False, True, True), "efficient"),
    ((8, 0), torch.float16, (64, 64), False, True, (False, False, True), "math"),
])
def test_kernel_choice_follows_torchs_cuda_dispatcher(capability, dtype, dims, mask, same, enabled, kernel):
    assert choose_kernel(capability, dtype, dims[0], dims[1], mask, same, enabled) == kernel


def _attention(gpu: str, dtype: torch.dtype, backend=None) -> tuple[int, float, float, tuple]:
    """(peak bytes above the inputs, forward seconds, backward seconds, gradient shapes) of one
    GPT-2-small-sized causal attention call (8 x 12 heads x 1024 tokens x 64)."""
    rt = gpemu.patch(gpu=gpu, summary=False, clock=VirtualClock())
    try:
        q, k, v = (torch.empty(8, 12, 1024, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = rt.engine.now()
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            from torch.nn.attention import sdpa_kernel

            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        t1 = rt.engine.now()
        peak = torch.cuda.max_memory_allocated() - base
        out.sum().backward()
        torch.cuda.synchronize()
        assert out.shape == (8, 12, 1024, 64) and out.dtype == dtype and out.is_cuda
        return peak, t1 - t0, rt.engine.now() - t1, tuple(t.grad.shape for t in (q, k, v))
    finally:
        gpemu.unpatch()


def test_a_flash_kernel_keeps_no_scores_and_the_math_path_does():
    flash_peak, fwd, bwd, grads = _attention("A100", torch.float16)
    out_bytes = 8 * 12 * 1024 * 64 * 2
    assert flash_peak <= out_bytes + 8 * 12 * 1024 * 4 + 2 * 512  # output + logsumexp
    assert grads == ((8, 12, 1024, 64),) * 3
    assert bwd > 1.5 * fwd > 0
    math_peak, *_ = _attention("K80", torch.float32)  # no fused kernel on a K80: the scores exist
    assert math_peak > 8 * 12 * 1024 * 1024 * 4
    from torch.nn.attention import SDPBackend

    forced, *_ = _attention("A100", torch.float16, backend=SDPBackend.MATH)  # sdpa_kernel is honoured
    assert forced > 8 * 12 * 1024 * 1024 * 2


def test_tensor_cores_make_half_precision_attention_faster():
    _, fwd16, bwd16, _ = _attention("A100", torch.float16)
    _, fwd32, bwd32, _ = _attention("A100", torch.float32)  # the memory-efficient kernel, no tensor cores
    assert fwd32 > 4 * fwd16 and bwd32 > 4 * bwd16


def test_requires_grad_true_on_a_computed_tensor_that_requires_grad():
    """HF's gradient checkpointing calls output.requires_grad_(True) on embedding outputs."""
    gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
    try:
        w = torch.nn.Linear(4, 4).cuda()
        y = w(torch.zeros(2, 4, device="cuda"))
        assert y.requires_grad_(True) is y and y.requires_grad
        with pytest.raises(RuntimeError, match="leaf"):
            y.requires_grad_(False)  # as torch: only leaves can stop requiring grad
    finally:
        gpemu.unpatch()
