"""The emulator's own work per training iteration in Python bytecodes: a count that no machine load
changes, for before/after comparisons of the emulator's overhead.

benchmarks/overhead.py times the same step (its workloads and loop are used here); on a shared
machine its CPU times move by a few percent between runs, as much as a change under study. This
script traces the steady-state iterations (after the recording and the optimizer's first step)
and counts the bytecodes executed in every Python function, torch's own Python included: the
work that a CPU time per iteration mostly is, since the step's C++ parts (autograd's engine,
wrapper tensors) are the same for both revisions. On this machine the two agree: 27becd3 -> the
package split measured +7.3% bytecodes and +6-8% CPU time per iteration (gpt2_small, resnet50).

    python benchmarks/opcodes.py --models gpt2_small,resnet50          # this checkout
    python benchmarks/opcodes.py --old 27becd3 --models gpt2_small,resnet50 --top 15
    python benchmarks/opcodes.py --old 27becd3 --host this             # the new side with a host model

``--old REV`` runs the same count on git revision REV too (staged as benchmarks/ab_revisions.py
does) and prints both with the change; ``--top N`` lists the N functions whose counts changed most
(by function name without leading underscores, so that a function moved to another module pairs
with itself).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


class BytecodeCounter:
    """The Python bytecodes executed between :meth:`start` and :meth:`stop` on this thread, torch's
    own Python included, by ``module:function`` (``counts``)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def _opcode(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            self.counts[f"{Path(code.co_filename).stem}:{code.co_name}"] += 1
        return self._opcode

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return self._opcode
        return None

    def start(self) -> None:
        sys.settrace(self._call)

    def stop(self) -> None:
        sys.settrace(None)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count(gpu: str, model: str, batch: int, iterations: int, host: str | None, warmup: int = 10) -> dict[str, float]:
    """Bytecodes per steady-state iteration of ``overhead.py``'s step, by ``module:function``:
    ``iterations`` traced after ``warmup`` untraced ones (the recording, the optimizer's first
    step and the gradient sets' first hand-outs are one-off work)."""
    import overhead  # (this revision's: its workloads and its measured loop)

    counter = BytecodeCounter()

    def toggle(rt: Any, i: int) -> bool:  # (called before iteration i: 0 records, 1 makes the optimizer's state)
        if i == 2 + warmup:
            counter.start()
        elif i == 2 + warmup + iterations:
            counter.stop()
        return True

    kwargs = {}
    if "host_model" in inspect.signature(overhead.measure).parameters:  # (a revision with a host model)
        from gpemu.config import EmuConfig

        kwargs["host_model"] = host or EmuConfig.from_env({}).host  # (gpemu's default, not overhead.py's)
    overhead.measure(gpu, model, batch, warmup + iterations + 1, toggle=toggle, **kwargs)
    counter.stop()
    return {name: n / iterations for name, n in counter.counts.items()}


def _counts_in(root: Path, a: argparse.Namespace, host: str | None) -> dict[str, dict[str, float]]:
    """The counts of every case, taken by this script in a child interpreter run on ``root`` (from
    ``root``'s benchmarks folder, where it finds that revision's overhead.py)."""
    script = root / "benchmarks" / "opcodes.py"
    if script.resolve() != Path(__file__).resolve():
        shutil.copyfile(__file__, script)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, str(script), "--gpus", a.gpus, "--models", a.models]
        argv += ["--batch", str(a.batch), "--iterations", str(a.iterations), "--warmup", str(a.warmup)]
        argv += ["--json", out.name]
        argv += ["--host", host] if host else []
        env = dict(os.environ, PYTHONPATH=str(root))
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1:] or ["(no message)"]
            sys.exit(f"opcodes.py: the count failed in {root}: {last[0]}")
        return json.loads(Path(out.name).read_text())


def _by_name(counts: dict[str, float]) -> collections.Counter[str]:
    """Counts by function name, leading underscores dropped (a private function made public when
    it moved to another module pairs with itself)."""
    out: collections.Counter[str] = collections.Counter()
    for name, n in counts.items():
        out[name.rpartition(":")[2].lstrip("_") or name] += n
    return out


def _print_changes(old: dict[str, float], new: dict[str, float], top: int) -> None:
    before, after = _by_name(old), _by_name(new)
    changes = sorted(((after[f] - before[f], f) for f in set(before) | set(after)), key=lambda c: -abs(c[0]))
    for delta, name in changes[:top]:
        print(f"    {delta:+8.1f}  {before[name]:8.1f} -> {after[name]:8.1f}  {name}")


def _check(p: argparse.ArgumentParser, a: argparse.Namespace, models: set[str]) -> None:
    """One line for a model overhead.py does not know, or a revision git does not."""
    sys.path.insert(0, str(REPO))
    from overhead import EXTRA_MODELS

    from examples import tvmodels

    known = set(tvmodels.MODELS) | set(EXTRA_MODELS)
    unknown = sorted(models - known)
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}: give overhead.py's, e.g. resnet50, gpt2_small, params1000")
    if a.old:
        found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{a.old}^{{commit}}"],
                               capture_output=True)  # fmt: skip
        if found.returncode != 0:
            p.error(f"--old {a.old!r} is not a revision of this repository (give a commit, tag or branch)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="V100", help="emulated GPUs, comma-separated (default V100)")
    p.add_argument("--models", default="gpt2_small,resnet50", help="overhead.py's models, comma-separated")
    p.add_argument("--batch", type=int, default=32, help="batch of the image models (gpt2_small: 8 x 1024 tokens)")
    p.add_argument("--iterations", type=int, default=20, help="traced iterations per case (default 20)")
    p.add_argument("--warmup", type=int, default=10, help="untraced iterations before them (default 10)")
    p.add_argument("--host", default=None, help="gpemu run --host for this checkout's side (default: gpemu's own)")
    p.add_argument("--old", default=None, help="git revision to count too, e.g. 27becd3")
    p.add_argument("--top", type=int, default=0, help="with --old: the N functions whose counts changed most")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)  # (the child's answer to --old)
    a = p.parse_args()
    if a.iterations < 1 or a.warmup < 0:
        p.error("--iterations must be at least 1 and --warmup at least 0")
    cases = [(g, m) for g in a.gpus.split(",") for m in a.models.split(",")]
    if not a.json:
        _check(p, a, {m for _, m in cases})
    if a.json:
        result = {f"{g}/{m}": count(g, m, a.batch, a.iterations, a.host, a.warmup) for g, m in cases}
        Path(a.json).write_text(json.dumps(result))
        return
    from _common import machine  # (not in the child: the old revision's benchmarks may lack it)

    print(f"machine: {machine()}")
    new = _counts_in(REPO, a, a.host)
    old: dict[str, dict[str, float]] = {}
    if a.old:
        from ab_revisions import stage

        with tempfile.TemporaryDirectory(prefix="gpemu-opcodes-") as tmp:
            old = _counts_in(stage(a.old, Path(tmp)), a, None)
    print(f"\n{'case':24} {'old':>10} {'new':>10} {'change':>8}   (Python bytecodes per iteration)")
    for case, counts in new.items():
        total = sum(counts.values())
        if case not in old:
            print(f"{case:24} {'':>10} {total:10.0f}")
            continue
        before = sum(old[case].values())
        print(f"{case:24} {before:10.0f} {total:10.0f} {100 * (total - before) / before:+7.1f}%")
        if a.top:
            _print_changes(old[case], counts, a.top)


if __name__ == "__main__":
    main()
