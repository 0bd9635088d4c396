"""What a newcomer reads holds: links point at shipped files, the README's set-up commands are
the ones CI runs, and the GPU example of docs/adding.md imports and works."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from gpemu.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "k8s" / "README.md"]


def _shipped() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): every file present is shipped
        return {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()}
    files = set(out.stdout.split())
    return files | {str(Path(f).parent) for f in files}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_at_shipped_files(doc: Path) -> None:
    shipped = _shipped()
    text = doc.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    targets += re.findall(r"`((?:\.\./)+[\w./-]+)`", text)  # paths outside the repository
    for target in targets:
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} points outside the repository: {target}"
        assert str(path.relative_to(ROOT)) in shipped, f"{doc.name} points at a file that is not shipped: {target}"


def test_readme_set_up_is_two_commands_and_ci_runs_the_second() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    block = setup.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands == [
        "pip install torch==2.13.0 -e . && gpemu run --gpu V100 -- python examples/imagenet_classifier.py",
        "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q -n 2 --dist loadfile",
    ]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup  # how to get the small CPU build


def test_the_gpu_example_imports_and_is_usable(tmp_path: Path, capsys) -> None:
    db = f"sqlite:///{tmp_path / 'scratch.sqlite'}"
    assert main(["db", "init", "--db", db]) == 0
    assert main(["db", "import", str(ROOT / "examples" / "rtx3090.json"), "--db", db]) == 0
    assert "imported 1 GPUs" in capsys.readouterr().out
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db

    pdb = open_profile_db(EmuConfig(db_url=db))
    spec = pdb.gpu("rtx3090")
    assert spec.name == "NVIDIA GeForce RTX 3090" and spec.memory_bytes == 24 << 30 and spec.sm_count == 82
    assert pdb.gpu("V100").name == "Tesla V100-PCIE-32GB"  # the shipped GPUs are still there
