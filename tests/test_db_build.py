"""Building the default database: many processes at once, versioning, recovery, --db URLs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

from gpemu.config import EmuConfig
from gpemu.db import db_location, open_profile_db
from gpemu.db.build import data_version, default_db_path, ensure_default_db, load_shipped, open_url

_CHILD = textwrap.dedent("""
    import json, os, sys, time
    start_at = float(sys.argv[1])
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db
    from gpemu.db.build import default_db_path
    cfg = EmuConfig.from_env()
    while time.time() < start_at:   # line every process up on the same instant
        time.sleep(0.001)
    db = open_profile_db(cfg)
    v = db.lookup("V100", "resnet50", 128, "forward").value
    ino = os.stat(default_db_path(cfg.default_data_dir)).st_ino
    print(json.dumps({"value": v, "ino": ino, "count": db.count("forward")}))
""")


@pytest.mark.subprocess
def test_concurrent_first_use_builds_once(tmp_path):
    """DataLoader workers / DDP ranks open the database at the same moment on first use."""
    data_dir = tmp_path / "data"
    env = {**os.environ, "GPEMU_DATA_DIR": str(data_dir)}
    env.pop("GPEMU_DB", None)
    n = 5
    start_at = time.time() + 4.0  # after every child has imported SQLAlchemy
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(start_at)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert {r["value"] for r in results} == {0.119328}
    assert {r["count"] for r in results} == {36 * 6 * 256}
    # One build: every process saw the same file (a second build would have renamed a new one in).
    assert len({r["ino"] for r in results}) == 1
    assert os.stat(default_db_path(data_dir)).st_ino == results[0]["ino"]
    leftovers = [p.name for p in data_dir.iterdir() if p.name.endswith(".building")]
    assert leftovers == []


def _meta(path) -> dict[str, str]:
    con = sqlite3.connect(path)
    try:
        return dict(con.execute("SELECT key, value FROM meta").fetchall())
    finally:
        con.close()


@pytest.mark.slow
def test_outdated_or_broken_database_is_rebuilt(tmp_path):
    path = ensure_default_db(tmp_path)
    assert _meta(path)["data_version"] == data_version()
    assert ensure_default_db(tmp_path) == path  # current: left alone
    ino = os.stat(path).st_ino
    assert ensure_default_db(tmp_path) == path and os.stat(path).st_ino == ino

    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value='0000' WHERE key='data_version'")
    con.commit()
    con.close()
    ensure_default_db(tmp_path)
    assert _meta(path)["data_version"] == data_version()
    assert os.stat(path).st_ino == ino  # refreshed in place: open connections keep writing into it

    db = open_profile_db(EmuConfig(data_dir=str(tmp_path)))
    assert db.lookup("K80", "vgg16", 32, "backward").provenance == "measured"


@pytest.mark.slow
def test_data_dir_with_odd_characters_is_built_once(tmp_path):
    from gpemu.db.build import _is_current

    odd = tmp_path / "my data #1?x"
    path = ensure_default_db(odd)
    assert _is_current(path)
    ino = os.stat(path).st_ino
    assert open_profile_db(EmuConfig(data_dir=str(odd))).lookup("M40", "alexnet", 8, "forward").value > 0
    assert os.stat(path).st_ino == ino  # not rebuilt on the second open


def test_unreadable_file_is_not_current(tmp_path):
    from gpemu.db.build import _is_current

    path = default_db_path(tmp_path)
    path.write_bytes(b"this is not a database")  # e.g. a crash of an old gpemu mid-write
    assert not _is_current(path)
    assert not _is_current(tmp_path / "missing.sqlite")


@pytest.mark.slow
def test_db_url_is_used_as_is_and_filled_on_request(tmp_path):
    url = f"sqlite:///{tmp_path / 'custom.sqlite'}"
    cfg = EmuConfig(db_url=url, data_dir=str(tmp_path / "unused"))
    assert db_location(cfg) == url
    db = open_profile_db(cfg)
    assert db.count() == 0 and not (tmp_path / "unused").exists()
    counts = load_shipped(db.engine)
    assert counts["measurements"] == db.count() > 270_000
    assert open_profile_db(cfg).lookup("V100", "resnet50", 128, "forward").value == 0.119328


def test_in_memory_url_keeps_its_data(tmp_path):
    db = open_url("sqlite://")
    db.add_distribution("d", "bytes", [1.0, 2.0])
    assert db.distribution("d").tolist() == [1.0, 2.0]


def test_newer_schema_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'future.sqlite'}"
    open_url(url).close()
    con = sqlite3.connect(tmp_path / "future.sqlite")
    con.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    con.commit()
    con.close()
    with pytest.raises(ValueError, match="schema version 99, this gpemu uses 2"):
        open_url(url)


def test_unwritable_data_dir_gives_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create the gpemu data directory"):
        ensure_default_db(blocker / "sub")


# ---------------------------------------------------------------------------- upgrades keep user data
_MINE = {
    "format": "gpemu-profile-db",
    "schema_version": 1,
    "gpus": [
        {
            "name": "NVIDIA GeForce RTX 3090",
            "aliases": ["RTX3090"],
            "memory_bytes": 24 << 30,
            "fp32_flops": 35.6e12,
            "fp16_flops": 71e12,
            "memory_bandwidth": 936e9,
            "host_link_bandwidth_pinned": 20e9,
            "host_link_bandwidth_pageable": 10e9,
            "sm_count": 82,
        }
    ],
    "models": [
        {
            "name": "mynet",
            "class_name": "MyNet",
            "param_count": 1000,
            "param_bytes": 4000,
            "buffer_bytes": 0,
            "fwd_flops_per_sample": 1e6,
            "fwd_bwd_flops_per_sample": 3e6,
            "fingerprint": None,
            "input_size": 32,
        }
    ],
    "measurements": {
        "columns": ["gpu", "model", "kind", "batch_size", "value", "source"],
        "rows": [
            ["RTX3090", "mynet", "forward", 8, 0.0123, "my lab"],
            ["V100", "resnet50", "forward", 128, 0.2, "my lab"],
        ],
    },
}


def _gpemu(*args: str, data_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPEMU_DATA_DIR": str(data_dir), "COLUMNS": "200"}
    env.pop("GPEMU_DB", None)
    return subprocess.run(
        [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.subprocess
def test_upgrade_keeps_imported_and_profiled_rows_and_says_so(tmp_path):
    """Import rows, change data_version (what every upgrade does), run any command: still there."""
    data = tmp_path / "data"
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(_MINE))
    assert _gpemu("db", "import", str(mine), data_dir=data).returncode == 0
    path = default_db_path(data)
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE profile_limits (id INTEGER PRIMARY KEY, gpu TEXT UNIQUE, oom_batch_size INTEGER)")
    con.execute("INSERT INTO profile_limits (gpu, oom_batch_size) VALUES ('RTX3090', 512)")
    con.execute("UPDATE meta SET value='0000' WHERE key='data_version'")
    con.commit()
    con.close()

    shown = _gpemu("show", "mynet", "--gpu", "RTX3090", "-b", "8", "--json", data_dir=data)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["measurements"]["forward"]["value"] == 0.0123
    assert "refreshed in place (shipped data 0000 -> " in shown.stderr
    assert "kept 1 GPU(s), 1 model(s), 2 measurement(s), 1 row(s) of profile_limits" in shown.stderr
    assert _meta(path)["data_version"] == data_version()
    db = open_profile_db(EmuConfig(data_dir=str(data)))
    assert db.lookup("V100", "resnet50", 128, "forward").value == 0.2  # the user's own measurement wins
    shipped = open_profile_db(EmuConfig.from_env())
    assert db.lookup("V100", "resnet50", 64, "forward") == shipped.lookup("V100", "resnet50", 64, "forward")
    assert db.count() == shipped.count() + 1  # one new row; the other replaced a shipped one
    con = sqlite3.connect(path)
    assert con.execute("SELECT gpu, oom_batch_size FROM profile_limits").fetchall() == [("RTX3090", 512)]
    con.close()
    assert (data / "profiles-v2.sqlite.previous").exists()  # and a copy from before is kept
    again = _gpemu("gpus", data_dir=data)  # current now: no second rebuild, no message
    assert again.returncode == 0 and "rebuilt" not in again.stderr and "RTX3090" in again.stdout


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["DROP TABLE meta", "UPDATE meta SET value='0' WHERE key='schema_version'"])
def test_unreadable_meta_or_other_schema_rebuilds_without_losing_rows(tmp_path, damage):
    path = ensure_default_db(tmp_path)
    db = open_url(f"sqlite:///{path}")
    from gpemu.db.io import import_path

    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps(_MINE))
    assert import_path(db, mine).rejected == []
    db.close()
    con = sqlite3.connect(path)
    con.execute(damage)
    con.commit()
    con.close()
    ensure_default_db(tmp_path)
    db = open_profile_db(EmuConfig(data_dir=str(tmp_path)))
    assert db.lookup("RTX3090", "mynet", 8, "forward").value == 0.0123
    assert _meta(path)["schema_version"] == "2"


@pytest.mark.slow
def test_a_file_that_is_not_a_database_is_kept_aside_and_reported(tmp_path, capsys):
    path = default_db_path(tmp_path)
    path.write_bytes(b"SQLite format 3\x00 but then garbage" * 100)
    ensure_default_db(tmp_path)
    err = capsys.readouterr().err
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("profiles-v2.sqlite.unreadable-")]
    assert len(kept) == 1 and kept[0].read_bytes().startswith(b"SQLite format 3\x00 but then garbage")
    assert "could not be read" in err and "nothing was carried over" in err and str(kept[0]) in err
    assert open_profile_db(EmuConfig(data_dir=str(tmp_path))).count() == open_profile_db(EmuConfig.from_env()).count()


@pytest.mark.slow
def test_changed_shipped_gpu_is_replaced_and_named(tmp_path, capsys):
    path = ensure_default_db(tmp_path)
    con = sqlite3.connect(path)
    con.execute("UPDATE gpus SET sm_count = 1 WHERE name LIKE '%V100%'")
    con.execute("UPDATE meta SET value='0000' WHERE key='data_version'")
    con.commit()
    con.close()
    ensure_default_db(tmp_path)
    err = capsys.readouterr().err
    assert "replaces the old file's rows for Tesla V100-PCIE-32GB" in err and "kept no rows of your own" in err
    assert open_profile_db(EmuConfig(data_dir=str(tmp_path))).gpu("V100").sm_count == 80


def test_schema_1_database_at_a_url_is_upgraded_in_place_keeping_its_rows(tmp_path):
    """A --db database made by a gpemu before schema 2 (no datasheet columns on gpus) is migrated
    when opened: its GPUs stay, as the user's, with the new facts unknown."""
    from gpemu.db import GpuSpec, schema

    path = tmp_path / "old.sqlite"
    url = f"sqlite:///{path}"
    open_url(url).close()
    con = sqlite3.connect(path)
    for column in schema.gpus.columns.keys()[10:]:  # back to the schema-1 table
        con.execute(f"ALTER TABLE gpus DROP COLUMN {column}")
    con.execute(
        "INSERT INTO gpus (name, aliases, memory_bytes, fp32_flops, fp16_flops, memory_bandwidth, "
        "host_link_bandwidth_pinned, host_link_bandwidth_pageable, sm_count) "
        "VALUES ('Old Card', '[\"OLD\"]', 1073741824, 1e12, 2e12, 1e11, 1e10, 5e9, 8)"
    )
    con.execute("UPDATE meta SET value='1' WHERE key='schema_version'")
    con.commit()
    con.close()

    db = open_url(url)
    old = db.gpu("OLD")
    assert (old.name, old.sm_count, old.provenance, old.generation, old.tf32_tensor_flops) == (
        "Old Card",
        8,
        "user",
        None,
        None,
    )
    assert _meta(path)["schema_version"] == "2"
    db.add_gpu(
        GpuSpec(
            name="New Card",
            aliases=("NEW",),
            memory_bytes=1 << 30,
            fp32_flops=1e12,
            fp16_flops=2e12,
            memory_bandwidth=1e11,
            host_link_bandwidth_pinned=1e10,
            host_link_bandwidth_pageable=5e9,
            sm_count=8,
            generation="ada",
            compute_capability=(8, 9),
        )
    )
    db.close()
    again = open_url(url)  # current now: opened as it is
    assert again.gpu("NEW").compute_capability == (8, 9) and again.gpu("OLD").name == "Old Card"


@pytest.mark.slow
def test_rebuild_keeps_a_user_gpu_whose_alias_now_names_a_shipped_one_and_says_so(tmp_path, capsys):
    """Your own "H100" from before gpemu shipped one: kept under its name; the alias now means
    the shipped GPU, and the rebuild says so."""
    path = ensure_default_db(tmp_path)
    con = sqlite3.connect(path)
    con.execute(
        "INSERT INTO gpus (name, aliases, memory_bytes, fp32_flops, fp16_flops, memory_bandwidth, "
        "host_link_bandwidth_pinned, host_link_bandwidth_pageable, sm_count) "
        "VALUES ('My Hopper', '[\"H100\", \"MYH\"]', 85899345920, 6.7e13, 9.9e14, 3.35e12, 5e10, 5e9, 132)"
    )
    con.execute("UPDATE meta SET value='0000' WHERE key='data_version'")
    con.commit()
    con.close()
    capsys.readouterr()
    ensure_default_db(tmp_path)
    err = " ".join(capsys.readouterr().err.split())
    assert "kept 1 GPU(s)" in err
    assert "the alias 'H100' of My Hopper now names the shipped NVIDIA H100 80GB HBM3 (use 'My Hopper')" in err
    db = open_profile_db(EmuConfig(data_dir=str(tmp_path)))
    assert db.gpu("H100").name == "NVIDIA H100 80GB HBM3" and db.gpu("MYH").name == "My Hopper"
    assert db.gpu("My Hopper").provenance == "user"
