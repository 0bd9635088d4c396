"""What kind of GPU work one aten op is, and the features its time depends on.

``classify(func, args, kwargs, out)`` takes an op as a ``TorchDispatchMode`` sees it (an
``OpOverload`` with meta / fake / real tensors) and returns :class:`OpFeatures`: the op class
(which efficiency curve prices it), FLOPs, bytes read + written, dtype, and the shape facts that
change a kernel's efficiency (convolution groups, kernel size, stride, the GEMM reduction depth).
Backward ops (``convolution_backward``, ``native_batch_norm_backward``, ``threshold_backward``,
``max_pool2d_with_indices_backward``, ...) are classified like their forward ops and marked
``backward``, because a backward pass is just a sequence of them.

Classification is by op name (the overload packet), not by module: the same names reach a
dispatch mode whichever module issued them. Unknown ops fall into ``ELEMENTWISE`` (a streaming
kernel priced by its bytes), the safest guess for the long tail of pointwise aten ops.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .flops import (
    attention_backward_flops,
    attention_forward_flops,
    bmm_flops,
    conv_backward_flops,
    conv_forward_flops,
    gemm_flops,
)
from .flops import shape as shape_of

__all__ = ["OpClass", "OpFeatures", "classify", "op_name", "COMPUTE_CLASSES", "MEMORY_CLASSES"]


class OpClass(str, enum.Enum):
    """Kinds of GPU work with one efficiency curve each."""

    GEMM = "gemm"  # mm / addmm / bmm / baddbmm / linear / matmul
    CONV = "conv"  # dense convolution (groups == 1)
    CONV_GROUPED = "conv_grouped"  # 1 < groups < channels (ResNeXt, ShuffleNet v1)
    CONV_DEPTHWISE = "conv_depthwise"  # one input channel per group (MobileNet, MNASNet)
    NORM = "norm"  # batch / layer / group / RMS norm, forward and backward
    ELEMENTWISE = "elementwise"  # activations, adds, dropout, fills: streaming kernels
    REDUCTION = "reduction"  # sum / mean / softmax / log_softmax / losses
    POOLING = "pooling"  # max / avg / adaptive pooling
    EMBEDDING = "embedding"  # embedding lookups and their scatter-add backward
    ATTENTION = "attention"  # fused scaled_dot_product_attention (flash / efficient / cudnn)
    COPY = "copy"  # data movement: cat, clone, copies, index / gather / scatter
    FREE = "free"  # views, metadata, allocation: no kernel

    def __str__(self) -> str:  # "conv", not "OpClass.CONV", in tables and JSON
        return self.value


# Classes priced against a compute peak (FLOP/s); the others against memory bandwidth.
# Depthwise convolutions are memory-bound (~2 FLOPs per byte for 3x3; every GPU's ridge point is
# above 5) and run in PyTorch's own CUDA kernel, never on tensor cores: pricing them by bytes
# carries over between GPUs and precisions, pricing them by FLOPs would not.
COMPUTE_CLASSES = frozenset({OpClass.GEMM, OpClass.CONV, OpClass.CONV_GROUPED, OpClass.ATTENTION})
MEMORY_CLASSES = frozenset(set(OpClass) - COMPUTE_CLASSES - {OpClass.FREE})


@dataclass(frozen=True, slots=True)
class OpFeatures:
    """One op as the cost model sees it.

    ``flops``: multiply-adds x 2 for GEMM / conv / attention, about one per output element for the
    rest (only informative there). ``nbytes``: bytes the kernel(s) read and write (each distinct
    tensor argument once, plus the outputs). ``groups``/``kernel``/``stride``/``reduction``
    describe convolutions and GEMMs (``reduction`` = K of the implicit GEMM: C_in/groups x kernel
    elements for a convolution); 1/1/1/0 elsewhere.
    """

    name: str
    op_class: OpClass
    backward: bool
    flops: float
    nbytes: float
    dtype: str = "float32"
    groups: int = 1
    kernel: int = 1
    stride: int = 1
    reduction: int = 0

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved (0 for an op that moves nothing)."""
        return self.flops / self.nbytes if self.nbytes else 0.0


# ------------------------------------------------------------------------------ name tables
# Ops that launch no kernel: views, metadata, allocation (an empty tensor is not written).
_FREE = frozenset(
    {
        "detach",
        "alias",
        "lift_fresh",
        "t",
        "transpose",
        "permute",
        "view",
        "_unsafe_view",
        "expand",
        "slice",
        "select",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "squeeze",
        "unsqueeze",
        "as_strided",
        "narrow",
        "_reshape_alias",
        "reshape",
        "diagonal",
        "unfold",
        "view_as_real",
        "view_as_complex",
        "real",
        "imag",
        "_neg_view",
        "_conj",
        "conj",
        "resolve_conj",
        "resolve_neg",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "empty_permuted",
        "size",
        "stride",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "numel",
        "dim",
        "is_same_size",
        "_local_scalar_dense",
        "set",
        "resize",
        "_resize_output",
        "record_stream",
        "_to_copy_meta",
        "_nested_tensor_size",
        "prim_layout",
        "_has_compatible_shallow_copy_type",
    }
)
_GEMM = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_scaled_mm",
        "_scaled_mm_v2",
        "_grouped_mm",
        "_scaled_grouped_mm",
        "_scaled_grouped_mm_v2",
        "_addmm_activation",
        "_int_mm",
        "addr",
        "outer",
        "einsum",
    }
)
_CONV = frozenset(
    {
        "convolution",
        "_convolution",
        "cudnn_convolution",
        "cudnn_convolution_transpose",
        "convolution_overrideable",
        "_slow_conv2d_forward",
        "mkldnn_convolution",
        "_conv_depthwise2d",
        "conv_depthwise3d",
        "slow_conv_dilated2d",
        "slow_conv_dilated3d",
        "slow_conv3d_forward",
        "slow_conv_transpose2d",
        "slow_conv_transpose3d",
        "_mps_convolution",
        "miopen_convolution",
        "miopen_depthwise_convolution",
        "convolution_backward",
        "convolution_backward_overrideable",
        "_slow_conv2d_backward",
        "cudnn_convolution_backward",
        "mkldnn_convolution_backward",
    }
)
_NORM = frozenset(
    {
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
        "cudnn_batch_norm",
        "miopen_batch_norm",
        "_batch_norm_with_update",
        "_batch_norm_with_update_functional",
        "_batch_norm_no_update",
        "batch_norm_stats",
        "batch_norm_elemt",
        "batch_norm_gather_stats",
        "batch_norm_gather_stats_with_counts",
        "batch_norm_update_stats",
        "batch_norm_backward_reduce",
        "batch_norm_backward_elemt",
        "native_layer_norm",
        "native_group_norm",
        "_fused_rms_norm",
        "native_batch_norm_backward",
        "cudnn_batch_norm_backward",
        "miopen_batch_norm_backward",
        "batch_norm_backward",
        "native_layer_norm_backward",
        "native_group_norm_backward",
        "_fused_rms_norm_backward",
        "instance_norm",
        "rms_norm",
    }
)
_POOL = frozenset(
    {
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool2d_with_indices",
        "max_pool3d_with_indices",
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "_adaptive_avg_pool2d",
        "_adaptive_avg_pool3d",
        "adaptive_avg_pool1d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "max_unpool2d",
        "max_unpool3d",
        "max_pool2d_with_indices_backward",
        "max_pool3d_with_indices_backward",
        "max_pool2d_backward",
        "avg_pool2d_backward",
        "avg_pool3d_backward",
        "_adaptive_avg_pool2d_backward",
        "_adaptive_avg_pool3d_backward",
        "adaptive_max_pool2d_backward",
        "adaptive_max_pool3d_backward",
        "fractional_max_pool2d_backward",
        "fractional_max_pool3d_backward",
    }
)
_REDUCTION = frozenset(
    {
        "sum",
        "mean",
        "amax",
        "amin",
        "max",
        "min",
        "aminmax",
        "prod",
        "var",
        "std",
        "var_mean",
        "std_mean",
        "norm",
        "linalg_vector_norm",
        "_softmax",
        "_log_softmax",
        "_safe_softmax",
        "softmax",
        "log_softmax",
        "_softmax_backward_data",
        "_log_softmax_backward_data",
        "logsumexp",
        "cumsum",
        "cumprod",
        "argmax",
        "argmin",
        "all",
        "any",
        "count_nonzero",
        "nll_loss_forward",
        "nll_loss_backward",
        "nll_loss2d_forward",
        "nll_loss2d_backward",
        "mse_loss",
        "mse_loss_backward",
        "l1_loss",
        "smooth_l1_loss",
        "smooth_l1_loss_backward",
        "binary_cross_entropy",
        "binary_cross_entropy_backward",
        "binary_cross_entropy_with_logits",
        "kl_div",
        "huber_loss",
        "huber_loss_backward",
        "topk",
        "sort",
        "median",
        "nanmedian",
        "mode",
        "kthvalue",
        "_cdist_forward",
        "cross_entropy_loss",
    }
)
_EMBEDDING = frozenset(
    {
        "embedding",
        "embedding_dense_backward",
        "embedding_backward",
        "_embedding_bag",
        "_embedding_bag_forward_only",
        "_embedding_bag_backward",
        "_embedding_bag_dense_backward",
        "embedding_bag",
        "embedding_renorm",
    }
)
_COPY = frozenset(
    {
        "copy",
        "_to_copy",
        "clone",
        "cat",
        "stack",
        "hstack",
        "vstack",
        "contiguous",
        "_copy_from",
        "_copy_from_and_resize",
        "lift_fresh_copy",
        "constant_pad_nd",
        "reflection_pad2d",
        "replication_pad2d",
        "repeat",
        "repeat_interleave",
        "tile",
        "index_select",
        "gather",
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index",
        "_unsafe_index",
        "index_put",
        "_index_put_impl",
        "index_add",
        "index_copy",
        "index_fill",
        "masked_select",
        "masked_scatter",
        "take",
        "put",
        "flip",
        "roll",
        "narrow_copy",
        "select_backward",
        "slice_backward",
        "as_strided_scatter",
        "slice_scatter",
        "select_scatter",
        "diagonal_scatter",
        "expand_copy",
        "permute_copy",
        "transpose_copy",
        "view_copy",
        "_unsafe_view_copy",
        "t_copy",
        "unsqueeze_copy",
        "im2col",
        "col2im",
        "pixel_shuffle",
        "pixel_unshuffle",
        "channel_shuffle",
        "native_channel_shuffle",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact2d",
        "upsample_nearest2d_backward",
        "upsample_bilinear2d",
        "upsample_bilinear2d_backward",
        "_upsample_bilinear2d_aa",
        "grid_sampler_2d",
        "grid_sampler_2d_backward",
        "tril",
        "triu",
        "nonzero",
        "unique",
        "_unique2",
        "where_copy",
    }
)
_ATTENTION_MARKS = (
    "scaled_dot_product",
    "flash_attention",
    "efficient_attention",
    "cudnn_attention",
    "flex_attention",
    "_varlen_attn",
)


def op_name(func: Any) -> str:
    """The overload packet's name without a trailing in-place underscore ('relu_' -> 'relu')."""
    packet = getattr(func, "overloadpacket", func)
    name = getattr(packet, "__name__", None) or str(func).split(".")[-2 if "." in str(func) else -1]
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


def _class_of(name: str, func: Any) -> OpClass:
    if getattr(func, "is_view", False) or name in _FREE:
        return OpClass.FREE
    if any(mark in name for mark in _ATTENTION_MARKS):
        return OpClass.ATTENTION
    if name in _GEMM:
        return OpClass.GEMM
    if name in _CONV:
        return OpClass.CONV
    if name in _NORM:
        return OpClass.NORM
    if name in _POOL:
        return OpClass.POOLING
    if name in _REDUCTION:
        return OpClass.REDUCTION
    if name in _EMBEDDING:
        return OpClass.EMBEDDING
    if name in _COPY:
        return OpClass.COPY
    return OpClass.ELEMENTWISE


# ------------------------------------------------------------------------------ tensor walks
def _tensors(x: Any) -> Iterable[Any]:
    """Tensor-like leaves of nested args (anything with shape, dtype and element_size)."""
    if hasattr(x, "shape") and hasattr(x, "element_size") and hasattr(x, "dtype"):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


# Ops that read (gather) or write in place (scatter) only the rows their indices name: an
# embedding lookup of one token reads one row of its table, not the table (a decode step).
_GATHERS = frozenset({"embedding", "index", "index_select", "gather"})
_SCATTERS = frozenset({"index_put", "_index_put_impl", "index_copy", "index_add"})


# Ops that overwrite their first argument without reading it (copy_(dst, src) reads src, writes dst).
_OVERWRITES = frozenset({"copy", "fill", "zero"})


def _indexed_bytes(name: str, func: Any, args: tuple, out_ts: list[Any]) -> float | None:
    """Bytes of a gather (indices, the rows read, the output written) or of an in-place scatter
    (indices, the values read, as many bytes written); None for any other op."""
    if name in _GATHERS and out_ts:
        idx = [t for t in _tensors(args[1:]) if not t.dtype.is_floating_point]
        return float(sum(_nbytes(t) for t in idx) + 2 * sum(_nbytes(t) for t in out_ts))
    if name in _SCATTERS and str(getattr(func, "overloadpacket", func)).endswith("_") and len(args) >= 3:
        ts = list(_tensors(args[1:]))
        return float(sum(_nbytes(t) for t in ts) + sum(_nbytes(t) for t in _tensors(args[2:3])))
    return None


def _bytes_moved(read: Iterable[Any], written: Iterable[Any]) -> float:
    # Each distinct input tensor is read once (add(x, x) reads x once); every output is written.
    seen: set[int] = set()
    total = 0
    for t in read:
        if id(t) not in seen:
            seen.add(id(t))
            total += _nbytes(t)
    for t in written:
        total += _nbytes(t)
    return float(total)


def _dtype_name(ts: list[Any], floating_first: bool = True) -> str:
    for t in ts:
        if not floating_first or t.dtype.is_floating_point:
            return str(t.dtype).replace("torch.", "")
    return str(ts[0].dtype).replace("torch.", "") if ts else "float32"


def _largest_dtype(ts: list[Any]) -> str:
    floating = [t for t in ts if t.dtype.is_floating_point]
    pool = floating or ts
    if not pool:
        return "float32"
    return str(max(pool, key=lambda t: t.numel()).dtype).replace("torch.", "")


# ------------------------------------------------------------------------------ per-class features
def _gemm(name: str, args: tuple, out_ts: list[Any]) -> tuple[float, int]:
    """(FLOPs, K) of a GEMM-family op from its operand shapes."""
    ts = [t for t in _tensors(args)]
    if name in ("addmm", "_addmm_activation", "baddbmm", "addbmm", "addmv", "addr"):
        ts = ts[1:]  # the added tensor (bias / input) is not a GEMM operand
    if len(ts) < 2:
        return 0.0, 0
    a, b = shape_of(ts[0]), shape_of(ts[1])
    if "grouped_mm" in name:
        return _grouped_gemm(a, b, out_ts)
    if name in ("mv", "addmv"):
        return gemm_flops(a[0], a[1], 1), a[1]
    if name in ("dot", "vdot"):
        return 2.0 * a[0], a[0]
    if name in ("addr", "outer"):
        return 2.0 * a[0] * b[0], 1
    if len(a) >= 3 or len(b) >= 3 or name in ("bmm", "baddbmm", "addbmm"):
        if len(a) >= 2 and len(b) >= 2:
            flops = bmm_flops(a, b) if len(a) >= len(b) else bmm_flops(a, b) * math.prod(b[:-2])
            return flops, a[-1]
    if len(a) == 2 and len(b) == 2:
        return gemm_flops(a[0], a[1], b[1]), a[1]
    # other ranks (linear / matmul composites on odd shapes): output elements x 2K
    k = a[-1]
    n_out = sum(int(t.numel()) for t in out_ts[:1])
    return 2.0 * n_out * k, k


def _grouped_gemm(a: tuple[int, ...], b: tuple[int, ...], out_ts: list[Any]) -> tuple[float, int]:
    """(FLOPs, K) of a grouped GEMM (a mixture of experts' ``_grouped_mm`` / ``_scaled_grouped_mm``):
    every output element reduces over ``a``'s last dimension, except when both operands are 2-D
    (a weight gradient: the groups split that dimension, and the output has one matrix per group)."""
    out = shape_of(out_ts[0]) if out_ts else ()
    n_out = math.prod(out) if out else 0
    k = a[-1] if a else 0
    if len(a) == 2 and len(b) == 2 and len(out) == 3:
        groups = max(out[0], 1)
        return 2.0 * n_out / groups * k, k // groups
    return 2.0 * n_out * k, k


def _conv(name: str, args: tuple, kwargs: dict, out: Any, out_ts: list[Any]) -> dict[str, Any]:
    """Features of a forward or backward convolution, with its grouping."""
    backward = "backward" in name
    ts = list(_tensors(args[:3] if backward else args[:2]))
    if backward:
        grad_out, x, w = ts[0], ts[1], ts[2]
        transposed = bool(args[7]) if len(args) > 7 else False
        groups = int(args[9]) if len(args) > 9 else 1
        mask = list(args[10]) if len(args) > 10 else [True, True, False]
        flops = conv_backward_flops(shape_of(grad_out), shape_of(x), shape_of(w), transposed, mask)
        stride_arg = args[4] if len(args) > 4 else [1]
        # Read only what the requested gradients need: grad_out always, input for the weight
        # gradient, weight for the input gradient.
        read = [grad_out] + ([x] if mask[1] else []) + ([w] if mask[0] else [])
        nbytes = _bytes_moved(read, out_ts)
    else:
        x, w = ts[0], ts[1]
        transposed = bool(args[6]) if len(args) > 6 else bool(kwargs.get("transposed", False))
        groups = int(args[8]) if len(args) > 8 else int(kwargs.get("groups", 1))
        if name == "_conv_depthwise2d":
            groups = int(x.shape[1])
        stride_arg = args[3] if len(args) > 3 else kwargs.get("stride", [1])
        flops = conv_forward_flops(shape_of(x), shape_of(w), shape_of(out_ts[0]), transposed)
        nbytes = _bytes_moved(list(_tensors(args[:3])), out_ts)
    w_shape = shape_of(w)
    kernel = math.prod(w_shape[2:]) if len(w_shape) > 2 else 1
    in_per_group = w_shape[0] if transposed else w_shape[1]
    c_in = int(x.shape[1]) if len(x.shape) > 1 else 1
    if groups <= 1:
        cls = OpClass.CONV
    elif (transposed and w_shape[1] == 1) or (not transposed and in_per_group == 1 and groups == c_in):
        cls = OpClass.CONV_DEPTHWISE
    else:
        cls = OpClass.CONV_GROUPED
    stride_list = list(stride_arg) if isinstance(stride_arg, (list, tuple)) else [int(stride_arg)]
    return {
        "op_class": cls,
        "flops": flops,
        "nbytes": nbytes,
        "groups": max(1, groups),
        "kernel": kernel,
        "stride": max(int(s) for s in stride_list) if stride_list else 1,
        "reduction": int(in_per_group) * kernel,
        "dtype": _dtype_name([x, w]),
    }


def _attention(name: str, args: tuple, out_ts: list[Any]) -> float:
    ts = [t for t in _tensors(args) if len(t.shape) >= 3]
    try:
        if "backward" in name:
            return attention_backward_flops(shape_of(ts[1]), shape_of(ts[2]), shape_of(ts[3]))
        return attention_forward_flops(shape_of(ts[0]), shape_of(ts[1]), shape_of(ts[2]))
    except (IndexError, ValueError):
        return 0.0


def _pool_kernel(name: str, args: tuple) -> tuple[int, int]:
    # (kernel elements, stride) of max/avg pooling; adaptive pooling reads each input once
    off = 2 if "backward" in name else 1
    if "adaptive" in name or len(args) <= off:
        return 1, 1
    ks = args[off]
    ks = list(ks) if isinstance(ks, (list, tuple)) else [int(ks)]
    st = args[off + 1] if len(args) > off + 1 and args[off + 1] else ks
    st = list(st) if isinstance(st, (list, tuple)) else [int(st)]
    if len(ks) == 1:
        ks = ks * 2
    return int(math.prod(int(k) for k in ks)), max(int(s) for s in st) if st else 1


def classify(
    func: Any, args: tuple = (), kwargs: dict | None = None, out: Any = None, backward: bool | None = None
) -> OpFeatures:
    """Classify one aten op and compute its features.

    ``func`` is an ``OpOverload`` (e.g. ``torch.ops.aten.convolution_backward.default``), ``args``
    / ``kwargs`` / ``out`` what the op was called with and returned (meta tensors are fine: only
    shapes and dtypes are read). ``backward`` marks an op recorded during a backward pass; left
    ``None`` it is inferred from the name (``*_backward``). Never raises for an op it does not
    know: that is an elementwise op priced by its bytes.
    """
    kwargs = kwargs or {}
    name = op_name(func)
    cls = _class_of(name, func)
    is_bwd = ("backward" in name) if backward is None else bool(backward)
    if cls is OpClass.FREE:
        return OpFeatures(name, cls, is_bwd, 0.0, 0.0)
    out_ts = list(_tensors(out))
    in_ts = list(_tensors((args, kwargs)))
    if cls is OpClass.CONV:
        try:
            return OpFeatures(name=name, backward=is_bwd, **_conv(name, args, kwargs, out, out_ts))
        except (IndexError, TypeError, ValueError, AttributeError):
            cls = OpClass.CONV  # odd overload: fall through to bytes-only features
    nbytes = _indexed_bytes(name, func, args, out_ts)
    if nbytes is None:
        read = list(_tensors((args[1:], kwargs))) if name in _OVERWRITES else in_ts
        nbytes = _bytes_moved(read, out_ts)
    n_out = float(sum(int(t.numel()) for t in out_ts))
    if cls is OpClass.GEMM:
        try:
            flops, k = _gemm(name, args, out_ts)
        except (IndexError, TypeError, ValueError):
            flops, k = 2.0 * n_out, 0
        return OpFeatures(name, cls, is_bwd, flops, nbytes, _dtype_name(in_ts or out_ts), reduction=int(k))
    if cls is OpClass.ATTENTION:
        return OpFeatures(name, cls, is_bwd, _attention(name, args, out_ts), nbytes, _dtype_name(in_ts or out_ts))
    if cls is OpClass.POOLING:
        kernel, stride = _pool_kernel(name, args)
        n_in = float(sum(int(t.numel()) for t in in_ts[:1]))
        return OpFeatures(
            name,
            cls,
            is_bwd,
            max(n_in, n_out * kernel),
            nbytes,
            _largest_dtype(in_ts + out_ts),
            kernel=kernel,
            stride=stride,
        )
    if cls is OpClass.NORM:
        # ~ a handful of FLOPs per element (statistics, normalise, affine); bandwidth-bound anyway
        n = float(max((int(t.numel()) for t in in_ts), default=0))
        return OpFeatures(name, cls, is_bwd, 8.0 * n, nbytes, _largest_dtype(in_ts + out_ts))
    if cls is OpClass.REDUCTION:
        n = float(max((int(t.numel()) for t in in_ts), default=0))
        return OpFeatures(name, cls, is_bwd, n, nbytes, _largest_dtype(in_ts + out_ts))
    return OpFeatures(name, cls, is_bwd, n_out, nbytes, _largest_dtype(in_ts + out_ts))
