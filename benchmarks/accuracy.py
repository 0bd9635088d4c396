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

All 36 architectures exist in ``examples/tvmodels/`` and run as themselves, identified by
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
from typing import NamedTuple

import torch
from _common import machine, progress_bar  # (puts the repository on sys.path)
from torch import nn

import gpemu
from examples import tvmodels
from gpemu import costs
from gpemu.clock import VirtualClock
from gpemu.identify import identify

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


class BatchResult(NamedTuple):
    """One batch size of one (GPU, model): emulated and target seconds per iteration."""

    batch: int
    emulated: float  # NaN: out of emulated GPU memory
    target: float
    stand_in: bool  # run as a stand-in module with a configured model name
    idle: float  # GPU idle seconds per iteration waiting for the host


class Case(NamedTuple):
    """One measured (GPU, model, batch size) of a pass, with its relative error."""

    gpu: str
    model: str
    batch: int
    emulated: float
    target: float
    stand_in: bool
    error: float


class PassResult(NamedTuple):
    """A pass's cases, the combinations that ran out of emulated memory, and each case's GPU idle
    time (waiting for the host) as a share of its target."""

    cases: list[Case]
    oom: list[str]
    idles: list[float]


class Combo(NamedTuple):
    """What a pass runs for one (GPU, model): the batch sizes, in run order."""

    gpu: str
    model: str
    batches: list[int]


def run_combo(
    gpu: str, model_name: str, batches: list[int], virtual: bool, inputs: dict[int, torch.Tensor], iterations: int
) -> list[BatchResult]:
    """Emulated and target time per batch size of ``batches``."""
    module, standin = build(model_name)
    out: list[BatchResult] = []
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
                out.append(BatchResult(bs, float("nan"), target, standin, 0.0))
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
            out.append(BatchResult(bs, elapsed, target, standin, idle))
    return out


def stats(errors: list[float]) -> str:
    a = sorted(abs(e) for e in errors)
    p99 = a[min(len(a) - 1, math.ceil(0.99 * len(a)) - 1)]
    return f"n={len(a)}  mean |error| {100 * sum(a) / len(a):.3f}%  p99 {100 * p99:.3f}%  worst {100 * a[-1]:.3f}%"


def _parser() -> argparse.ArgumentParser:
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
    return p


def plan_pass(gpus: list[str], models: list[str], quick: bool) -> list[Combo]:
    """Every (GPU, model) at every batch size, or with ``quick`` 6 models per GPU spread over the
    list, one batch size each, rotating."""
    plan = []
    for gi, gpu in enumerate(gpus):
        chosen = models
        if quick:
            step_ = max(1, len(models) // 6)
            chosen = models[gi % step_ :: step_][:6]
        for mi, name in enumerate(chosen):
            plan.append(Combo(gpu, name, [BATCHES[(gi + mi) % len(BATCHES)]] if quick else list(BATCHES)))
    return plan


def run_pass(
    title: str, plan: list[Combo], virtual: bool, inputs: dict[int, torch.Tensor], iterations: int
) -> PassResult:
    cases: list[Case] = []
    oom: list[str] = []
    idles: list[float] = []
    with progress_bar(now_field=True) as progress:
        task = progress.add_task(title, total=sum(len(c.batches) for c in plan), now="")
        for combo in plan:
            progress.update(task, now=f"{combo.gpu}/{combo.model}")
            for r in run_combo(combo.gpu, combo.model, combo.batches, virtual, inputs, 1 if virtual else iterations):
                progress.advance(task)
                if r.emulated != r.emulated:
                    oom.append(f"{combo.gpu}/{combo.model}/bs{r.batch}")
                    continue
                idles.append(r.idle / r.target)
                error = (r.emulated - r.target) / r.target
                cases.append(Case(combo.gpu, combo.model, r.batch, r.emulated, r.target, r.stand_in, error))
    return PassResult(cases, oom, idles)


def report_pass(title: str, took: float, result: PassResult, worst: int) -> None:
    cases, oom, idles = result
    print(f"\n== {title}: {stats([c.error for c in cases])}  ({took:.1f} s wall; machine: {machine()})")
    if oom:
        print(f"   skipped, out of emulated GPU memory ({len(oom)}): {', '.join(oom)}")
    for tag, sel in (
        ("identified by structure", [c for c in cases if not c.stand_in]),
        ("configured stand-ins *", [c for c in cases if c.stand_in]),
    ):
        if sel:
            print(f"   {tag:26} {stats([c.error for c in sel])}")
    mean_signed = sum(c.error for c in cases) / len(cases)
    print(
        f"   mean signed error {100 * mean_signed:+.3f}% (positive: emulation slower than the real GPU); "
        f"GPU idle waiting for the host inside iterations: mean {100 * sum(idles) / len(idles):.3f}% "
        f"of the target"
    )
    print(f"   worst {worst}:")
    for c in sorted(cases, key=lambda c: -abs(c.error))[:worst]:
        print(
            f"     {c.gpu:8} {c.model + ('*' if c.stand_in else ''):20} bs{c.batch:<4} emulated "
            f"{1e3 * c.emulated:9.2f} ms  target {1e3 * c.target:9.2f} ms  {100 * c.error:+.3f}%"
        )


def main() -> None:
    a = _parser().parse_args()

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
        f"  * stand-in module + configured model (architecture not in examples/tvmodels/): "
        f"{', '.join(standins) or 'none'}"
    )

    passes = [] if a.real_only else [("virtual clock, all combinations", True, False)]
    if not a.virtual_only:
        if a.full:
            passes.append(("real clock, all combinations", False, False))
        else:
            passes.append(("real clock, stratified subset (--quick)", False, True))

    for title, virtual, quick in passes:
        started = time.perf_counter()
        result = run_pass(title, plan_pass(gpus, models, quick), virtual, inputs, a.iterations)
        report_pass(title, time.perf_counter() - started, result, a.show_worst)


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
