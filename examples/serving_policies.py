"""Batching policies for LLM serving, compared on emulated GPUs: a minimal server loop in plain
PyTorch (a Llama-shaped decoder, a KV cache the server preallocates per slot), fed the same
stream of requests under two policies:

* **static**: take up to ``--slots`` waiting requests, prefill them, decode until the longest is
  done, then take the next batch (a request that arrives meanwhile waits for the whole batch);
* **continuous** (Orca/vLLM-style iteration-level scheduling): before every decode step, admit
  waiting requests into free slots (each prefilled on arrival) and retire finished ones.

    gpemu run --gpu A100 --clock virtual -- python examples/serving_policies.py
    gpemu run --gpu H100 --clock virtual -- python examples/serving_policies.py --requests 96 --rate 12

Requests arrive as a Poisson process (``--rate`` per second) with random prompt and output
lengths (the same seed gives the same requests). On virtual time (``--clock virtual``) arrival
gaps advance the clock instead of sleeping, so time to first token (arrival to the first token
back on the host), time per output token and throughput are what the emulated GPU gives, and
the study takes seconds. gpemu's own serving metrics (per model call, without the queueing) are
in the summary printed at exit. On a real GPU the same script runs as it is (in real time).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import torch
from torch import nn


# ---------------------------------------------------------------------------------------------
# the model: a Llama-shaped decoder whose attention reads a preallocated per-slot KV cache
# ---------------------------------------------------------------------------------------------
class KVSlots:
    """Keys and values of every slot, allocated once: per layer ``(slots, heads, max_len, head_dim)``."""

    def __init__(self, layers: int, slots: int, heads: int, max_len: int, head_dim: int, dtype: torch.dtype) -> None:
        shape = (slots, heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(layers)]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, where: torch.Tensor, span: int):
        """``where``: ``(2, b, t)``, each token's slot and position (prefill: positions 0..t-1);
        ``span``: how many cache positions attention reads (the longest sequence's length)."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        slots, positions = where[0], where[1]
        k_cache[slots, :, positions] = k.transpose(1, 2)  # (the new tokens into their slots)
        v_cache[slots, :, positions] = v.transpose(1, 2)
        if t > 1:  # a prefill attends within its prompt
            a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # a decode step reads its slot's cache (positions past its length are masked)
            keys, values = k_cache[slots[:, 0], :, :span], v_cache[slots[:, 0], :, :span]
            mask = torch.arange(span, device=x.device)[None, :] <= positions[:, -1:]
            a = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :])
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, cache: KVSlots, where: torch.Tensor, span: int) -> torch.Tensor:
        x = self.emb(ids)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cache.keys[i], cache.values[i], where, span)
        return self.head(self.norm(x[:, -1])).argmax(-1)  # greedy: the next token of each sequence


# ---------------------------------------------------------------------------------------------
# requests and the two policies
# ---------------------------------------------------------------------------------------------
@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    slot: int = -1
    length: int = 0  # tokens in its cache
    made: int = 0  # output tokens so far
    first_token: float | None = None
    done: float | None = None
    token_times: list[float] = field(default_factory=list)


def make_requests(n: int, rate: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(Request(t, prompt=rng.randint(32, 512), output=rng.randint(16, 192)))
    return out


class Server:
    def __init__(self, model: Decoder, cache: KVSlots, slots: int) -> None:
        self.model, self.cache, self.slots = model, cache, slots
        self.free = list(range(slots))
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_for(self, r: Request) -> None:
        """Idle until ``r`` has arrived (virtual time: the clock jumps)."""
        gap = r.arrival - self.now()
        if gap > 0:
            time.sleep(gap)

    def prefill(self, r: Request) -> None:
        r.slot = self.free.pop()
        ids = torch.randint(0, 32000, (1, r.prompt)).cuda()
        where = torch.stack([torch.full((1, r.prompt), r.slot), torch.arange(r.prompt)[None]]).cuda()
        self.model(ids, self.cache, where, r.prompt).tolist()  # the first token, back on the host
        r.length, r.made = r.prompt, 1
        r.first_token = self.now()
        r.token_times.append(r.first_token)

    def decode(self, active: list[Request]) -> None:
        """One token for every active request (a batch of their slots)."""
        ids = torch.zeros(len(active), 1, dtype=torch.long).cuda()
        where = torch.tensor([[[r.slot] for r in active], [[r.length] for r in active]]).cuda()
        span = max(r.length for r in active) + 1
        self.model(ids, self.cache, where, span).tolist()
        t = self.now()
        for r in active:
            r.length += 1
            r.made += 1
            r.token_times.append(t)

    def retire(self, active: list[Request]) -> list[Request]:
        t = self.now()
        for r in active:
            if r.made >= r.output:
                r.done = t
                self.free.append(r.slot)
        return [r for r in active if r.made < r.output]


def static(server: Server, requests: list[Request]) -> None:
    waiting = list(requests)
    while waiting:
        server.wait_for(waiting[0])
        now = server.now()
        batch = [r for r in waiting if r.arrival <= now][: server.slots]
        waiting = [r for r in waiting if r not in batch]
        for r in batch:
            server.prefill(r)
        active = server.retire(batch)
        while active:  # (a finished request's slot idles until the whole batch is done)
            server.decode(active)
            active = server.retire(active)


def continuous(server: Server, requests: list[Request]) -> None:
    waiting, active = list(requests), []
    while waiting or active:
        if not active:
            server.wait_for(waiting[0])
        now = server.now()
        while waiting and waiting[0].arrival <= now and server.free:
            r = waiting.pop(0)
            server.prefill(r)
            active.append(r)
        active = server.retire(active)
        if active:
            server.decode(active)
            active = server.retire(active)


# ---------------------------------------------------------------------------------------------
def report(policy: str, requests: list[Request]) -> str:
    ttft = sorted(r.first_token - r.arrival for r in requests)
    tpot = sorted((r.done - r.first_token) / max(1, r.made - 1) for r in requests)
    end = max(r.done for r in requests)
    tokens = sum(r.made for r in requests)

    def p(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return (
        f"{policy:<11} TTFT p50 {p(ttft, 0.5):8.1f} ms  p99 {p(ttft, 0.99):8.1f} ms   "
        f"TPOT p50 {p(tpot, 0.5):6.2f} ms  p99 {p(tpot, 0.99):6.2f} ms   "
        f"{tokens / end:7.0f} tokens/s   all done at {end:6.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--slots", type=int, default=16, help="the largest batch (KV cache slots)")
    ap.add_argument("--policies", default="static,continuous")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(0)
    # Llama-shaped (1 B parameters with 16 layers), fp16
    model = Decoder(vocab=32000, dim=2048, layers=a.layers, heads=16, hidden=5632).half().cuda().eval()
    cache = KVSlots(a.layers, a.slots, 16, 512 + 192 + 1, 128, torch.float16)
    print(
        f"{a.requests} requests at {a.rate:g}/s on {torch.cuda.get_device_name()}, {a.slots} slots, {a.layers} layers"
    )
    for name in a.policies.split(","):
        policy = {"static": static, "continuous": continuous}[name]
        requests = make_requests(a.requests, a.rate, a.seed)
        server = Server(model, cache, a.slots)
        with torch.no_grad():
            policy(server, requests)
        print(report(name, requests))


if __name__ == "__main__":
    main()
