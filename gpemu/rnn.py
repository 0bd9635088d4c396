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

torch's own path (op by op, as with cuDNN disabled on a GPU) runs for LSTMs with projections
(``proj_size``), packed sequences (``batch_sizes``; ``pack_padded_sequence`` itself does not run
on emulated tensors yet: its lengths are host values), tensor subclasses and calls the emulator
cannot see whole (a torch function mode other than autocast's).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch

from .costs import rnn_price
from .tensor import EmuTensor, TensorState

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install"]

_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class _FusedRNN(torch.autograd.Function):
    """One cuDNN RNN call: outputs, final states, reserve space, gradients and time; no math."""

    @staticmethod
    def forward(ctx: Any, ts: TensorState, mode: str, dims: tuple, dtype: torch.dtype, n_state: int,  # type: ignore[override]
                input: EmuTensor, *rest: EmuTensor) -> tuple:
        steps, batch, input_size, hidden, layers, directions, batch_first, for_backward = dims
        gates = _GATES[mode]
        # Final states a program ignores get no gradient (autograd would otherwise make zeros
        # from the wrappers' metadata: plain meta tensors).
        ctx.set_materialize_grads(False)
        dev = input._dev
        mem = ts.memory[dev]
        price = rnn_price(ts.rt, dev, gates, steps, batch, input_size, hidden, layers, directions, dtype, False)
        ts.charge(price.gpu, dev, f"_cudnn_rnn ({mode})", price)
        element = torch.empty((), dtype=dtype).element_size()
        out_shape = (batch, steps, hidden * directions) if batch_first else (steps, batch, hidden * directions)
        out = ts.wrap(out_shape, _contiguous_strides(out_shape), 0, dtype, dev,
                      mem.allocate(_numel(out_shape) * element))
        state_shape = (layers * directions, batch, hidden)
        states = [ts.wrap(state_shape, _contiguous_strides(state_shape), 0, dtype, dev,
                          mem.allocate(_numel(state_shape) * element)) for _ in range(n_state)]
        weights = rest[n_state:]
        # Kept for the backward: each layer's and step's gates and cell/hidden values (cuDNN's
        # reserve space) and, in a lower precision than the weights, their cast flat copy.
        keep = 0
        if for_backward:
            keep = layers * directions * steps * batch * (gates + 2) * hidden * element
            keep += sum(w.numel() for w in weights if w.dtype != dtype) * element
        ctx.reserve = mem.allocate(keep) if keep else None
        ctx.ts, ctx.mode, ctx.dims, ctx.dtype, ctx.n_state = ts, mode, dims, dtype, n_state
        ctx.specs = [(t.shape, t.dtype) for t in (input, *rest)]
        return (out, *states)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        ts: TensorState = ctx.ts
        steps, batch, input_size, hidden, layers, directions, _, _ = ctx.dims
        dev = next(g._dev for g in grads if isinstance(g, EmuTensor)) if any(
            isinstance(g, EmuTensor) for g in grads) else None
        if dev is None:
            return (None,) * (6 + len(ctx.specs) - 1)
        mem = ts.memory[dev]
        price = rnn_price(ts.rt, dev, _GATES[ctx.mode], steps, batch, input_size, hidden, layers, directions,
                          ctx.dtype, True)
        ts.charge(price.gpu, dev, f"_cudnn_rnn_backward ({ctx.mode})", price)
        out = []
        for (shape, dt), needed in zip(ctx.specs, ctx.needs_input_grad[5:]):
            if not needed:
                out.append(None)
                continue
            size = torch.empty((), dtype=dt).element_size()
            out.append(ts.wrap(shape, _contiguous_strides(tuple(shape)), 0, dt, dev, mem.allocate(_numel(shape) * size)))
        ctx.reserve = None
        return (None, None, None, None, None, *out)


def _make(rt: "Runtime", mode: str, orig: Callable) -> Callable:
    ts = rt.tensors

    @functools.wraps(orig)
    def rnn(*args: Any, **kwargs: Any) -> Any:
        # Unpacked: (input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
        # batch_first); packed sequences pass batch_sizes second and no batch_first.
        if kwargs or len(args) != 9 or not isinstance(args[3], bool) or not torch.backends.cudnn.enabled \
                or _foreign_mode():
            return orig(*args, **kwargs)
        input, hx, params, has_biases, num_layers, _dropout, train, bidirectional, batch_first = args
        states = tuple(hx) if isinstance(hx, (tuple, list)) else (hx,)
        tensors = (input, *states, *params)
        if not all(type(t) is EmuTensor for t in tensors) or input.dim() != 3 or not input.is_floating_point():
            return orig(*args, **kwargs)
        directions = 2 if bidirectional else 1
        hidden = states[0].shape[-1]
        per_layer = (4 if has_biases else 2) * directions
        if any(s.shape[-1] != hidden for s in states) or len(params) != per_layer * num_layers:
            return orig(*args, **kwargs)  # an LSTM with projections (proj_size)
        dtype = input.dtype
        if torch.is_autocast_enabled("cuda") and dtype in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.get_autocast_dtype("cuda")
        steps, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
        # cuDNN keeps its reserve space for a training call that autograd will differentiate
        # (decided here: inside the Function's forward grad mode is off).
        for_backward = bool(train) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        dims = (steps, batch, input.shape[2], hidden, num_layers, directions, bool(batch_first), for_backward)
        result = _FusedRNN.apply(ts, mode, dims, dtype, len(states), input, *states, *params)
        return result[0], *result[1:]

    rnn.__wrapped__ = orig  # type: ignore[attr-defined]
    return rnn


def _foreign_mode() -> bool:
    """A torch function mode that is not gpemu's own (its autocast mode) is active: it must see
    the call, so torch's own path runs."""
    if not torch._C._len_torch_function_stack():
        return False
    return any(not getattr(m, "gpemu_mode", False) for m in torch.overrides._get_current_function_mode_stack())


def install(rt: "Runtime") -> None:
    """Replace ``torch._VF.lstm``, ``gru``, ``rnn_tanh`` and ``rnn_relu`` (what torch.nn's RNN
    modules call)."""
    vf = torch._VF
    for mode in _GATES:
        rt.patcher.replace(vf, mode, _make(rt, mode, getattr(vf, mode)))
