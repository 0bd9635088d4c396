"""setup.cfg's package data: every glob ships something (a glob that matches nothing is a file
that was moved or removed, and the package would silently install without it)."""

from __future__ import annotations

import configparser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _package_dirs(cfg: configparser.ConfigParser) -> dict[str, Path]:
    """Installed package name -> repository folder (setup.cfg's package_dir)."""
    out = {}
    for line in cfg["options"]["package_dir"].strip().splitlines():
        name, _, folder = (x.strip() for x in line.partition("="))
        out[name] = REPO / folder
    return out


def test_every_package_data_glob_matches_a_file() -> None:
    cfg = _setup_cfg()
    folders = _package_dirs(cfg)
    globs = {package: value for package, value in cfg["options.package_data"].items()}
    assert {"gpemu", "gpemu.db", "gpemu.costmodel"} <= set(globs)
    empty = []
    for package, value in globs.items():
        for pattern in (p.strip() for p in value.split(",") if p.strip()):
            if not [f for f in folders[package].glob(pattern) if f.is_file()]:
                empty.append(f"{package}: {pattern}")
    assert empty == []


def test_the_shipped_data_is_in_a_package_data_glob() -> None:
    """The files the database is built from, the cost model's parameters and the bootstrap
    that `gpemu run` puts on PYTHONPATH are all covered by some glob."""
    cfg = _setup_cfg()
    folders = _package_dirs(cfg)
    shipped = {
        "gpemu.db": ["data/measurements.csv.gz", "data/models.csv", "data/distributions.json.gz"],
        "gpemu.costmodel": ["data/params.json"],
        "gpemu": ["_bootstrap/sitecustomize.py"],
    }
    for package, files in shipped.items():
        patterns = [p.strip() for p in cfg["options.package_data"][package].split(",")]
        for name in files:
            path = folders[package] / name
            assert path.is_file(), name
            assert any(path in folders[package].glob(p) for p in patterns), (package, name)
