"""Generation loops end as on a GPU with placeholder values (issue 33): the stopping logic's
known values decide where the model's placeholders cannot matter, and the program's own logic on
a model's outputs (without autograd) reads them as the zeros a host would read back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock
from gpemu.device import host_shadow


@pytest.fixture
def rt():
    r = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    yield r
    gpemu.unpatch()


def _unknown_bools(n: int) -> torch.Tensor:
    return torch.randn(n, device="cuda") > 0  # random: values unknown


def test_known_values_decide_where_the_unknown_ones_cannot_matter(rt) -> None:
    with torch.enable_grad():  # (exact logic: holds with autograd on too)
        u = _unknown_bools(4)
        true = torch.ones(4, dtype=torch.bool, device="cuda")
        false = torch.zeros(4, dtype=torch.bool, device="cuda")
        assert host_shadow(true | u).all() and host_shadow(u | true).all()
        assert host_shadow(false | u) is None  # the unknown decides
        assert not host_shadow(u & false).any()
        ints = torch.randint(0, 9, (4,), device="cuda")
        assert host_shadow(ints * torch.zeros(4, dtype=torch.long, device="cuda")).tolist() == [0] * 4
        assert host_shadow(torch.randn(4, device="cuda") * torch.zeros(4, device="cuda")) is None  # (0 * inf)
        v = u.clone()
        v |= true
        assert host_shadow(v).all()
        assert host_shadow(torch.where(true, torch.ones(4, device="cuda"), torch.randn(4, device="cuda"))).all()


def test_where_keeps_a_python_numbers_value(rt) -> None:
    cond = torch.zeros(1, 2, dtype=torch.bool, device="cuda")
    half = torch.ones(1, 2, device="cuda", dtype=torch.float16)
    worst = torch.where(cond, half, -7.0)
    assert worst.dtype == torch.float16 and worst.device.type == "cuda"
    assert host_shadow(worst).tolist() == [[-7.0, -7.0]]
    assert host_shadow(half.where(~cond, 3)).tolist() == [[1.0, 1.0]]


def test_program_logic_without_autograd_reads_placeholders_as_zeros(rt) -> None:
    """Outside the model's forward and without autograd, known values mixed with a model's
    placeholders are computed with zeros for them: a token buffer written with generated tokens
    reads the prompt and zeros, never stale values, and what is computed from it is known."""
    model = nn.Linear(8, 16).cuda()
    buf = torch.full((2, 6), 7, dtype=torch.long, device="cuda")
    with torch.no_grad():
        tokens = model(torch.zeros(2, 8, device="cuda")).argmax(-1)  # the model's: unknown
        assert host_shadow(tokens) is None
        buf[:, 4] = tokens  # a partial write through a view
        assert buf.tolist() == [[7, 7, 7, 7, 0, 7]] * 2
        assert (buf != 7).sum().item() == 2
    with torch.enable_grad():  # training logic keeps the model's values unknown
        loss = model(torch.zeros(2, 8, device="cuda")).sum() * torch.ones((), device="cuda")
        assert host_shadow(loss) is None


def test_a_large_known_mask_keeps_its_values_beside_placeholders(rt) -> None:
    """transformers' generate() grows its attention mask each step (``cat`` of the mask and
    ``mask.new_ones``) beside the model's placeholder logits: a mask of more than 4,096 elements
    (batch 32 x 2,048) stays known and all ones, step after step (it used to turn unknown, then
    zeros, every other step: the host values of a large known input were dropped)."""
    mask = torch.ones(32, 2048, dtype=torch.long).cuda()
    model = nn.Linear(8, 16).cuda()
    with torch.no_grad():
        for _ in range(3):
            logits = model(torch.zeros(32, 8, device="cuda"))  # placeholders beside the mask
            ones = mask.new_ones((mask.shape[0], 1))
            mask = torch.cat([mask, ones], dim=-1)
            picked = logits.argmax(-1) * mask[:, -1]  # known values mixed with placeholders
            assert host_shadow(picked) is not None
    shadow = host_shadow(mask)
    assert shadow is not None and mask.shape == (32, 2051) and bool(shadow.all())


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _hf_style_greedy(model: nn.Module, ids: torch.Tensor, max_length: int, eos: int) -> tuple[torch.Tensor, int]:
    """The shape of transformers' _sample loop: a length criterion or an EOS criterion (on the
    model's tokens) ends a sequence; the loop stops when none is unfinished."""
    unfinished = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
    steps = 0
    finished = False
    while not finished:
        logits = model(ids)[:, -1]
        steps += 1
        nxt = logits.argmax(-1)
        nxt = nxt * unfinished + 0 * (1 - unfinished)
        ids = torch.cat([ids, nxt[:, None]], dim=-1)
        at_length = torch.full((ids.shape[0],), ids.shape[1] >= max_length, dtype=torch.bool, device=ids.device)
        done = torch.full((ids.shape[0],), False, dtype=torch.bool, device=ids.device)
        done = done | at_length | torch.isin(ids[:, -1:], torch.tensor([eos], device=ids.device)).any(-1)
        unfinished = unfinished & ~done
        finished = bool(unfinished.max() == 0)
        if steps > 100:
            break
    return ids, steps


@pytest.mark.parametrize("grad", [False, True])
def test_a_generation_loop_ends_at_its_length_limit(rt, grad: bool) -> None:
    model = _TinyLM().cuda()
    prompt = torch.randint(1, 49, (3, 5)).cuda()  # from the host: known
    with torch.set_grad_enabled(grad):
        ids, steps = _hf_style_greedy(model, prompt, max_length=12, eos=49)
    assert steps == 7 and ids.shape == (3, 12)


@pytest.mark.slow
def test_transformers_generate_ends_for_each_decoding_strategy(rt) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=64, eos_token_id=99, bos_token_id=99
    )
    model = transformers.GPT2LMHeadModel(cfg).cuda().eval()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    prompt = torch.randint(1, 90, (2, 8)).cuda()
    for kw in (
        {"do_sample": False},
        {"do_sample": True, "top_k": 5},
        {"num_beams": 3},
        {"num_beams": 2, "early_stopping": True},
        {"do_sample": False, "cache_implementation": "static"},
    ):
        calls.clear()
        out = model.generate(prompt, max_new_tokens=5, pad_token_id=0, **kw)
        assert out.shape == (2, 13), kw
        if "cache_implementation" not in kw:  # (a compiled static-cache step is not a module call)
            assert len(calls) == 5, kw
