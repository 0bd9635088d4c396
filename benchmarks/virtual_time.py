"""Virtual time's targets (issue 31), each run on the real clock (before: gpemu's default) and on
virtual time (``gpemu run --clock virtual``), printing the figures side by side.

    python benchmarks/virtual_time.py timeline        # same emulated timeline: 4 workloads, real vs virtual
    python benchmarks/virtual_time.py oversubscribed  # Llama-3.1-8B-shaped FSDP2, 4 vs 16 ranks, twice each
    python benchmarks/virtual_time.py speed           # one emulated hour of ResNet-50 on a V100: wall time
    python benchmarks/virtual_time.py sharing         # a time-sharing study: real vs virtual completion times

Per-iteration times are the summary's mean iteration time (``--metrics``, rank 0: the time
between optimizer steps on the emulated GPU's timeline); "wall" is the real time of the
whole command, start-up included. Every figure depends on this machine's load: the load average
is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from _common import REPO, machine

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]
# A GPU-bound ResNet-50 loop (the batch stays in pinned memory; no input pipeline): `speed`.
GPU_BOUND_LOOP = r"""
import sys, time
import torch
sys.path.insert(0, sys.argv[3])
import tvmodels
steps, batch = int(sys.argv[1]), int(sys.argv[2])
model = tvmodels.resnet50().cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
images, labels = torch.randn(batch, 3, 224, 224).pin_memory(), torch.randint(0, 1000, (batch,)).pin_memory()
for i in range(steps):
    x, y = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    if i % 100 == 0: loss.item()
torch.cuda.synchronize()
"""


class Run(NamedTuple):
    """One command's figures: steady-state iteration time, AU, wall time, the load meanwhile."""

    iteration_s: float
    au: float
    wall_s: float
    load: float
    text: str  # what the command printed


def gpemu_run(gpu: str, gpus: int, clock: str, command: list[str], timeout: float = 1800) -> Run:
    """``gpemu run`` the command on ``clock``; the figures from rank 0's metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        argv = [PY, "-m", "gpemu.cli", "run", "--gpu", gpu, "--gpus", str(gpus), "--clock", clock]
        argv += ["--no-summary", "--metrics", str(metrics), "--", *command]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=timeout, env=_env())
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not metrics.exists():
            sys.exit(f"failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-3000:]}")
        s = json.loads(metrics.read_text())
    dev = s["devices"][0]
    return Run(dev["iteration_time"]["mean_s"], s["au"], wall, os.getloadavg()[0], proc.stdout + proc.stderr)


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "examples"), env.get("PYTHONPATH", "")])
    return env


def _row(name: str, real: Run, virtual: Run) -> str:
    diff = 100 * (virtual.iteration_s - real.iteration_s) / real.iteration_s
    return (
        f"{name:<34} {real.iteration_s * 1e3:10.2f} {virtual.iteration_s * 1e3:10.2f} {diff:+8.2f}% "
        f"{real.wall_s:8.1f} {virtual.wall_s:8.1f}   load {real.load:.1f} / {virtual.load:.1f}"
    )


def timeline(args: argparse.Namespace) -> None:
    """Same emulated timeline: per-iteration times on the real clock and on virtual time."""
    ddp = [*TORCHRUN, "--nproc-per-node", "2", "examples/ddp_train.py", "--steps", "16"]
    stall = [PY, "examples/data_stall.py", "--iterations", "30", "--workers"]
    fsdp = [*TORCHRUN, "--nproc-per-node", "4", "benchmarks/llama_fsdp.py", "--layers", "8", "--steps", "6"]
    workloads = [
        ("imagenet_classifier (V100, 2 workers)", "V100", 1, [PY, "examples/imagenet_classifier.py", "--steps", "30"]),
        ("ddp_train x2 (V100)", "V100", 2, ddp),
        ("data_stall, 1 worker (V100)", "V100", 1, [*stall, "1"]),
        ("data_stall, 2 workers (V100)", "V100", 1, [*stall, "2"]),
        ("Llama-8B-shaped FSDP2 x4 (H100)", "H100", 4, fsdp),
    ]
    print(f"{'workload':<34} {'real (ms)':>10} {'virtual':>10} {'diff':>9} {'wall r':>8} {'wall v':>8}")
    for name, gpu, gpus, command in workloads:
        if args.only and args.only not in name:
            continue
        real = gpemu_run(gpu, gpus, "real", command)
        virtual = gpemu_run(gpu, gpus, "virtual", command)
        print(_row(name, real, virtual), flush=True)


def oversubscribed(args: argparse.Namespace) -> None:
    """Llama-3.1-8B shapes (8 of its 32 blocks), local batch 2 x 8192 tokens (torchtitan's): 4 and
    16 ranks on this host, on both clocks, ``--repeat`` times each. A step's host work is about a
    seventh of its GPU work, as in torchtitan's 8B run: 16 ranks on 2 cores are host-bound in real
    time."""
    command = ["benchmarks/llama_fsdp.py", "--layers", "8", "--steps", str(args.steps)]
    print(f"{'ranks':>5} {'clock':>8} {'step (ms)':>10} {'AU':>7} {'wall (s)':>9}   load")
    for ranks in (4, 16):
        for clock in ("real", "virtual"):
            for _ in range(args.repeat):
                r = gpemu_run("H100", ranks, clock, [*TORCHRUN, "--nproc-per-node", str(ranks), *command])
                step = f"{r.iteration_s * 1e3:10.1f} {100 * r.au:6.1f}%"
                print(f"{ranks:>5} {clock:>8} {step} {r.wall_s:9.1f}   {r.load:.1f}", flush=True)


def speed(args: argparse.Namespace) -> None:
    """One emulated hour of GPU-bound ResNet-50 training on a V100, on virtual time."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "loop.py"
        script.write_text(GPU_BOUND_LOOP)
        probe = gpemu_run("V100", 1, "virtual", [PY, str(script), "50", str(args.batch), str(REPO / "examples")])
        steps = int(args.hours * 3600 / probe.iteration_s)
        r = gpemu_run("V100", 1, "virtual", [PY, str(script), str(steps), str(args.batch), str(REPO / "examples")])
    emulated = steps * r.iteration_s
    print(
        f"ResNet-50 batch {args.batch} on V100: {steps} steps of {r.iteration_s * 1e3:.1f} ms = {emulated / 60:.1f} "
        f"emulated minutes in {r.wall_s:.1f} s of wall time ({emulated / r.wall_s:.0f}x real time; load {r.load:.1f})"
    )


def sharing(args: argparse.Namespace) -> None:
    """The same jobs through the sharing manager on real and on virtual time: each job's
    completion time, and how long each run took."""
    sys.path.insert(0, str(REPO / "examples"))
    import sharing_study as study

    from gpemu.integrations.sharing.broker import RabbitBroker

    iteration_s = study.iteration_seconds()
    jobs = study.make_jobs(args.jobs, args.seed, 45.0 * args.scale, 90.0 * args.scale, iteration_s)
    broker = RabbitBroker.start()
    try:
        runs = {c: study.run_study(broker.url, args.policy, c, jobs, iteration_s, 0.005) for c in ("real", "virtual")}
    finally:
        broker.stop()
    real, virtual = runs["real"], runs["virtual"]
    errors = [abs(v.completion - r.completion) / r.completion for r, v in zip(real.jobs, virtual.jobs, strict=True)]
    print(f"{len(jobs)} jobs, {args.policy}, {sum(j.iterations for j in jobs) * iteration_s:.0f} s of GPU work")
    for s in (real, virtual):
        study.report(s)
    print(
        f"per-job completion time, virtual vs real: mean |diff| {100 * sum(errors) / len(errors):.2f}%, "
        f"max {100 * max(errors):.2f}%; virtual run {real.wall_s / virtual.wall_s:.1f}x faster"
    )
    worst = sorted(zip(errors, real.jobs, virtual.jobs, strict=True), key=lambda t: -t[0])[:3]
    for err, r, v in worst:
        print(f"  {r.name}: arrived {r.arrival:.2f} s, {r.iterations} iterations, completion {r.completion:.3f} s "
              f"real, {v.completion:.3f} s virtual ({100 * err:.2f}%)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=("timeline", "oversubscribed", "speed", "sharing"))
    ap.add_argument("--only", help="timeline: only the workload whose name contains this")
    ap.add_argument("--repeat", type=int, default=2, help="oversubscribed: runs per case")
    ap.add_argument("--steps", type=int, default=6, help="oversubscribed: steps per run")
    ap.add_argument("--hours", type=float, default=1.0, help="speed: emulated hours")
    ap.add_argument("--batch", type=int, default=128, help="speed: batch size")
    ap.add_argument("--jobs", type=int, default=40, help="sharing: jobs")
    ap.add_argument("--scale", type=float, default=0.1, help="sharing: the study's times x this (real run length)")
    ap.add_argument("--policy", default="round-robin", help="sharing: the manager's policy")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    print(machine())
    {"timeline": timeline, "oversubscribed": oversubscribed, "speed": speed, "sharing": sharing}[args.target](args)


if __name__ == "__main__":
    main()
