"""The emulator's instructions per training iteration, counted by valgrind: a before/after
comparison of its overhead that no machine load moves, C side included.

benchmarks/overhead.py times the step and benchmarks/opcodes.py counts its Python bytecodes. This
script counts the machine instructions of the same step (``overhead.py``'s workloads: the batch
copied in, forward, loss, backward, optimizer step, zero_grad, a sync) under valgrind's callgrind,
so the interpreter, torch's C++ and the autograd engine count too. Only the steady-state
iterations are counted: they run inside ``itertools.starmap`` after the warm-up, and callgrind
collects only inside ``starmap_next`` (``--toggle-collect``). Both sides run with
``PYTHONHASHSEED=0`` (a hash seed alone moves a count by about 0.4%). About 3 minutes a case.

    python benchmarks/instructions.py --models gpt2_small,resnet50
    python benchmarks/instructions.py --old 27becd3 --models gpt2_small,resnet50

Needs ``valgrind`` on the PATH and a Python built with its symbols (``starmap_next``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def run_steps(model: str, batch: int, warmup: int, iterations: int, gpu: str) -> None:
    """``overhead.py``'s step on ``model``: ``warmup`` iterations, then ``iterations`` inside
    ``itertools.starmap`` (the part callgrind counts)."""
    import collections
    import dataclasses
    import itertools

    import overhead  # (this revision's: its workloads and its loss)
    import torch

    import gpemu
    from gpemu.clock import VirtualClock
    from gpemu.config import EmuConfig

    build, x, y, _ = overhead.workload(model, batch)
    with torch.device("meta"):
        module = build()
    module = module.to_empty(device="cpu")
    # gpemu's default host model where the revision has one (the old side has none)
    settings = {"host": "none"} if "host" in {f.name for f in dataclasses.fields(EmuConfig)} else {}
    with gpemu.emulate(gpu=gpu, clock=VirtualClock(), summary=False, **settings):
        net = module.cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

        def step() -> None:
            loss = overhead.step_loss(net(x.cuda()), y.cuda())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()

        for _ in range(warmup):
            step()
        collections.deque(itertools.starmap(step, itertools.repeat((), iterations)), maxlen=0)


def count(root: Path, a: argparse.Namespace, model: str) -> float:
    """Instructions per iteration of ``model`` with the revision staged at ``root``."""
    script = root / "benchmarks" / "instructions.py"
    if script.resolve() != Path(__file__).resolve():
        shutil.copyfile(__file__, script)
    with tempfile.TemporaryDirectory(prefix="gpemu-callgrind-") as tmp:
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", "--collect-atstart=no"]
        argv += ["--toggle-collect=starmap_next", sys.executable, str(script), "--child", model]
        argv += ["--gpu", a.gpu, "--batch", str(a.batch), "--warmup", str(a.warmup), "--iterations", str(a.iterations)]
        env = dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED="0")
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True)
        found = re.search(r"Collected\s*:\s*(\d+)", proc.stderr)
        if proc.returncode != 0 or found is None:
            last = [line for line in proc.stderr.splitlines() if line and not line.startswith("==")][-1:]
            sys.exit(f"instructions.py: {model} failed in {root}: {(last or ['(no message)'])[0]}")
        return int(found.group(1)) / a.iterations


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2_small,resnet50", help="overhead.py's models, comma-separated")
    p.add_argument("--gpu", default="V100", help="emulated GPU (default V100)")
    p.add_argument("--batch", type=int, default=32, help="batch of the image models (gpt2_small: 8 x 1024 tokens)")
    p.add_argument("--iterations", type=int, default=200, help="counted iterations per case (default 200)")
    p.add_argument("--warmup", type=int, default=20, help="uncounted iterations before them (default 20)")
    p.add_argument("--old", default=None, help="git revision to count too, e.g. 27becd3")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # (the run valgrind watches)
    a = p.parse_args()
    if a.iterations < 1 or a.warmup < 2:
        p.error("--iterations must be at least 1 and --warmup at least 2 (recording, optimizer state)")
    if a.child:
        sys.path.insert(0, str(HERE))
        run_steps(a.child, a.batch, a.warmup, a.iterations, a.gpu)
        return
    if shutil.which("valgrind") is None:
        p.error("valgrind is not on the PATH (Debian: apt install valgrind)")
    if a.old:
        found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{a.old}^{{commit}}"])
        if found.returncode != 0:
            p.error(f"--old {a.old!r} is not a revision of this repository (give a commit, tag or branch)")
    sys.path.insert(0, str(HERE))
    from _common import machine

    print(f"machine: {machine()}")
    print(f"\n{'case':24} {'old':>12} {'new':>12} {'change':>8}   (instructions per iteration, {a.gpu})", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpemu-instructions-") as tmp:
        old_root = None
        if a.old:
            from ab_revisions import stage

            old_root = stage(a.old, Path(tmp))
        for model in a.models.split(","):
            new = count(REPO, a, model)
            if old_root is None:
                print(f"{model:24} {'':>12} {new:12,.0f}", flush=True)
                continue
            old = count(old_root, a, model)
            print(f"{model:24} {old:12,.0f} {new:12,.0f} {100 * (new - old) / old:+7.1f}%", flush=True)


if __name__ == "__main__":
    main()
