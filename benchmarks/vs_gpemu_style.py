"""Side by side: gpemu's deadline engine vs a GPEmu-style emulator on the same targets.

GPEmu-style: one ``time.sleep(forward)`` and one ``time.sleep(backward)`` per iteration; every
sleep's overshoot and all host work in between add up. gpemu: enqueue forward and backward on a
virtual stream and wait at the sync point until the absolute deadline; host work while the GPU
is busy is hidden, as on a real GPU.

Targets come from the profile database (forward, backward seconds of a model on a GPU at a
batch size). Host work per iteration (the script's own Python time: data loading, logging)
is simulated with a busy loop and is below the GPU time, so a real GPU would hide it.

    python benchmarks/vs_gpemu_style.py                 # 3 cases x 300 iterations
    python benchmarks/vs_gpemu_style.py --iterations 100 --host-work-ms 2
"""

from __future__ import annotations

import argparse
import time

from gpemu.clock import RealClock
from gpemu.config import EmuConfig
from gpemu.recorder import Recorder
from gpemu.time import TimeEngine

CASES = (("alexnet", "P100", 64), ("resnet18", "V100", 32), ("mobilenet_v2", "A100", 16))


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def gpemu_style(fwd: float, bwd: float, iterations: int, host: float) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        if host:
            busy(host)
        time.sleep(fwd)
        time.sleep(bwd)
    return time.perf_counter() - start


def deadline_engine(fwd: float, bwd: float, iterations: int, host: float) -> float:
    engine = TimeEngine(1, Recorder(), clock=RealClock())
    stream = engine.default_stream(0)
    start = time.perf_counter()
    for _ in range(iterations):
        stream.enqueue(fwd, "forward", "m")
        stream.enqueue(bwd, "backward", "m")
        if host:
            busy(host)
        engine.synchronize(0, "item")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--host-work-ms", type=float, default=1.0)
    a = p.parse_args()
    from gpemu.db import open_profile_db

    db = open_profile_db(EmuConfig.from_env())
    db.gpus()
    print(f"{'case':28} {'target s':>9} {'GPEmu-style':>22} {'gpemu (deadlines)':>22}")
    for host_ms in sorted({0.0, a.host_work_ms}):
        print(f"-- host work per iteration: {host_ms} ms")
        for model, gpu, bs in CASES:
            fwd = db.lookup(gpu, model, bs, "forward").value
            bwd = db.lookup(gpu, model, bs, "backward").value
            target = (fwd + bwd) * a.iterations
            old = gpemu_style(fwd, bwd, a.iterations, host_ms / 1e3)
            new = deadline_engine(fwd, bwd, a.iterations, host_ms / 1e3)
            case = f"{model}/{gpu}/bs{bs} x{a.iterations:<5}"
            print(f"{case} {target:9.3f} {_vs(old, target):>22} {_vs(new, target):>22}")


def _vs(t: float, target: float) -> str:
    return f"{t:8.3f} s ({100 * (t - target) / target:+6.3f}%)"


if __name__ == "__main__":
    main()
