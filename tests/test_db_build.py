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


def test_concurrent_first_use_builds_once(tmp_path):
    """DataLoader workers / DDP ranks open the database at the same moment on first use."""
    data_dir = tmp_path / "data"
    env = {**os.environ, "GPEMU_DATA_DIR": str(data_dir)}
    env.pop("GPEMU_DB", None)
    n = 5
    start_at = time.time() + 4.0  # after every child has imported SQLAlchemy
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(start_at)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
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
    assert os.stat(path).st_ino != ino

    db = open_profile_db(EmuConfig(data_dir=str(tmp_path)))
    assert db.lookup("K80", "vgg16", 32, "backward").provenance == "measured"


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
    with pytest.raises(ValueError, match="schema version 99, this gpemu uses 1"):
        open_url(url)


def test_unwritable_data_dir_gives_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot create the gpemu data directory"):
        ensure_default_db(blocker / "sub")
