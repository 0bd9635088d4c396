"""FlexAttention on emulated GPUs (component ``gpemu.flex_attention``).

``torch.nn.attention.flex_attention.flex_attention`` calls the higher-order op (HOP)
``flex_attention``; on a GPU it is one fused kernel that computes only the score blocks its block
mask keeps. On emulated tensors:

* **the op**: the HOP's rule for the emulated tensor type (a tensor subclass's rule, torch's
  ``flex_attention.py_impl(EmuTensor)``; likewise for ``flex_attention_backward``) makes the
  outputs as the kernel makes them (output in the query's layout, ``logsumexp`` and
  ``max_scores`` in fp32) and charges one fused attention kernel
  (:func:`gpemu.costs.attention_price`) priced with the fraction of score blocks the block mask
  computes (partial and full blocks; causal masks compute about half);
* **autograd**: the HOP's autograd kernel traces ``score_mod`` with fake tensors to build its
  backward graph, which cannot be done on emulated CUDA tensors on a CPU build (a fake CUDA tensor
  that requires grad aborts the process). For emulated inputs it runs torch's own
  ``FlexAttentionAutogradOp`` with ``score_mod`` as its forward graph and no joint graph: the
  emulated backward rule never runs ``score_mod``;
* **block masks**: ``create_block_mask`` on an emulated device runs as torch runs it (its GPU work
  and memory charged as usual), and its block counts are computed again on the host, so the
  emulated block mask holds its real counts (placeholders otherwise): the sparsity a kernel is
  priced with, and what the block mask prints. A mask_mod that reads tensors on the emulated GPU
  (packed documents' ids) reads their known values there; values the host does not know leave
  the counts unknown, and the kernel is priced dense (said once). A mask larger than
  ``HOST_MASK_BUDGET`` elements (a 16k-token packed batch) is not counted whole: a sample of its
  rows gives the density its kernels are priced with, and its counts stay unknown.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch._C import DispatchKey
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .costs import attention_price
from .device import EmuTensor, TensorState, host_shadow, set_host_shadow
from .hostvalues import SHADOW_MAX_ELEMENTS

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "block_density", "HOST_MASK_ELEMENTS", "HOST_MASK_BUDGET"]

# A block mask is computed on the host in pieces of at most this many mask elements (rows of
# whole query blocks): a 128k-token causal mask is 2^34 elements.
HOST_MASK_ELEMENTS = 1 << 24
# A block mask of more elements than this (batch x heads x query x key) is not counted whole (~0.5 s
# on a host core): its density comes from a sample of its rows (_sampled_density).
HOST_MASK_BUDGET = 1 << 24
_SAMPLED_ROWS = 4  # query rows read in each sampled block row

# Where BlockMask.as_tuple() keeps what pricing reads.
_KV_NUM_BLOCKS, _KV_INDICES, _FULL_KV_NUM_BLOCKS = 2, 3, 4


# The density of a block mask too large to count whole on the host, from a sample of its rows
# (keyed by its kv_num_blocks tensor): prices its kernels; its counts stay unknown.
_SAMPLED_DENSITY: WeakIdKeyDictionary = WeakIdKeyDictionary()


def block_density(block_mask: tuple) -> float | None:
    """The fraction of score blocks a kernel computes under ``block_mask`` (``BlockMask.as_tuple()``):
    partial and full blocks over all blocks; None when its counts are unknown (placeholders)."""
    counts = _value(block_mask[_KV_NUM_BLOCKS])
    full = block_mask[_FULL_KV_NUM_BLOCKS]
    full_counts = _value(full) if isinstance(full, torch.Tensor) else torch.zeros(())
    if counts is None or full_counts is None:
        sampled = _SAMPLED_DENSITY.get(block_mask[_KV_NUM_BLOCKS])
        return float(sampled) if sampled is not None else None
    return _density(counts, full_counts, block_mask[_KV_INDICES])


def _density(counts: torch.Tensor, full_counts: torch.Tensor, indices: Any) -> float | None:
    if not isinstance(indices, torch.Tensor):
        return None
    computed = float(counts.sum()) + float(full_counts.sum())
    total = counts.numel() * max(int(indices.shape[-1]), 1)
    return min(1.0, computed / total) if total else 1.0


def _value(t: Any) -> torch.Tensor | None:
    if isinstance(t, EmuTensor):
        return host_shadow(t)
    return t if isinstance(t, torch.Tensor) else None


def _query_layout(shape: tuple[int, ...], query_stride: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a tensor of ``shape`` laid out as the query is, last dimension innermost (the
    flex kernel's output layout, torch's ``_permute_strides``)."""
    order = sorted(range(len(shape)), key=lambda d: query_stride[d])
    last = len(shape) - 1
    if query_stride[last] != 1 or order[0] != last:
        order.remove(last)
        order.insert(0, last)
    strides = [0] * len(shape)
    acc = 1
    for d in order:
        strides[d] = acc
        acc *= max(int(shape[d]), 1)
    return tuple(strides)


def _charge(ts: TensorState, q: EmuTensor, k: EmuTensor, v: EmuTensor, block_mask: tuple, backward: bool) -> None:
    batch, heads, length, head_dim = (int(n) for n in q.shape)
    density = block_density(block_mask)
    if density is None:
        ts.say_once(
            "FlexAttention: a block mask's block counts are unknown (made from placeholder values); "
            "its kernels are priced as if every block were computed"
        )
    dev = q.emu_device
    price = attention_price(
        ts.rt,
        dev,
        batch * heads,
        length,
        int(k.shape[-2]),
        head_dim,
        int(v.shape[-1]),
        q.dtype,
        False,
        backward,
        kv_batch_heads=int(k.shape[0]) * int(k.shape[1]),
        density=density,
    )
    ts.charge(price.gpu, dev, "flex_attention" + ("_backward" if backward else ""), price)


def flex_forward(
    query: EmuTensor,
    key: EmuTensor,
    value: EmuTensor,
    score_mod: Callable,
    block_mask: tuple,
    scale: float,
    kernel_options: dict,
    score_mod_other_buffers: tuple = (),
    mask_mod_other_buffers: tuple = (),
) -> tuple[EmuTensor, EmuTensor, EmuTensor]:
    """The ``flex_attention`` HOP on emulated tensors: one fused kernel's outputs and time."""
    ts = query.emu_state
    dev = query.emu_device
    batch, heads, length, _ = (int(n) for n in query.shape)
    shape = (batch, heads, length, int(value.shape[-1]))
    nbytes = shape[0] * shape[1] * shape[2] * shape[3] * query.element_size()
    out = ts.wrap(shape, _query_layout(shape, query.stride()), 0, query.dtype, dev, ts.memory[dev].allocate(nbytes))
    logsumexp = ts.new((batch, heads, length), torch.float32, dev)
    max_scores = ts.new((batch, heads, length), torch.float32, dev)
    _charge(ts, query, key, value, block_mask, backward=False)
    return out, logsumexp, max_scores


def flex_backward(
    query: EmuTensor,
    key: EmuTensor,
    value: EmuTensor,
    out: EmuTensor,
    logsumexp: EmuTensor,
    grad_out: Any,
    grad_logsumexp: Any,
    fw_graph: Any,
    joint_graph: Any,
    block_mask: tuple,
    scale: float,
    kernel_options: dict,
    score_mod_other_buffers: tuple = (),
    mask_mod_other_buffers: tuple = (),
) -> tuple[EmuTensor, EmuTensor, EmuTensor, tuple]:
    """The ``flex_attention_backward`` HOP on emulated tensors: the gradients' memory, the fused
    backward kernel's time (with its fp32 dQ accumulator as workspace)."""
    ts = query.emu_state
    dev = query.emu_device
    mem = ts.memory[dev]
    _charge(ts, query, key, value, block_mask, backward=True)
    mem.touch(query.numel() * 4)
    grad_query = ts.wrap(
        tuple(query.shape),
        _query_layout(tuple(query.shape), query.stride()),
        0,
        query.dtype,
        dev,
        mem.allocate(query.numel() * query.element_size()),
    )
    grad_key = ts.new(tuple(key.shape), key.dtype, dev)
    grad_value = ts.new(tuple(value.shape), value.dtype, dev)
    buffers = tuple(
        ts.new(tuple(b.shape), b.dtype, dev) if isinstance(b, EmuTensor) else None for b in score_mod_other_buffers
    )
    return grad_query, grad_key, grad_value, buffers


def _emulated(*tensors: Any) -> bool:
    return any(type(t) is EmuTensor for t in tensors)


def _make_autograd_rule(original: Callable) -> Callable:
    from torch._higher_order_ops.flex_attention import FlexAttentionAutogradOp

    @functools.wraps(original)
    def flex_attention_autograd(
        query: Any,
        key: Any,
        value: Any,
        score_mod: Callable,
        block_mask: tuple,
        scale: float,
        kernel_options: dict,
        score_mod_other_buffers: tuple = (),
        mask_mod_other_buffers: tuple = (),
    ) -> Any:
        args = (query, key, value, score_mod, block_mask, scale, kernel_options)
        if not _emulated(query, key, value):
            return original(*args, score_mod_other_buffers, mask_mod_other_buffers)
        # torch's own autograd function; no joint graph: the emulated backward never runs score_mod
        return FlexAttentionAutogradOp.apply(
            *args[:4], None, *args[4:], mask_mod_other_buffers, *score_mod_other_buffers
        )

    return flex_attention_autograd


# -- block masks ----------------------------------------------------------------------------------
def _known_value(x: Any) -> Any:
    if not isinstance(x, EmuTensor):
        return x
    value = host_shadow(x)
    if value is None:
        raise ValueError("its mask_mod reads tensors on the emulated GPU, whose values are placeholders")
    return value


class _KnownValuesOnHost(TorchFunctionMode):
    """While a mask_mod runs on the host: each emulated tensor it reads (document ids, offsets of
    packed sequences) is its known host value, as the GPU's kernel reads its values."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = tree_map(_known_value, (args, kwargs or {}))
        return func(*args, **kwargs)


def _piece(create: Callable, mask_mod: Callable, q0: int, rows: int, shape: tuple, block: tuple, keyword: dict) -> Any:
    """``create_block_mask`` on the host for query rows ``q0`` to ``q0 + rows``."""
    batch, heads, _, kv_len = shape

    def shifted(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        with _KnownValuesOnHost():
            return mask_mod(b, h, q_idx + q0, kv_idx)

    piece = create(shifted, batch, heads, rows, kv_len, device="cpu", BLOCK_SIZE=block, **keyword)
    if type(piece.kv_num_blocks) is not torch.Tensor:
        raise ValueError("its mask_mod reads tensors on the emulated GPU, whose values are placeholders")
    return piece


def _host_counts(create: Callable, mask_mod: Callable, shape: tuple, block: tuple[int, int], keyword: dict) -> dict:
    """The block counts of ``create_block_mask`` computed on the host, a few query blocks at a time
    (kv counts and indices of each piece side by side, q counts summed over pieces)."""
    batch, heads, q_len, kv_len = shape
    rows_per_piece = max(1, HOST_MASK_ELEMENTS // max(1, (batch or 1) * (heads or 1) * kv_len * block[0])) * block[0]
    pieces = [
        _piece(create, mask_mod, q0, min(rows_per_piece, q_len - q0), shape, block, keyword)
        for q0 in range(0, q_len, rows_per_piece)
    ]
    counts: dict[str, torch.Tensor | None] = {}
    for name in ("kv_num_blocks", "full_kv_num_blocks", "kv_indices", "full_kv_indices"):
        parts = [getattr(p, name) for p in pieces]
        counts[name] = None if any(x is None for x in parts) else torch.cat(parts, dim=2)
    for name in ("q_num_blocks", "full_q_num_blocks"):
        parts = [getattr(p, name) for p in pieces]
        counts[name] = None if any(x is None for x in parts) else functools.reduce(torch.add, parts)
    return counts


def _sampled_density(mask_mod: Callable, shape: tuple, block: tuple[int, int]) -> float:
    """A large mask's density from a sample of its first batch row and head: block rows drawn at
    random, one from each of equal stretches (the causal slope followed, documents' periodicity
    not aliased), each read on a few of its query rows (a key block is computed when one of them
    keeps a key in it): about HOST_MASK_BUDGET / 8 mask elements."""
    from torch.nn.attention.flex_attention import create_mask

    batch, heads, q_len, kv_len = shape
    q_blocks, kv_blocks = -(-q_len // block[0]), -(-kv_len // block[1])
    picks = max(1, min(q_blocks, HOST_MASK_BUDGET // (8 * _SAMPLED_ROWS * kv_len)))
    draws = torch.rand(picks, generator=torch.Generator().manual_seed(q_len * 31 + kv_len))
    first_rows = [min(q_blocks - 1, int((i + float(draws[i])) * q_blocks / picks)) * block[0] for i in range(picks)]
    offsets = torch.linspace(0, block[0] - 1, _SAMPLED_ROWS).long()
    q_rows = (torch.tensor(first_rows).unsqueeze(1) + offsets).clamp(max=q_len - 1).flatten()

    def sampled(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        with _KnownValuesOnHost():
            return mask_mod(b, h, q_rows[q_idx], kv_idx)

    first = (None if batch is None else 1, None if heads is None else 1)
    kept = create_mask(sampled, *first, len(q_rows), kv_len, device="cpu").reshape(len(q_rows), kv_len)
    kept = torch.nn.functional.pad(kept, (0, kv_blocks * block[1] - kv_len))
    computed = kept.view(picks, _SAMPLED_ROWS, kv_blocks, block[1]).any(dim=3).any(dim=1)
    return float(computed.sum()) / (picks * kv_blocks)


def _make_create_block_mask(rt: Runtime, original: Callable) -> Callable:
    @functools.wraps(original)
    def create_block_mask(
        mask_mod: Callable,
        B: int | None,
        H: int | None,
        Q_LEN: int,
        KV_LEN: int,
        device: Any = None,
        BLOCK_SIZE: int | tuple[int, int] = 128,
        **keyword: Any,
    ) -> Any:
        mask = original(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE, **keyword)
        if not isinstance(getattr(mask, "kv_num_blocks", None), EmuTensor):
            return mask
        block = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else (BLOCK_SIZE, BLOCK_SIZE)
        keyword.pop("_compile", None)
        shape = (B, H, Q_LEN, KV_LEN)
        # A large mask (torchtitan's packed documents: one 16k x 16k mask every step) is not
        # counted whole: seconds of host time a step, where the GPU takes a millisecond. A sample
        # of its rows gives the density its kernels are priced with; its counts stay unknown.
        whole = (B or 1) * (H or 1) * Q_LEN * KV_LEN <= HOST_MASK_BUDGET
        engine = rt.engine
        engine.enter()  # the host computation stands in for GPU kernels: the emulator's own time
        try:
            if whole:
                counts = _host_counts(original, mask_mod, shape, block, keyword)
            else:
                _SAMPLED_DENSITY[mask.kv_num_blocks] = _sampled_density(mask_mod, shape, block)
                return mask
        except Exception as exc:  # a mask_mod that reads emulated tensors: its values are unknown
            rt.say_once(f"FlexAttention: a block mask's counts could not be computed on the host ({exc!r})")
            return mask
        finally:
            engine.leave()
        for name, value in counts.items():
            t = getattr(mask, name, None)
            if isinstance(t, EmuTensor) and value is not None and value.numel() <= SHADOW_MAX_ELEMENTS:
                set_host_shadow(t, value)
        return mask

    return create_block_mask


# -- install --------------------------------------------------------------------------------------
def _set_rule(rt: Runtime, op: Any, table: dict, key: Any, rule: Callable) -> None:
    """``table[key] = rule`` for HOP ``op`` (its kernel or subclass-rule table), undone at unpatch."""
    missing = object()
    before = table.get(key, missing)
    table[key] = rule
    op._dispatch_cache.clear()

    def undo() -> None:
        if before is missing:
            table.pop(key, None)
        else:
            table[key] = before
        op._dispatch_cache.clear()

    rt.patcher.on_restore(undo)


def install(rt: Runtime) -> None:
    """The FlexAttention HOPs' rules for emulated tensors, their autograd kernel for emulated
    inputs, and ``create_block_mask`` with host-computed counts."""
    import torch.nn.attention.flex_attention as api
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    _set_rule(rt, flex_attention, flex_attention.python_key_table, EmuTensor, flex_forward)
    _set_rule(rt, flex_attention_backward, flex_attention_backward.python_key_table, EmuTensor, flex_backward)
    autograd = flex_attention.py_kernels[DispatchKey.Autograd]
    _set_rule(rt, flex_attention, flex_attention.py_kernels, DispatchKey.Autograd, _make_autograd_rule(autograd))
    original = api.create_block_mask
    rt.patcher.replace_everywhere(original, _make_create_block_mask(rt, original))
