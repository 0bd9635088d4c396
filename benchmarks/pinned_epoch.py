"""Does emulating pinned memory change an epoch? (GPEmu paper Fig. 3c: AlexNet, P100.)

    python benchmarks/pinned_epoch.py [--batches 2000] [--workers 2]

Runs one epoch of an AlexNet training loop (torchvision-equal AlexNet, batches of 64
3x224x224 fp32 from a real DataLoader with worker processes (batches made once per worker), ``pin_memory=True``,
``images.cuda(non_blocking=True)``, ``loss.item()`` every iteration like the PyTorch ImageNet
example) in three settings, each in its own process:

  on         gpemu, P100 + alexnet timings, pinned emulation on (mlock'd pool)
  off        the same with GPEMU_PINNED=0: pin_memory() makes a plain pageable copy, so the
             copy is charged as pageable (synchronous, pageable bandwidth)
  reference  no gpemu at all: the same loader and loop shape, the GPU replaced by sleeping
             (to absolute deadlines) for the per-iteration GPU time the 'on' run charged

and prints epoch time, time the loop waited for data, Python GC activity inside the loop and
minor page faults (fresh pageable buffers fault every page in; pool blocks do not).
The paper: real GPU 329.65 s, emulation without pinned memory 400.39 s (+21%), with 329.43 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from _common import REPO  # (puts the repository on sys.path)
from torch.utils.data import DataLoader, Dataset

from examples.tvmodels import alexnet

if TYPE_CHECKING:
    from gpemu.runtime import Runtime


class Images(Dataset):
    """Whole batches of ImageNet-sized samples, nearly free to produce: each worker builds one
    64x3x224x224 batch once and sends it again (it lands in shared memory once), so the epoch is
    bound by the GPU and the main process's host work, not by a 2-core machine's decoding."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self._images: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, i: int):
        if self._images is None:
            self._images = torch.full((64, 3, 224, 224), 0.5)
        return self._images, torch.randint(0, 1000, (64,))


class GcWatch:
    """Counts collections and the time spent in them (gc.callbacks)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._t = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t


class Epoch(NamedTuple):
    """One epoch of the loop: batches, seconds, and seconds spent waiting for the loader."""

    batches: int
    seconds: float
    data_wait: float


def timed_epoch(loader: DataLoader, step: Callable[[torch.Tensor, torch.Tensor], None]) -> Epoch:
    data_wait = 0.0
    start = time.perf_counter()
    it = iter(loader)
    n = 0
    while True:
        t = time.perf_counter()
        try:
            images, target = next(it)
        except StopIteration:
            break
        data_wait += time.perf_counter() - t
        step(images, target)
        n += 1
    return Epoch(n, time.perf_counter() - start, data_wait)


class EmulatedStep:
    """The training step of the PyTorch ImageNet example, on the (emulated) GPU."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.criterion = torch.nn.CrossEntropyLoss()
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def __call__(self, images: torch.Tensor, target: torch.Tensor) -> None:
        images = images.cuda(non_blocking=True)
        target = target.cuda(non_blocking=True)
        loss = self.criterion(self.model(images), target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        loss.item()  # sync point every iteration, like the ImageNet example's meters


class SleepingStep:
    """The GPU work the 'on' run charged per iteration, as sleep to absolute deadlines."""

    def __init__(self, gpu_seconds: float) -> None:
        from gpemu.clock import RealClock

        self.clock = RealClock()
        self.gpu_seconds = gpu_seconds
        self.deadline = 0.0

    def __call__(self, images: torch.Tensor, target: torch.Tensor) -> None:
        self.deadline = max(self.deadline, time.perf_counter()) + self.gpu_seconds
        self.clock.wait_until(self.deadline)


def emulator_figures(rt: Runtime, batches: int) -> dict:
    """What the emulated run charged per iteration, its host waits and its pinned pool's figures."""
    spans = list(rt.recorder.spans)
    out: dict = {
        "gpu_s_per_iter": sum(s.end - s.start for s in spans if not s.name.startswith("model")) / max(batches, 1),
        "transfer_s_per_iter": sum(
            s.end - s.start for s in spans if s.kind == "transfer" and not s.name.startswith("model")
        )
        / max(batches, 1),
    }
    waits: dict[str, float] = {}
    for w in rt.recorder.waits:
        waits[w.reason] = waits.get(w.reason, 0.0) + (w.end - w.start)
    out["host_waits_s"] = waits
    pinned = rt.pinned  # None: the pinned-memory component is not installed
    out["pin_s"] = pinned.pin_seconds if pinned is not None else 0.0
    out["pool"] = pinned.pool.stats().as_dict() if pinned is not None and pinned.enabled else None
    return out


def run_one(setting: str, batches: int, workers: int, gpu_seconds: float | None) -> dict:
    torch.set_num_threads(1)
    loader = DataLoader(
        Images(batches),
        batch_size=None,
        num_workers=workers,
        pin_memory=True,
        persistent_workers=False,
        prefetch_factor=2 if workers else None,
    )
    rt = None
    step: Callable[[torch.Tensor, torch.Tensor], None]
    if setting in ("on", "off"):
        import gpemu

        rt = gpemu.patch(gpu="P100", model="alexnet", pinned=(setting == "on"), summary=False)
        step = EmulatedStep(alexnet().cuda())
    else:
        loader.pin_memory = False  # no accelerator: torch would warn and not pin anyway
        assert gpu_seconds is not None, "the reference run sleeps for the 'on' run's GPU time"
        step = SleepingStep(gpu_seconds)
    watch = GcWatch()
    flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gc.callbacks.append(watch)
    epoch = timed_epoch(loader, step)
    gc.callbacks.remove(watch)
    out = {
        "setting": setting,
        "batches": epoch.batches,
        "epoch_s": epoch.seconds,
        "data_wait_s": epoch.data_wait,
        "gc_counts": watch.count,
        "gc_s": watch.seconds,
        "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0,
    }
    if rt is not None:
        out.update(emulator_figures(rt, epoch.batches))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=2000, help="batches of 64 per epoch (default 2000, ~1-2 min)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--setting", choices=("on", "off", "reference"), help=argparse.SUPPRESS)
    ap.add_argument("--gpu-seconds", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batches < 1 or args.workers < 0:
        ap.error("--batches must be >= 1 and --workers >= 0")
    if args.setting:
        print(json.dumps(run_one(args.setting, args.batches, args.workers, args.gpu_seconds)))
        return
    results = {}
    for setting in ("on", "off", "reference"):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--setting",
            setting,
            "--batches",
            str(args.batches),
            "--workers",
            str(args.workers),
        ]
        if setting == "reference":
            cmd += ["--gpu-seconds", str(results["on"]["gpu_s_per_iter"])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if proc.returncode != 0:
            sys.exit(f"setting {setting} failed:\n{proc.stderr[-3000:]}")
        results[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = results["reference"]["epoch_s"]
    print(
        f"AlexNet / P100 timings, {args.batches} batches of 64, {args.workers} workers; "
        f"GPU time per iteration {results['on']['gpu_s_per_iter'] * 1e3:.2f} ms "
        f"(transfer {results['on']['transfer_s_per_iter'] * 1e3:.2f} ms pinned, "
        f"{results['off']['transfer_s_per_iter'] * 1e3:.2f} ms pageable)"
    )
    print(
        f"{'setting':10s} {'epoch s':>9s} {'vs ref':>8s} {'data wait s':>12s} {'GC gen0/1/2':>14s} "
        f"{'GC s':>7s} {'minor faults':>13s} {'pin s':>7s}"
    )
    for setting, r in results.items():
        gcs = "/".join(str(c) for c in r["gc_counts"])
        print(
            f"{setting:10s} {r['epoch_s']:9.2f} {100 * (r['epoch_s'] - ref) / ref:+7.1f}% {r['data_wait_s']:12.2f} "
            f"{gcs:>14s} {r['gc_s']:7.3f} {r['minor_faults']:13d} {r.get('pin_s', 0.0):7.2f}"
        )
    for setting in ("on", "off"):
        r = results[setting]
        waits = ", ".join(f"{k} {v:.2f}s" for k, v in sorted(r["host_waits_s"].items()))
        print(f"{setting}: host waits: {waits}; pool {r['pool']}")


if __name__ == "__main__":
    main()
