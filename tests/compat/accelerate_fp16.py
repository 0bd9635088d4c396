"""accelerate with fp16 mixed precision and a shuffled DataLoader, on 2 processes or on one.

    accelerate launch --multi_gpu --num_processes 2 --mixed_precision fp16 accelerate_fp16.py --steps 4
    ACCELERATE_MIXED_PRECISION=fp16 python accelerate_fp16.py --processes 1 --steps 4

The optimizer is built before prepare() moves the model (accelerate's own order). Each process
gets its shard of one shuffled order (accelerate broadcasts the main process's generator state),
checked by gathering the sample indices every process saw. Prints, on the main process,
"accelerate: trained <N> steps, <X> ms/step".
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2, help="how many processes the launcher started")
    args = parser.parse_args()
    accelerator = Accelerator()
    model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = 32 * accelerator.num_processes * args.steps
    data = TensorDataset(torch.randn(n, 128), torch.randint(0, 10, (n,)), torch.arange(n))
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert accelerator.mixed_precision == "fp16" and accelerator.num_processes == args.processes
    times, steps, seen = [], 0, []
    model.train()
    for x, y, index in loader:
        seen.append(index)
        t0 = time.perf_counter()
        with accelerator.autocast():
            loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    total = accelerator.gather(torch.tensor([steps], device=accelerator.device))
    assert total.tolist() == [steps] * accelerator.num_processes, total
    everyone = accelerator.gather(torch.cat(seen)).tolist()
    assert sorted(everyone) == list(range(n)), "the processes' shards overlap: their shuffles differ"
    if accelerator.is_main_process:
        steady = times[1:] or times
        line = f"accelerate: trained {steps} steps, {1000 * sum(steady) / len(steady):.2f} ms/step\n"
        sys.stdout.write(line)  # in one write: other ranks' output shares the stream
        sys.stdout.flush()
    accelerator.end_training()


if __name__ == "__main__":
    main()
