"""nn.DataParallel over 4 GPUs, the single-process multi-GPU recipe of pytorch/examples' ImageNet
script (``torch.nn.DataParallel(model).cuda()``), with ResNet-50 (examples/tvmodels/: the
torchvision architecture in plain PyTorch).

    python data_parallel.py --arch resnet50 --batch-size 256 --steps 5

Prints "data-parallel: trained <N> steps, <X> ms/step" (steady steps: after the first).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import tvmodels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    assert torch.cuda.device_count() >= 4, "needs 4 GPUs"
    model = torch.nn.DataParallel(getattr(tvmodels, args.arch)()).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, 1000, (args.batch_size,))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        output = model(images)  # scattered from the host to the 4 GPUs
        loss = F.cross_entropy(output, target.cuda(non_blocking=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()  # as the ImageNet script's meters do: waits for the step
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    line = f"data-parallel: trained {len(times)} steps, {1000 * sum(steady) / len(steady):.2f} ms/step\n"
    sys.stdout.write(line)  # in one write: other ranks' output shares the stream
    sys.stdout.flush()


if __name__ == "__main__":
    main()
