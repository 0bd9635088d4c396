"""A paged KV cache (vLLM-style) served with continuous batching, on emulated GPUs: a minimal server
loop in plain PyTorch whose KV cache is one preallocated pool of fixed-size blocks per layer.

* **the pool**: sized as vLLM sizes it, ``--gpu-memory-utilization`` of the GPU's memory less
  what is in use after the weights (``torch.cuda.mem_get_info``), in blocks of ``--block-size``
  tokens (``--blocks N`` asks for N blocks instead); a pool that does not fit raises CUDA's
  out-of-memory error, as it would there;
* **the block table**: each request holds a list of block numbers; a token at position ``p`` is
  written to block ``table[p // block_size]`` at offset ``p % block_size``, and a decode step's
  attention gathers its sequences' blocks (``pool[table]``) and masks the positions past each
  sequence's length;
* **the scheduler**: before every decode step, waiting requests are admitted while their prompt
  fits the free blocks (each prefilled on admission); a running request that needs a new block
  when none is free is preempted (its blocks freed, recomputed later: vLLM's default).

    gpemu run --gpu A100 --clock virtual -- python examples/serving_paged.py
    gpemu run --gpu A100 --clock virtual -- python examples/serving_paged.py --blocks 40000   # does not fit

It prints the pool (blocks, bytes per block), the peak of blocks in use, TTFT (arrival to first
token), TPOT and throughput; gpemu's summary at exit gives its own serving metrics (per model
call) and the KV cache it saw held: the whole pool, which the server holds from the start.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn


# ---------------------------------------------------------------------------------------------
# the paged KV cache
# ---------------------------------------------------------------------------------------------
class PagedKV:
    """Per layer, keys and values in ``(blocks, heads, block_size, head_dim)`` pools allocated once,
    and the free list of block numbers."""

    def __init__(self, layers: int, blocks: int, heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
        shape = (blocks, heads, block_size, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(layers)]
        self.block_size = block_size
        self.free = list(range(blocks))

    @staticmethod
    def block_bytes(layers: int, heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block number stands for: its keys and values in every layer."""
        return 2 * layers * heads * block_size * head_dim * dtype.itemsize


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, step: Step) -> torch.Tensor:
        """``step``: where the new tokens go (each token's block and offset) and, for a decode
        step, what the sequences read (their block tables and valid positions)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # the new tokens into their blocks: (b*t) rows of (heads, head_dim)
        k_pool[step.slot_blocks, :, step.slot_offsets] = k.transpose(1, 2).reshape(b * t, self.heads, -1)
        v_pool[step.slot_blocks, :, step.slot_offsets] = v.transpose(1, 2).reshape(b * t, self.heads, -1)
        if t > 1:  # a prefill attends within its prompt
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a decode step gathers its sequences' blocks: (b, blocks, heads, block, hd) -> (b, heads, span, hd)
            keys = k_pool[step.table].permute(0, 2, 1, 3, 4).flatten(2, 3)
            values = v_pool[step.table].permute(0, 2, 1, 3, 4).flatten(2, 3)
            a = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask[:, None, None, :])
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class Step(NamedTuple):
    """Where one model call's tokens go and what they read: each new token's block and offset;
    for a decode step, each sequence's block table (padded with block 0) and its valid positions.
    (Given to the model as tensors, not in an object: gpemu counts the tensors a call's objects
    hold as its KV cache.)"""

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    table: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, cache: PagedKV, *step: torch.Tensor | None) -> torch.Tensor:
        x = self.emb(ids)
        where = Step(*step)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cache.keys[i], cache.values[i], where)
        return self.head(self.norm(x[:, -1])).argmax(-1)  # greedy: the next token of each sequence


# ---------------------------------------------------------------------------------------------
# requests and the server
# ---------------------------------------------------------------------------------------------
@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens in its cache
    made: int = 0  # output tokens so far
    first_token: float | None = None
    done: float | None = None
    preempted: int = 0


def make_requests(n: int, rate: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(Request(t, prompt=rng.randint(32, 512), output=rng.randint(16, 192)))
    return out


class Server:
    def __init__(self, model: Decoder, cache: PagedKV, max_batch: int) -> None:
        self.model, self.cache, self.max_batch = model, cache, max_batch
        self.t0 = time.perf_counter()
        self.peak_blocks = 0
        self.preemptions = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _need(self, tokens: int) -> int:
        return -(-tokens // self.cache.block_size)

    def _take(self, r: Request, tokens: int) -> bool:
        """Blocks for ``r`` to hold ``tokens`` tokens (False: not enough free)."""
        more = self._need(tokens) - len(r.blocks)
        if more > len(self.cache.free):
            return False
        r.blocks += [self.cache.free.pop() for _ in range(more)]
        self.peak_blocks = max(self.peak_blocks, self.cache.keys[0].shape[0] - len(self.cache.free))
        return True

    def release(self, r: Request) -> None:
        self.cache.free += r.blocks
        r.blocks = []

    def prefill(self, r: Request) -> bool:
        """Admit ``r``: its prompt (and any tokens it made before a preemption) into its blocks,
        its next token back on the host (False: its blocks do not fit now)."""
        tokens = r.prompt + r.made
        if not self._take(r, tokens + 1):
            return False
        bs = self.cache.block_size
        positions = torch.arange(tokens)
        table = torch.tensor(r.blocks)
        step = Step(table[positions // bs].cuda(), (positions % bs).cuda())
        ids = torch.randint(0, self.model.emb.num_embeddings, (1, tokens)).cuda()
        self.model(ids, self.cache, *step).tolist()
        r.length = tokens
        if r.first_token is None:
            r.made, r.first_token = 1, self.now()
        return True

    def decode(self, active: list[Request]) -> None:
        """One token for every active request: the batch's block tables, padded to the longest."""
        bs = self.cache.block_size
        width = max(len(r.blocks) for r in active)
        table = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in active])
        lengths = torch.tensor([r.length for r in active])
        step = Step(
            table[torch.arange(len(active)), lengths // bs].cuda(),
            (lengths % bs).cuda(),
            table.cuda(),
            (torch.arange(width * bs)[None, :] <= lengths[:, None]).cuda(),
        )
        ids = torch.zeros(len(active), 1, dtype=torch.long).cuda()
        self.model(ids, self.cache, *step).tolist()
        for r in active:
            r.length += 1
            r.made += 1

    def grow(self, active: list[Request], waiting: list[Request]) -> list[Request]:
        """Every active request gets room for its next token; when the pool is out of blocks the
        newest is preempted (its blocks freed, back to the front of the queue)."""
        kept = list(active)
        for r in list(active):
            while r in kept and not self._take(r, r.length + 1):
                victim = kept.pop()
                self.release(victim)
                victim.preempted += 1
                self.preemptions += 1
                waiting.insert(0, victim)
        return kept

    def retire(self, active: list[Request]) -> list[Request]:
        t = self.now()
        for r in active:
            if r.made >= r.output:
                r.done = t
                self.release(r)
        return [r for r in active if r.made < r.output]


def serve(server: Server, requests: list[Request]) -> None:
    """Continuous batching over the paged cache."""
    waiting, active = list(requests), []
    while waiting or active:
        if not active and waiting[0].arrival > server.now():
            time.sleep(waiting[0].arrival - server.now())  # (virtual time: the clock jumps)
        while waiting and waiting[0].arrival <= server.now() and len(active) < server.max_batch:
            if not server.prefill(waiting[0]):
                if not active:  # (alone, and still too long for the pool)
                    raise SystemExit(f"a request of {waiting[0].prompt + waiting[0].made} tokens does not fit the pool")
                break
            active.append(waiting.pop(0))
        active = server.retire(active)
        active = server.grow(active, waiting)
        if active:
            server.decode(active)
            active = server.retire(active)


# ---------------------------------------------------------------------------------------------
def report(requests: list[Request]) -> str:
    ttft = sorted(r.first_token - r.arrival for r in requests)
    tpot = sorted((r.done - r.first_token) / max(1, r.made - 1) for r in requests)
    end = max(r.done for r in requests)
    tokens = sum(r.made for r in requests)

    def p(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return (
        f"paged       TTFT p50 {p(ttft, 0.5):8.1f} ms  p99 {p(ttft, 0.99):8.1f} ms   "
        f"TPOT p50 {p(tpot, 0.5):6.2f} ms  p99 {p(tpot, 0.99):6.2f} ms   "
        f"{tokens / end:7.0f} tokens/s   all done at {end:6.2f} s"
    )


def pool_blocks(wanted: int | None, utilization: float, block_bytes: int) -> int:
    """The blocks asked for, or as many as fit in ``utilization`` of the GPU's memory beside what
    is in use (vLLM's rule)."""
    if wanted is not None:
        return wanted
    free, total = torch.cuda.mem_get_info()
    return max(0, int(total * utilization) - (total - free)) // block_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--max-batch", type=int, default=32, help="the most sequences a decode step runs")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--blocks", type=int, default=None, help="blocks in the pool (default: from free memory)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="of the GPU's memory, weights and pool")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(0)
    heads, head_dim, dtype = 16, 128, torch.float16
    # Llama-shaped (1 B parameters with 16 layers), fp16
    model = Decoder(vocab=32000, dim=heads * head_dim, layers=a.layers, heads=heads, hidden=5632)
    model = model.to(dtype).cuda().eval()
    per_block = PagedKV.block_bytes(a.layers, heads, a.block_size, head_dim, dtype)
    blocks = pool_blocks(a.blocks, a.gpu_memory_utilization, per_block)
    before = torch.cuda.memory_allocated()
    try:
        cache = PagedKV(a.layers, blocks, heads, a.block_size, head_dim, dtype)
    except torch.cuda.OutOfMemoryError as e:
        print(f"the pool of {blocks} blocks ({blocks * per_block / 2**30:.2f} GiB) does not fit: {e}")
        raise SystemExit(1) from None
    held = torch.cuda.memory_allocated() - before
    print(
        f"{a.requests} requests at {a.rate:g}/s on {torch.cuda.get_device_name()}, {a.layers} layers; "
        f"pool {blocks} blocks of {a.block_size} tokens, {per_block / 2**20:.2f} MiB a block, "
        f"{held / 2**30:.2f} GiB allocated"
    )
    requests = make_requests(a.requests, a.rate, a.seed)
    server = Server(model, cache, a.max_batch)
    with torch.no_grad():
        serve(server, requests)
    print(report(requests))
    print(
        f"blocks in use at peak {server.peak_blocks} of {blocks} "
        f"({server.peak_blocks * per_block / 2**30:.2f} GiB), {server.preemptions} preemption(s)"
    )


if __name__ == "__main__":
    main()
