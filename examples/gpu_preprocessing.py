"""GPU-side preprocessing (DALI-style JPEG decode) in front of a training loop, emulated.

    python examples/gpu_preprocessing.py [--gpu V100] [--dist decode-dali] [--batches 300] [--cpu-share 0]
    gpemu run --gpu V100 -- python examples/gpu_preprocessing.py      # the same, under `gpemu run`

This example uses gpemu's own API (``GpuPreprocess`` has no PyTorch equivalent): it patches
torch itself when run with plain ``python``, and uses the run's emulated GPU under ``gpemu run``.
About 50 s for 300 batches (a progress bar shows where it is; Ctrl-C stops it).

The loader yields raw batches; ``GpuPreprocess("decode-dali").wrap(loader)`` charges each
batch's decode as GPU time drawn from the measured distribution and holds the decoder's GPU
memory, growing to its plateau over the first batches. At the end the script compares the
emulated per-batch decode times with the stored distribution (two-sample KS statistic,
percentiles) and prints the memory held after selected batches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.data import DataLoader, Dataset

import gpemu
from gpemu.integrations.gpu_preprocessing import GpuPreprocess

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tvmodels import resnet18  # noqa: E402


class EncodedBatches(Dataset):
    """Stand-in for batches of encoded JPEGs: decoding happens 'on the GPU' below."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.zeros(64, 3, 224, 224), torch.randint(0, 1000, (64,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default=None, help="emulated GPU (default V100; under `gpemu run`, the run's)")
    ap.add_argument("--dist", default="decode-dali", help="decode-dali, norm-ffcv or a recorded distribution")
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--cpu-share", type=float, default=0.0)
    args = ap.parse_args()
    try:
        run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


def run(args: argparse.Namespace) -> None:
    rt = gpemu.current()  # set under `gpemu run` (or when a caller patched already)
    own = rt is None
    if own:
        rt = gpemu.patch(gpu=args.gpu or "V100", summary=False)
    elif args.gpu and rt.db.gpu(args.gpu).name != rt.gpus[0].name:
        sys.exit(
            f"--gpu {args.gpu} differs from the emulated GPU of this run ({rt.gpus[0].name}); "
            "drop --gpu or pass it to `gpemu run`"
        )
    gpu = rt.gpus[0].name
    model = resnet18().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    loader = DataLoader(EncodedBatches(args.batches), batch_size=None, num_workers=0, pin_memory=True)
    prep = GpuPreprocess(args.dist, cpu_share=args.cpu_share, seed=0)
    base = torch.cuda.memory_allocated()
    memory_at: dict[int, int] = {}  # held by the preprocessing step
    total_at: dict[int, int] = {}  # everything allocated beyond the model's parameters
    first_span = len(rt.recorder.spans)
    start = time.perf_counter()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        task = progress.add_task(f"training on emulated {gpu}", total=args.batches)
        for i, (images, target) in enumerate(prep.wrap(loader)):
            images, target = images.cuda(non_blocking=True), target.cuda(non_blocking=True)
            loss = criterion(model(images), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()
            if i in (0, 1, 2, 3, 18, 19, 100, args.batches - 1):
                memory_at[i] = prep.memory_bytes
                total_at[i] = torch.cuda.memory_allocated() - base
            progress.advance(task)
    wall = time.perf_counter() - start
    spans = np.array([s.end - s.start for s in rt.recorder.spans[first_span:] if s.kind == "preprocess"])
    stored = rt.db.distribution(args.dist)
    print(
        f"{args.batches} batches on emulated {gpu}: {wall:.2f} s wall, "
        f"preprocessing {spans.sum():.2f} s of GPU time ({args.dist}), cpu share {args.cpu_share}"
    )
    try:
        from scipy.stats import ks_2samp

        res = ks_2samp(spans, stored)
        print(f"two-sample KS vs stored distribution: statistic {res.statistic:.4f}, p-value {res.pvalue:.3f}")
    except ImportError:
        pass
    for q in (10, 50, 90, 99):
        print(
            f"  p{q:<2d} emulated {np.percentile(spans, q) * 1e3:7.3f} ms   "
            f"stored {np.percentile(stored, q) * 1e3:7.3f} ms"
        )
    print("GPU memory after each batch (torch.cuda.memory_allocated() counts the preprocessing):")
    for i in sorted(memory_at):
        print(
            f"  after batch {i:4d}: preprocessing {memory_at[i] / 2**20:8.1f} MiB, "
            f"all beyond the model {total_at[i] / 2**20:8.1f} MiB"
        )
    prep.close()
    if own:
        gpemu.unpatch()


if __name__ == "__main__":
    main()
