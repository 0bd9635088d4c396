"""Drift: do many short emulated iterations end when the sum of their GPU times says?

Each iteration enqueues a forward and a backward on the default stream of a real-clock
TimeEngine and then, every ``--sync-every`` iterations, synchronizes (like ``loss.item()``),
optionally doing some host work in between (hidden behind GPU time, as on a real GPU). Because
the engine waits until ABSOLUTE deadlines, one late wake-up does not delay the next iteration's
deadline, so the total should end within 0.1% of the sum of targets (issue 4's target).

Two passes per ``--sync-every`` value, same targets:

* **headline** — the loop is only ``enqueue; enqueue; [busy]; [synchronize]`` (no
  book-keeping), and the figure is ``(elapsed - sum of targets) / sum of targets``, elapsed
  measured by ``perf_counter`` around the whole loop. What remains is the emulator's drift
  plus the bare loop's own Python between a sync and its next enqueue (a real program pays
  that too: the GPU is idle while the host has not issued work).
* **instrumented** — the same loop with a clock that logs every engine clock reading and
  ``perf_counter`` marks around each sync, so each gap after a sync is split into its raw host
  parts: the emulator's return path (its last clock reading in the sync -> back in the loop),
  the loop's own Python (-> the next enqueue is called) and the emulator's entry path (-> the
  enqueue reads the clock). The marks run right after a wait, with cold caches on this VM,
  and cost ~2 us per sync (this pass: +0.13% where the headline reads +0.04-0.05%); with
  book-keeping in the loop it is the benchmark's old definition of the figure, kept for
  comparison.

The engine forgives, per sync, the wake-up lateness, its own book-keeping up to its last clock
reading, and ``return_allowance`` (calibrated once per process: the return + entry path
measured after real waits, median after 5 us waits and lower quartile after 2 ms waits, see
``gpemu.time.calibrate_return_allowance``).
``--allowance-us 0`` runs the engine without the allowance (the old behaviour).

Each pass starts after ``gc.collect()``. Without it, the process's first full garbage
collection after importing torch (70-90 ms over ~190k objects, measured here) lands inside the
first timed pass as one huge GPU idle gap (it was the single gap of 25-80 ms in nearly every
earlier run, which looked like preemption). Later collections inside a pass, e.g. caused by
the engine's own records, still count; the figures print how many full collections ran inside
each pass and how long they took.

    python benchmarks/drift.py                      # 10,000 iterations of ~2.5 ms, sync every 1,10,100
    python benchmarks/drift.py --iterations 2000 --host-work-ms 0.5 --sync-every 1
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from _common import machine

from gpemu.clock import RealClock
from gpemu.recorder import Recorder
from gpemu.time import TimeEngine, calibrate_return_allowance


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class LoggingClock(RealClock):
    """A real clock that keeps every reading the engine takes (instrumented pass only)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[float] = []

    def now(self) -> float:  # type: ignore[override]
        t = time.perf_counter()
        self.log.append(t)
        return t


def make_plan(
    iterations: int, fwd_ms: float, bwd_ms: float, jitter: float, seed: int, sync_every: int
) -> list[tuple[float, float, bool]]:
    rng = random.Random(seed)
    return [
        (
            fwd_ms * (1 + rng.uniform(-jitter, jitter)) / 1e3,
            bwd_ms * (1 + rng.uniform(-jitter, jitter)) / 1e3,
            i % sync_every == 0 or i == iterations,
        )
        for i in range(1, iterations + 1)
    ]


class GcWatch:
    """Counts full (generation 2) garbage collections and their time while active."""

    def __init__(self) -> None:
        self.full = 0
        self.full_s = 0.0
        self._t0 = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.full += 1
            self.full_s += time.perf_counter() - self._t0

    def __enter__(self) -> GcWatch:
        gc.collect()  # start from a collected heap (see the module docstring)
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


def _gaps(engine: TimeEngine) -> list[float]:
    spans = engine.recorder.spans
    return sorted(b.start - a.end for a, b in zip(spans, spans[1:], strict=False) if b.start > a.end)


def run_headline(
    plan: list[tuple[float, float, bool]], host_work_ms: float, allowance: tuple[float, float] | None
) -> dict:
    engine = TimeEngine(1, Recorder(), clock=RealClock(), return_allowance=allowance)
    enqueue = engine.default_stream(0).enqueue
    synchronize = engine.synchronize
    host = host_work_ms / 1e3
    perf = time.perf_counter
    with GcWatch() as gcw:
        start = perf()
        for f, b, sync in plan:
            enqueue(f, "forward", "drift")
            enqueue(b, "backward", "drift")
            if host:
                busy(host)  # e.g. the next batch's preparation, overlapping the GPU
            if sync:
                synchronize(0, "item")
        elapsed = perf() - start
    target = sum(f + b for f, b, _ in plan)
    gaps = _gaps(engine)
    spans = engine.recorder.spans
    return {
        "target_s": target,
        "elapsed_s": elapsed,
        "gaps_s": sum(gaps),
        "big_gaps_s": sum(g for g in gaps if g > 1e-3),
        "gap_median_us": 1e6 * gaps[len(gaps) // 2] if gaps else 0.0,
        "gap_max_ms": 1e3 * gaps[-1] if gaps else 0.0,
        "gaps_over_1ms": sum(1 for g in gaps if g > 1e-3),
        "first_start_s": spans[0].start - start if spans else 0.0,
        "final_late_s": elapsed - (engine.device_busy_until(0) - start),
        "forgiven_s": engine.recorder.counters.get("wake_late_s", 0.0),
        "allowance_s": engine.return_allowance,
        "gc_full": gcw.full,
        "gc_full_s": gcw.full_s,
        "error_pct": 100 * (elapsed - target) / target,
        "late_per_iter_us": 1e6 * (elapsed - target) / len(plan),
    }


def run_instrumented(
    plan: list[tuple[float, float, bool]], host_work_ms: float, allowance: tuple[float, float] | None
) -> dict:
    clock = LoggingClock()
    engine = TimeEngine(1, Recorder(), clock=clock, return_allowance=allowance)
    enqueue = engine.default_stream(0).enqueue
    synchronize = engine.synchronize
    local = engine.local.host
    log = clock.log
    host = host_work_ms / 1e3
    perf = time.perf_counter
    # Per sync that waited: (deadline, engine's last clock reading in the sync, back in the loop,
    # the loop calls the next enqueue, the enqueue read the clock).
    marks: list[tuple[float, float, float, float, float]] = []
    pending: tuple[float, float, float] | None = None
    gcw = GcWatch().__enter__()
    start = perf()
    for f, b, sync in plan:
        if pending is not None:
            n = len(log)
            call = perf()
            enqueue(f, "forward", "drift")
            marks.append((*pending, call, log[n]))
            pending = None
        else:
            enqueue(f, "forward", "drift")
        enqueue(b, "backward", "drift")
        if host:
            busy(host)
        if sync:
            deadline = engine.device_busy_until(0)
            synchronize(0, "item")
            ret = perf()
            if local.wait_deadline == deadline:  # it waited: its last reading was settle()'s
                pending = (deadline, log[-1], ret)
    elapsed = perf() - start
    gcw.__exit__()
    target = sum(f + b for f, b, _ in plan)
    spans = engine.recorder.spans
    by_end = {a.end: b.start for a, b in zip(spans, spans[1:], strict=False)}
    ret_s, loop_s, entry_s, gap_after_sync = [], [], [], 0.0
    for deadline, settled, ret, call, read in marks:
        ret_s.append(ret - settled)
        loop_s.append(call - ret)
        entry_s.append(read - call)
        nxt = by_end.get(deadline)
        if nxt is not None and nxt > deadline:
            gap_after_sync += nxt - deadline

    def med(xs: list[float]) -> float:
        return 1e6 * sorted(xs)[len(xs) // 2] if xs else 0.0

    gaps = _gaps(engine)
    return {
        "target_s": target,
        "elapsed_s": elapsed,
        "error_pct": 100 * (elapsed - target) / target,
        "late_per_iter_us": 1e6 * (elapsed - target) / len(plan),
        "syncs": len(marks),
        "gaps_s": sum(gaps),
        "gaps_after_sync_s": gap_after_sync,
        "big_gaps_s": sum(g for g in gaps if g > 1e-3),
        "big_gaps": sum(1 for g in gaps if g > 1e-3),
        "return_s": sum(ret_s),
        "loop_s": sum(loop_s),
        "entry_s": sum(entry_s),
        "return_med_us": med(ret_s),
        "loop_med_us": med(loop_s),
        "entry_med_us": med(entry_s),
        "path_med_us": med([r + e for r, e in zip(ret_s, entry_s, strict=False)]),
        "gc_full": gcw.full,
        "gc_full_s": gcw.full_s,
        "allowance_s": engine.return_allowance,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=10_000)
    p.add_argument("--fwd-ms", type=float, default=0.8)
    p.add_argument("--bwd-ms", type=float, default=1.7)
    p.add_argument("--jitter", type=float, default=0.3, help="relative +- spread of each target")
    p.add_argument(
        "--host-work-ms",
        type=float,
        default=0.0,
        help="host busy time per iteration between enqueue and sync (hidden if < GPU time)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sync-every",
        default="1,10,100",
        help="comma-separated: sync (loss.item()) every N iterations; each value is one run",
    )
    p.add_argument(
        "--allowance-us",
        type=float,
        default=None,
        help="engine return_allowance in us (default: calibrated; 0 = the old engine behaviour)",
    )
    p.add_argument("--no-instrumented", action="store_true", help="headline pass only")
    return p


def print_headline(k: int, r: dict) -> None:
    """The headline pass of one --sync-every value: the figure, and what it is made of."""
    print(
        f"  sync every {k:3d}: sum of targets {r['target_s']:.4f} s, elapsed {r['elapsed_s']:.4f} s, "
        f"error {r['error_pct']:+.4f}% ({r['late_per_iter_us']:+.2f} us/iteration)  "
        f"[target |error| <= 0.1%: {'met' if abs(r['error_pct']) <= 0.1 else 'NOT met'}]",
        flush=True,
    )
    err_ms = 1e3 * (r["elapsed_s"] - r["target_s"])
    print(
        f"      error {err_ms:+.2f} ms = GPU idle gaps {1e3 * r['gaps_s']:.2f} ms (median {r['gap_median_us']:.1f} "
        f"us, {r['gaps_over_1ms']} over 1 ms, longest {r['gap_max_ms']:.1f} ms) + last wake-up late "
        f"{1e3 * r['final_late_s']:.3f} ms + first enqueue {1e3 * r['first_start_s']:.3f} ms; "
        f"allowance {1e6 * r['allowance_s'][1]:.2f} us per long wait "
        f"({1e6 * r['allowance_s'][0]:.2f} short), wake-up lateness forgiven "
        f"{1e3 * r['forgiven_s']:.1f} ms; full garbage collections in the loop: {r['gc_full']} "
        f"({1e3 * r['gc_full_s']:.1f} ms)",
        flush=True,
    )
    # Diagnostic only (not the figure): a gap over 1 ms is the whole process held (preempted by
    # another process on this shared machine, or a garbage collection), which would idle a
    # real GPU too.
    print(
        f"      diagnostic: without the {r['gaps_over_1ms']} gap(s) over 1 ms (process held: preemption, GC) "
        f"the error would be {100 * (r['elapsed_s'] - r['target_s'] - r['big_gaps_s']) / r['target_s']:+.4f}%",
        flush=True,
    )


def print_instrumented(m: dict) -> None:
    """The instrumented pass: the old definition, and the host time after each sync split in parts."""
    print(
        f"      instrumented pass (marks in the loop; old definition): error {m['error_pct']:+.4f}% "
        f"({m['late_per_iter_us']:+.2f} us/iteration), GPU idle gaps {1e3 * m['gaps_s']:.2f} ms "
        f"({1e3 * m['gaps_after_sync_s']:.2f} ms after the {m['syncs']} syncs that waited; without its "
        f"{m['big_gaps']} gap(s) over 1 ms: "
        f"{100 * (m['elapsed_s'] - m['target_s'] - m['big_gaps_s']) / m['target_s']:+.4f}%; full garbage "
        f"collections in the loop: {m['gc_full']} ({1e3 * m['gc_full_s']:.1f} ms))",
        flush=True,
    )
    print(
        f"      raw host time after those syncs: emulator return path {1e3 * m['return_s']:.2f} ms "
        f"(median {m['return_med_us']:.2f} us), loop's own Python {1e3 * m['loop_s']:.2f} ms "
        f"(median {m['loop_med_us']:.2f} us), emulator entry path {1e3 * m['entry_s']:.2f} ms "
        f"(median {m['entry_med_us']:.2f} us); return+entry median {m['path_med_us']:.2f} us vs "
        f"long-wait allowance {1e6 * m['allowance_s'][1]:.2f} us",
        flush=True,
    )


def main() -> None:
    p = _parser()
    a = p.parse_args()
    if a.iterations < 1 or a.fwd_ms < 0 or a.bwd_ms < 0:
        p.error("iterations must be >= 1 and times >= 0")
    # Both passes use the same allowance (the instrumented pass's logging clock is not a RealClock,
    # so the engine would not calibrate it itself).
    allowance = calibrate_return_allowance() if a.allowance_us is None else (a.allowance_us / 1e6,) * 2
    print(
        f"drift: {a.iterations} iterations, fwd {a.fwd_ms} ms + bwd {a.bwd_ms} ms (+-{a.jitter:.0%}), "
        f"host work {a.host_work_ms} ms/iter",
        flush=True,
    )
    for k in (int(v) for v in a.sync_every.split(",")):
        plan = make_plan(a.iterations, a.fwd_ms, a.bwd_ms, a.jitter, a.seed, k)
        r = run_headline(plan, a.host_work_ms, allowance)
        print_headline(k, r)
        if a.no_instrumented:
            continue
        m = run_instrumented(plan, a.host_work_ms, allowance)
        print_instrumented(m)
    print(
        f"  machine: {machine()}; what remains with a sync every "
        f"iteration is the loop's own time between a sync's return and its next enqueue (a real program pays "
        f"it too), the emulator's path beyond the allowance (colder caches after a long wait), and "
        f"preemption by other processes wherever it lands"
    )


if __name__ == "__main__":
    main()
