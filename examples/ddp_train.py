"""Data-parallel training with DistributedDataParallel, launched by torchrun (no gpemu import).

    torchrun --nproc-per-node 2 examples/ddp_train.py                       # real GPUs
    gpemu run --gpu V100 --gpus 2 -- torchrun --nproc-per-node 2 examples/ddp_train.py

Uses backend='nccl', LOCAL_RANK for the device, a DistributedSampler, DDP with no_sync()
gradient accumulation, and an all_reduce of the accuracy counters, like most DDP scripts.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tvmodels
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser(description="DDP training launched by torchrun")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=16, help="per GPU")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    samples = args.batch_size * args.steps * args.accumulate * world
    data = TensorDataset(torch.rand(samples, 3, 64, 64), torch.randint(0, 1000, (samples,)))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, pin_memory=True)

    model = DDP(getattr(tvmodels, args.arch)().to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    correct = torch.zeros((), device=device)
    seen = 0
    t0 = time.perf_counter()
    for i, (images, target) in enumerate(loader):
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        last_micro_batch = (i + 1) % args.accumulate == 0
        context = model.no_sync() if not last_micro_batch else torch.enable_grad()
        with context:
            output = model(images)
            loss = F.cross_entropy(output, target) / args.accumulate
            loss.backward()
        if last_micro_batch:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        correct += (output.argmax(1) == target).sum()
        seen += len(target)
    totals = torch.tensor([seen], device=device)
    dist.all_reduce(totals)
    dist.all_reduce(correct)
    torch.cuda.synchronize()
    if rank == 0:
        print(
            f"world {world}: {args.steps} steps in {time.perf_counter() - t0:.2f} s, "
            f"{int(totals.item())} samples, accuracy {correct.item() / totals.item():.3f}, "
            f"on {torch.cuda.get_device_name(device)}",
            flush=True,
        )
    print(f"rank {rank} on {device} (current device {torch.cuda.current_device()})", flush=True)
    # DDP sits in reference cycles; collect it before tearing the process group down, or gloo's
    # threads may be stopped during interpreter shutdown and abort. Then leave together.
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
