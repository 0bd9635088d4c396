"""The package's structure holds: import contracts (.importlinter, checked with import-linter on
the installed layout) and no module reaching into another module's privates."""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _package_dirs() -> dict[str, Path]:
    """Installed package name -> repository folder (setup.cfg's package_dir)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (x.strip() for x in line.partition("="))
        out[name] = REPO / folder
    return out


def _stage(root: Path) -> Path:
    """The installed layout (gpemu/db/, gpemu/k8s/, ...) of the package's Python files under root."""
    for name, folder in _package_dirs().items():
        dst = root.joinpath(*name.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for f in folder.glob("*.py"):
            shutil.copy(f, dst / f.name)
    shutil.copy(REPO / ".importlinter", root / ".importlinter")
    return root


def _lint(root: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if lint is None:
        pytest.fail("lint-imports (import-linter) is not installed: pip install -e '.[test]'")
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run(
        [lint, "--config", ".importlinter", "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.subprocess
def test_import_contracts_are_kept(tmp_path: Path) -> None:
    result = _lint(_stage(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.subprocess
def test_a_wrong_way_import_breaks_the_contracts(tmp_path: Path) -> None:
    root = _stage(tmp_path)
    engine = root / "gpemu" / "engine.py"
    engine.write_text(engine.read_text() + "\nfrom gpemu.fastpaths import replay  # points up\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "gpemu.engine is not allowed to import gpemu.fastpaths" in result.stdout


def _private_uses(path: Path, module: str) -> list[str]:
    """``from gpemu.x import _private`` and ``x._private`` (x an imported gpemu module) in one
    file, where gpemu.x is another module than this file's own."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != "gpemu" and not source.startswith("gpemu."):
                continue
            for a in node.names:
                if a.name.startswith("_") and source != module:
                    found.append(f"{path.name}:{node.lineno} from {source} import {a.name}")
                aliases[a.asname or a.name] = f"{source}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gpemu"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            target = aliases.get(node.value.id)
            if target is not None and target != module:
                found.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_privates() -> None:
    found = []
    for name, folder in _package_dirs().items():
        for f in sorted(folder.glob("*.py")):
            if f.name.endswith(("_pb2.py", "_pb2_grpc.py")):  # generated gRPC stubs
                continue
            module = name if f.name == "__init__.py" else f"{name}.{f.stem}"
            found += [f"{name}: {use}" for use in _private_uses(f, module)]
    assert found == []


def test_the_private_use_check_sees_both_forms(tmp_path: Path) -> None:
    f = tmp_path / "mod.py"
    f.write_text("from gpemu.tensor import _secret\nfrom gpemu import tensor as t\nt._other\n")
    assert len(_private_uses(f, "gpemu.mod")) == 2
