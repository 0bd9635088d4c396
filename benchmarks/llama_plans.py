"""Llama 3.1 under torchtitan's parallelism plans (FSDP2, TP, PP) on torch's own APIs, launched by
`gpemu run` (no gpemu import): the shapes and plans of torchtitan's Llama 3.1 benchmarks
(torchtitan/benchmarks/llama3_h100_202412_torchtitan.md), for more emulated GPUs than processes.

    # 8B FSDP on 8 and 128 emulated H100s (one process each)
    gpemu run --cluster dgx-h100 --nodes 1 --fold --clock virtual -- python benchmarks/llama_plans.py --size 8b
    gpemu run --cluster dgx-h100 --nodes 16 --fold --clock virtual -- python benchmarks/llama_plans.py --size 8b
    # 70B FSDP 32 x TP 8 on 256
    gpemu run --cluster dgx-h100 --nodes 32 --fold --clock virtual -- \
        python benchmarks/llama_plans.py --size 70b --tp 8 --batch 16 --ac full
    # 405B FSDP 8 x TP 8 x PP 8 on 512: one process per pipeline stage
    gpemu run --cluster dgx-h100 --nodes 64 --fold --processes 8 --clock virtual -- \
        python benchmarks/llama_plans.py --size 405b --tp 8 --pp 8 --batch 32 --ac full

The mesh is (pp, dp, tp), pipeline stages outermost (torchtitan's order; `--processes` = the
pipeline degree runs one process per stage). Each block is tensor-parallel as torchtitan's llama3
plan with sequence parallel and loss parallel, ``fully_shard``-ed over dp (bf16 parameters,
fp32 reduction), activation checkpointing full or selective (every other block: torchtitan's
layer-wise selective form), a 1F1B / interleaved 1F1B / GPipe pipeline of microbatches of one
sequence. Built on the meta device and materialised with ``to_empty``. The first rank of each
stage prints its step times, tokens/s/GPU as torchtitan counts it (a dp rank's tokens per second
over its tp x pp GPUs) and its peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SIZES = {  # dim, layers, heads, kv heads, ffn, vocabulary (Llama 3.1)
    "405b": (16384, 126, 128, 8, 53248, 128256),
    "70b": (8192, 80, 64, 8, 28672, 128256),
    "8b": (4096, 32, 32, 8, 14336, 128256),
    "tiny": (256, 4, 8, 4, 512, 1024),
}


class Attention(nn.Module):
    """Grouped-query attention whose heads are split over ``tp`` tensor-parallel ranks."""

    def __init__(self, dim: int, heads: int, kv_heads: int, tp: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.local_heads, self.local_kv = heads // tp, kv_heads // tp
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q = self.wq(h).view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.local_kv, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.local_kv, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(attn.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


class Block(nn.Module):
    """A Llama transformer block: RMSNorm, attention, RMSNorm, SwiGLU (torchtitan's module names)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int, tp: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads, tp)
        self.feed_forward = FeedForward(dim, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Stage(nn.Module):
    """Blocks ``first`` to ``last`` (exclusive) of the model, with the embedding on the first
    stage and the norm and output layer on the last."""

    def __init__(self, size: str, first: int, last: int, tp: int) -> None:
        super().__init__()
        dim, depth, heads, kv_heads, ffn, vocab = SIZES[size]
        self.tok_embeddings = nn.Embedding(vocab, dim) if first == 0 else None
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, ffn, tp) for _ in range(first, last))
        self.norm = nn.RMSNorm(dim) if last == depth else None
        self.output = nn.Linear(dim, vocab, bias=False) if last == depth else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None and self.output is not None:
            x = self.output(self.norm(x))
        return x


def tensor_parallel(stage: Stage, tp_mesh: dist.DeviceMesh) -> None:
    """torchtitan's llama3 TP plan with sequence parallel: activations between blocks sharded on
    the sequence, all-gathered into attention and the feed-forward, reduce-scattered out; the
    output layer's logits sharded on the vocabulary (loss parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {}
    if stage.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(stage, tp_mesh, top)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    col, row = ColwiseParallel(), RowwiseParallel(output_layouts=Shard(1))
    plan = {
        "attention_norm": SequenceParallel(),
        "attention": gather,
        "attention.wq": col,
        "attention.wk": col,
        "attention.wv": col,
        "attention.wo": row,
        "ffn_norm": SequenceParallel(),
        "feed_forward": gather,
        "feed_forward.w1": col,
        "feed_forward.w3": col,
        "feed_forward.w2": row,
    }
    for block in stage.layers:
        parallelize_module(block, tp_mesh, plan)


def parallelize(stage: Stage, mesh: dist.DeviceMesh, pp: int, ac: str, first: int) -> Stage:
    """torchtitan's llama3 plan: TP inside each block over mesh["tp"], then activation
    checkpointing (a wrapper around the block), then FSDP2 over mesh["dp"]."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh["tp"].size() > 1:
        tensor_parallel(stage, mesh["tp"])
    for i, block in enumerate(stage.layers):
        if ac == "full" or (ac == "selective" and (first + i) % 2 == 0):
            stage.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = pp == 1  # torchtitan keeps a pipeline stage's parameters gathered between microbatches
    for block in stage.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(stage, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
    stage.to_empty(device="cuda")
    return stage


def build(args: argparse.Namespace, mesh: dist.DeviceMesh) -> list[Stage]:
    """This rank's stages (one per virtual stage: interleaved schedules hold several)."""
    depth = SIZES[args.size][1]
    per_rank = 2 if args.schedule == "Interleaved1F1B" else 1
    total = args.pp * per_rank
    pp_rank = mesh["pp"].get_local_rank()
    stages = []
    for index in (pp_rank + k * args.pp for k in range(per_rank)):
        first, last = depth * index // total, depth * (index + 1) // total
        with torch.device("meta"):
            stage = Stage(args.size, first, last, args.tp)
        stages.append(parallelize(stage, mesh, args.pp, args.ac, first))
    return stages


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--schedule", choices=["1F1B", "Interleaved1F1B", "GPipe"], default="1F1B")
    ap.add_argument("--batch", type=int, default=2, help="local batch (sequences per dp rank)")
    ap.add_argument("--microbatch", type=int, default=1, help="sequences per pipeline microbatch")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--ac", choices=["full", "selective", "none"], default="selective")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    dp = world // (args.tp * args.pp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    stages = build(args, mesh)
    params = [p for stage in stages for p in stage.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, fused=True)
    step = _pipeline_step(args, mesh, stages) if args.pp > 1 else _plain_step(args, stages[0])
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0:
        _report(args, mesh, times, dp)
    dist.destroy_process_group()


def _plain_step(args: argparse.Namespace, model: Stage):  # noqa: ANN202
    from torch.distributed.tensor.parallel import loss_parallel

    vocab = SIZES[args.size][5]
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1))

    def step() -> None:
        batch = tokens.cuda(non_blocking=True)
        with loss_parallel() if args.tp > 1 else contextlib.nullcontext():
            loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()

    return step


def _pipeline_step(args: argparse.Namespace, mesh: dist.DeviceMesh, stages: list[Stage]):  # noqa: ANN202
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.tensor.parallel import loss_parallel

    per_rank, pp_rank = len(stages), mesh["pp"].get_local_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    piped = [
        PipelineStage(stage, pp_rank + k * args.pp, args.pp * per_rank, device, group=mesh["pp"].get_group())
        for k, stage in enumerate(stages)
    ]
    cls = getattr(schedules, f"Schedule{args.schedule}")
    schedule = cls(piped if per_rank > 1 else piped[0], n_microbatches=args.batch // args.microbatch, loss_fn=loss_fn)
    vocab = SIZES[args.size][5]
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1))

    def step() -> None:
        batch = tokens.cuda(non_blocking=True)
        with loss_parallel() if args.tp > 1 else contextlib.nullcontext():
            if pp_rank == 0:
                schedule.step(batch[:, :-1])
            elif pp_rank == args.pp - 1:
                schedule.step(target=batch[:, 1:])
            else:
                schedule.step()

    return step


def _report(args: argparse.Namespace, mesh: dist.DeviceMesh, times: list[float], dp: int) -> None:
    pp_rank, world = mesh["pp"].get_local_rank(), dist.get_world_size()
    steady = times[2:] or times
    mean = sum(steady) / len(steady)
    tps = args.batch * args.seq / mean / (args.tp * args.pp)
    gib = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"llama3 {args.size} on {world} GPUs (pp {args.pp} x dp {dp} x tp {args.tp}, "
        f"{args.schedule if args.pp > 1 else 'no'} pipeline, local batch {args.batch} x {args.seq}, AC {args.ac}), "
        f"stage {pp_rank} (rank {dist.get_rank()}): "
        f"step {mean:.3f} s (mean of steps {min(3, len(times))}-{len(times)}), {tps:,.0f} tokens/s/GPU, "
        f"peak memory {gib:.1f} GiB",
        flush=True,
    )


if __name__ == "__main__":
    main()
