"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` as cuDNN runs them (component ``gpemu.rnn``).

On a CUDA build with cuDNN enabled, torch runs a whole multi-layer RNN as one ``_cudnn_rnn``
call (and one ``_cudnn_rnn_backward``): cuDNN projects every timestep's input in one GEMM per
layer and runs the recurrence on the GPU. The CPU build decomposes the same ``_VF.lstm`` call
into per-timestep ops: ``nn.LSTM(200, 200, 2)`` over 35 steps dispatches ~2,500 kernels forward
and backward, which gpemu would price one by one, each with the host issue time of an eager op:
~49 ms where cuDNN's work is well under a millisecond.

While ``torch.backends.cudnn.enabled`` (torch's default) and every tensor of the call is
emulated, ``_VF.lstm / gru / rnn_tanh / rnn_relu`` run as one emulated op: the output and final
states of the right shapes and dtype, cuDNN's reserve space (the gates of every layer and step)
kept for the backward, gradients for the input, the initial state and every weight, and the GPU
time of :func:`gpemu.costs.rnn_price`. Under ``autocast('cuda')`` the op runs in the autocast
dtype, as CUDA's autocast casts cuDNN RNNs (inputs and flattened weights).

Packed sequences run as on a GPU: ``pack_padded_sequence`` and ``pad_packed_sequence`` are one
gather/scatter kernel each way, with torch's own checks and sizes (computed on a meta stand-in
from the host's lengths: run on the emulated tensors, the CPU build's kernels would build their
outputs and their backward's zeros from the wrappers' meta metadata); a packed RNN runs fused
too, over the packed rows. torch's own path (op by op, as with cuDNN disabled on a GPU) runs for
LSTMs with projections (``proj_size``), tensor subclasses and calls the emulator cannot see
whole (a torch function mode other than autocast's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .costs import copy_price, rnn_price
from .device import EmuTensor, TensorState

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install"]

_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


class _FusedRNN(torch.autograd.Function):
    """One cuDNN RNN call: outputs, final states, reserve space, gradients and time; no math."""

    @staticmethod
    def forward(
        ctx: Any,
        ts: TensorState,
        mode: str,
        dims: tuple,
        dtype: torch.dtype,
        n_state: int,
        input: EmuTensor,
        *rest: EmuTensor,
    ) -> tuple:
        steps, batch, rows, input_size, hidden, layers, directions, layout, for_backward = dims
        gates = _GATES[mode]
        # Final states a program ignores get no gradient (autograd would otherwise make zeros
        # from the wrappers' metadata: plain meta tensors).
        ctx.set_materialize_grads(False)
        dev = input.emu_device
        mem = ts.memory[dev]
        price = rnn_price(ts.rt, dev, gates, steps, batch, input_size, hidden, layers, directions, dtype, False, rows)
        ts.charge(price.gpu, dev, f"_cudnn_rnn ({mode})", price)
        element = dtype.itemsize
        width = hidden * directions
        out_shape = {"packed": (rows, width), "batch_first": (batch, steps, width)}.get(layout, (steps, batch, width))
        out = ts.new(out_shape, dtype, dev)
        states = [ts.new((layers * directions, batch, hidden), dtype, dev) for _ in range(n_state)]
        weights = rest[n_state:]
        # Kept for the backward: each layer's and step's gates and cell/hidden values (cuDNN's
        # reserve space) and, in a lower precision than the weights, their cast flat copy.
        keep = 0
        if for_backward:
            keep = layers * directions * rows * (gates + 2) * hidden * element
            keep += sum(w.numel() for w in weights if w.dtype != dtype) * element
        ctx.reserve = mem.allocate(keep) if keep else None
        ctx.ts, ctx.mode, ctx.dims, ctx.dtype, ctx.dev = ts, mode, dims, dtype, dev
        ctx.specs = [(t.shape, t.dtype) for t in (input, *rest)]
        return (out, *states)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ts: TensorState = ctx.ts
        steps, batch, rows, input_size, hidden, layers, directions, _, _ = ctx.dims
        if all(g is None for g in grads):
            return (None,) * (5 + len(ctx.specs))
        # (A gradient autograd assembled itself, e.g. from a padded view of the output, can be a
        # plain meta tensor made from the wrapper's metadata: only its existence matters here.)
        dev = ctx.dev
        price = rnn_price(
            ts.rt, dev, _GATES[ctx.mode], steps, batch, input_size, hidden, layers, directions, ctx.dtype, True, rows
        )
        ts.charge(price.gpu, dev, f"_cudnn_rnn_backward ({ctx.mode})", price)
        out = [
            ts.new(tuple(shape), dt, dev) if needed else None
            for (shape, dt), needed in zip(ctx.specs, ctx.needs_input_grad[5:], strict=False)
        ]
        ctx.reserve = None
        return (None, None, None, None, None, *out)


def _charge_copy(ts: TensorState, dev: int, elements: int, dtype: torch.dtype, name: str, backward: bool) -> None:
    nbytes = 2 * elements * dtype.itemsize
    price = copy_price(ts.rt, dev, nbytes, dtype, backward)
    ts.charge(price.gpu, dev, name, price)


class _Gather(torch.autograd.Function):
    """One gather/scatter kernel that lays ``source``'s rows out as ``shape`` (packing a padded
    batch, padding a packed one); its backward lays the gradient back out (zeros where padded)."""

    @staticmethod
    def forward(ctx: Any, ts: TensorState, name: str, shape: tuple, source: EmuTensor) -> EmuTensor:
        out = ts.new(shape, source.dtype, source.emu_device)
        _charge_copy(ts, source.emu_device, out.numel(), source.dtype, name, False)
        ctx.ts, ctx.name, ctx.spec = ts, name, (tuple(source.shape), source.dtype, source.emu_device)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        shape, dtype, dev = ctx.spec
        out = ctx.ts.new(shape, dtype, dev)
        _charge_copy(ctx.ts, dev, out.numel(), dtype, ctx.name + "_backward", True)
        return None, None, None, out


def _stand_in(t: EmuTensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _make_pack(rt: Runtime, orig: Callable) -> Callable:
    ts = rt.tensors

    @functools.wraps(orig)
    def _pack_padded_sequence(input: Any, lengths: Any, batch_first: bool) -> Any:
        if (
            type(input) is not EmuTensor
            or not isinstance(lengths, torch.Tensor)
            or lengths.device.type != "cpu"
            or _foreign_mode()
        ):
            return orig(input, lengths, batch_first)
        # torch's checks and batch sizes from the host's lengths, the data's shape on meta
        data, batch_sizes = orig(_stand_in(input), lengths, batch_first)
        return _Gather.apply(ts, "_pack_padded_sequence", tuple(data.shape), input), batch_sizes

    _pack_padded_sequence.__wrapped__ = orig
    return _pack_padded_sequence


def _make_pad(rt: Runtime, orig: Callable) -> Callable:
    ts = rt.tensors

    @functools.wraps(orig)
    def _pad_packed_sequence(
        data: Any, batch_sizes: Any, batch_first: bool, padding_value: float, total_length: int
    ) -> Any:
        if (
            type(data) is not EmuTensor
            or not isinstance(batch_sizes, torch.Tensor)
            or batch_sizes.device.type != "cpu"
            or _foreign_mode()
        ):
            return orig(data, batch_sizes, batch_first, padding_value, total_length)
        padded, lengths = orig(_stand_in(data), batch_sizes, batch_first, padding_value, total_length)
        return _Gather.apply(ts, "_pad_packed_sequence", tuple(padded.shape), data), lengths

    _pad_packed_sequence.__wrapped__ = orig
    return _pad_packed_sequence


def _make(rt: Runtime, mode: str, orig: Callable) -> Callable:
    ts = rt.tensors

    @functools.wraps(orig)
    def rnn(*args: Any, **kwargs: Any) -> Any:
        # Unpacked: (input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
        # batch_first); packed: (data, batch_sizes, hx, params, has_biases, num_layers, dropout,
        # train, bidirectional), batch_sizes a host tensor.
        if kwargs or len(args) != 9 or not torch.backends.cudnn.enabled or _foreign_mode():
            return orig(*args, **kwargs)
        if isinstance(args[3], bool):
            input, hx, params, has_biases, num_layers, _dropout, train, bidirectional, batch_first = args
            batch_sizes, layout, dims_in = None, "batch_first" if batch_first else "time_first", 3
        elif isinstance(args[4], bool) and isinstance(args[1], torch.Tensor) and args[1].device.type == "cpu":
            input, batch_sizes, hx, params, has_biases, num_layers, _dropout, train, bidirectional = args
            layout, dims_in = "packed", 2
        else:
            return orig(*args, **kwargs)
        states = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
        tensors = (input, *states, *params)
        if not all(type(t) is EmuTensor for t in tensors) or input.dim() != dims_in or not input.is_floating_point():
            return orig(*args, **kwargs)
        directions = 2 if bidirectional else 1
        hidden = states[0].shape[-1]
        per_layer = (4 if has_biases else 2) * directions
        if any(s.shape[-1] != hidden for s in states) or len(params) != per_layer * num_layers:
            return orig(*args, **kwargs)  # an LSTM with projections (proj_size)
        dtype = input.dtype
        if torch.is_autocast_enabled("cuda") and dtype in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.get_autocast_dtype("cuda")
        if batch_sizes is not None:
            steps, batch = len(batch_sizes), int(batch_sizes[0]) if len(batch_sizes) else 0
        elif layout == "batch_first":
            steps, batch = input.shape[1], input.shape[0]
        else:
            steps, batch = input.shape[0], input.shape[1]
        rows = input.shape[0] if batch_sizes is not None else steps * batch
        # cuDNN keeps its reserve space for a training call that autograd will differentiate
        # (decided here: inside the Function's forward grad mode is off).
        for_backward = bool(train) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        dims = (steps, batch, rows, input.shape[-1], hidden, num_layers, directions, layout, for_backward)
        return _FusedRNN.apply(ts, mode, dims, dtype, len(states), input, *states, *params)

    rnn.__wrapped__ = orig
    return rnn


def _foreign_mode() -> bool:
    """A torch function mode that is not gpemu's own (its autocast mode) is active: it must see
    the call, so torch's own path runs."""
    if not torch._C._len_torch_function_stack():
        return False
    return any(not getattr(m, "gpemu_mode", False) for m in torch.overrides._get_current_function_mode_stack())


def install(rt: Runtime) -> None:
    """Replace ``torch._VF.lstm``, ``gru``, ``rnn_tanh`` and ``rnn_relu`` (what torch.nn's RNN
    modules call) and the packed-sequence ops ``pack_padded_sequence`` / ``pad_packed_sequence``
    call."""
    vf = torch._VF
    for mode in _GATES:
        rt.patcher.replace(vf, mode, _make(rt, mode, getattr(vf, mode)))
    rt.patcher.replace(vf, "_pack_padded_sequence", _make_pack(rt, vf._pack_padded_sequence))
    rt.patcher.replace(vf, "_pad_packed_sequence", _make_pad(rt, vf._pad_packed_sequence))
