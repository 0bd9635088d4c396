"""Inference and serving (issue 33): decode steps replayed by shape class, priced at their real
cache length; KV-cache memory as on a GPU; serving metrics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpemu
from gpemu.clock import VirtualClock


class KVCache:
    """A server's own cache object: per layer, key and value tensors that grow by the new tokens."""

    def __init__(self, layers: int) -> None:
        self.keys: list = [None] * layers
        self.values: list = [None] * layers
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        if layer == len(self.keys) - 1:
            self.length += k.shape[2]
        return self.keys[layer], self.values[layer]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        k, v = cache.update(layer, k, v)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        x = self.emb(ids)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cache, i)
        return self.head(x[:, -1])


def _decode(steps: int, replay: bool, prompt: int, batch: int = 2, dim: int = 32) -> tuple[list[float], KVCache, dict]:
    """Prefill then ``steps`` greedy decode steps; each step's emulated time (virtual clock)."""
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock(), replay=replay)
    try:
        torch.manual_seed(0)
        model = TinyDecoder(dim=dim).cuda().eval()
        cache = KVCache(len(model.blocks))
        times = []
        with torch.no_grad():
            tok = model(torch.randint(0, 64, (batch, prompt)).cuda(), cache).argmax(-1, keepdim=True)
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = rt.engine.now()
                tok = model(tok, cache).argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                times.append(rt.engine.now() - t0)
        return times, cache, rt.replay.info() if rt.replay is not None else {}
    finally:
        gpemu.unpatch()


@pytest.mark.slow
def test_decode_steps_are_one_shape_class_priced_at_their_cache_length() -> None:
    """A decode step whose shapes differ only in the cache length is replayed (not recorded
    again), its cache grows as op by op, and each step costs what it costs op by op there."""
    # (sizes where the step is bound by the GPU's work, not by the host issuing it: an op-by-op
    # step on a virtual clock is charged no host time)
    fast, cache, info = _decode(24, replay=True, prompt=4096, batch=32, dim=512)
    slow, ref_cache, _ = _decode(24, replay=False, prompt=4096, batch=32, dim=512)
    assert info["shape_class"] >= 18, info  # a few recordings find the line, then replays
    assert cache.length == ref_cache.length == 4096 + 24
    assert [k.shape for k in cache.keys] == [k.shape for k in ref_cache.keys]
    assert all(k.device.type == "cuda" for k in cache.keys + cache.values)
    # each step at its own length: the same growth per token as op by op (attention over the
    # cache, the cache's copy); the level within the host issue time a replay prices as a whole
    # pass (op by op on a virtual clock: none)
    assert fast[-1] - fast[-2] == pytest.approx(slow[-1] - slow[-2], rel=1e-3)
    assert fast[-1] - fast[8] == pytest.approx(slow[-1] - slow[8], rel=1e-3)
    assert fast[-1] - fast[-2] > 0
    for a, b in zip(fast, slow, strict=True):
        assert a == pytest.approx(b, rel=0.03)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_transformers_generate_replays_its_decode_steps(cache: str) -> None:
    transformers = pytest.importorskip("transformers")
    rt = gpemu.patch(gpu="A100", summary=False, clock=VirtualClock())
    try:
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=128)
        model = transformers.GPT2LMHeadModel(cfg).cuda().eval()
        prompt = torch.randint(1, 90, (2, 8)).cuda()
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0, cache_implementation=cache)
        assert out.shape == (2, 48)
        assert rt.replay.info()["shape_class"] >= 30
    finally:
        gpemu.unpatch()
