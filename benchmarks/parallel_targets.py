"""Issue 30's torchtitan targets on this machine: Llama 3.1 8B FSDP on 8, 128 (and 1,024) emulated H100s,
70B FSDP + TP on 256, 405B FSDP + TP + PP on 512, each 10 steps of benchmarks/llama_plans.py
under `gpemu run --fold` on virtual time (more GPUs than processes: one process per pipeline
stage). Prints each run's tokens/s/GPU and peak memory per rank beside torchtitan's published
figures, with the run's wall-clock time per step, CPU time and peak memory of all its processes.

    python benchmarks/parallel_targets.py            # all five (about 10 minutes on 2 busy cores)
    python benchmarks/parallel_targets.py 8b-8 70b-256

Published: torchtitan/benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton, H100 96 GB HBM2e
at 500 W, 400 Gb/s RDMA per GPU; torch.compile and Float8 where the table says: the emulated runs
are eager bf16, so they compare with the plain FSDP rows; the 70B and 405B rows had compile and
Float8 (and AsyncTP for 405B), which the emulated runs do not have).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import psutil

SCRIPT = Path(__file__).with_name("llama_plans.py")


class Target(NamedTuple):
    name: str
    nodes: int  # DGX H100 nodes of 8
    processes: int  # one per pipeline stage
    args: tuple[str, ...]
    published: str  # torchtitan's figure for the same plan
    steps: int = 10


TARGETS = {
    # local batch 1, torchtitan's llama3_8b config: its benchmark's local batch 2 took 82.4 GiB of a
    # 96 GB H100, more than the emulated 80 GB H100 SXM holds (the emulated run says so: out of memory)
    "8b-8": Target(
        "8B FSDP 8",
        1,
        1,
        ("--size", "8b", "--batch", "1", "--ac", "selective"),
        "5,762 TPS/GPU at local batch 2, 82.4 GiB",
    ),
    "8b-128": Target(
        "8B FSDP 128", 16, 1, ("--size", "8b", "--batch", "2", "--ac", "selective"), "5,605 TPS/GPU, 67.0 GiB"
    ),
    "8b-1024": Target(
        "8B FSDP 1024", 128, 1, ("--size", "8b", "--batch", "2", "--ac", "selective"), "none found at 1,024 GPUs"
    ),
    "70b-256": Target(
        "70B FSDP 32 x TP 8",
        32,
        1,
        ("--size", "70b", "--tp", "8", "--batch", "16", "--ac", "full"),
        "829 TPS/GPU, 71.9 GiB (compile + Float8)",
    ),
    "405b-512": Target(
        "405B FSDP 8 x TP 8 x PP 8",
        64,
        8,
        # 16 microbatches of 2 sequences (torchtitan: 32 of 1; each microbatch costs this host
        # ~1 CPU-s per stage, so 32 x 10 steps x 8 stages would take an hour on 2 cores), 3 steps
        ("--size", "405b", "--tp", "8", "--pp", "8", "--batch", "32", "--microbatch", "2", "--ac", "full"),
        "100 TPS/GPU, 82.5 GiB (1F1B, 32 microbatches of 1, compile + Float8 + AsyncTP)",
        steps=3,
    ),
}


class Measured(NamedTuple):
    lines: list[str]  # the stages' report lines
    wall_s: float
    cpu_s: float
    peak_rss_gib: float  # all the run's processes together


class Finished(NamedTuple):
    output: str  # stdout and stderr together
    returncode: int
    measured: Measured  # (its lines left empty)


def measure(command: list[str], env: dict[str, str], cwd: str | None = None) -> Finished:
    """Run ``command``: its output, exit status, and wall-clock time, CPU time and peak RSS summed
    over all its processes (sampled every 0.5 s)."""
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parent, peak = psutil.Process(child.pid), 0
    cpu: dict[int, float] = {}
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(child.stdout or []), daemon=True)
    reader.start()  # (a pipe left unread fills and stops a chatty run)
    while child.poll() is None:
        rss = 0
        try:
            for p in [parent, *parent.children(recursive=True)]:
                with p.oneshot():
                    rss += p.memory_info().rss
                    times = p.cpu_times()
                    cpu[p.pid] = times.user + times.system
        except psutil.Error:
            pass  # a process ended while being read
        peak = max(peak, rss)
        time.sleep(0.5)
    reader.join()
    wall = time.perf_counter() - started
    return Finished("".join(out), child.returncode, Measured([], wall, sum(cpu.values()), peak / 2**30))


def run(target: Target, steps: int) -> Measured:
    command = ["gpemu", "run", "--cluster", "dgx-h100", "--nodes", str(target.nodes), "--fold"]
    command += ["--processes", str(target.processes), "--clock", "virtual", "--no-summary", "--"]
    command += [sys.executable, str(SCRIPT), *target.args, "--steps", str(steps)]
    done = measure(command, dict(os.environ))
    lines = [line for line in done.output.splitlines() if line.startswith("llama3 ")]
    if done.returncode or not lines:
        tail = "\n".join(done.output.splitlines()[-15:])
        raise SystemExit(f"{target.name} failed ({done.returncode}):\n{tail}")
    return done.measured._replace(lines=sorted(lines))


def main() -> None:
    wanted = sys.argv[1:] or list(TARGETS)
    for key in wanted:
        target = TARGETS[key]
        steps = target.steps
        measured = run(target, steps)
        print(f"== {target.name} on {target.nodes * 8} emulated H100s ({target.processes} process(es))")
        for line in measured.lines:
            print("   ", re.sub(r"^llama3 ", "", line))
        print(
            f"    this machine: {measured.wall_s:.0f} s wall for {steps} steps ({measured.wall_s / steps:.1f} s per "
            f"step, start-up included), {measured.cpu_s:.0f} CPU-s, peak RSS {measured.peak_rss_gib:.2f} GiB (all "
            f"processes); published: {target.published}",
            flush=True,
        )


if __name__ == "__main__":
    main()
