"""The code's shape in the figures the architecture issue tracks: files over 800 lines, functions
over 100 (and 80) lines, reads of an emulated tensor's private fields outside the module that
defines them, and how often ``Any`` is written.

    python benchmarks/code_shape.py [ROOT]     # ROOT: a checkout (default: this one)
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

FOLDERS = ("gpemu", "db", "profiler", "integrations", "k8s", "tests", "examples", "benchmarks")
GENERATED = {"api_pb2.py", "api_pb2_grpc.py"}
TENSOR_FIELDS = re.compile(r"\._(dev|block|shadow|key|meta|ts)\b")
# The modules that define the emulated tensor's fields (the reads inside them are its own).
TENSOR_HOMES = ("gpemu/tensor.py", "gpemu/device/")


def _files(root: Path) -> list[Path]:
    out = []
    for folder in FOLDERS:
        out += [p for p in (root / folder).rglob("*.py") if p.name not in GENERATED]
    return sorted(out)


def _annotation_anys(tree: ast.AST) -> int:
    """How many times ``Any`` is written in the annotations of a module (parameters, returns,
    variables; string annotations parsed)."""
    count = 0
    annotations: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
            annotations += [a.annotation for a in every if a is not None and a.annotation is not None]
            if node.returns is not None:
                annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
    for ann in annotations:
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                continue
        count += sum(1 for n in ast.walk(ann) if isinstance(n, ast.Name) and n.id == "Any")
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    root = Path(ap.parse_args().root)
    big, long100, long80, private_reads, anys = [], [], [], 0, 0
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        lines = text.count("\n")
        if lines > 800:
            big.append((lines, rel))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 100:
                    long100.append((n, f"{rel}:{node.name}"))
                if n > 80:
                    long80.append((n, f"{rel}:{node.name}"))
        in_package = rel.startswith(("gpemu/", "db/", "profiler/", "integrations/", "k8s/"))
        if in_package and not rel.startswith(TENSOR_HOMES):
            private_reads += len(TENSOR_FIELDS.findall(text))
        if in_package:
            anys += _annotation_anys(ast.parse(text))
    print(f"files over 800 lines (generated code aside): {len(big)}")
    for n, name in sorted(big, reverse=True):
        print(f"  {n:5d}  {name}")
    print(f"functions over 100 lines: {len(long100)}")
    for n, name in sorted(long100, reverse=True):
        print(f"  {n:5d}  {name}")
    print(f"functions over 80 lines: {len(long80)}")
    print(f"reads of an emulated tensor's private fields outside its own modules: {private_reads}")
    print(f"'Any' in the package's annotations: {anys}")


if __name__ == "__main__":
    main()
