"""Emulated host->GPU copy times against what they should be (real clock, real waits).

    python benchmarks/transfers.py [--gpu P100] [--model alexnet] [--batch 64] [--iters 50]

Per iteration: copy one ImageNet batch, then the model's forward+backward GPU time (from the
profile database) is queued. Four ways to copy:

  pageable            x.cuda()                              host waits for the copy
  pinned              x_pinned.cuda()                        host waits, pinned bandwidth
  pinned+non_blocking x_pinned.cuda(non_blocking=True)       queued on the compute stream
  side stream         the same on a second stream, one batch ahead (copy/compute overlap)

Expected per-iteration time is computed from the same database values; the difference is the
emulator's own error (sleep overshoot, host overhead).
"""

from __future__ import annotations

import argparse
import time

import torch

import gpemu
from gpemu.transfers import host_to_device_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="P100")
    ap.add_argument("--model", default="alexnet")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    rt = gpemu.patch(gpu=args.gpu, model=args.model, summary=False)
    engine = rt.engine
    fwd = rt.db.lookup(args.gpu, args.model, args.batch, "forward").value
    bwd = rt.db.lookup(args.gpu, args.model, args.batch, "backward").value
    compute = fwd + bwd
    x = torch.randn(args.batch, 3, 224, 224)
    xp = x.pin_memory()
    pageable, prov = host_to_device_seconds(rt, x, 0, pinned=False)
    pinned, _ = host_to_device_seconds(rt, xp, 0, pinned=True)
    print(
        f"{args.model} on {args.gpu}, batch {args.batch}: forward+backward {compute * 1e3:.2f} ms; "
        f"copy pageable {pageable * 1e3:.2f} ms ({prov}), pinned {pinned * 1e3:.2f} ms"
    )

    def step() -> None:
        engine.stream(0).enqueue(compute, "forward", "fwd+bwd")

    def run(name: str, body, expected: float) -> None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.iters):
            body()
        torch.cuda.synchronize()
        per = (time.perf_counter() - t) / args.iters
        print(
            f"{name:22s} {per * 1e3:8.3f} ms/iter   expected {expected * 1e3:8.3f}   "
            f"error {100 * (per - expected) / expected:+6.2f}%"
        )

    run("pageable", lambda: (x.cuda(), step()), pageable + compute)
    run("pinned", lambda: (xp.cuda(), step()), pinned + compute)
    # non_blocking on the compute stream: the copy is ordered after the previous compute, so
    # nothing overlaps; the host only stops at the final synchronize.
    run("pinned+non_blocking", lambda: (xp.cuda(non_blocking=True), step()), pinned + compute)
    side = torch.cuda.Stream()

    def overlapped() -> None:
        with torch.cuda.stream(side):
            xp.cuda(non_blocking=True)  # next batch's copy runs beside this batch's compute
        step()

    run("side stream (overlap)", overlapped, max(pinned, compute))
    c = rt.recorder.counters
    print(
        f"h2d copies {int(c['h2d_copies'])}, {c['h2d_bytes'] / 2**30:.2f} GiB "
        f"({c.get('h2d_pinned_bytes', 0) / 2**30:.2f} GiB pinned)"
    )
    gpemu.unpatch()


if __name__ == "__main__":
    main()
