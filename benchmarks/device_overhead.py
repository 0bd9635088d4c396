"""Emulator host time per training iteration (fwd + bwd + SGD momentum), ResNet-50.

Prints the host time gpemu itself spends per iteration, i.e. wall time minus the time the
host waited for emulated GPU work (sync points). Usage:

    python benchmarks/device_overhead.py [--model resnet50] [--batch 128] [--iters 30] [--no-replay]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import machine  # (puts the repository on sys.path)

from examples import tvmodels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--gpu", default="V100")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument(
        "--autograd-edges",
        type=int,
        default=0,
        metavar="N",
        help="instead: plain torch (no gpemu), the autograd engine's cost of a Function with N "
        "leaf inputs whose backward returns None for them (what a replayed backward pays "
        "per parameter)",
    )
    args = ap.parse_args()
    if args.autograd_edges:
        autograd_edges(args.autograd_edges)
        return

    import gpemu
    from gpemu import device as tensor
    from gpemu.fastpaths import replay

    rt = gpemu.patch(gpu=args.gpu, replay=not args.no_replay, summary=False)
    model = getattr(tvmodels, args.model)().cuda()
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss()
    # Inputs already on the emulated GPU: the figure is the emulator's own per-iteration cost.
    x = torch.randn(args.batch, 3, 224, 224).cuda()
    y = torch.randint(0, 1000, (args.batch,)).cuda()
    host = []
    cpu = []
    for _ in range(args.iters):
        waits_before = sum(w.end - w.start for w in rt.recorder.waits)
        t0 = time.perf_counter()
        c0 = time.thread_time()
        out = model(x)
        loss = crit(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t1 = time.perf_counter()
        cpu.append(time.thread_time() - c0)
        waited = sum(w.end - w.start for w in rt.recorder.waits) - waits_before
        host.append(t1 - t0 - waited)
    steady = host[3:] if len(host) > 5 else host
    steady_cpu = cpu[3:] if len(cpu) > 5 else cpu
    mem = rt.memory[0]
    print(
        f"model={args.model} batch={args.batch} gpu={args.gpu} replay={not args.no_replay} optimizer={args.optimizer}"
    )
    print(f"machine: {machine()}")
    print(f"first iteration (recording) host time: {host[0] * 1e3:.1f} ms")
    print(
        f"steady host time per iteration: median {statistics.median(steady) * 1e3:.2f} ms, "
        f"min {min(steady) * 1e3:.2f} ms over {len(steady)} iterations"
    )
    # CPU time of this thread: unaffected by other processes competing for the cores (waits on
    # emulated GPU time spin at the end, so this is only clean when no sync point waited).
    print(
        f"steady host CPU time per iteration (thread_time): median {statistics.median(steady_cpu) * 1e3:.2f} ms, "
        f"min {min(steady_cpu) * 1e3:.2f} ms"
    )
    print(f"replay: {replay.replay_info()}, op-metadata cache entries: {tensor.cache_info()['entries']}")
    print(f"tracked memory: allocated {mem.allocated / 2**20:.0f} MiB, peak {mem.peak_allocated / 2**20:.0f} MiB")
    gpemu.unpatch()


def autograd_edges(n: int) -> None:
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *leaves):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return (g,) + (None,) * n

    def timed(requires_grad: bool) -> float:
        leaves = [torch.zeros(3, requires_grad=requires_grad) for _ in range(n)]
        x = torch.zeros(3, requires_grad=True)
        times = []
        for _ in range(300):
            s = Fn.apply(x, *leaves).sum()
            t0 = time.perf_counter()
            s.backward()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with_edges, without = timed(True), timed(False)
    print(
        f"backward over a Function with {n} leaf inputs returning None: {with_edges * 1e6:.0f} us "
        f"(inputs not requiring grad: {without * 1e6:.0f} us) = "
        f"{(with_edges - without) / n * 1e6:.2f} us per parameter edge"
    )


if __name__ == "__main__":
    main()
