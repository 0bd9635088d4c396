"""The compatibility matrix: every scenario of tests/compat/ run under ``gpemu run``, one row per
case (issue 15's "Must show" table).

    python benchmarks/compat_matrix.py                        # every scenario
    python benchmarks/compat_matrix.py --only torch-parallel,data-parallel
    python benchmarks/compat_matrix.py --python /tmp/cudavenv/bin/python   # another torch build
    python benchmarks/compat_matrix.py --json matrix.json

Columns: works? (exit 0 and the script's own step count), the script's wall time per step
(after the first), the emulated GPU busy time per step (steady state, busiest device), their
ratio (host / GPU: above 1, the emulator's host work shows in the printed time), and the time's
provenance (from the run's notes: ``measured`` when the profile database gave the model's time,
``estimated`` otherwise; "expected" is the registry's).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine  # (puts the repository on sys.path)

from tests.compat import scenarios

HEADER = (
    "client",
    "scenario",
    "GPU",
    "works",
    "wall ms/step",
    "GPU ms/step",
    "host/GPU",
    "provenance",
    "expected",
    "run s",
)


def torch_build(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__, torch.version.cuda or 'cpu')"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--python", default=sys.executable, help="interpreter (its torch) that runs the scenarios")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--keep", default="", help="run in this folder and keep each run's output and metrics")
    return p


def run_scenario(s: scenarios.Scenario, base: Path, python: str) -> list[dict]:
    """Runs one scenario under ``gpemu run`` (its output kept in ``base/<name>``): a row per case."""
    t0 = time.perf_counter()
    try:
        result = scenarios.run(s, base / s.name, python)
    except subprocess.TimeoutExpired:
        result = None
    if result is not None:
        (base / s.name / "output.txt").write_text(result.output)
    gpu_ms = result.gpu_ms_per_step() if result else None
    rows = []
    for case in s.cases:
        steps, wall_ms = result.cases.get(case.name, (None, None)) if result else (None, None)
        works = bool(result and result.returncode == 0 and steps == case.steps)
        rows.append(
            {
                "client": case.client,
                "scenario": s.name,
                "case": case.name,
                "gpu": f"{s.gpus}x{s.gpu}" if s.world == 1 else f"{s.world} ranks x {s.gpu}",
                "works": works,
                "steps": steps,
                "wall_ms_per_step": wall_ms,
                # one GPU figure per command: for a command of several cases it is theirs together
                "gpu_ms_per_step": gpu_ms if len(s.cases) == 1 else None,
                "provenance": result.provenance() if result else None,
                "expected": s.provenance,
                "run_s": round(time.perf_counter() - t0, 1),
                "error": None if works else (result.output[-1500:] if result else "timeout"),
            }
        )
    return rows


def table_line(row: dict) -> str:
    """One row of the markdown table (HEADER's columns)."""
    wall_ms, gpu_ms = row["wall_ms_per_step"], row["gpu_ms_per_step"]
    cells = [
        row["client"],
        row["scenario"],
        row["gpu"],
        "yes" if row["works"] else "NO",
        f"{wall_ms:.1f}" if wall_ms is not None else "-",
        f"{gpu_ms:.1f}" if gpu_ms is not None else "(with the others)",
        f"{wall_ms / gpu_ms:.2f}" if wall_ms and gpu_ms else "-",
        str(row["provenance"]),
        row["expected"],
        f"{row['run_s']:.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = _parser()
    args = p.parse_args()
    try:
        chosen = (
            [scenarios.by_name(n) for n in args.only.split(",")]
            if args.only
            else [s for s in scenarios.SCENARIOS if s.matrix]
        )
    except KeyError as exc:
        p.error(f"--only: {exc.args[0]}")
    print(f"# torch {torch_build(args.python)}; python {platform.python_version()}; {machine()}", flush=True)
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER), flush=True)
    rows = []
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compat-matrix-"))
    for s in chosen:
        for row in run_scenario(s, base, args.python):
            rows.append(row)
            print(table_line(row), flush=True)
    for row in rows:
        if not row["works"]:
            print(f"\n## {row['scenario']} / {row['case']} failed:\n{row['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    sys.exit(0 if all(r["works"] for r in rows) else 1)


if __name__ == "__main__":
    main()
