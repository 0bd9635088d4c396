"""``scaled_dot_product_attention`` on emulated GPUs (component ``gpemu.attention``).

On a CUDA build, ``F.scaled_dot_product_attention`` picks a fused kernel: cuDNN attention,
FlashAttention-2 or the memory-efficient kernel where the GPU and inputs allow it, else the math
path (which materialises the ``L x S`` scores and, for grouped-query attention, repeats the keys
and values per query head). On the CPU build the emulated tensors would always take the math
path: ~10 ops, and memory for the full scores (+816 MiB for one GPT-2 call at 1024 tokens where a
flash kernel keeps ~24 MiB), i.e. spurious OOMs at long sequences. Here the kernel is chosen as
torch's CUDA dispatcher chooses it (:func:`choose_kernel`: ``select_sdp_backend`` and the
``can_use_*`` checks of torch's ``sdp_utils.cpp``), honouring
``torch.backends.cuda.{flash,mem_efficient,math,cudnn}_sdp_enabled()`` and
``torch.nn.attention.sdpa_kernel``:

* **order**: flash, memory-efficient, math, cuDNN; cuDNN first on Hopper and Blackwell
  (sm 9.0, 10.x) with cuDNN newer than 9.15 (torch's ``check_prefer_cudnn_attention``);
* **flash**: fp16/bf16, sm 8.0 to 12.1, one head dim (q, k, v) of at most 256, no explicit
  mask, ``is_causal`` only with equal query and key lengths;
* **memory-efficient**: fp32/fp16 (and bf16 from sm 8.0), sm 5.0 to 12.1, head dims aligned to
  the GEMM alignment (8 halves / 4 floats on tensor cores), an explicit mask allowed;
* **cuDNN**: fp16/bf16, sm 8.0 to 12.1, head dims multiples of 8 up to 128 (256 on sm 9.0/10.x
  with cuDNN newer than 9.22), an explicit mask allowed;
* **grouped-query attention** (``enable_gqa=True``, query heads a multiple of the key/value
  heads): all three fused kernels take it as it is (flash and memory-efficient with as many key
  as value heads); without ``enable_gqa``, unequal head counts take the math path;
* **math**: everything else — torch's own composite runs op by op, as on the GPU.

A fused kernel runs as one emulated op: its output (in the kernel's memory layout), the softmax
statistics it keeps for backward (``logsumexp``, fp32, ``B x H x L``), a backward that makes the
inputs' gradients with the kernel's workspace, and its GPU time (:func:`gpemu.costs.attention_price`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .costmodel.gpus import compute_capability
from .costs import attention_price
from .device import EmuTensor, TensorState, host_shadow, set_host_shadow

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "choose_kernel", "AttentionCall", "SdpBackends", "KERNEL_OPS"]

_HALF = (torch.float16, torch.bfloat16)
_CUDNN_PREFERRED_FROM = 91500  # cuDNN version above which torch puts cuDNN attention first (sm 9.0/10.x)
_CUDNN_D256_FROM = 92200  # cuDNN version above which head dims up to 256 run on sm 9.0/10.x

# The aten op each fused kernel is (its name on the emulated timeline, its DTensor sharding rule).
KERNEL_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
}


class AttentionCall(NamedTuple):
    """What torch's CUDA dispatcher looks at to pick an attention kernel (4-d ``B x H x L x D``)."""

    dtype: torch.dtype
    head_dim: int  # query and key
    value_dim: int
    query_heads: int
    key_heads: int
    value_heads: int
    query_len: int
    key_len: int
    has_mask: bool = False
    causal: bool = False
    gqa: bool = False  # enable_gqa
    same_dtype: bool = True
    key_dim: int | None = None  # None: head_dim
    dropout: float = 0.0
    requires_grad: bool = False
    batch: int = 1

    @classmethod
    def of(cls, q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool, gqa: bool) -> AttentionCall:
        """The call's facts from its tensors (``B x H x L x D``; 3-d inputs have one head)."""

        def heads(t: Any) -> int:
            return int(t.shape[-3]) if t.dim() >= 4 else 1

        return cls(
            q.dtype,
            int(q.shape[-1]),
            int(v.shape[-1]),
            heads(q),
            heads(k),
            heads(v),
            int(q.shape[-2]),
            int(k.shape[-2]),
            mask is not None,
            bool(causal),
            bool(gqa),
            q.dtype == k.dtype == v.dtype,
            int(k.shape[-1]),
            float(dropout),
            any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled(),
            int(q.shape[0]) if q.dim() >= 4 else 1,
        )


class SdpBackends(NamedTuple):
    """Which SDPA kernels torch may use (``torch.backends.cuda.*_sdp_enabled()``)."""

    flash: bool = True
    efficient: bool = True
    math: bool = True
    cudnn: bool = True

    @classmethod
    def enabled(cls) -> SdpBackends:
        b = torch.backends.cuda
        return cls(b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(), b.cudnn_sdp_enabled())


def _heads_ok(call: AttentionCall, same_kv_heads: bool) -> bool:
    """torch's ``check_batch_size_and_num_heads_dense``: equal head counts, or grouped-query
    attention (``enable_gqa``) with key/value heads dividing the query heads."""
    q, k, v = call.query_heads, call.key_heads, call.value_heads
    if not call.gqa:
        return q == k == v
    if same_kv_heads and k != v:
        return False
    return q % k == 0 and q % v == 0


def _can_flash(capability: tuple[int, int], call: AttentionCall) -> bool:
    dim = call.head_dim
    training_limit = capability in ((8, 6), (8, 7), (8, 8), (8, 9), (12, 0), (12, 1)) and call.requires_grad
    return (
        call.dtype in _HALF
        and (8, 0) <= capability <= (12, 1)
        and not call.has_mask
        and dim == (call.key_dim or dim) == call.value_dim
        and dim <= 256
        and not (training_limit and (192 < dim <= 224 or (dim > 224 and call.dropout > 0)))
        and not (call.causal and call.query_len != call.key_len)
        and _heads_ok(call, same_kv_heads=True)
    )


def _gemm_alignment(capability: tuple[int, int], dtype: torch.dtype) -> int:
    """torch's ``minimum_gemm_alignment``: elements a head dim must be a multiple of."""
    half = dtype in _HALF
    tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
    alignment = 4 if capability >= (8, 0) else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _can_efficient(capability: tuple[int, int], call: AttentionCall) -> bool:
    dtypes = (torch.float32, *_HALF) if capability >= (8, 0) else (torch.float32, torch.float16)
    align = _gemm_alignment(capability, call.dtype)
    return (
        call.dtype in dtypes
        and (5, 0) <= capability <= (12, 1)
        and call.head_dim == (call.key_dim or call.head_dim)
        and call.head_dim % align == 0
        and call.value_dim % align == 0
        and _heads_ok(call, same_kv_heads=True)
    )


def _can_cudnn(capability: tuple[int, int], call: AttentionCall, version: int) -> bool:
    hopper_or_blackwell = capability == (9, 0) or capability[0] == 10
    d256 = hopper_or_blackwell and version > _CUDNN_D256_FROM
    limit = 256 if d256 else 128
    dims = (call.key_dim or call.head_dim, call.value_dim)
    backward_ok = not (call.requires_grad and d256) or dims in ((192, 128), (256, 256)) or max(dims) <= 128
    return (
        call.dtype in _HALF
        and (8, 0) <= capability <= (12, 1)
        and call.dropout * 16 == int(call.dropout * 16)
        and call.batch <= 65535
        and call.query_heads <= 65535
        and max(dims) <= limit
        and dims[0] % 8 == 0
        and dims[1] % 8 == 0
        and call.key_len != 1
        and not (call.dropout > 0 and call.query_len == 1)
        and backward_ok
        and _heads_ok(call, same_kv_heads=False)
    )


def _priority(capability: tuple[int, int], cudnn_version: int) -> tuple[str, ...]:
    """torch's ``priority_order``: cuDNN first on sm 9.0/10.x with a recent cuDNN."""
    if cudnn_version > _CUDNN_PREFERRED_FROM and capability[0] in (9, 10) and capability[1] in (0, 3):
        return ("cudnn", "flash", "efficient", "math")
    return ("flash", "efficient", "math", "cudnn")


def choose_kernel(
    capability: tuple[int, int], call: AttentionCall, enabled: SdpBackends, cudnn_version: int = 0
) -> str:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``: the kernel torch's CUDA
    dispatcher would run for ``call`` on a GPU of compute ``capability`` (``enabled``: torch's
    flags; ``cudnn_version``: ``torch.backends.cudnn.version()``). Raises torch's error when
    no enabled kernel can run it."""
    if not call.same_dtype:
        return "math"
    checks = {
        "flash": lambda: enabled.flash and _can_flash(capability, call),
        "efficient": lambda: enabled.efficient and _can_efficient(capability, call),
        "cudnn": lambda: enabled.cudnn and _can_cudnn(capability, call, cudnn_version),
        "math": lambda: enabled.math,
    }
    for kernel in _priority(capability, cudnn_version):
        if checks[kernel]():
            return kernel
    raise RuntimeError("No available kernel. Aborting execution.")


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
        host: _HostAttention | None = None,
    ) -> EmuTensor:
        *batch, length, heads_dim = q.shape  # (B, H, L, D)
        source = k.shape[-2]
        value_dim = v.shape[-1]
        dev = q.emu_device
        mem = ts.memory[dev]
        bh = 1
        for n in batch:
            bh *= n
        kv_bh = bh // q.shape[-3] * k.shape[-3] if q.dim() == 4 else bh  # grouped-query: fewer key/value heads
        price = attention_price(
            ts.rt, dev, bh, length, source, heads_dim, value_dim, q.dtype, causal, False, kv_batch_heads=kv_bh
        )
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
        rows = (length + 31) // 32 * 32 if kernel == "efficient" else length
        ctx.kept = mem.allocate(bh * rows * 4)  # logsumexp, fp32, kept for backward
        ctx.ts, ctx.kernel, ctx.causal, ctx.mask_grad = ts, kernel, causal, isinstance(mask, torch.Tensor)
        ctx.shapes = [(t.shape, t.dtype) for t in (q, k, v)]
        ctx.dims = (bh, kv_bh, length, source, heads_dim, value_dim, q.dtype, dev)
        ctx.mask_spec = (mask.shape, mask.dtype) if isinstance(mask, torch.Tensor) else None
        # (the values are the emulator's own work: an entry, its time forgiven)
        ctx.host = ts.call(host.forward, out, q, k, v, mask) if host is not None else None
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        ts: TensorState = ctx.ts
        bh, kv_bh, length, source, head_dim, value_dim, dtype, dev = ctx.dims
        mem = ts.memory[dev]
        price = attention_price(
            ts.rt, dev, bh, length, source, head_dim, value_dim, dtype, ctx.causal, True, kv_batch_heads=kv_bh
        )
        ts.charge(price.gpu, dev, f"{ctx.kernel}_attention_backward", price)
        # Workspace: an fp32 accumulator for dQ (and the softmax row sums), for the kernel's run.
        mem.touch(bh * length * head_dim * 4 + bh * length * 4)
        grads = [ts.new(shape, dt, dev) for shape, dt in ctx.shapes]
        if ctx.host is not None:
            ts.call(ctx.host.backward, grad, grads)
        ctx.kept = ctx.host = None
        mask_grad = None
        if ctx.mask_spec is not None and ctx.needs_input_grad[6]:
            mask_shape, mask_dtype = ctx.mask_spec
            mask_grad = ts.new(mask_shape, mask_dtype, dev)
        return None, None, None, grads[0], grads[1], grads[2], mask_grad, None


class _HostAttention:
    """A fused kernel's real values in value mode (:mod:`gpemu.device.values`): torch's own
    attention on the host values, its dropout drawn from the emulated device's generator, and the
    gradients by recomputing it (with the same dropout) in the backward."""

    def __init__(self, ts: TensorState, orig: Callable, args: _SdpaArgs) -> None:
        self.ts = ts
        self.run = functools.partial(
            orig, dropout_p=args.dropout_p, is_causal=args.is_causal, scale=args.scale, enable_gqa=args.enable_gqa
        )
        self.seed: int | None = None
        self.inputs: tuple = ()

    def _call(self, q: Any, k: Any, v: Any, mask: Any) -> Any:
        values = self.ts.values
        if self.seed is None or values is None:
            return self.run(q, k, v, attn_mask=mask)
        with values.seeded(self.seed):
            return self.run(q, k, v, attn_mask=mask)

    def forward(self, out: EmuTensor, q: EmuTensor, k: EmuTensor, v: EmuTensor, mask: Any) -> _HostAttention | None:
        """Set ``out``'s values; self (kept for the backward), or None when an input is unknown."""
        inputs = [host_shadow(t) for t in (q, k, v)]
        mask_value = host_shadow(mask) if isinstance(mask, EmuTensor) else mask
        values = self.ts.values
        if values is None or any(x is None for x in inputs) or (isinstance(mask, EmuTensor) and mask_value is None):
            return None
        if self.run.keywords["dropout_p"]:
            self.seed = values.draw(q.emu_device)
        self.inputs = (*inputs, mask_value)
        with torch.no_grad():
            set_host_shadow(out, self._call(*self.inputs))
        return self

    def backward(self, grad: Any, grads: list[EmuTensor]) -> None:
        """Set the gradients' values (q, k, v) from the output gradient's."""
        grad_value = host_shadow(grad)
        if grad_value is None:
            return
        q, k, v, mask = self.inputs
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            result = self._call(leaves[0], leaves[1], leaves[2], mask)
            for target, value in zip(grads, torch.autograd.grad(result, leaves, grad_value), strict=True):
                set_host_shadow(target, value)


def _held(t: Any) -> EmuTensor | None:
    """The emulated tensor a tensor subclass that holds tensors (a DTensor) holds, else None."""
    if type(t) is EmuTensor:
        return t
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        return _held(getattr(t, attrs[0])) if attrs else None
    return None


def _kernel(
    capability: tuple[int, int], q: Any, k: Any, v: Any, mask: Any, dropout: float, causal: bool, gqa: bool
) -> str:
    call = AttentionCall.of(q, k, v, mask, dropout, causal, gqa)
    return choose_kernel(capability, call, SdpBackends.enabled(), int(torch.backends.cudnn.version() or 0))


def _fused_op(capability: tuple[int, int], args: _SdpaArgs, orig: Callable) -> Any:
    """SDPA over tensor subclasses that hold emulated tensors (DTensor): the fused aten op a GPU
    picks, dispatched through the subclass (its sharding rules), so each shard runs that op on its
    emulated tensors. The CPU build's choice for meta-backed inputs is the math composite, which a
    DTensor cannot run (it builds a plain mask tensor)."""
    q, k, v, mask, dropout, causal, scale, gqa = args
    kernel = _kernel(capability, q, k, v, mask, dropout, causal, gqa)
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, bool(causal), scale=scale)[0]
    if kernel == "efficient":
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, need_lse, dropout, bool(causal), scale=scale
        )[0]
    if kernel == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, need_lse, dropout, bool(causal), False, scale=scale
        )[0]
    return _with_causal_values(args).run(orig)


class _SdpaArgs(NamedTuple):
    """One ``scaled_dot_product_attention`` call's arguments."""

    query: Any
    key: Any
    value: Any
    attn_mask: Any
    dropout_p: float
    is_causal: bool
    scale: Any
    enable_gqa: bool

    def run(self, orig: Callable) -> Any:
        """The call as torch's own function runs it (the math path here)."""
        return orig(
            self.query,
            self.key,
            self.value,
            attn_mask=self.attn_mask,
            dropout_p=self.dropout_p,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
        )


def _on_held_tensors(capabilities: list[tuple[int, int]], args: _SdpaArgs, orig: Callable) -> Any:
    """SDPA over anything but three emulated tensors: tensor subclasses holding emulated tensors
    take the fused op a GPU picks (:func:`_fused_op`), the rest torch's own function."""
    inner = _held(args.query)
    if inner is not None and args.query.dim() == 4 and _held(args.key) is not None and _held(args.value) is not None:
        return _fused_op(capabilities[inner.emu_device], args, orig)
    return _with_causal_values(args).run(orig)


def _with_causal_values(args: _SdpaArgs) -> _SdpaArgs:
    """The math path's call in value mode (:mod:`gpemu.device.values`): torch's math kernel
    builds its causal mask without a kernel of its own, on the emulated tensors' C++ device
    (meta), where it has no values; here it is given as the same mask with its values (no memory,
    no kernel, as there), which the kernel adds to the scores with the same op."""
    q, k = args.query, args.key
    if not args.is_causal or type(q) is not EmuTensor or type(k) is not EmuTensor or q.emu_state.values is None:
        return args
    if args.attn_mask is not None:
        return args  # (torch refuses both; its own error)
    ts = q.emu_state
    mask = ts.call(_causal_mask, ts, q.shape[-2], k.shape[-2], q.dtype, q.emu_device)  # (the emulator's own work)
    return args._replace(attn_mask=mask, is_causal=False)


def _causal_mask(ts: TensorState, length: int, source: int, dtype: torch.dtype, dev: int) -> EmuTensor:
    with torch._C.DisableTorchFunction():  # (host tensors: no mode of the program's applies)
        keep = torch.ones(length, source, dtype=torch.bool).tril()
        values = torch.zeros(length, source, dtype=dtype).masked_fill(~keep, float("-inf"))
    mask = ts.wrap((length, source), (source, 1), 0, dtype, dev, None)
    set_host_shadow(mask, values)
    return mask


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
        args = _SdpaArgs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if (
            not (type(query) is EmuTensor and type(key) is EmuTensor and type(value) is EmuTensor)
            or query.dim() < 3
            or torch._C._len_torch_function_stack()
        ):
            return _on_held_tensors(capabilities, args, orig)
        q, k, v = query, key, value
        if torch.is_autocast_enabled("cuda"):  # what autocast would do to this op's inputs
            dtype = torch.get_autocast_dtype("cuda")
            # (emulated ops: their results are emulated)
            q, k, v = (
                cast(EmuTensor, t.to(dtype)) if t.is_floating_point() and t.dtype != dtype else t for t in (q, k, v)
            )
        kernel = _kernel(capabilities[q.emu_device], q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
        if kernel == "math":
            return _with_causal_values(args).run(orig)
        host = _HostAttention(ts, orig, args) if ts.values is not None else None
        return _FusedAttention.apply(ts, kernel, bool(is_causal), q, k, v, attn_mask, host)

    scaled_dot_product_attention.__wrapped__ = orig
    return scaled_dot_product_attention


def install(rt: Runtime) -> None:
    """Replace ``torch.nn.functional.scaled_dot_product_attention`` (every reference under torch)."""
    F = torch.nn.functional
    orig = F.scaled_dot_product_attention
    rt.patcher.replace_everywhere_many([(orig, _make_sdpa(rt, orig))])
