"""FLOP counts of the ops whose time is set by arithmetic (GEMMs, convolutions, attention).

One idea per function, as in ``torch.utils.flop_counter``; a multiply-add counts as 2 FLOPs.

Why not ``torch.utils.flop_counter.flop_registry`` for everything: its formula for
``aten.convolution_backward`` (torch 2.13/2.14) computes the weight gradient of a *grouped*
convolution as if it were ungrouped, so it counts ``groups`` times too many FLOPs (a depthwise
64-channel 3x3 conv reports a backward of 65x its forward instead of 2x). Here a convolution's
backward is one forward-sized convolution per requested gradient (input, weight), whatever the
grouping: that is the work cuDNN does.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

__all__ = [
    "gemm_flops",
    "bmm_flops",
    "conv_forward_flops",
    "conv_backward_flops",
    "attention_forward_flops",
    "attention_backward_flops",
    "flop_counter_mapping",
]


def gemm_flops(m: int, k: int, n: int) -> float:
    """(m x k) @ (k x n): 2 m k n FLOPs."""
    return 2.0 * m * k * n


def bmm_flops(a_shape: Sequence[int], b_shape: Sequence[int]) -> float:
    """Batched (b x m x k) @ (b x k x n); leading dimensions of ``a`` multiply."""
    *batch, m, k = a_shape
    n = b_shape[-1]
    return gemm_flops(m, k, n) * prod(batch)


def conv_forward_flops(
    x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], transposed: bool = False
) -> float:
    """One convolution: 2 x batch x (spatial points of the non-transposed output side) x weight
    elements. The weight already holds ``C_in / groups`` input channels per output channel, so
    this is right for grouped and depthwise convolutions too."""
    spatial = (x_shape if transposed else out_shape)[2:]
    return 2.0 * x_shape[0] * prod(spatial) * prod(w_shape)


def conv_backward_flops(
    grad_out_shape: Sequence[int],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    transposed: bool,
    output_mask: Sequence[bool],
) -> float:
    """``aten.convolution_backward``: grad_input and grad_weight each cost one forward-sized
    convolution (the bias gradient is a reduction, counted as memory traffic, not FLOPs)."""
    out_shape = x_shape if transposed else grad_out_shape
    in_shape = grad_out_shape if transposed else x_shape
    fwd = conv_forward_flops(in_shape, w_shape, out_shape, transposed)
    return fwd * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def _attention_dims(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> tuple[int, int, int, int, int]:
    # (batch x heads, query length, key length, query/key depth, value depth); heads of q win (GQA)
    *lead, s_q, d_q = q
    s_k, d_v = k[-2], v[-1]
    return prod(lead), s_q, s_k, d_q, d_v


def attention_forward_flops(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int]) -> float:
    """Scaled dot-product attention: Q K^T and P V (softmax and causal masking not counted)."""
    bh, s_q, s_k, d_q, d_v = _attention_dims(q_shape, k_shape, v_shape)
    return bh * (gemm_flops(s_q, d_q, s_k) + gemm_flops(s_q, s_k, d_v))


def attention_backward_flops(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int]) -> float:
    """Its backward: recompute the scores (Q K^T), then dP = dO V^T, dV = P^T dO, dQ = dS K and
    dK = dS^T Q — three GEMMs over the query/key depth and two over the value depth (flash and
    efficient kernels recompute the scores; the math path's stored P saves one, ignored here)."""
    bh, s_q, s_k, d_q, d_v = _attention_dims(q_shape, k_shape, v_shape)
    return bh * (3 * gemm_flops(s_q, d_q, s_k) + 2 * gemm_flops(s_q, s_k, d_v))


def shape(x: Any) -> tuple[int, ...]:
    """A tensor's shape as plain ints (meta / fake tensors included)."""
    return tuple(int(d) for d in x.shape)


def _counter_conv_backward(
    grad_out_shape: Sequence[int],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    _bias: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: Any,
    output_mask: Sequence[bool],
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    # torch's argument order for aten.convolution_backward's formula (shapes, not tensors)
    return int(conv_backward_flops(grad_out_shape, x_shape, w_shape, transposed, output_mask))


def flop_counter_mapping() -> dict[Any, Any]:
    """``custom_mapping`` for ``torch.utils.flop_counter.FlopCounterMode`` that counts a
    convolution's backward as :func:`conv_backward_flops` does (torch's own formula overcounts a
    grouped convolution's weight gradient by its group count, see the module docstring)."""
    import torch

    return {torch.ops.aten.convolution_backward: _counter_conv_backward}
