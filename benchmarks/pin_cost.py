"""What pinning one ImageNet batch costs on this machine (real mmap + mlock + copy).

    python benchmarks/pin_cost.py [--batch 64] [--repeats 20] [--epochs 3] [--as-nobody]

Prints the first pin (a pool miss: mmap, mlock and page faults of a new 64 MiB block), the
steady state (pool hits: just the copy), a plain pageable copy (``clone``) for comparison, and
VmLck before/after. Then runs a few epochs of DataLoader(pin_memory=True, num_workers=2) under
gpemu and prints, per epoch, whether every batch is pinned, pool misses and VmLck.
``--as-nobody`` (as root) does all of it in a forked child running as uid/gid 65534, which has
no CAP_IPC_LOCK and an 8 MiB RLIMIT_MEMLOCK here: the pool works unlocked and says so once.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import gpemu
from gpemu.integrations.pinned_memory import PinnedHostPool, host_pool, locked_bytes, pin


class Batches(Dataset):
    def __init__(self, n: int, batch: int) -> None:
        self.n, self.batch = n, batch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((self.batch, 3, 224, 224), float(i)), torch.full((self.batch,), i)


def dataloader_epochs(epochs: int, batch: int) -> None:
    gpemu.patch(gpu="V100", summary=False)
    loader = DataLoader(Batches(8, batch), batch_size=None, num_workers=2, pin_memory=True)
    pool = host_pool()
    vm0 = locked_bytes()
    print(
        f"DataLoader(pin_memory=True, num_workers=2), {batch}x3x224x224 batches, 8 per epoch; "
        f"VmLck at start {vm0 / 2**20:.0f} MiB"
    )
    for epoch in range(epochs):
        before = pool.stats()
        pinned = 0
        for x, y in loader:
            pinned += int(x.is_pinned() and y.is_pinned())
            if epoch == 0:
                time.sleep(0.05)  # let the loader run ahead as far as it may (fills the pool)
        after = pool.stats()
        print(
            f"  epoch {epoch}: pinned batches {pinned}/8, pool misses {after.misses - before.misses}, "
            f"hits {after.hits - before.hits}, blocks {after.blocks}, reserved {after.bytes_reserved / 2**20:.0f} MiB, "
            f"locked {after.bytes_locked / 2**20:.0f} MiB, VmLck {locked_bytes() / 2**20:.0f} MiB"
        )
    gpemu.unpatch()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--as-nobody", action="store_true")
    args = ap.parse_args()
    if args.batch < 1 or args.repeats < 1 or args.epochs < 0:
        ap.error("--batch and --repeats must be positive, --epochs >= 0")
    if args.as_nobody:
        if os.geteuid() != 0:
            ap.error("--as-nobody needs root (it drops to uid 65534 in a child)")
        # Open the database and import what DataLoader workers need as root first: here
        # `nobody` cannot read root's data directory nor /root, where Python lives.
        gpemu.patch(gpu="V100", summary=False)
        import multiprocessing.connection  # noqa: E401,F401
        import multiprocessing.popen_fork
        import multiprocessing.queues
        import multiprocessing.resource_sharer  # noqa: E401,F401

        import numpy.random  # noqa: E401,F401
        import torch.utils.data._utils.worker

        try:
            import torch.profiler._cupti_monitor  # noqa: F401  (DataLoader.__next__ imports it)
        except Exception:
            pass
        pid = os.fork()
        if pid:
            _, status = os.waitpid(pid, 0)
            sys.exit(os.waitstatus_to_exitcode(status))
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        print(f"running as uid {os.getuid()} (RLIMIT_MEMLOCK 8 MiB, no CAP_IPC_LOCK)", flush=True)
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
    print(
        f"steady pin (hit: copy), median      {statistics.median(hits) * ms:8.2f} ms   "
        f"(min {min(hits) * ms:.2f}, max {max(hits) * ms:.2f})"
    )
    print(f"pageable clone, median              {statistics.median(clones) * ms:8.2f} ms")
    print(
        f"pool: blocks {s.blocks}, hits {s.hits}, misses {s.misses}, locked {s.bytes_locked / 2**20:.0f} MiB, "
        f"lock failures {s.lock_failures}"
    )
    print(f"VmLck grew by {(locked_bytes() - vm0) / 2**20:.0f} MiB")
    if args.epochs:
        dataloader_epochs(args.epochs, args.batch)
    sys.stdout.flush()
    if args.as_nobody:
        os._exit(0)


if __name__ == "__main__":
    main()
