"""The compatibility matrix: every scenario of tests/compat/ run under ``gpemu run``, one row per
case (issue 15's "Must show" table), then the third-party scripts of issue 28 run unmodified from
their own repositories (tests/compat/thirdparty.py), one row per command.

    python benchmarks/compat_matrix.py                        # every scenario and third-party row
    python benchmarks/compat_matrix.py --only torch-parallel,data-parallel
    python benchmarks/compat_matrix.py --python /tmp/cudavenv/bin/python   # another torch build
    python benchmarks/compat_matrix.py --json matrix.json
    python benchmarks/compat_matrix.py --part thirdparty --repos /work/.mirror \
        --python /tmp/cu213/bin/python --newer-python /tmp/cu214/bin/python

Third-party rows need the repositories' snapshots (``--repos DIR``: fetch's ``owner+name/repo``
git directories, or checkouts named ``name``), the libraries each row names (timm, torchvision,
...) in the interpreter, and no network: the data is synthetic. A row that cannot run says why
(no snapshot, a missing library, a commit that needs a newer torch: ``--newer-python``). Each row
prints its provenance: repository, commit and the command line that reproduces it.

Columns: works? (exit 0 and the script's own step count), the script's wall time per step
(after the first), the emulated GPU busy time per step (steady state, busiest device; a
collective's wait for a slower rank not counted), their ratio (host / GPU: above 1, the
emulator's host work shows in the printed time), and the time's
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
from collections.abc import Iterator
from pathlib import Path

from _common import machine  # (puts the repository on sys.path)

from tests.compat import scenarios, thirdparty

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


THIRD_PARTY_HEADER = ("row", "what", "GPU", "works", "GPU ms/step", "iterations", "model time", "run s")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated scenario or third-party row names")
    p.add_argument("--part", choices=("all", "scenarios", "thirdparty"), default="all")
    p.add_argument("--python", default=sys.executable, help="interpreter (its torch) that runs the scenarios")
    p.add_argument(
        "--newer-python", default="", help="interpreter for the third-party rows whose commit needs a newer torch"
    )
    p.add_argument("--repos", action="append", default=[], help="folder of the repositories' snapshots (repeatable)")
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


def third_party_rows(names: list[str]) -> list[thirdparty.Row]:
    """The rows asked for, each after the row whose output it reads."""
    if not names:
        return list(thirdparty.ROWS)
    wanted = {thirdparty.by_name(n).name for n in names}
    for row in thirdparty.ROWS[::-1]:
        if row.name in wanted and row.after:
            wanted.add(row.after)
    return [r for r in thirdparty.ROWS if r.name in wanted]


def run_third_party(rows: list[thirdparty.Row], base: Path, args: argparse.Namespace) -> Iterator[dict]:
    """Each row in a copy of its repository (one copy per repository, rows in order); a row that
    cannot run says why."""
    folders = [Path(f) for f in args.repos]
    copies: dict[str, Path] = {}
    known: dict[tuple, dict] = {}

    def facts_of(python: str, row: thirdparty.Row) -> dict:
        key = (python, row.needs)
        if key not in known:
            known[key] = thirdparty.interpreter_facts(python, row.needs)
        return known[key]

    for row in rows:
        source = thirdparty.find_source(row.repo, folders)
        python = args.python
        facts = facts_of(python, row)
        if row.min_torch and args.newer_python and thirdparty.why_not(row, facts):
            python = args.newer_python
            facts = facts_of(python, row)
        gpu = f"{row.world} ranks x {row.gpu}" if row.world > 1 else f"{row.gpus}x{row.gpu}"
        entry = {"row": row.name, "what": row.what, "gpu": gpu}
        if source is None:
            reason: str | None = f"no snapshot of {row.repo} (fetch github:{row.repo}, then --repos DIR)"
        else:
            reason = thirdparty.why_not(row, facts)
        if source is None or reason:
            yield {**entry, "works": None, "why": reason, "provenance": row.repo}
            continue
        if row.repo not in copies:
            copies[row.repo] = base / row.repo.replace("/", "+")
            missing = thirdparty.copy_out(source, copies[row.repo])
            if missing:
                sys.stderr.write(
                    f"# {row.repo}: {len(missing)} file(s) not in the snapshot: {', '.join(missing[:5])}\n"
                )
        t0 = time.perf_counter()
        try:
            result = thirdparty.run(row, copies[row.repo], base / "runs" / row.name, python, facts)
        except subprocess.CalledProcessError as exc:  # its data or the repository's own preparation
            yield {**entry, "works": False, "why": f"preparation failed: {exc}", "provenance": row.repo}
            continue
        (base / "runs" / row.name / "output.txt").write_text(result.output)
        yield {
            **entry,
            "works": result.works,
            "why": None if result.works else result.output[-2500:],
            "gpu_ms_per_step": scenarios.gpu_ms_per_step(result.metrics),
            "iterations": int(result.metrics[0].get("iterations") or 0) if result.metrics else None,
            "model_time": scenarios.time_provenance(result.metrics),
            "torch": facts["torch"],
            "run_s": round(time.perf_counter() - t0, 1),
            "provenance": thirdparty.provenance_line(row, source),
        }


def third_party_line(row: dict) -> str:
    """One row of the third-party table (THIRD_PARTY_HEADER's columns)."""
    works = {True: "yes", False: "NO", None: "not run"}[row["works"]]
    ms = row.get("gpu_ms_per_step")
    cells = [
        row["row"],
        row["what"],
        row["gpu"],
        works,
        f"{ms:.1f}" if ms is not None else "-",
        str(row.get("iterations", "-")),
        str(row.get("model_time", "-")),
        f"{row['run_s']:.0f}" if "run_s" in row else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = _parser()
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    scenario_names = {s.name for s in scenarios.SCENARIOS}
    try:
        chosen = (
            [scenarios.by_name(n) for n in names if n in scenario_names]
            if names
            else [s for s in scenarios.SCENARIOS if s.matrix]
        )
        rows_3p = (
            third_party_rows([n for n in names if n not in scenario_names])
            if not names or any(n not in scenario_names for n in names)
            else []
        )
    except KeyError as exc:
        p.error(f"--only: {exc.args[0]}")
    if args.part == "thirdparty":
        chosen = []
    if args.part == "scenarios":
        rows_3p = []
    print(f"# torch {torch_build(args.python)}; python {platform.python_version()}; {machine()}", flush=True)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="compat-matrix-"))
    rows = []
    if chosen:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER), flush=True)
    for s in chosen:
        for row in run_scenario(s, base, args.python):
            rows.append(row)
            print(table_line(row), flush=True)
    third = []
    if rows_3p:
        if args.newer_python:
            print(f"# newer interpreter: torch {torch_build(args.newer_python)}", flush=True)
        print("\n| " + " | ".join(THIRD_PARTY_HEADER) + " |")
        print("|" + "---|" * len(THIRD_PARTY_HEADER), flush=True)
        for row in run_third_party(rows_3p, base, args):
            third.append(row)
            print(third_party_line(row), flush=True)
        print("\nProvenance (repository@commit: command, run in a copy of the repository):")
        for row in third:
            print(f"- {row['row']}: {row['provenance']}")
    for row in rows:
        if not row["works"]:
            print(f"\n## {row['scenario']} / {row['case']} failed:\n{row['error']}")
    for row in third:
        if not row["works"]:
            print(f"\n## {row['row']} {'failed' if row['works'] is False else 'not run'}:\n{row['why']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"scenarios": rows, "thirdparty": third}, indent=2) + "\n")
    sys.exit(0 if all(r["works"] for r in rows) and all(r["works"] for r in third) else 1)


if __name__ == "__main__":
    main()
