"""A Llama-3.1-shaped FSDP2 training step, launched by torchrun (no gpemu import): the closest
real FSDP workload to torchtitan's llama3 that runs here (torchtitan itself is not installed).

    gpemu run --gpu H100 --clock virtual -- torchrun --nproc-per-node 4 benchmarks/llama_fsdp.py --steps 6
    gpemu run --gpu H100 -- torchrun --nproc-per-node 16 benchmarks/llama_fsdp.py --steps 6

Llama-3.1-8B's shapes (``--size 8b``: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
vocabulary 128256), bf16 parameters with fp32 reduction (torchtitan's default mixed precision),
each block ``fully_shard``-ed and checkpointed (full activation checkpointing), AdamW, local
batch 2 of 8192 tokens. Built on the meta device and materialised with ``to_empty``, as
torchtitan does. Rank 0 prints each step's time (``time.perf_counter`` around the step, the step
ending with a ``loss.item()``) and, at the end, the mean of the steps after the first two.

``--layers`` keeps fewer blocks of the same shapes: the emulated FSDP2 memory is overstated today
(its ``resize_(0)`` frees are not seen), so all 32 blocks of the 8B model do not fit an emulated
H100; a step's GPU time and its host work both scale with the depth, so their ratio (what decides
whether a run is host-bound) is the full model's.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

SIZES = {  # dim, layers, heads, kv heads, ffn, vocabulary
    "8b": (4096, 32, 32, 8, 14336, 128256),
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "tiny": (256, 2, 4, 2, 512, 1024),
}


class Block(nn.Module):
    """A Llama transformer block: RMSNorm, grouped-query attention, RMSNorm, SwiGLU."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attention_norm = nn.RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w13 = nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, s, d))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, size: str, layers: int | None = None) -> None:
        super().__init__()
        dim, depth, heads, kv_heads, ffn, vocab = SIZES[size]
        layers = layers or depth
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=True)
        return self.output(self.norm(x))


def build(size: str, layers: int | None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Llama(size, layers)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device="cuda")
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="8b")
    ap.add_argument("--layers", type=int, help="transformer blocks (default: the size's own)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2, help="local batch (sequences per rank)")
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    model = build(args.size, args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    vocab = SIZES[args.size][5]
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1))
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = tokens.cuda(non_blocking=True)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss.item()
        times.append(time.perf_counter() - t0)
        if dist.get_rank() == 0:
            gib = torch.cuda.max_memory_allocated() / 2**30
            print(f"step {step}: {times[-1] * 1e3:.1f} ms, peak memory {gib:.2f} GiB", flush=True)
    if dist.get_rank() == 0:
        steady = times[2:] or times
        print(f"mean step time (after the first two): {sum(steady) / len(steady) * 1e3:.1f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
