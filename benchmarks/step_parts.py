"""Where the emulator's host time goes inside one training step, phase by phase.

Runs the overhead benchmark's step (pageable input copy, forward, label copy, cross-entropy,
backward, SGD-momentum step, zero_grad, synchronize) on a virtual clock and prints the median
host time of each phase, so a change to one fast path shows where it lands. ``--compare-loss``
interleaves blocks with the cross-entropy fast path on and off (op by op) in one process;
``--compare-direct`` does the same for loss.backward() without the autograd engine.

    python benchmarks/step_parts.py                                  # AlexNet / A100 / batch 32
    python benchmarks/step_parts.py --model resnet50 --gpu V100 --batch-size 128
    python benchmarks/step_parts.py --compare-loss
    python benchmarks/step_parts.py --compare-direct
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from _common import machine  # (puts the repository on sys.path)
from torch.nn import functional as F

import gpemu
from examples import tvmodels
from gpemu.clock import VirtualClock

PHASES = ("input copy", "forward", "label copy", "loss", "backward", "optimizer step", "zero_grad", "synchronize")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="alexnet", choices=sorted(tvmodels.MODELS))
    p.add_argument("--gpu", default="A100")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument(
        "--compare-loss",
        action="store_true",
        help="alternate blocks of 10 iterations with the cross-entropy fast path on and off",
    )
    p.add_argument(
        "--compare-direct",
        action="store_true",
        help="alternate blocks of 10 iterations with loss.backward() run with and without the "
        "autograd engine (gpemu.fastpaths.backward._direct_backward)",
    )
    a = p.parse_args()
    if a.batch_size < 1 or a.iterations < 10:
        p.error("--batch-size must be >= 1 and --iterations >= 10")
    with torch.device("meta"):
        module = tvmodels.MODELS[a.model]()
    module = module.to_empty(device="cpu")
    times: dict[bool, dict[str, list[float]]] = {True: {k: [] for k in PHASES}, False: {k: [] for k in PHASES}}
    with gpemu.emulate(gpu=a.gpu, clock=VirtualClock(), summary=False) as rt:
        fast_loss = F.cross_entropy
        op_by_op_loss = getattr(fast_loss, "__wrapped__", fast_loss)
        model = module.cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.empty(a.batch_size, 3, 224, 224), torch.zeros(a.batch_size, dtype=torch.long)
        pc = time.perf_counter
        gc.collect()
        for i in range(a.iterations + 5):
            fast = not ((a.compare_loss or a.compare_direct) and (i // 10) % 2)
            loss_fn = fast_loss if fast or a.compare_direct else op_by_op_loss
            rt.replay.direct_enabled = fast or a.compare_loss
            t0 = pc()
            xc = x.cuda()
            t1 = pc()
            out = model(xc)
            if isinstance(out, tuple):  # GoogLeNet in training mode: (logits, aux...)
                out = out[0]
            t2 = pc()
            yc = y.cuda()
            t3 = pc()
            loss = loss_fn(out, yc)
            t4 = pc()
            loss.backward()
            t5 = pc()
            opt.step()
            t6 = pc()
            opt.zero_grad(set_to_none=True)
            t7 = pc()
            torch.cuda.synchronize()
            t8 = pc()
            if i >= 5:  # recording, optimizer state creation, fast-path plans
                marks = (t0, t1, t2, t3, t4, t5, t6, t7, t8)
                for k, (s, e) in zip(PHASES, zip(marks, marks[1:], strict=False), strict=False):
                    times[fast][k].append(e - s)
    modes = (True, False) if a.compare_loss or a.compare_direct else (True,)
    names = {
        True: "engine-free" if a.compare_direct else "loss fast path",
        False: "engine" if a.compare_direct else "loss op by op",
    }
    header = f"{'phase':16}" + "".join(f"{names[m]:>16}" for m in modes)
    print(f"{a.model} / {a.gpu} / batch {a.batch_size}: median host time per phase (us), {a.iterations} iterations")
    print(header)
    for k in PHASES:
        print(f"{k:16}" + "".join(f"{1e6 * statistics.median(times[m][k]):16.1f}" for m in modes))
    print(
        f"{'sum of medians':16}"
        + "".join(f"{1e6 * sum(statistics.median(times[m][k]) for k in PHASES):16.1f}" for m in modes)
    )
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
