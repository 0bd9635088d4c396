"""Two revisions of gpemu, one benchmark, interleaved on the same machine in one run.

Each revision is checked out from git (or the working tree, ``WORKTREE``) into a scratch folder
with the installed package layout (``db/`` as ``gpemu/db`` and so on, from setup.cfg), and the
benchmark runs alternately on one and the other, ``--rounds`` times each, so that a machine
getting busier or quieter affects both alike. Rows of the benchmark's table with the same key
are compared by their median over the rounds.

    python benchmarks/ab_revisions.py --old 9a331bc --new WORKTREE --rounds 3 -- \\
        benchmarks/overhead.py --gpus V100,A100 --models resnet50,alexnet --batches 32 --iterations 30

The default row parser reads ``benchmarks/overhead.py``'s table (key: gpu, model, batch;
value: host ms per iteration). Both revisions run with this Python and its installed
dependencies. Leave ``PYTHONHASHSEED`` unset: a fixed seed gives each revision one fixed dict
layout, a bias of a few percent that more rounds do not average away (9 rounds of the same two
revisions read +2.5 to +9.4% with the seed fixed at 0, +2.5 to +5.9% in 15 rounds without).
For a count no load or layout moves, see benchmarks/instructions.py.
"""

from __future__ import annotations

import argparse
import configparser
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, machine


def stage(rev: str, into: Path) -> Path:
    """``rev``'s files in the installed layout under ``into`` (plus examples/ and benchmarks/)."""
    src = into / "src"
    if rev == "WORKTREE":
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info"))
    else:
        src.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    cfg = configparser.ConfigParser()
    cfg.read(src / "setup.cfg")
    root = into / "stage"
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (x.strip() for x in line.partition("="))
        shutil.copytree(src / folder, root.joinpath(*name.split(".")), dirs_exist_ok=True)
    for extra in ("examples", "benchmarks"):
        if (src / extra).exists():
            shutil.copytree(src / extra, root / extra, dirs_exist_ok=True)
    return root


def overhead_rows(out: str, column: int = 3) -> dict[tuple, float]:
    """benchmarks/overhead.py's table: (gpu, model, batch) -> host ms per iteration (``column``
    3: wall time; 5: the running thread's CPU time, less disturbed by a busy machine)."""
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        # gpu, model, batch, host ms/iter, ..., a share in % (the table gained columns over time)
        if len(parts) >= 7 and parts[2].isdigit() and any(x.endswith("%") for x in parts[4:]):
            try:
                rows[(parts[0], parts[1], int(parts[2]))] = float(parts[column])
            except ValueError:
                continue
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="git revision (or WORKTREE)")
    p.add_argument("--new", default="WORKTREE", help="git revision (default: the working tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--benchmark-from",
        choices=("each", "new"),
        default="each",
        help="run each revision's own copy of the benchmark script (default), or the new "
        "revision's on both (cases only the new script has, e.g. added models, get a "
        "before figure)",
    )
    p.add_argument(
        "--value",
        choices=("wall", "cpu"),
        default="wall",
        help="compare overhead.py's wall time per iteration (default) or its thread CPU time (on a busy "
        "machine the less disturbed of the two)",
    )
    p.add_argument(
        "--new-args",
        default="",
        help='arguments added for the new revision only, e.g. "--host none" to run it in the configuration the '
        "old revision had (an option the old script does not know)",
    )
    p.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- script.py [args]: path relative to the repository")
    a = p.parse_args()
    bench = [x for x in a.benchmark if x != "--"]
    if not bench:
        p.error("give the benchmark after --, e.g. -- benchmarks/overhead.py --gpus V100")
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    for rev in {a.old, a.new} - {"WORKTREE"}:
        found = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"])
        if found.returncode != 0:
            p.error(f"{rev!r} is not a revision of this repository (give a commit, tag, branch or WORKTREE)")
    print(f"machine: {machine()}")
    print(
        f"old {a.old} vs new {a.new}, {a.rounds} rounds of: {' '.join(bench)} ({a.benchmark_from} revision's script)"
        + (f"; the new one with {a.new_args}" if a.new_args else ""),
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gpemu-ab-") as tmp:
        roots = {rev: stage(rev, Path(tmp) / tag) for tag, rev in (("old", a.old), ("new", a.new))}
        if a.benchmark_from == "new":  # the whole folder: a script imports its neighbours (machine.py)
            shutil.copytree(roots[a.new] / "benchmarks", roots[a.old] / "benchmarks", dirs_exist_ok=True)
        results: dict[str, list[dict]] = {a.old: [], a.new: []}
        try:
            for r in range(a.rounds):
                for rev in (a.old, a.new) if r % 2 == 0 else (a.new, a.old):
                    root = roots[rev]
                    env = dict(os.environ, PYTHONPATH=str(root))
                    extra = a.new_args.split() if rev == a.new and rev != a.old else []
                    proc = subprocess.run(
                        [sys.executable, str(root / bench[0]), *bench[1:], *extra],
                        cwd=root,
                        env=env,
                        capture_output=True,
                        text=True,
                    )
                    if proc.returncode != 0:
                        sys.exit(f"{rev}: the benchmark failed:\n{proc.stderr[-2000:]}")
                    results[rev].append(overhead_rows(proc.stdout, 3 if a.value == "wall" else 5))
                    print(f"  round {r + 1}: {rev} done (load {os.getloadavg()[0]:.2f})", flush=True)
        except KeyboardInterrupt:
            sys.exit("interrupted")
    keys = sorted(set().union(*results[a.old]) & set().union(*results[a.new]))
    if not keys:
        sys.exit("ab_revisions: the two revisions' tables have no case in common (is the benchmark's table the same?)")
    print(f"\n{'case':34} {'old ms':>8} {'new ms':>8} {'change':>8}   ({a.value} time per iteration)")
    worst = -float("inf")  # (every case may be faster: the slowest change is then negative)
    for key in keys:
        old = statistics.median(r[key] for r in results[a.old] if key in r)
        new = statistics.median(r[key] for r in results[a.new] if key in r)
        change = (new - old) / old
        worst = max(worst, change)
        print(f"{'/'.join(map(str, key)):34} {old:8.3f} {new:8.3f} {100 * change:+7.1f}%")
    print(f"slowest change: {100 * worst:+.1f}% (medians of {a.rounds} interleaved rounds); machine after: {machine()}")


if __name__ == "__main__":
    main()
