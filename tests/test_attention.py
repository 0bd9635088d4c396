"""scaled_dot_product_attention: the kernel a GPU of that generation runs, its memory and time."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import gpemu
from gpemu.attention import AttentionCall, SdpBackends, choose_kernel
from gpemu.clock import VirtualClock

ALL_ON = SdpBackends()
FLASH_OFF = SdpBackends(flash=False)
ONLY_MATH = SdpBackends(flash=False, efficient=False, cudnn=False)
ONLY_CUDNN = SdpBackends(flash=False, efficient=False, math=False)
NEW_CUDNN = 91600  # newer than 9.15: torch puts cuDNN attention first on sm 9.0 / 10.x


def _call(dtype=torch.float16, dims=(64, 64), heads=(16, 16, 16), **facts) -> AttentionCall:
    facts = {"query_len": 1024, "key_len": 1024, **facts}
    return AttentionCall(dtype, dims[0], dims[1], *heads, **facts)


GQA = {"heads": (32, 8, 8), "gqa": True}


@pytest.mark.parametrize(
    "capability, call, enabled, cudnn, kernel",
    [
        ((8, 0), _call(), ALL_ON, 0, "flash"),  # A100, fp16
        ((9, 0), _call(torch.bfloat16, (128, 128)), ALL_ON, 0, "flash"),  # H100, bf16
        ((8, 0), _call(torch.float32), ALL_ON, 0, "efficient"),  # fp32: no flash
        ((8, 0), _call(has_mask=True), ALL_ON, 0, "efficient"),  # an explicit mask
        ((7, 0), _call(), ALL_ON, 0, "efficient"),  # V100: no flash
        ((7, 0), _call(torch.bfloat16), ALL_ON, 0, "math"),  # bf16 before Ampere
        ((3, 7), _call(torch.float32), ALL_ON, 0, "math"),  # K80
        ((8, 0), _call(heads=(16, 8, 8)), ALL_ON, 0, "math"),  # unequal head counts without enable_gqa
        ((8, 0), _call(), FLASH_OFF, 0, "efficient"),
        ((8, 0), _call(), ONLY_MATH, 0, "math"),
        ((8, 0), _call(causal=True, query_len=1, key_len=1024), ALL_ON, 0, "efficient"),  # flash: causal needs L == S
        ((8, 9), _call(dims=(200, 200), requires_grad=True), ALL_ON, 0, "efficient"),  # L4 training, head dim 200
        # grouped-query attention (Llama-3: 32 query heads, 8 key/value heads)
        ((8, 0), _call(torch.bfloat16, (128, 128), **GQA), ALL_ON, 0, "flash"),
        ((9, 0), _call(torch.bfloat16, (128, 128), **GQA), ALL_ON, 0, "flash"),
        ((9, 0), _call(torch.bfloat16, (128, 128), **GQA), ALL_ON, NEW_CUDNN, "cudnn"),
        ((8, 0), _call(torch.bfloat16, (128, 128), **GQA), ALL_ON, NEW_CUDNN, "flash"),  # cuDNN first only on 9.0/10.x
        ((8, 0), _call(torch.float32, (128, 128), **GQA), ALL_ON, 0, "efficient"),
        ((7, 0), _call(torch.float16, (128, 128), **GQA), ALL_ON, 0, "efficient"),
        ((8, 0), _call(heads=(32, 8, 4), gqa=True), ALL_ON, 0, "math"),  # flash/efficient want as many K as V heads
        ((8, 0), _call(heads=(32, 8, 4), gqa=True), ONLY_CUDNN, 0, "cudnn"),
        ((8, 0), _call(heads=(32, 6, 6), gqa=True), ONLY_MATH, 0, "math"),
    ],
)
def test_kernel_choice_follows_torchs_cuda_dispatcher(capability, call, enabled, cudnn, kernel):
    assert choose_kernel(capability, call, enabled, cudnn) == kernel


def test_no_enabled_kernel_is_torchs_error():
    with pytest.raises(RuntimeError, match="No available kernel"):
        choose_kernel((8, 0), _call(heads=(32, 6, 6), gqa=True), ONLY_CUDNN, 0)


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


@pytest.mark.parametrize("gpu", ["A100", "H100"])
def test_grouped_query_attention_runs_the_fused_kernel(gpu):
    """Llama-3's attention (32 query heads, 8 key/value heads, bf16) at 2 x 2048 tokens keeps what
    a fused kernel keeps (output and statistics), not the math path's repeated keys and scores."""
    with gpemu.emulate(gpu=gpu, summary=False, clock=VirtualClock()) as rt:
        q = torch.empty(2, 32, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(2, 8, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        first = len(rt.recorder.spans)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        peak = torch.cuda.max_memory_allocated() - base
        out.sum().backward()
        names = {s.name for s in rt.recorder.spans[first:] if "attention" in s.name}
        assert out.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert peak <= q.numel() * 2 + 2 * 32 * 2048 * 4 + 2 * 512  # output + logsumexp
    assert names == {"flash_attention", "flash_attention_backward"}


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
