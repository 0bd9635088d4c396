"""What pinning one ImageNet batch costs on this machine (real mmap + mlock + copy).

    python benchmarks/pin_cost.py [--batch 64] [--repeats 20]

Prints the first pin (a pool miss: mmap, mlock and page faults of a new 64 MiB block), the
steady state (pool hits: just the copy), a plain pageable copy (``clone``) for comparison, and
VmLck before/after.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from gpemu.integrations.pinned_memory import PinnedHostPool, locked_bytes, pin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.batch < 1 or args.repeats < 1:
        ap.error("--batch and --repeats must be positive")
    torch.set_num_threads(1)  # like DataLoader's pin thread
    x = torch.randn(args.batch, 3, 224, 224)
    nbytes = x.numel() * x.element_size()
    pool = PinnedHostPool()
    vm0 = locked_bytes()
    t = time.perf_counter()
    y = pin(x, pool)
    first = time.perf_counter() - t
    del y
    gc.collect()
    hits, clones = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        y = pin(x, pool)
        hits.append(time.perf_counter() - t)
        del y
        t = time.perf_counter()
        z = x.clone()
        clones.append(time.perf_counter() - t)
        del z
    s = pool.stats()
    ms = 1e3
    print(f"batch {args.batch}x3x224x224 fp32 = {nbytes / 2**20:.2f} MiB -> block {s.bytes_reserved / 2**20:.0f} MiB")
    print(f"first pin (miss: mmap+mlock+copy)   {first * ms:8.2f} ms")
    print(f"steady pin (hit: copy), median      {statistics.median(hits) * ms:8.2f} ms   (min {min(hits) * ms:.2f}, max {max(hits) * ms:.2f})")
    print(f"pageable clone, median              {statistics.median(clones) * ms:8.2f} ms")
    print(f"pool: blocks {s.blocks}, hits {s.hits}, misses {s.misses}, locked {s.bytes_locked / 2**20:.0f} MiB, "
          f"lock failures {s.lock_failures}")
    print(f"VmLck grew by {(locked_bytes() - vm0) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
