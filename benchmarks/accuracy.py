"""Accuracy: emulated iteration time vs the real GPUs' measured time, all models x GPUs x batches.

For every (GPU, model, batch size) of the profile database (36 models x 6 GPUs x batch sizes
16/32/64/128/256) an ordinary training step runs under ``gpemu.patch``::

    x = host_batch.cuda()                 # pageable copy of ImageNet-sized synthetic data
    loss = model(x).sum(); loss.backward()
    model.zero_grad(set_to_none=True); torch.cuda.synchronize()

and its emulated time is compared with the database's measured forward + backward + host-to-
device copy of that batch (the target). The database's backward also timed its loop's gradient
zeroing and accumulation and an SGD step (``gpemu.costmodel.measured_loop``), which this loop does
not run: the target takes the backward as a run charges it, less their price
(``gpemu.costs.model_times``). Targets: mean |error| <= 1%, p99 <= 3%.

Two passes:

1. **all combinations, virtual clock** (``gpemu.patch(..., clock=VirtualClock())``): the engine's GPU
   timeline, no real waiting — checks identification, costs and stream arithmetic on all 1080.
2. **real clock**: the same step with real deadline waits, wall time measured with
   ``perf_counter`` — checks that the waits deliver that timeline. ``--quick`` (default) runs a
   stratified subset (each GPU x 6 models spread over sizes, batch sizes rotating); ``--full``
   runs all 1080 (about 15 minutes of emulated GPU time).

All 36 architectures exist in ``examples/tvmodels.py`` and run as themselves, identified by
their structure. A database model without one there (e.g. a user-added model) runs as a small
stand-in module with ``gpemu.patch(model=<name>)`` (configured), marked ``*``.

    python benchmarks/accuracy.py                 # virtual all + real quick subset
    python benchmarks/accuracy.py --full          # real clock on all combinations
    python benchmarks/accuracy.py --virtual-only
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import machine  # noqa: E402  (CPU model, cores, load average now)

import gpemu  # noqa: E402
from examples import tvmodels  # noqa: E402
from gpemu import costs  # noqa: E402
from gpemu.clock import VirtualClock  # noqa: E402
from gpemu.identify import identify  # noqa: E402

BATCHES = (16, 32, 64, 128, 256)


def stand_in() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1000))


def build(name: str) -> tuple[nn.Module, bool]:
    # Built on meta, then given uninitialised host memory: a normal CPU module without the
    # seconds of weight initialisation (emulated GPUs never read the values).
    with torch.device("meta"):
        module, standin = (tvmodels.MODELS[name](), False) if name in tvmodels.MODELS else (stand_in(), True)
    return module.to_empty(device="cpu"), standin


def step(model: nn.Module, host_batch: torch.Tensor) -> None:
    x = host_batch.cuda()
    out = model(x)
    if isinstance(out, tuple):  # GoogLeNet in training mode: (logits, aux2, aux1)
        out = out[0]
    loss = out.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def run_combo(
    gpu: str, model_name: str, batches: list[int], virtual: bool, inputs: dict[int, torch.Tensor], iterations: int
) -> list[tuple[int, float, float, bool]]:
    """Returns (batch, emulated seconds/iteration, target seconds, stand-in?) per batch size."""
    module, standin = build(model_name)
    out = []
    with gpemu.emulate(
        gpu=gpu, model=model_name if standin else None, summary=False, clock=VirtualClock() if virtual else None
    ) as rt:
        engine = rt.engine
        spec = rt.gpus[0]
        model = module.cuda()
        ident = identify(rt, model)
        for bs in batches:
            # The database's backward also ran the measured loop's gradient zeroing, accumulation
            # and SGD step, which this loop does not: the model's backward is that less their
            # price (gpemu.costs.model_times, gpemu.costmodel.measured_loop).
            times = costs.model_times(rt, ident, bs, 0)
            target = times.forward + times.backward + rt.db.lookup(spec.name, model_name, bs, "h2d_transfer").value
            try:
                # Warm-up until the emulator's steady state, as a GPU benchmark discards its first
                # iterations: the recording (op by op), the plain replays and the first hub-mode
                # replay (config.tuning.hub_after + 2 steps) each do one-off host work. Measured
                # after one warm-up step, they were inside the three real-clock iterations:
                # 20 + 2 + 12 ms of host time (GoogLeNet, 187 parameters, loaded 2-core machine)
                # on 38 ms steps: the +13.9% of V100/GoogLeNet/16 and +9.3% of
                # V100/MobileNetV3-large/32.
                for _ in range(max(1, rt.config.tuning.hub_after + 2)):
                    step(model, inputs[bs])
            except torch.cuda.OutOfMemoryError:
                # The emulated GPU's memory is tracked: a batch the card cannot hold fails as on
                # the real card (the database's figures for it are the authors' fill-ins).
                model.zero_grad(set_to_none=True)
                out.append((bs, float("nan"), target, standin, 0.0))
                continue
            clock = engine.clock.now if virtual else time.perf_counter
            first = len(rt.recorder.spans)
            t0 = clock()
            for _ in range(iterations):
                step(model, inputs[bs])
            elapsed = (clock() - t0) / iterations
            # GPU idle time inside the measured iterations: the host had not enqueued the next
            # work yet (its own Python time after a blocking copy, before the forward's enqueue).
            spans = sorted(rt.recorder.spans[first:], key=lambda sp: sp.start)
            idle = sum(max(0.0, b.start - a.end) for a, b in zip(spans, spans[1:], strict=False)) / iterations
            out.append((bs, elapsed, target, standin, idle))
    return out


def stats(errors: list[float]) -> str:
    a = sorted(abs(e) for e in errors)
    p99 = a[min(len(a) - 1, math.ceil(0.99 * len(a)) - 1)]
    return f"n={len(a)}  mean |error| {100 * sum(a) / len(a):.3f}%  p99 {100 * p99:.3f}%  worst {100 * a[-1]:.3f}%"


def progress_bar():
    """A rich progress bar on stderr (removed when done, so the printed figures stay clean)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[now]}"),
        console=Console(stderr=True),
        transient=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="real-clock pass on a stratified subset (default)")
    g.add_argument("--full", action="store_true", help="real-clock pass on all combinations")
    g.add_argument("--virtual-only", action="store_true")
    p.add_argument("--real-only", action="store_true", help="skip the virtual-clock pass")
    p.add_argument(
        "--iterations",
        type=int,
        default=3,
        help="measured iterations per combination in the real-clock pass (the virtual pass "
        "is deterministic and runs 1); a single wall-clock iteration carries the "
        "scheduling noise of its first and last wake-up, more iterations average it",
    )
    p.add_argument(
        "--gpus", default=None, help="comma-separated subset of GPUs (default: all the database has measurements for)"
    )
    p.add_argument("--models", default=None, help="comma-separated subset of models (default: all)")
    p.add_argument("--show-worst", type=int, default=8)
    a = p.parse_args()

    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db

    db = open_profile_db(EmuConfig.from_env())
    # Only GPUs with measurements: the database also lists datasheet-only GPUs (nothing to compare with).
    measured = {g.name for g in db.measured_gpus()}
    gpus = a.gpus.split(",") if a.gpus else [s.short_name for s in db.gpus() if s.name in measured]
    models = a.models.split(",") if a.models else [m.name for m in db.models()]
    inputs = {bs: torch.empty(bs, 3, 224, 224) for bs in BATCHES}  # values are never read
    standins = sorted(m for m in models if m not in tvmodels.MODELS)
    print(f"accuracy: {len(gpus)} GPUs x {len(models)} models x batch sizes {BATCHES}")
    print(
        f"  * stand-in module + configured model (architecture not in examples/tvmodels.py): "
        f"{', '.join(standins) or 'none'}"
    )

    passes = [] if a.real_only else [("virtual clock, all combinations", True, None)]
    if not a.virtual_only:
        if a.full:
            passes.append(("real clock, all combinations", False, None))
        else:
            passes.append(("real clock, stratified subset (--quick)", False, "quick"))

    for title, virtual, subset in passes:
        started = time.perf_counter()
        rows: list = []
        oom: list[str] = []
        idles: list[float] = []
        plan = []  # (gpu, model, batch sizes) in run order
        for gi, gpu in enumerate(gpus):
            chosen = models
            if subset == "quick":  # 6 models per GPU spread over the list, batch sizes rotating
                step_ = max(1, len(models) // 6)
                chosen = models[gi % step_ :: step_][:6]
            for mi, name in enumerate(chosen):
                plan.append((gpu, name, list(BATCHES) if subset is None else [BATCHES[(gi + mi) % len(BATCHES)]]))
        with progress_bar() as progress:
            task = progress.add_task(title, total=sum(len(b) for _, _, b in plan), now="")
            for gpu, name, batches in plan:
                progress.update(task, now=f"{gpu}/{name}")
                iters = 1 if virtual else a.iterations
                for bs, emu, target, standin, idle in run_combo(gpu, name, batches, virtual, inputs, iters):
                    progress.advance(task)
                    if emu != emu:
                        oom.append(f"{gpu}/{name}/bs{bs}")
                        continue
                    idles.append(idle / target)
                    rows.append((gpu, name, bs, emu, target, standin, (emu - target) / target))
        took = time.perf_counter() - started
        print(f"\n== {title}: {stats([r[-1] for r in rows])}  ({took:.1f} s wall; machine: {machine()})")
        if oom:
            print(f"   skipped, out of emulated GPU memory ({len(oom)}): {', '.join(oom)}")
        for tag, sel in (
            ("identified by structure", [r for r in rows if not r[5]]),
            ("configured stand-ins *", [r for r in rows if r[5]]),
        ):
            if sel:
                print(f"   {tag:26} {stats([r[-1] for r in sel])}")
        mean_signed = sum(r[-1] for r in rows) / len(rows)
        print(
            f"   mean signed error {100 * mean_signed:+.3f}% (positive: emulation slower than the real GPU); "
            f"GPU idle waiting for the host inside iterations: mean {100 * sum(idles) / len(idles):.3f}% "
            f"of the target"
        )
        print(f"   worst {a.show_worst}:")
        for gpu, name, bs, emu, target, standin, err in sorted(rows, key=lambda r: -abs(r[-1]))[: a.show_worst]:
            print(
                f"     {gpu:8} {name + ('*' if standin else ''):20} bs{bs:<4} emulated {1e3 * emu:9.2f} ms  "
                f"target {1e3 * target:9.2f} ms  {100 * err:+.3f}%"
            )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        # One line, and no teardown tracebacks (a database connection or a waiting thread cut
        # off mid-call would print its own): leave at once.
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130)
