"""Value mode's host kernels: the real values of CUDA-only ops that have no CPU kernel.

With real values (:mod:`gpemu.device.values`) each op's values are computed by running the op
on the host values; a few ops exist only for CUDA: the fused attention kernels (FlashAttention,
memory-efficient, cuDNN) and their backwards, which the emulator dispatches where a GPU would
(under autocast, over DTensors). Each is computed here as the same attention in float32 (scores,
causal mask or bias, softmax, dropout, values), its backward by recomputing it and applying the
attention's gradient formulas.

Dropout: the forward draws a seed from the emulated device's generator and keeps it in its
``philox_offset`` output, as the CUDA kernel keeps its Philox state there for the backward, which
draws the same mask from it.

Each host kernel takes the op's arguments with emulated tensors replaced by their values and the
op's flattened outputs, and returns one value (or None: unknown) per output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .values import ValueMode

__all__ = ["HOST_KERNELS", "HostKernel"]

aten = torch.ops.aten
# (values, host arguments, host keyword arguments, the op's flattened outputs, device) -> a value per output
HostKernel = Callable[[ValueMode, list, dict, list, int], list]


class _Attention:
    """One attention computed in float32 over (..., L, D) inputs, kept for its backward: the
    softmax weights (before and after dropout) and the inputs, K/V heads repeated for
    grouped-query attention."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any, dropout: float, causal: bool, scale: Any
    ) -> None:
        self.group = q.shape[-3] // k.shape[-3] if k.dim() == 4 and k.shape[-3] != q.shape[-3] else 1
        self.q, self.k, self.v = q.float(), self._heads(k.float()), self._heads(v.float())
        self.scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        scores = (self.q @ self.k.transpose(-2, -1)) * self.scale
        if causal:
            length, source = scores.shape[-2], scores.shape[-1]
            keep = torch.ones(length, source, dtype=torch.bool).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if isinstance(bias, torch.Tensor):
            scores = scores.masked_fill(~bias, float("-inf")) if bias.dtype == torch.bool else scores + bias.float()
        self.lse = torch.logsumexp(scores, dim=-1)
        self.weights = torch.softmax(scores, dim=-1)
        self.kept = self.weights  # after dropout
        self.dropout = dropout

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.group, dim=-3) if self.group > 1 else t

    def _grouped(self, t: torch.Tensor) -> torch.Tensor:
        if self.group == 1:
            return t
        *batch, heads, length, dim = t.shape
        return t.reshape(*batch, heads // self.group, self.group, length, dim).sum(-3)

    def output(self, seed: int) -> torch.Tensor:
        if self.dropout > 0:
            with ValueMode.seeded(seed):
                self.kept = torch.nn.functional.dropout(self.weights, self.dropout)
        return self.kept @ self.v

    def gradients(self, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dQ, dK, dV) for the output's gradient (after :meth:`output`)."""
        g = grad_out.float()
        grad_v = self.kept.transpose(-2, -1) @ g
        grad_kept = g @ self.v.transpose(-2, -1)
        if self.dropout > 0:  # (dropout kept weights w/(1-p) where it kept them, 0 elsewhere)
            grad_weights = torch.where(self.kept != 0, grad_kept / (1 - self.dropout), 0.0)
        else:
            grad_weights = grad_kept
        grad_scores = self.weights * (grad_weights - (grad_weights * self.weights).sum(-1, keepdim=True))
        grad_q = grad_scores @ self.k * self.scale
        grad_k = grad_scores.transpose(-2, -1) @ self.q * self.scale
        return grad_q, self._grouped(grad_k), self._grouped(grad_v)


def _seed_value(seed: int, like: Any) -> torch.Tensor | None:
    if not isinstance(like, torch.Tensor) or like.numel() != 1:
        return None
    return torch.tensor(seed, dtype=like.dtype).reshape(like.shape)


def _forward(positions: tuple[int, int, int], lse_of: Callable[[torch.Tensor, Any], torch.Tensor]) -> HostKernel:
    """A fused forward: ``positions`` are its arguments' indices of (attn_bias or -1, dropout_p,
    is_causal); outputs 0 (output), 1 (logsumexp, laid out by ``lse_of``) and the last
    ``philox_offset`` (the dropout seed) are computed."""
    bias_at, dropout_at, causal_at = positions

    def kernel(values: ValueMode, args: list, kwargs: dict, outs: list, dev: int) -> list:
        q, k, v = args[0], args[1], args[2]
        bias = args[bias_at] if 0 <= bias_at < len(args) else None
        dropout = float(args[dropout_at]) if dropout_at < len(args) else float(kwargs.get("dropout_p", 0.0))
        causal = bool(args[causal_at]) if causal_at < len(args) else bool(kwargs.get("is_causal", False))
        seed = values.draw(dev) if dropout > 0 else 0
        attention = _Attention(q, k, v, bias, dropout, causal, kwargs.get("scale"))
        result: list = [None] * len(outs)
        result[0] = attention.output(seed).to(q.dtype)
        result[1] = lse_of(attention.lse, outs[1])
        offset_at = _philox_offset_index(outs)
        if offset_at is not None:
            result[offset_at] = _seed_value(seed, outs[offset_at])
        for i, o in enumerate(outs):  # (the rest: RNG state, sequence offsets, debug mask: known)
            if result[i] is None and isinstance(o, torch.Tensor):
                result[i] = torch.zeros(o.shape, dtype=o.dtype)
        return result

    return kernel


def _philox_offset_index(outs: list) -> int | None:
    """The forward output that keeps the dropout seed: ``philox_offset``, the last 0-dim integer
    tensor output."""
    found = None
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor) and o.dim() == 0 and not o.dtype.is_floating_point:
            found = i
    return found


def _lse_padded(lse: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """logsumexp in the output's shape: (B, H, L), rows padded to 32 (memory-efficient kernel),
    or (B, H, L, 1) (cuDNN)."""
    if like.dim() == lse.dim() + 1:
        return lse.unsqueeze(-1).to(like.dtype)
    if like.shape[-1] == lse.shape[-1]:
        return lse.to(like.dtype)
    out = torch.zeros(like.shape, dtype=like.dtype)
    out[..., : lse.shape[-1]] = lse
    return out


def _backward(positions: tuple[int, int, int, int, int], grads: int) -> HostKernel:
    """A fused backward: ``positions`` are its arguments' indices of (attn_bias or -1,
    dropout_p, is_causal, philox_offset, first of q/k/v); its first three outputs are the inputs'
    gradients (``grads`` outputs in all, the rest unknown)."""
    bias_at, dropout_at, causal_at, offset_at, qkv_at = positions

    def kernel(values: ValueMode, args: list, kwargs: dict, outs: list, dev: int) -> list:
        grad_out = args[0]
        q, k, v = args[qkv_at], args[qkv_at + 1], args[qkv_at + 2]
        bias = args[bias_at] if bias_at >= 0 else None
        dropout = float(args[dropout_at])
        causal = bool(args[causal_at]) if causal_at < len(args) else bool(kwargs.get("is_causal", False))
        offset = args[offset_at]
        seed = int(offset.reshape(()).item()) if isinstance(offset, torch.Tensor) and offset.numel() == 1 else 0
        # (Inside dispatch autograd is off: the gradients are written out.)
        attention = _Attention(q, k, v, bias, dropout, causal, kwargs.get("scale"))
        attention.output(seed)
        found = attention.gradients(grad_out)
        result: list = [None] * grads
        for i, (g, x) in enumerate(zip(found, (q, k, v), strict=True)):
            result[i] = g.to(x.dtype)
        return result

    return kernel


HOST_KERNELS: dict[Any, HostKernel] = {
    aten._scaled_dot_product_flash_attention.default: _forward((-1, 3, 4), _lse_padded),
    aten._scaled_dot_product_efficient_attention.default: _forward((3, 5, 6), _lse_padded),
    aten._scaled_dot_product_cudnn_attention.default: _forward((3, 5, 6), _lse_padded),
    aten._scaled_dot_product_flash_attention_backward.default: _backward((-1, 10, 11, 13, 1), 3),
    aten._scaled_dot_product_efficient_attention_backward.default: _backward((4, 9, 11, 8, 1), 4),
    aten._scaled_dot_product_cudnn_attention_backward.default: _backward((8, 13, 14, 7, 1), 3),
}
