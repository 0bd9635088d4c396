"""The code's style holds on every CI run: ruff's linter and formatter (configured in
pyproject.toml) find nothing to change anywhere in the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

REPO = Path(__file__).resolve().parents[1]


def _ruff() -> str:
    ruff = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return ruff


def test_ruff_lint_finds_nothing() -> None:
    result = subprocess.run([_ruff(), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_format_changes_nothing() -> None:
    result = subprocess.run([_ruff(), "format", "--check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_sees_a_planted_defect(tmp_path: Path) -> None:
    # The checks above can fail: an unused import and a badly formatted line are found.
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx=1\n")
    lint = subprocess.run([_ruff(), "check", "--no-cache", "--isolated", str(bad)], capture_output=True, text=True)
    fmt = subprocess.run(
        [_ruff(), "format", "--check", "--no-cache", "--isolated", str(bad)], capture_output=True, text=True
    )
    assert lint.returncode != 0 and "F401" in lint.stdout
    assert fmt.returncode != 0


def _stage(root: Path) -> Path:
    """The installed layout of the package's Python files under root (gpemu.db from db/, ...),
    each file a link to the repository's, so the type checker's messages name real files."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (x.strip() for x in line.partition("="))
        dst = root.joinpath(*name.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for f in (REPO / folder).glob("*.py"):
            (dst / f.name).symlink_to(f)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _mypy(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "-p", "gpemu"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_type_checker_finds_nothing(tmp_path: Path) -> None:
    result = _mypy(_stage(tmp_path))
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
