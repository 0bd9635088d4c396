"""scaled_dot_product_attention: the kernel a GPU of that generation runs, its memory and time."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpemu
from gpemu.attention import choose_kernel
from gpemu.clock import VirtualClock

ALL_ON = (True, True, True)


@pytest.mark.parametrize(
    "capability, dtype, dims, mask, same, enabled, kernel",
    [
        ((8, 0), torch.float16, (64, 64), False, True, ALL_ON, "flash"),  # A100, fp16
        ((9, 0), torch.bfloat16, (128, 128), False, True, ALL_ON, "flash"),  # H100, bf16
        ((8, 0), torch.float32, (64, 64), False, True, ALL_ON, "efficient"),  # fp32: no flash
        ((8, 0), torch.float16, (64, 64), True, True, ALL_ON, "efficient"),  # an explicit mask
        ((7, 0), torch.float16, (64, 64), False, True, ALL_ON, "efficient"),  # V100: no flash
        ((7, 0), torch.bfloat16, (64, 64), False, True, ALL_ON, "math"),  # bf16 before Ampere
        ((3, 7), torch.float32, (64, 64), False, True, ALL_ON, "math"),  # K80
        ((8, 0), torch.float16, (64, 64), False, False, ALL_ON, "math"),  # unequal head counts
        ((8, 0), torch.float16, (64, 64), False, True, (False, True, True), "efficient"),
        ((8, 0), torch.float16, (64, 64), False, True, (False, False, True), "math"),
    ],
)
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_dtensor_inputs_run_the_fused_kernel_shard_by_shard(tmp_path):
    """Tensor parallelism: q/k/v are DTensors over emulated shards; SDPA dispatches the fused op a
    GPU picks through DTensor's sharding rules (the CPU build's math composite would mix a plain
    mask tensor with DTensors), and each shard's kernel is charged."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False) as rt:
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cuda", (1,))
            names = {}
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(2, 8, 512, 64, device="cuda", dtype=dtype, requires_grad=True)
                q = distribute_tensor(x, mesh, [Shard(1)])
                first = len(rt.recorder.spans)
                out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
                assert isinstance(out, DTensor) and out.shape == (2, 8, 512, 64) and out.device.type == "cuda"
                out.to_local().sum().backward()
                torch.cuda.synchronize()
                names[dtype] = {s.name.split(".")[0] for s in rt.recorder.spans[first:] if "attention" in s.name}
        finally:
            dist.destroy_process_group()
    assert names[torch.bfloat16] == {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
    }
    assert names[torch.float32] == {
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
    }
