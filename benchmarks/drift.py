"""Drift: do many short emulated iterations end when the sum of their GPU times says?

Each iteration enqueues a forward and a backward on the default stream of a real-clock
TimeEngine and then synchronizes (like ``loss.item()``), optionally doing some host work in
between (hidden behind GPU time, as on a real GPU). Because the engine waits until ABSOLUTE
deadlines, one late wake-up does not delay the next iteration's deadline, so the total should
end within 0.1% of the sum of targets (target). The remaining error is the host's own time
between a sync's return and the next enqueue, which a real program pays too.

    python benchmarks/drift.py                      # 10,000 iterations of ~2.5 ms
    python benchmarks/drift.py --iterations 2000 --host-work-ms 0.5
"""

from __future__ import annotations

import argparse
import os
import random
import time

from gpemu.clock import RealClock
from gpemu.engine import TimeEngine
from gpemu.recorder import Recorder


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(iterations: int, fwd_ms: float, bwd_ms: float, jitter: float, host_work_ms: float, seed: int,
        sync_every: int = 1) -> dict:
    rng = random.Random(seed)
    engine = TimeEngine(1, Recorder(), clock=RealClock())
    stream = engine.default_stream(0)
    targets = [(fwd_ms * (1 + rng.uniform(-jitter, jitter)) / 1e3, bwd_ms * (1 + rng.uniform(-jitter, jitter)) / 1e3)
               for _ in range(iterations)]
    host = host_work_ms / 1e3
    now = engine.now
    # Per sync: (deadline, emulated time the sync returned to the loop, emulated time the loop
    # called the next enqueue). Reading engine.now() costs ~0.1 us, counted as the loop's own time.
    marks: list[tuple[float, float, float]] = []
    pending: tuple[float, float] | None = None
    start = time.perf_counter()
    for i, (f, b) in enumerate(targets, 1):
        if pending is not None:
            marks.append((pending[0], pending[1], now()))
            pending = None
        stream.enqueue(f, "forward", "drift")
        stream.enqueue(b, "backward", "drift")
        if host:
            busy(host)  # e.g. the next batch's preparation, overlapping the GPU
        if i % sync_every == 0 or i == iterations:
            deadline = engine.device_busy_until(0)
            engine.synchronize(0, "item")
            pending = (deadline, now())
    elapsed = time.perf_counter() - start
    target = sum(f + b for f, b in targets)
    spans = engine.recorder.spans
    first_start = spans[0].start - start if spans else 0.0
    # GPU idle gaps on the emulated timeline: what the sum of targets does not cover.
    gaps = sorted(b.start - a.end for a, b in zip(spans, spans[1:]) if b.start > a.end)
    # Split the gaps after syncs: emulator's return path (deadline -> back in the loop), the
    # loop's own Python (-> enqueue called), emulator's entry path (-> enqueue read the clock).
    exit_s = loop_s = entry_s = 0.0
    by_end = {}
    for a, b in zip(spans, spans[1:]):
        by_end[a.end] = b.start
    for deadline, ret, call in marks:
        nxt = by_end.get(deadline)
        if nxt is None or nxt <= deadline:
            continue  # the GPU was still busy: no gap
        exit_s += max(0.0, ret - deadline)
        loop_s += max(0.0, call - max(ret, deadline))
        entry_s += max(0.0, nxt - max(call, deadline))
    final_late = elapsed - (engine.device_busy_until(0) - start)
    gap_total = sum(gaps)
    return {"iterations": iterations, "target_s": target, "elapsed_s": elapsed,
            "gaps_s": gap_total, "gap_median_us": 1e6 * gaps[len(gaps) // 2] if gaps else 0.0,
            "gap_max_ms": 1e3 * gaps[-1] if gaps else 0.0, "gaps_over_1ms": sum(1 for g in gaps if g > 1e-3),
            "forgiven_s": engine.recorder.counters.get("wake_late_s", 0.0),
            "exit_s": exit_s, "loop_s": loop_s, "entry_s": entry_s,
            "other_gaps_s": gap_total - exit_s - loop_s - entry_s,
            "first_start_s": first_start, "final_late_s": final_late,
            "error_pct": 100 * (elapsed - target) / target,
            "late_per_iter_us": 1e6 * (elapsed - target) / iterations}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=10_000)
    p.add_argument("--fwd-ms", type=float, default=0.8)
    p.add_argument("--bwd-ms", type=float, default=1.7)
    p.add_argument("--jitter", type=float, default=0.3, help="relative +- spread of each target")
    p.add_argument("--host-work-ms", type=float, default=0.0,
                   help="host busy time per iteration between enqueue and sync (hidden if < GPU time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", default="1,10,100",
                   help="comma-separated: sync (loss.item()) every N iterations; each value is one run")
    a = p.parse_args()
    if a.iterations < 1 or a.fwd_ms < 0 or a.bwd_ms < 0:
        p.error("iterations must be >= 1 and times >= 0")
    print(f"drift: {a.iterations} iterations, fwd {a.fwd_ms} ms + bwd {a.bwd_ms} ms (+-{a.jitter:.0%}), "
          f"host work {a.host_work_ms} ms/iter")
    for k in (int(v) for v in a.sync_every.split(",")):
        r = run(a.iterations, a.fwd_ms, a.bwd_ms, a.jitter, a.host_work_ms, a.seed, sync_every=k)
        print(f"  sync every {k:3d}: sum of targets {r['target_s']:.4f} s, elapsed {r['elapsed_s']:.4f} s, "
              f"error {r['error_pct']:+.4f}% ({r['late_per_iter_us']:+.2f} us/iteration)  "
              f"[target |error| <= 0.1%: {'met' if abs(r['error_pct']) <= 0.1 else 'NOT met'}]", flush=True)
        err_ms = 1e3 * (r["elapsed_s"] - r["target_s"])
        print(f"      error {err_ms:+.2f} ms = GPU idle gaps {1e3 * r['gaps_s']:.2f} ms + engine wait error "
              f"(last wake-up late) {1e3 * r['final_late_s']:.3f} ms + first enqueue {1e3 * r['first_start_s']:.3f} ms",
              flush=True)
        print(f"      gaps after syncs: emulator return path {1e3 * r['exit_s']:.2f} ms, loop's own Python "
              f"{1e3 * r['loop_s']:.2f} ms, emulator enqueue entry {1e3 * r['entry_s']:.2f} ms, other "
              f"{1e3 * r['other_gaps_s']:.2f} ms (gap median {r['gap_median_us']:.1f} us, {r['gaps_over_1ms']} "
              f"over 1 ms, longest {r['gap_max_ms']:.1f} ms); wake-up lateness forgiven "
              f"{1e3 * r['forgiven_s']:.1f} ms", flush=True)
    print(f"  machine load {' '.join(f'{x:.1f}' for x in os.getloadavg())}; with a sync every iteration the "
          f"error is the host's time between a sync's return and its next enqueue (a real program pays "
          f"its own loop's share too; preemption by other processes lands in whichever part it hits)")


if __name__ == "__main__":
    main()
