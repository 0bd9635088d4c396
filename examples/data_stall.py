"""Data stalls: a light model waits for its input pipeline, a heavy one does not.

An ordinary PyTorch training script (no gpemu import): a CPU-bound input pipeline that really
decodes JPEGs and augments them (PIL decode, random crop, flip, normalise) feeds a model on
``cuda``. Run it on an emulated GPU and read the summary gpemu prints at exit:

    gpemu run --gpu V100 -- python examples/data_stall.py --arch alexnet --workers 0
    gpemu run --gpu V100 -- python examples/data_stall.py --arch resnet50 --workers 0

The GPEmu paper's observation: with the same pipeline, AlexNet (≈ 30 ms of GPU work per batch of
64 on a V100) spends most of its time stalled on data, ResNet-50 (≈ 200 ms) much less, and more
DataLoader workers shrink the stall. ``--sweep`` runs every combination under ``gpemu run`` and
prints a table of stall shares (about a minute or two):

    python examples/data_stall.py --sweep
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tvmodels import alexnet, resnet50  # noqa: E402  (torchvision-equal models, see tvmodels/)

ARCHS = {"alexnet": alexnet, "resnet50": resnet50}
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def synthetic_jpegs(count: int, size: int = 256, seed: int = 0) -> list[bytes]:
    """ImageNet-like JPEG files (smooth shapes plus noise, quality 90), made once in memory."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    files = []
    for _ in range(count):
        a, b, c = rng.uniform(2, 12, 3)
        base = np.stack([np.sin(a * xx + b * yy), np.cos(b * xx * c), np.sin(c * yy + a)], axis=-1)
        img = (127 + 80 * base + rng.normal(0, 25, (size, size, 3))).clip(0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        files.append(buf.getvalue())
    return files


class JpegDataset(Dataset):
    """Decode + random crop + horizontal flip + normalise, all on the CPU, per sample."""

    def __init__(self, files: list[bytes], length: int, crop: int = 224) -> None:
        self.files, self.length, self.crop = files, length, crop

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        img = Image.open(io.BytesIO(self.files[index % len(self.files)])).convert("RGB")
        w, h = img.size
        x, y = int(rng.integers(0, w - self.crop + 1)), int(rng.integers(0, h - self.crop + 1))
        img = img.crop((x, y, x + self.crop, y + self.crop))
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        arr = (np.asarray(img, dtype=np.float32) / 255.0 - MEAN) / STD
        return torch.from_numpy(arr.transpose(2, 0, 1).copy()), index % 1000


def train(arch: str, workers: int, batch_size: int, iterations: int, threads: int) -> None:
    # One intra-op thread, as DataLoader workers use: on a small shared machine two OpenMP threads
    # fighting other processes made collating a batch 10x slower than one thread.
    torch.set_num_threads(threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = ARCHS[arch]().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    criterion = torch.nn.CrossEntropyLoss()
    data = JpegDataset(synthetic_jpegs(32), length=batch_size * iterations)
    loader = DataLoader(
        data,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=False,
    )
    model.train()
    start = time.perf_counter()
    for step, (images, target) in enumerate(loader):
        images = images.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(
        f"{arch}, {workers} worker(s): {iterations} iterations in {time.perf_counter() - start:.2f} s on "
        f"{torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}",
        flush=True,
    )


def _gpemu() -> list[str]:
    exe = shutil.which("gpemu")
    return [exe] if exe else [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())"]


def sweep(gpu: str, archs: list[str], workers: list[int], batch_size: int, iterations: int) -> None:
    """Run every (arch, workers) under `gpemu run` and print the stall shares from --metrics."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    rows = []
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with tempfile.TemporaryDirectory() as tmp, progress:
        task = progress.add_task("runs", total=len(archs) * len(workers))
        for arch in archs:
            for w in workers:
                metrics = os.path.join(tmp, f"{arch}-{w}.json")
                cmd = _gpemu() + [
                    "run",
                    "--gpu",
                    gpu,
                    "--no-summary",
                    "--metrics",
                    metrics,
                    "--",
                    sys.executable,
                    os.path.abspath(__file__),
                    "--arch",
                    arch,
                    "--workers",
                    str(w),
                    "--batch-size",
                    str(batch_size),
                    "--iterations",
                    str(iterations),
                ]
                progress.console.print(
                    f"$ gpemu run --gpu {gpu} --metrics {os.path.basename(metrics)} -- python "
                    f"examples/data_stall.py --arch {arch} --workers {w}",
                    highlight=False,
                )
                progress.update(task, description=f"{arch}, {w} worker(s)")
                proc = subprocess.run(cmd, capture_output=True, text=True)
                progress.advance(task)
                if proc.returncode != 0:
                    sys.stderr.write(proc.stderr)
                    raise SystemExit(f"run failed: {arch} with {w} workers")
                with open(metrics) as f:
                    m = json.load(f)
                dev = m["devices"][0]
                win = dev["steady"] or dev["whole"]
                rows.append(
                    (
                        arch,
                        w,
                        dev["iteration_time"]["mean_s"] * 1e3,
                        win["busy_s"] / max(1, dev["iterations"] - 1) * 1e3,
                        win["data_stall_share"],
                        dev["au"],
                    )
                )
    print()
    print(
        f"Data stall on an emulated {gpu}, batch {batch_size}, {iterations} iterations "
        f"(steady state: iterations 1..{iterations - 1})"
    )
    print(f"{'model':<10} {'workers':>7} {'iter (ms)':>10} {'GPU busy/iter (ms)':>19} {'data stall':>11} {'AU':>7}")
    for arch, w, it, busy, stall, au in rows:
        print(f"{arch:<10} {w:>7} {it:>10.1f} {busy:>19.1f} {100 * stall:>10.1f}% {100 * au:>6.1f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="alexnet")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the main process")
    p.add_argument("--sweep", action="store_true", help="run alexnet/resnet50 x workers under `gpemu run`")
    p.add_argument("--gpu", default="V100", help="GPU for --sweep")
    p.add_argument("--sweep-workers", default="0,2", help="worker counts for --sweep (comma separated)")
    args = p.parse_args()
    try:
        if args.sweep:
            sweep(
                args.gpu,
                ["alexnet", "resnet50"],
                [int(w) for w in args.sweep_workers.split(",")],
                args.batch_size,
                args.iterations,
            )
        else:
            train(args.arch, args.workers, args.batch_size, args.iterations, args.threads)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
