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
    engine = root / "gpemu" / "time" / "engine.py"
    engine.write_text(engine.read_text() + "\nfrom gpemu.fastpaths import replay  # points up\n")
    result = _lint(root)
    assert result.returncode != 0
    assert "gpemu.time is not allowed to import gpemu.fastpaths" in result.stdout


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
    f.write_text("from gpemu.device import _secret\nfrom gpemu import device as t\nt._other\n")
    assert len(_private_uses(f, "gpemu.mod")) == 2


def _owned_privates(tree: ast.AST) -> set[str]:
    """The private attributes a module defines for its own objects: ``self._x = ...`` /
    ``cls._x = ...``, names in a class body (``_x: int``, ``_x = ...``) and ``__slots__``."""
    owned: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                owned.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                for t in targets:
                    if isinstance(t, ast.Name):
                        owned.add(t.id)
                if isinstance(item, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets
                ):
                    owned.update(
                        e.value
                        for e in ast.walk(item.value)
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)
                    )
    return {n for n in owned if n.startswith("_") and not n.startswith("__")}


def _package_files() -> dict[str, Path]:
    """Installed module name -> file, for every module of the package (generated stubs aside)."""
    out = {}
    for name, folder in _package_dirs().items():
        for f in sorted(folder.glob("*.py")):
            if not f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                out[name if f.name == "__init__.py" else f"{name}.{f.stem}"] = f
    return out


def _foreign_attribute_uses(files: dict[str, Path]) -> list[str]:
    """``obj._field`` where ``_field`` is a private attribute another module of the package
    defines for its objects and this module does not (reads and writes through another module's
    object); and writes of an emulated tensor's public fields (``t.emu_block = ...``) outside
    gpemu.device, whose TensorState methods are the way to change them."""
    trees = {m: ast.parse(f.read_text()) for m, f in files.items()}
    owned = {m: _owned_privates(t) for m, t in trees.items()}
    found = []
    for module, tree in trees.items():
        others = set().union(*(o for m, o in owned.items() if m != module)) - owned[module]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            is_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if node.attr in others and not is_self:
                found.append(f"{module}:{node.lineno} .{node.attr}")
            if (
                isinstance(node.ctx, ast.Store)
                and node.attr.startswith("emu_")
                and not module.startswith("gpemu.device")
            ):
                found.append(f"{module}:{node.lineno} writes .{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_objects() -> None:
    assert _foreign_attribute_uses(_package_files()) == []


def test_the_attribute_check_sees_reads_and_writes(tmp_path: Path) -> None:
    owner = tmp_path / "owner.py"
    owner.write_text("class Box:\n    def __init__(self):\n        self._inside = 1\n")
    user = tmp_path / "user.py"
    user.write_text("def peek(box, t):\n    t.emu_block = None\n    return box._inside\n")
    found = _foreign_attribute_uses({"gpemu.owner": owner, "gpemu.user": user})
    assert sorted(found) == ["gpemu.user:2 writes .emu_block", "gpemu.user:3 ._inside"]
