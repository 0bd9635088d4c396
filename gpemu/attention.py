"""``scaled_dot_product_attention`` on emulated GPUs (component ``gpemu.attention``).

On a CUDA build, ``F.scaled_dot_product_attention`` picks a fused kernel: FlashAttention-2 where
the GPU and inputs allow it, else the memory-efficient kernel, else the math path (which
materialises the ``L x S`` scores). On the CPU build the emulated tensors would always take the
math path: ~10 ops, and memory for the full scores (+816 MiB for one GPT-2 call at 1024 tokens
where a flash kernel keeps ~24 MiB), i.e. spurious OOMs at long sequences. Here the kernel is
chosen as torch's CUDA dispatcher chooses it (``sdp_utils``, simplified), honouring
``torch.backends.cuda.{flash,mem_efficient,math}_sdp_enabled()`` and ``torch.nn.attention.sdpa_kernel``:

* **flash**: fp16/bf16, compute capability 8.0 or newer, head dim at most 256 and a multiple
  of 8, no explicit mask (``is_causal`` is fine), same head count for keys and queries;
* **memory-efficient**: fp32/fp16/bf16 (bf16 from 8.0), capability 5.0 or newer, head dim a
  multiple of 8 (4 in fp32), an explicit mask allowed;
* **math**: everything else — torch's own composite runs op by op, as on the GPU.

A fused kernel runs as one emulated op: its output (in the kernel's memory layout), the softmax
statistics it keeps for backward (``logsumexp``, fp32, ``B x H x L``), a backward that makes the
inputs' gradients with the kernel's workspace, and its GPU time (:func:`gpemu.costs.attention_price`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .costmodel.gpus import compute_capability
from .costs import attention_price
from .device import EmuTensor, TensorState

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "choose_kernel"]

_HALF = (torch.float16, torch.bfloat16)


def choose_kernel(
    capability: tuple[int, int],
    dtype: torch.dtype,
    head_dim: int,
    value_dim: int,
    has_mask: bool,
    same_heads: bool,
    enabled: tuple[bool, bool, bool],
) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the kernel torch's CUDA dispatcher would run.
    ``enabled``: whether flash, memory-efficient and math attention are enabled (torch's flags)."""
    flash_on, efficient_on, _ = enabled
    if not same_heads:
        return "math"  # grouped-query attention: the fused kernels want equal head counts here
    if (
        flash_on
        and dtype in _HALF
        and capability >= (8, 0)
        and head_dim == value_dim
        and head_dim <= 256
        and head_dim % 8 == 0
        and not has_mask
    ):
        return "flash"
    align = 4 if dtype == torch.float32 else 8
    if (
        efficient_on
        and dtype in (torch.float32, *_HALF)
        and capability >= (5, 0)
        and not (dtype == torch.bfloat16 and capability < (8, 0))
        and head_dim % align == 0
        and value_dim % align == 0
    ):
        return "efficient"
    return "math"


class _FusedAttention(torch.autograd.Function):
    """One fused attention kernel: outputs, kept statistics, gradients and time; no math."""

    @staticmethod
    def forward(
        ctx: Any,
        ts: TensorState,
        kernel: str,
        causal: bool,
        q: EmuTensor,
        k: EmuTensor,
        v: EmuTensor,
        mask: Any,
    ) -> EmuTensor:
        *batch, length, heads_dim = q.shape  # (B, H, L, D)
        source = k.shape[-2]
        value_dim = v.shape[-1]
        dev = q.emu_device
        mem = ts.memory[dev]
        bh = 1
        for n in batch:
            bh *= n
        rt = ts.rt
        price = attention_price(rt, dev, bh, length, source, heads_dim, value_dim, q.dtype, causal, False)
        ts.charge(price.gpu, dev, f"{kernel}_attention", price)
        # Output in the kernel's layout: (B, L, H, Dv) in memory, seen as (B, H, L, Dv).
        shape = (*batch, length, value_dim)
        stride: tuple[int, ...]
        if len(batch) == 2:
            b, h = batch
            stride = (length * h * value_dim, value_dim, h * value_dim, 1)
        else:
            stride = torch.empty(shape, device="meta").stride()
        nbytes = bh * length * value_dim * q.element_size()
        out = ts.wrap(shape, stride, 0, q.dtype, dev, mem.allocate(nbytes))
        rows = length if kernel == "flash" else (length + 31) // 32 * 32
        ctx.kept = mem.allocate(bh * rows * 4)  # logsumexp, fp32, kept for backward
        ctx.ts, ctx.kernel, ctx.causal, ctx.mask_grad = ts, kernel, causal, isinstance(mask, torch.Tensor)
        ctx.shapes = [(t.shape, t.dtype) for t in (q, k, v)]
        ctx.dims = (bh, length, source, heads_dim, value_dim, q.dtype, dev)
        ctx.mask_spec = (mask.shape, mask.dtype) if isinstance(mask, torch.Tensor) else None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        ts: TensorState = ctx.ts
        bh, length, source, head_dim, value_dim, dtype, dev = ctx.dims
        mem = ts.memory[dev]
        price = attention_price(ts.rt, dev, bh, length, source, head_dim, value_dim, dtype, ctx.causal, True)
        ts.charge(price.gpu, dev, f"{ctx.kernel}_attention_backward", price)
        # Workspace: an fp32 accumulator for dQ (and the softmax row sums), for the kernel's run.
        mem.touch(bh * length * head_dim * 4 + bh * length * 4)
        grads = [ts.new(shape, dt, dev) for shape, dt in ctx.shapes]
        ctx.kept = None
        mask_grad = None
        if ctx.mask_spec is not None and ctx.needs_input_grad[6]:
            mask_shape, mask_dtype = ctx.mask_spec
            mask_grad = ts.new(mask_shape, mask_dtype, dev)
        return None, None, None, grads[0], grads[1], grads[2], mask_grad


def _held(t: Any) -> EmuTensor | None:
    """The emulated tensor a tensor subclass that holds tensors (a DTensor) holds, else None."""
    if type(t) is EmuTensor:
        return t
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return _held(getattr(t, attrs[0])) if attrs else None
    return None


def _fused_op(
    capability: tuple[int, int],
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    dropout_p: float,
    causal: bool,
    scale: Any,
    orig: Callable,
) -> Any:
    """SDPA over tensor subclasses that hold emulated tensors (DTensor): the fused aten op a GPU
    picks, dispatched through the subclass (its sharding rules), so each shard runs that op on its
    emulated tensors. The CPU build's choice for meta-backed inputs is the math composite, which a
    DTensor cannot run (it builds a plain mask tensor)."""
    kernel = choose_kernel(
        capability,
        q.dtype,
        q.shape[-1],
        v.shape[-1],
        mask is not None,
        q.shape[1] == k.shape[1] == v.shape[1] and q.dtype == k.dtype == v.dtype,
        (
            torch.backends.cuda.flash_sdp_enabled(),
            torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled(),
        ),
    )
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, bool(causal), scale=scale)[0]
    if kernel == "efficient":
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, need_lse, dropout_p, bool(causal), scale=scale
        )[0]
    return orig(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale)


def _make_sdpa(rt: Runtime, orig: Callable) -> Callable:
    ts = rt.tensors
    capabilities = [compute_capability(spec) for spec in rt.gpus]

    @functools.wraps(orig)
    def scaled_dot_product_attention(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Any = None,
        enable_gqa: bool = False,
    ) -> Any:
        if (
            not (type(query) is EmuTensor and type(key) is EmuTensor and type(value) is EmuTensor)
            or query.dim() < 3
            or torch._C._len_torch_function_stack()
        ):
            inner = _held(query)
            if (
                inner is not None
                and query.dim() == 4
                and _held(key) is not None
                and _held(value) is not None
                and not enable_gqa
            ):
                return _fused_op(
                    capabilities[inner.emu_device], query, key, value, attn_mask, dropout_p, is_causal, scale, orig
                )
            return orig(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        q, k, v = query, key, value
        if torch.is_autocast_enabled("cuda"):  # what autocast would do to this op's inputs
            dtype = torch.get_autocast_dtype("cuda")
            # (emulated ops: their results are emulated)
            q, k, v = (
                cast(EmuTensor, t.to(dtype)) if t.is_floating_point() and t.dtype != dtype else t for t in (q, k, v)
            )
        same_heads = q.dim() != 4 or (q.shape[1] == k.shape[1] == v.shape[1])
        kernel = choose_kernel(
            capabilities[q.emu_device],
            q.dtype,
            q.shape[-1],
            v.shape[-1],
            attn_mask is not None,
            same_heads and q.dtype == k.dtype == v.dtype,
            (
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            ),
        )
        if kernel == "math":
            return orig(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        return _FusedAttention.apply(ts, kernel, bool(is_causal), q, k, v, attn_mask)

    scaled_dot_product_attention.__wrapped__ = orig
    return scaled_dot_product_attention


def install(rt: Runtime) -> None:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` (every reference under torch)."""
    F = torch.nn.functional
    orig = F.scaled_dot_product_attention
    rt.patcher.replace_everywhere_many([(orig, _make_sdpa(rt, orig))])
