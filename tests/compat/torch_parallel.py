"""torch's own parallel training APIs on 2 ranks, as their tutorials use them (torchrun x2).

    torchrun --nproc-per-node 2 torch_parallel.py --cases ddp,fsdp2,tp

ddp:   DistributedDataParallel(model, device_ids=[rank]) called with CPU batches (DDP moves
       inputs to device_ids[0]); static_graph; join() over uneven inputs; _get_ddp_logging_data().
       (--ddp-arch resnet50 --ddp-batch 64: a torchvision model on 224-px images instead of an MLP)
fsdp2: pytorch/examples distributed/FSDP2: a Transformer built on the meta device, fully_shard per
       block and at the root with a bf16 MixedPrecisionPolicy, to_empty + reset_parameters, Adam,
       clip_grad_norm_.
tp:    tensor parallelism: parallelize_module with ColwiseParallel/RowwiseParallel over a 2-rank
       device mesh, AdamW.

Prints "<case>: trained <N> steps, <X> ms/step" on rank 0 for each case.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def report(case: str, times: list[float]) -> None:
    steady = times[1:] or times
    if dist.get_rank() == 0:
        line = f"{case}: trained {len(times)} steps, {1000 * sum(steady) / len(steady):.2f} ms/step\n"
        sys.stdout.write(line)  # in one write: other ranks' output shares the stream
        sys.stdout.flush()


def run_ddp(steps: int, device: torch.device, arch: str = "mlp", batch: int = 64) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    if arch == "mlp":
        model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 10))
        shape = (256,)
    else:  # a torchvision architecture (examples/tvmodels/: the same modules in plain PyTorch)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        import tvmodels

        model, shape = getattr(tvmodels, arch)(num_classes=10), (3, 224, 224)
    ddp = DDP(model.to(device), device_ids=[device.index], static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    # Uneven inputs: rank 1 has one batch more (a last backward whose gradients it keeps);
    # join() lets rank 0 shadow its gradient all-reduce.
    batches = [(torch.randn(batch, *shape), torch.randint(0, 10, (batch,))) for _ in range(steps + rank)]
    times = []
    with ddp.join():
        for i, (x, y) in enumerate(batches):
            t0 = time.perf_counter()
            loss = F.cross_entropy(ddp(x), y.to(device))  # x stays on the CPU: DDP moves it
            loss.backward()
            if i < steps:
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    data = ddp._get_ddp_logging_data()
    assert data["world_size"] == dist.get_world_size() and data["static_graph"] == 1, data
    report("ddp", times[:steps])
    del ddp, opt
    gc.collect()


def run_fsdp2(steps: int, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim, bias=False)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.heads = 4

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.mlp(x)

        def reset_parameters(self) -> None:
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.LayerNorm)):
                    m.reset_parameters()

    class Transformer(nn.Module):
        def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.out = nn.Linear(dim, vocab, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx)
            for layer in self.layers:
                x = layer(x)
            return self.out(self.norm(x))

        def reset_parameters(self) -> None:
            self.tok.reset_parameters()
            self.norm.reset_parameters()
            self.out.reset_parameters()
            for layer in self.layers:
                layer.reset_parameters()

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    assert isinstance(model, FSDPModule)
    for p in model.parameters():
        assert p.placements == (Shard(0),) and p.dtype == torch.float32
    model.to_empty(device=device)
    model.reset_parameters()
    model.unshard()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters(recurse=False))
    model.reshard()
    assert all(p.device == device for p in model.parameters())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        x = torch.randint(0, 512, (8, 64), device=device)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    report("fsdp2", times)
    del model, optim
    gc.collect()


def run_tp(steps: int, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class FeedForward(nn.Module):
        def __init__(self, dim: int = 256) -> None:
            super().__init__()
            self.in_proj = nn.Linear(dim, 4 * dim)
            self.relu = nn.ReLU()
            self.out_proj = nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out_proj(self.relu(self.in_proj(x)))

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = parallelize_module(
        FeedForward().to(device), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    )
    assert isinstance(model.in_proj.weight, DTensor) and model.in_proj.weight.device == device
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        torch.manual_seed(i)  # every rank of the mesh gets the same input
        x = torch.rand(16, 256, device=device)
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    report("tp", times)
    del model, optim
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="ddp,fsdp2,tp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ddp-arch", default="mlp", help="ddp case's model: mlp or a torchvision architecture")
    parser.add_argument("--ddp-batch", type=int, default=64)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    for case in args.cases.split(","):
        if case == "ddp":
            run_ddp(args.steps, device, args.ddp_arch, args.ddp_batch)
        else:
            {"fsdp2": run_fsdp2, "tp": run_tp}[case](args.steps, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
