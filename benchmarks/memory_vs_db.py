"""Tracked GPU memory vs the profile database's measured memory, for dataset models.

For each (model, batch): one emulated training setup (model.cuda(), SGD momentum, 3 iterations,
memory='tracked'); prints the tracked peak allocated during an iteration and the memory that
stays between iterations, next to the database's peak and persistent memory (measured on the real
GPU by the GPEmu authors). Usage:

    python benchmarks/memory_vs_db.py [--gpu V100] [--cases resnet50:64,alexnet:128]
"""

from __future__ import annotations

import argparse
import gc

import _common  # noqa: F401  (puts the repository on sys.path)
import torch

from examples import tvmodels

DEFAULT = "resnet50:32,resnet50:128,resnet18:64,alexnet:128,vgg16:32,mobilenet_v2:64"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", default="V100")
    ap.add_argument("--cases", default=DEFAULT)
    args = ap.parse_args()

    import gpemu
    from gpemu.clock import VirtualClock

    MiB = 2**20
    print(
        f"{'model':<14}{'batch':>6}{'tracked peak':>14}{'db peak':>10}{'ratio':>7}"
        f"{'tracked persist':>17}{'db persist':>12}{'ratio':>7}   (MiB)"
    )
    for case in args.cases.split(","):
        name, batch = case.split(":")
        batch = int(batch)
        rt = gpemu.patch(gpu=args.gpu, summary=False, clock=VirtualClock())
        try:
            gpu = rt.gpus[0].name
            db_peak = rt.db.lookup(gpu, name, batch, "peak_memory")
            db_pers = rt.db.lookup(gpu, name, batch, "persistent_memory")
            mem = rt.memory[0]
            model = getattr(tvmodels, name)().cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            x = torch.empty(batch, 3, 224, 224).cuda()
            y = torch.zeros(batch, dtype=torch.long).cuda()
            for _ in range(3):
                mem.reset_peak()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                del loss
            gc.collect()
            persistent = mem.allocated - x.numel() * 4 - y.numel() * 8
            print(
                f"{name:<14}{batch:>6}{mem.peak_allocated / MiB:>14.0f}{db_peak.value / MiB:>10.0f}"
                f"{mem.peak_allocated / db_peak.value:>7.2f}{persistent / MiB:>17.0f}{db_pers.value / MiB:>12.0f}"
                f"{persistent / db_pers.value:>7.2f}   ({db_peak.provenance})"
            )
        finally:
            gpemu.unpatch()


if __name__ == "__main__":
    main()
