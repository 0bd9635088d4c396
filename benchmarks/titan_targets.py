"""Issue 30's torchtitan targets with torchtitan itself: its own train entry point and its own
Llama 3.1 configurations (benchmarks/titan_configs.py: torchtitan's ``llama3_8b`` / ``llama3_70b``
/ ``llama3_405b`` with the tokenizer and data set it ships for tests) on emulated DGX H100s under
``gpemu run --fold`` (one process standing for its identical ranks; one per pipeline stage), on
virtual time. Prints, per target, the steps torchtitan logged, its tokens/s/GPU and peak memory
(its own log lines: max reserved memory of the emulated GPU), and this machine's wall-clock time
per step, CPU time and peak RSS of all the run's processes, beside torchtitan's published figures.

    python benchmarks/titan_targets.py --python /path/to/torch-2.14-venv/bin/python \\
        --torchtitan /work/.mirror/pytorch+torchtitan/repo 8b-8 8b-128 70b-256 405b-512

``--torchtitan``: a torchtitan checkout, or a git directory whose HEAD is copied out (with the
synthetic c4_test data of tests/compat/synthetic.py). The interpreter needs torch >= 2.14 and
torchtitan's requirements (tyro, grain, datasets, tokenizers, torch_checkpointing, spmd_types)
and this gpemu. Published: torchtitan/benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton
H100 96 GB HBM2e at 500 W; the 70B and 405B rows with torch.compile and Float8, 405B also AsyncTP:
the emulated runs are eager bf16).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from statistics import mean
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "compat"))

from parallel_targets import Measured, measure  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class Target(NamedTuple):
    name: str
    nodes: int  # DGX H100 nodes of 8
    processes: int  # one per pipeline stage
    config: str  # a function of titan_configs.py
    published: str  # torchtitan's figure for the same plan
    env: tuple[tuple[str, str], ...] = ()


TARGETS = {
    "8b-8": Target("8B FSDP 8, local batch 1", 1, 1, "llama3_8b_offline", "5,762 TPS/GPU, 82.4 GiB at local batch 2"),
    "8b-8-lb2": Target("8B FSDP 8, local batch 2", 1, 1, "llama3_8b_lb2_offline", "5,762 TPS/GPU, 82.4 GiB"),
    "8b-128": Target(
        "8B FSDP 128, local batch 1", 16, 1, "llama3_8b_offline", "5,605 TPS/GPU, 67.0 GiB at local batch 2"
    ),
    "8b-128-lb2": Target("8B FSDP 128, local batch 2", 16, 1, "llama3_8b_lb2_offline", "5,605 TPS/GPU, 67.0 GiB"),
    "70b-256": Target(
        "70B FSDP 32 x TP 8, local batch 8",
        32,
        1,
        "llama3_70b_offline",
        "829 TPS/GPU, 71.9 GiB (local batch 16, compile + Float8)",
    ),
    "405b-512": Target(
        "405B FSDP 8 x TP 8 x PP 8 (1F1B), 16 microbatches of 2",
        64,
        8,
        "llama3_405b_offline",
        "100 TPS/GPU, 82.5 GiB (local batch 32, compile + Float8 + AsyncTP)",
        (("TITAN_MICROBATCHES", "16"),),
    ),
}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


class Step(NamedTuple):
    step: int
    memory_gib: float  # torchtitan's max reserved memory so far
    tps: float  # tokens per second per GPU over this step
    mfu: float  # percent, torchtitan's count


def steps_logged(output: str) -> list[Step]:
    """torchtitan's per-step metric lines (every process that logs them)."""
    found = []
    for line in _ANSI.sub("", output).splitlines():
        m = _STEP.search(line)
        if m:
            found.append(Step(int(m[1]), float(m[2]), float(m[3].replace(",", "")), float(m[4])))
    return found


def torchtitan_copy(source: Path, python: str) -> Path:
    """A folder torchtitan runs in: ``source`` itself when it is a checkout with its test data, else
    its HEAD copied out with synthetic c4_test data."""
    if (source / "torchtitan" / "train.py").is_file() and (source / "tests/assets/c4_test/data.json").is_file():
        return source
    import subprocess

    import thirdparty

    dest = Path(tempfile.mkdtemp(prefix="titan-"))
    found = thirdparty.find_source("pytorch/torchtitan", [source.parent.parent, source.parent, source])
    if found is None:
        raise SystemExit(f"--torchtitan {source}: no torchtitan checkout or git directory there")
    thirdparty.copy_out(found, dest)
    subprocess.run([python, str(thirdparty.SYNTHETIC), "c4-test", str(dest)], check=True)
    return dest


def run(target: Target, python: str, titan: Path, steps: int) -> tuple[list[Step], Measured]:
    command = [python, "-m", "gpemu.cli", "run", "--cluster", "dgx-h100", "--nodes", str(target.nodes), "--fold"]
    command += ["--processes", str(target.processes), "--clock", "virtual", "--no-summary", "--"]
    command += [python, "-m", "torchtitan.train", "--module", "titan_configs", "--config", target.config]
    env = {**os.environ, **OFFLINE, **dict(target.env), "TITAN_STEPS": str(steps), "PYTHONPATH": str(HERE)}
    done = measure(command, env, cwd=str(titan))
    log = Path(tempfile.gettempdir()) / f"titan-{target.config}.log"
    log.write_text(done.output)
    logged = steps_logged(done.output)
    if done.returncode or not logged:
        tail = "\n".join(done.output.splitlines()[-25:])
        raise SystemExit(
            f"{target.name} failed ({done.returncode}) after {len(logged)} step line(s) (all: {log}):\n{tail}"
        )
    return logged, done.measured


def report(target: Target, logged: list[Step], measured: Measured, steps: int) -> str:
    last = max(s.step for s in logged)
    later = [s for s in logged if s.step > 1] or logged  # (step 1 carries start-up and warm-up)
    lines = [
        f"== {target.name} on {target.nodes * 8} emulated H100s ({target.processes} process(es)): {last} steps",
        f"    tokens/s/GPU {mean(s.tps for s in later):,.0f} (steps 2-{last}, torchtitan's tps), MFU "
        f"{mean(s.mfu for s in later):.1f}% (torchtitan's count), peak memory "
        f"{max(s.memory_gib for s in logged):.2f} GiB per rank (max reserved, most of any process)",
        f"    per step: {', '.join(f'{s.tps:,.0f}' for s in logged)} tokens/s/GPU",
        f"    this machine: {measured.wall_s:.0f} s wall for {steps} steps ({measured.wall_s / steps:.1f} s per step,"
        f" start-up included), {measured.cpu_s:.0f} CPU-s, peak RSS {measured.peak_rss_gib:.2f} GiB (all processes)",
        f"    published: {target.published}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)} (default: the issue's four)")
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter with torch >= 2.14 and torchtitan's needs"
    )
    parser.add_argument("--torchtitan", type=Path, required=True, help="a torchtitan checkout or git directory")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {', '.join(unknown)}; valid: {', '.join(TARGETS)}")
    titan = torchtitan_copy(args.torchtitan, args.python)
    for key in args.targets or ["8b-8", "8b-128", "70b-256", "405b-512"]:
        target = TARGETS[key]
        logged, measured = run(target, args.python, titan, args.steps)
        print(report(target, logged, measured, args.steps), flush=True)


if __name__ == "__main__":
    main()
