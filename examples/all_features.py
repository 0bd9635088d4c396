"""An ordinary PyTorch training script that touches every GPU feature gpemu emulates.

Nothing here knows about gpemu. On a machine with an NVIDIA GPU it trains for real; on a CPU-only
machine run it as

    gpemu run --gpu V100 -- python examples/all_features.py
    gpemu run --gpu V100 --gpus 2 -- python examples/all_features.py

Features: torch.cuda.is_available / device_count / names, torch.accelerator, .cuda(non_blocking=True),
a DataLoader with pin_memory=True and worker processes, SGD and Adam, AMP (autocast + GradScaler),
torch.cuda.Event timing, torch.save / torch.load(map_location='cuda:0') and resuming from the
checkpoint, printed losses, an out-of-memory error caught and recovered with a smaller batch,
memory statistics, and a second GPU when there is one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class SyntheticImages(Dataset):
    """Random images and labels (deterministic per index), like a small CIFAR-style dataset."""

    def __init__(self, size: int, image_size: int = 32, classes: int = 10) -> None:
        self.size, self.image_size, self.classes = size, image_size, classes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)
        image = torch.randn(3, self.image_size, self.image_size, generator=g)
        return image, int(torch.randint(self.classes, (1,), generator=g))


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.BatchNorm2d(128),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class Training:
    """A model, its two optimizers (SGD for the features, Adam for the head), AMP's gradient scaler
    and the step count: what a checkpoint saves and a resumed run loads."""

    def __init__(self, model: nn.Module) -> None:
        self.step = 0
        self.model = model
        self.sgd = torch.optim.SGD(model.features.parameters(), lr=0.05, momentum=0.9)
        self.adam = torch.optim.Adam(model.head.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler("cuda")

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "sgd": self.sgd.state_dict(),
            "adam": self.adam.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, checkpoint: dict) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.sgd.load_state_dict(checkpoint["sgd"])
        self.adam.load_state_dict(checkpoint["adam"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.step = checkpoint["step"]


def train_steps(run: Training, loader: DataLoader, device: torch.device, steps: int) -> None:
    """Mixed-precision training steps, each timed with CUDA events."""
    model, scaler = run.model, run.scaler
    model.train()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    last = run.step + steps
    for images, labels in loader:
        if run.step >= last:
            break
        images = images.cuda(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        run.sgd.zero_grad(set_to_none=True)
        run.adam.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(run.sgd)
        nn.utils.clip_grad_norm_(model.features.parameters(), max_norm=5.0)
        scaler.step(run.sgd)
        scaler.step(run.adam)
        scaler.update()
        end.record()
        end.synchronize()
        print(
            f"step {run.step}: loss {loss.item():.3f}  GPU time {start.elapsed_time(end):.2f} ms  "
            f"scale {scaler.get_scale():.0f}",
            flush=True,
        )
        run.step += 1


def save_and_resume(run: Training) -> Training:
    """Saves a checkpoint and loads it onto cuda:0 into a new model and optimizers."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        torch.save(run.state_dict(), path)
        print(f"checkpoint saved at step {run.step} ({os.path.getsize(path) / 2**20:.2f} MiB)")
        checkpoint = torch.load(path, map_location="cuda:0")
    resumed = Training(SmallConvNet().cuda())
    resumed.load_state_dict(checkpoint)
    print(f"resumed from step {resumed.step} on {next(resumed.model.parameters()).device}")
    return resumed


def largest_batch_that_fits(model: nn.Module, device: torch.device, start_batch: int, image_size: int) -> int:
    """Try a forward+backward at decreasing batch sizes; recover from out-of-memory errors."""
    batch = start_batch
    while batch >= 1:
        try:
            x = torch.randn(batch, 3, image_size, image_size, device=device)
            model(x).float().sum().backward()
            model.zero_grad(set_to_none=True)
            return batch
        except torch.cuda.OutOfMemoryError as exc:
            print(f"out of memory at batch {batch} ({str(exc).split('.')[0]}); retrying with {batch // 2}", flush=True)
            del exc
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            batch //= 2
    raise RuntimeError("not even batch 1 fits")


def describe_gpus() -> None:
    print(
        f"GPUs: {torch.cuda.device_count()}  "
        f"({', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))})"
    )
    props = torch.cuda.get_device_properties(0)
    print(
        f"device 0: compute capability {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
        f"{props.multi_processor_count} SMs"
    )
    acc = torch.accelerator.current_accelerator()
    print(
        f"accelerator: {acc} (available: {torch.accelerator.is_available()}, "
        f"count: {torch.accelerator.device_count()}, current index: {torch.accelerator.current_device_index()})"
    )


def use_second_gpu() -> None:
    with torch.cuda.device(1):
        x = torch.ones(1024, 1024, device="cuda")
        y = (x @ x).sum()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated(1) / 2**20
        print(f"second GPU: {x.device}, {allocated:.1f} MiB allocated, result on {y.device}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps before the checkpoint")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--oom-batch", type=int, default=4096, help="first batch tried in the OOM probe (224x224)")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        raise SystemExit("this example needs an NVIDIA GPU (or `gpemu run --gpu V100 -- python ...`)")
    describe_gpus()
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    device = torch.device("cuda:0")

    dataset = SyntheticImages(size=args.batch_size * (args.steps + 4))
    loader = DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True
    )
    run = Training(SmallConvNet().cuda())
    t0 = time.perf_counter()
    train_steps(run, loader, device, args.steps)
    print(f"trained {run.step} steps in {time.perf_counter() - t0:.2f} s wall time")

    resumed = save_and_resume(run)
    train_steps(resumed, loader, device, 2)

    fits = largest_batch_that_fits(resumed.model, device, args.oom_batch, 224)
    print(f"largest batch that fits at 224x224: {fits}")
    print(
        f"peak memory: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB allocated, "
        f"{torch.cuda.max_memory_reserved() / 2**20:.1f} MiB reserved"
    )
    if torch.cuda.device_count() > 1:
        use_second_gpu()
    print("done")


if __name__ == "__main__":
    main()
