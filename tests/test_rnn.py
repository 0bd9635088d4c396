"""nn.LSTM / nn.GRU / nn.RNN as one cuDNN op (gpemu/rnn.py): shapes, gradients, time, memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock


@pytest.fixture
def rt():
    r = gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
    yield r
    torch.backends.cudnn.enabled = True
    gpemu.unpatch()


def _step(rt, model: nn.Module, x: torch.Tensor, hx=None) -> tuple:
    """One forward + backward through ``model``; returns (output, states, GPU spans)."""
    n0 = len(rt.recorder.spans)
    out, states = model(x) if hx is None else model(x, hx)
    out.float().sum().backward()
    torch.cuda.synchronize()
    return out, states if isinstance(states, tuple) else (states,), rt.recorder.spans[n0:]


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first,bidirectional", [(False, False), (True, True)])
def test_shapes_and_gradients_are_torchs(rt, cls, batch_first, bidirectional):
    shape = (5, 7, 16) if batch_first else (7, 5, 16)
    with torch.device("cpu"):
        ref = cls(16, 24, 3, batch_first=batch_first, bidirectional=bidirectional)
        ref_out, ref_states = ref(torch.zeros(shape))
    ref_states = ref_states if isinstance(ref_states, tuple) else (ref_states,)
    model = cls(16, 24, 3, batch_first=batch_first, bidirectional=bidirectional).cuda()
    x = torch.zeros(shape, device="cuda", requires_grad=True)
    out, states, spans = _step(rt, model, x)
    assert out.shape == ref_out.shape and out.device.type == "cuda" and out.dtype == torch.float32
    assert [s.shape for s in states] == [s.shape for s in ref_states]
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
    names = [s.name for s in spans]
    assert sum(n.startswith("_cudnn_rnn (") for n in names) == 1  # the whole RNN: one op forward...
    assert sum(n.startswith("_cudnn_rnn_backward") for n in names) == 1  # ...and one backward


def test_one_fused_op_costs_a_fraction_of_the_per_timestep_decomposition(rt):
    """With cuDNN disabled (as on a GPU) torch runs the per-timestep ops, priced one by one;
    cuDNN's one op is cheaper (word_language_model's LSTM: 2 layers, 35 steps, batch 20)."""
    model = nn.LSTM(200, 200, 2).cuda()
    x = torch.zeros(35, 20, 200, device="cuda")
    hx = tuple(torch.zeros(2, 20, 200, device="cuda") for _ in range(2))
    _, _, fused = _step(rt, model, x, hx)
    torch.backends.cudnn.enabled = False
    _, _, decomposed = _step(rt, nn.LSTM(200, 200, 2).cuda(), x, hx)  # (a new module: no replay)
    busy = [sum(s.end - s.start for s in spans) for spans in (fused, decomposed)]
    assert len(fused) < 10 and len(decomposed) > 500
    assert busy[0] * 2 < busy[1]  # kernel time alone; the decomposition also issues 100x the kernels


def test_time_follows_the_work(rt):
    """Twice the timesteps cost about twice the time; a wider layer costs more."""

    def busy(hidden: int, steps: int) -> float:
        model = nn.LSTM(256, hidden, 1).cuda()
        x = torch.zeros(steps, 64, 256, device="cuda")
        return sum(s.end - s.start for s in _step(rt, model, x)[2])

    assert busy(256, 100) == pytest.approx(2 * busy(256, 50), rel=0.15)
    assert busy(1024, 50) > 1.5 * busy(256, 50)


def test_autocast_runs_it_in_the_lower_precision(rt):
    model = nn.GRU(32, 32, 2).cuda()
    x = torch.zeros(10, 4, 32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, h = model(x)
    assert out.dtype == torch.bfloat16 and h.dtype == torch.bfloat16
    out.float().sum().backward()
    assert model.weight_ih_l0.grad.dtype == torch.float32


def test_reserve_space_is_held_until_the_backward(rt):
    model = nn.LSTM(64, 128, 2).cuda()
    x = torch.zeros(50, 32, 64, device="cuda")
    base = torch.cuda.memory_allocated()
    out, states = model(x)
    held = torch.cuda.memory_allocated() - base
    output_bytes = out.numel() * 4
    assert held > 3 * output_bytes  # outputs and states, plus every layer's and step's gates
    out.sum().backward()
    del out, states
    grads = sum(p.grad.numel() * 4 for p in model.parameters())
    assert torch.cuda.memory_allocated() - base == pytest.approx(grads, rel=0.01)


def test_an_lstm_with_projections_runs_torchs_own_path(rt):
    """cuDNN's fused op here has no projections: torch's decomposition runs, op by op."""
    proj = nn.LSTM(16, 32, 1, proj_size=8).cuda()
    x = torch.zeros(6, 3, 16, device="cuda")
    out, (h, c), spans = _step(rt, proj, x)
    assert out.shape == (6, 3, 8) and h.shape == (1, 3, 8) and c.shape == (1, 3, 32)
    assert not any(s.name.startswith("_cudnn_rnn") for s in spans)
    assert proj.weight_hr_l0.grad is not None


@pytest.mark.parametrize("cudnn", [True, False])
def test_packed_sequences_pack_run_and_pad_as_on_a_gpu(rt, cudnn):
    """pack_padded_sequence takes its lengths from the host, as on CUDA; the packed LSTM runs as
    one cuDNN op (or torch's decomposition with cuDNN disabled); padding back and backward work,
    with emulated gradients all the way to the input."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.backends.cudnn.enabled = cudnn
    x = torch.zeros(6, 3, 16, device="cuda", requires_grad=True)
    packed = pack_padded_sequence(x, [6, 4, 2])
    assert packed.data.shape == (12, 16) and packed.data.device.type == "cuda"
    assert packed.batch_sizes.tolist() == [3, 3, 2, 2, 1, 1]  # a host tensor, as torch makes it
    lstm = nn.LSTM(16, 32, 2).cuda()
    n0 = len(rt.recorder.spans)
    out, (h, c) = lstm(packed)
    assert out.data.shape == (12, 32) and h.shape == c.shape == (2, 3, 32)
    padded, lengths = pad_packed_sequence(out)
    assert padded.shape == (6, 3, 32) and lengths.tolist() == [6, 4, 2]
    padded.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "cuda"
    assert all(p.grad is not None and p.grad.shape == p.shape for p in lstm.parameters())
    fused = sum(s.name.startswith("_cudnn_rnn") for s in rt.recorder.spans[n0:])
    assert fused == (2 if cudnn else 0)


def test_a_packed_lstm_trains_an_embedding_before_it(rt):
    """Unsorted lengths (enforce_sorted=False), an embedding in front and an optimizer after:
    every parameter gets an emulated gradient, as from a GPU."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    emb, lstm, head = nn.Embedding(100, 16).cuda(), nn.LSTM(16, 32).cuda(), nn.Linear(32, 100).cuda()
    params = [*emb.parameters(), *lstm.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(3):
        tokens = torch.zeros(7, 4, dtype=torch.long, device="cuda")
        packed = pack_padded_sequence(emb(tokens), torch.tensor([3, 7, 1, 5]), enforce_sorted=False)
        out, _ = lstm(packed)
        padded, lengths = pad_packed_sequence(out, total_length=9)
        assert padded.shape == (9, 4, 32) and lengths.tolist() == [3, 7, 1, 5]
        head(padded).mean().backward()
        assert all(type(p.grad) is type(padded) and p.grad.shape == p.shape for p in params)
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()


def test_bad_lengths_get_torchs_own_error(rt):
    """Unsorted lengths with enforce_sorted=True: torch's message, not a device mismatch."""
    from torch.nn.utils.rnn import pack_padded_sequence

    with pytest.raises(RuntimeError, match="must be sorted in decreasing order"):
        pack_padded_sequence(torch.zeros(6, 3, 16, device="cuda"), [2, 4, 6])
