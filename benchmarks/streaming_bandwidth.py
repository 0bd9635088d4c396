"""Bandwidth-bound kernels (issue 29): what an emulated run charges for 64 MiB streaming ops, as a
fraction of the GPU's datasheet bandwidth.

For each GPU, each op runs once on emulated tensors of 64 MiB (float32) under ``gpemu.emulate`` on a
virtual clock with no modelled host (``host="none"``: the figure is the kernel's GPU time), between
two ``torch.cuda.synchronize()`` calls: add (reads two, writes one), ``copy_`` and ``clone`` (read
one, write one), ``cat`` of two 32 MiB halves, ``sum`` (reads one) and an in-place ``mul_``. The
bytes are what the kernel must move; the percentage is bytes / seconds / datasheet bandwidth, beside
what streaming kernels reach on that generation (:func:`gpemu.costmodel.published.stream_plateau`).

    python benchmarks/streaming_bandwidth.py [--gpus V100,A100,H100]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _common import machine  # (puts the repository on sys.path)

import gpemu
from gpemu.clock import VirtualClock
from gpemu.costmodel.gpus import gpu_sheet
from gpemu.costmodel.published import stream_plateau

ELEMENTS = 64 * 2**20 // 4  # float32 elements in 64 MiB


def rates(gpu: str) -> dict[str, tuple[float, float]]:
    """{op: (seconds, fraction of the datasheet bandwidth)} of each streaming op on ``gpu``."""
    bandwidth = gpu_sheet(gpu).memory_bandwidth
    with gpemu.emulate(gpu=gpu, clock=VirtualClock(), summary=False, host="none") as rt:
        now = rt.engine.now
        a, b, c = (torch.empty(ELEMENTS, device="cuda") for _ in range(3))
        h1, h2 = torch.empty(ELEMENTS // 2, device="cuda"), torch.empty(ELEMENTS // 2, device="cuda")
        ops: dict[str, tuple[Callable[[], object], int]] = {
            "add": (lambda: a + b, 3),
            "copy_": (lambda: c.copy_(a), 2),
            "clone": (lambda: a.clone(), 2),
            "cat": (lambda: torch.cat([h1, h2]), 2),
            "sum": (lambda: a.sum(), 1),
            "mul_": (lambda: c.mul_(2.0), 2),
        }
        out: dict[str, tuple[float, float]] = {}
        for name, (run, tensors) in ops.items():
            torch.cuda.synchronize()
            t0 = now()
            run()
            torch.cuda.synchronize()
            seconds = now() - t0
            out[name] = (seconds, tensors * ELEMENTS * 4 / seconds / bandwidth)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", default="V100,A100,H100", help="comma-separated GPU names (default V100,A100,H100)")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    print(
        f"{'GPU':6} {'GB/s':>6} {'streams':>8} | "
        + " | ".join(f"{n:>14}" for n in ("add", "copy_", "clone", "cat", "sum", "mul_"))
    )
    for gpu in args.gpus.split(","):
        sheet = gpu_sheet(gpu)
        row = rates(gpu)
        cells = " | ".join(f"{1e6 * s:7.0f} us {r:4.0%}" for s, r in row.values())
        print(f"{gpu:6} {sheet.memory_bandwidth / 1e9:6.0f} {stream_plateau(sheet.generation):8.0%} | {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
