"""ImageNet-style training of a torchvision architecture on synthetic data.

An ordinary PyTorch script (no gpemu import), shaped like pytorch/examples' ImageNet trainer:
a DataLoader with worker processes and pin_memory=True feeding 3x224x224 batches, SGD with
momentum, cross-entropy, and a per-iteration time print-out. On a CPU-only machine:

    gpemu run --gpu V100 -- python examples/imagenet_classifier.py --arch resnet50 --batch-size 32
    gpemu run --gpu A100 -- python examples/imagenet_classifier.py --steps 50 --batch-size 128

The models come from examples/tvmodels/ (same architectures and parameter counts as
torchvision's), so gpemu recognises them and uses measured GPU times.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import tvmodels
from torch.utils.data import DataLoader, Dataset


class SyntheticImageNet(Dataset):
    """Random 3x224x224 images with labels in [0, 1000), deterministic per index."""

    def __init__(self, size: int, image_size: int = 224, classes: int = 1000) -> None:
        self.size, self.image_size, self.classes = size, image_size, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)
        return torch.rand(3, self.image_size, self.image_size, generator=g), int(index % self.classes)


def main() -> None:
    parser = argparse.ArgumentParser(description="ImageNet-style training on synthetic data")
    parser.add_argument("--arch", default="resnet50", choices=sorted(n for n in tvmodels.__all__ if n[0].islower()))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"{args.arch} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
        f"batch {args.batch_size}, {args.workers} workers",
        flush=True,
    )
    model = getattr(tvmodels, args.arch)().to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loader = DataLoader(
        SyntheticImageNet(args.batch_size * args.steps),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=True,
        drop_last=True,
    )

    model.train()
    times = []
    end = time.perf_counter()
    for i, (images, target) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(images)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        top1 = (output.argmax(1) == target).float().mean()
        print(
            f"iter {i}: loss {loss.item():.3f}  acc@1 {top1.item() * 100:.1f}%  "
            f"time {(time.perf_counter() - end) * 1000:.1f} ms",
            flush=True,
        )
        times.append(time.perf_counter() - end)
        end = time.perf_counter()
    if len(times) > 1:
        steady = times[1:]
        print(
            f"mean iteration time (after the first): {sum(steady) / len(steady) * 1000:.1f} ms, "
            f"{args.batch_size * len(steady) / sum(steady):.1f} images/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
