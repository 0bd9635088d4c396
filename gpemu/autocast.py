"""``torch.autocast('cuda')`` dtype behaviour for emulated tensors.

On the CPU build, ``autocast('cuda')`` only flips thread-local state: CUDA autocasting happens
at the AutocastCUDA dispatch key, which meta-backed tensors do not carry. While a CUDA autocast
region is enabled, gpemu pushes a ``TorchFunctionMode`` that applies CUDA autocast's op lists
to calls that involve emulated tensors:

* **lower precision** (the autocast dtype, fp16 by default): matmul/mm/bmm/addmm/baddbmm/linear,
  convolutions, prelu, scaled_dot_product_attention, RNN cells ...;
* **float32**: softmax/log_softmax, losses (cross_entropy, nll, mse, l1, kl_div ...), norms
  (layer_norm, group_norm, norm), exp/log/pow, sum/prod/cumsum ...;
* **widest input type**: cat, stack, addcmul, addcdiv, index_put, scatter_add, bilinear ...;
* ``binary_cross_entropy`` raises the same error as on CUDA (unsafe to autocast).

Casts are real ops on emulated tensors (visible to autograd and memory accounting, like CUDA's);
casts of parameters (leaf tensors that require grad) are cached until the outermost autocast
region exits, as CUDA autocast does.

Limit: a Python-implemented composite function (``F.multi_head_attention_forward``) is seen as
one call, so the ops inside it are not re-cast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.autocast_mode import autocast
from torch.overrides import TorchFunctionMode

from .device import EmuTensor

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "AutocastMode", "AutocastRegions", "LOWER_PRECISION", "FP32", "PROMOTE"]

LOWER_PRECISION = (
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "addbmm",
    "baddbmm",
    "addmv",
    "addr",
    "mv",
    "chain_matmul",
    "linear",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
    "_convolution",
    "convolution",
    "conv_tbc",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "__matmul__",
    "__rmatmul__",
)
FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "__pow__",
    "__rpow__",
    "softplus",
    "layer_norm",
    "group_norm",
    "norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "softmax",
    "log_softmax",
    "softmin",
    "cross_entropy",
    "cross_entropy_loss",
    "cumprod",
    "cumsum",
    "prod",
    "sum",
    "normalize",
    "_softmax",
    "_log_softmax",
)
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "grid_sampler",
    "grid_sample",
    "index_put",
    "scatter_add",
    "tensordot",
    "cat",
    "stack",
    "concat",
    "concatenate",
    "vdot",
)

_NAMESPACES = (torch, torch.Tensor, torch._C._nn, torch.nn.functional, torch._C._VariableFunctions)


def _funcs(names: tuple[str, ...]) -> set:
    out = set()
    for name in names:
        for ns in _NAMESPACES:
            f = getattr(ns, name, None)
            if f is not None and callable(f):
                # (a function gpemu patched, e.g. F.cross_entropy, is listed as its original)
                out.add(getattr(f, "__wrapped__", f))
    return out


class _Policy:
    def __init__(self) -> None:
        self.lower = _funcs(LOWER_PRECISION)
        self.fp32 = _funcs(FP32)
        self.promote = _funcs(PROMOTE)
        self.unsafe = _funcs(("binary_cross_entropy",))


_POLICY: _Policy | None = None


def _policy() -> _Policy:
    global _POLICY
    if _POLICY is None:
        _POLICY = _Policy()
    return _POLICY


def _has_emulated(args: Any) -> bool:
    for a in args:
        if isinstance(a, EmuTensor):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(x, EmuTensor) for x in a):
            return True
    return False


class AutocastMode(TorchFunctionMode):
    """Applies CUDA autocast's op lists to emulated tensors while autocast('cuda') is on."""

    # Marks gpemu's own modes: a component that replaces a torch function (gpemu.rnn) still
    # takes its fast path under this mode, and steps aside for anyone else's.
    gpemu_mode = True

    def __init__(self) -> None:
        super().__init__()
        self.policy = _policy()
        self.cast_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not torch.is_autocast_enabled("cuda"):
            return func(*args, **kwargs)
        pol = self.policy
        try:
            # torch hands a mode the function its module holds now: gpemu's wrapper, if patched
            base = getattr(func, "__wrapped__", func)
            in_lower = base in pol.lower
            in_fp32 = not in_lower and base in pol.fp32
            in_promote = not in_lower and not in_fp32 and base in pol.promote
            unsafe = base in pol.unsafe
        except TypeError:  # unhashable callable
            return func(*args, **kwargs)
        if not (in_lower or in_fp32 or in_promote or unsafe) or not (
            _has_emulated(args) or _has_emulated(tuple(kwargs.values()))
        ):
            return func(*args, **kwargs)
        if unsafe:
            raise RuntimeError(
                "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
                "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
                "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
                "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
                "safe to autocast."
            )
        target: torch.dtype | None
        if in_lower:
            target = torch.get_autocast_dtype("cuda")
        elif in_fp32:
            target = torch.float32
        else:
            target = _widest(args, kwargs)
        if target is None:  # promote, but all of one floating type: nothing to cast
            return func(*args, **kwargs)
        args = tuple(self._cast(a, target) for a in args)
        kwargs = {k: self._cast(v, target) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _cast(self, a: Any, dtype: torch.dtype) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(self._cast(x, dtype) for x in a)
        if not isinstance(a, EmuTensor) or not a.is_floating_point() or a.dtype == dtype or a.dtype == torch.float64:
            return a
        cacheable = a.is_leaf and a.requires_grad
        if cacheable:
            hit = self.cast_cache.get(id(a))
            if hit is not None and hit[0] is a and hit[1].dtype == dtype:
                return hit[1]
        out = a.to(dtype)
        if cacheable:
            self.cast_cache[id(a)] = (a, out)
        return out


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    dtypes = []
    for a in list(args) + list(kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else (a,)
        for x in items:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                dtypes.append(x.dtype)
    if len(set(dtypes)) < 2:
        return None
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


class AutocastRegions:
    """The CUDA autocast regions of one run: an enabled ``autocast('cuda')`` region pushes the
    :class:`AutocastMode`, nested regions share it (and its cast cache), and the outermost exit
    drops the cache, as CUDA autocast's is dropped."""

    def __init__(self, original_enter: Callable[..., object], original_exit: Callable[..., object]) -> None:
        self.original_enter = original_enter
        self.original_exit = original_exit
        self.depth = 0  # enabled CUDA regions open now
        self.mode: AutocastMode | None = None

    def enter(self, region: autocast) -> object:
        result = self.original_enter(region)
        pushed = None
        if getattr(region, "device", None) == "cuda" and torch.is_autocast_enabled("cuda"):
            if self.mode is None or self.depth == 0:
                self.mode = AutocastMode()
            self.mode.__enter__()
            pushed = self.mode
            self.depth += 1
        # What this region pushed (None: nothing), for its own exit; a region object may be re-entered.
        region.__dict__.setdefault("_gpemu_modes", []).append(pushed)
        return result

    def exit(self, region: autocast, exc_type: object, exc_val: object, exc_tb: object) -> object:
        stack = region.__dict__.get("_gpemu_modes") or [None]
        pushed = stack.pop()
        if pushed is not None:
            pushed.__exit__(exc_type, exc_val, exc_tb)
            self.depth -= 1
            if self.depth == 0:
                pushed.cast_cache.clear()  # like CUDA autocast's cache, dropped at the outermost exit
        return self.original_exit(region, exc_type, exc_val, exc_tb)


def _autocast_method(ours: Callable[..., object], original: Callable[..., object]) -> Callable[..., object]:
    """A method of torch's ``autocast`` class that runs ``ours`` (which calls the original)."""

    @functools.wraps(original)
    def method(region: autocast, *args: object) -> object:
        return ours(region, *args)

    return method


def install(rt: Runtime) -> None:
    """Wrap autocast's __enter__/__exit__ so an enabled autocast('cuda') region pushes the mode."""
    regions = AutocastRegions(autocast.__enter__, autocast.__exit__)
    rt.patcher.replace(autocast, "__enter__", _autocast_method(regions.enter, autocast.__enter__))
    rt.patcher.replace(autocast, "__exit__", _autocast_method(regions.exit, autocast.__exit__))
