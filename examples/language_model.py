"""A small GPT-style language model trained on random tokens (an ordinary PyTorch script).

Causal self-attention (scaled_dot_product_attention), pre-norm transformer blocks, tied
embeddings, AdamW, bf16/fp16 autocast, gradient clipping. On a CPU-only machine:

    gpemu run --gpu A100 -- python examples/language_model.py
    gpemu run --gpu V100 -- python examples/language_model.py --layers 12 --width 768 --steps 20
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main() -> None:
    parser = argparse.ArgumentParser(description="GPT-style language model on random tokens")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = GPT(args.vocab, args.context, args.width, args.layers, args.heads).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"GPT with {params / 1e6:.1f}M parameters on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}",
        flush=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    use_bf16 = device == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    dtype = torch.bfloat16 if use_bf16 else torch.float16
    scaler = torch.amp.GradScaler(device, enabled=not use_bf16)
    for step in range(args.steps):
        t0 = time.perf_counter()
        data = torch.randint(args.vocab, (args.batch_size, args.context + 1))
        x, y = data[:, :-1].to(device, non_blocking=True), data[:, 1:].to(device, non_blocking=True)
        with torch.autocast(device, dtype=dtype):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        value = loss.item()
        seconds = time.perf_counter() - t0
        print(
            f"step {step}: loss {value:.3f} (ppl {math.exp(min(value, 20)):.1f})  {seconds * 1000:.1f} ms  "
            f"{args.batch_size * args.context / seconds:.0f} tokens/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
