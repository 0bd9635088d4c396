"""The default database on a shared data directory: rebuilds racing writers, other schema versions,
builds killed mid-way. Through the commands users run (`gpemu db init --force`, `gpemu gpus`)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpemu.db.build import DEFAULT_DB_NAME, LEGACY_DB_NAME, default_db_path, ensure_default_db

_MAIN = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"

pytestmark = pytest.mark.subprocess


def _env(data: Path) -> dict[str, str]:
    env = {**os.environ, "GPEMU_DATA_DIR": str(data), "COLUMNS": "200"}
    env.pop("GPEMU_DB", None)
    return env


def _gpemu(data: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _MAIN, *args], capture_output=True, text=True, env=_env(data), timeout=timeout
    )


# A writer as `gpemu profile` writes: one measurement per call, acknowledged when the call returns.
_WRITER = textwrap.dedent("""
    import json, sys, time
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db
    stop_at = time.time() + float(sys.argv[1])
    db = open_profile_db(EmuConfig.from_env())
    acked, failed, i = [], [], 0
    while time.time() < stop_at:
        i += 1
        row = {"gpu": "V100", "model": "alexnet", "kind": "forward", "batch_size": 10000 + i,
               "value": 0.001 * i, "source": "writer"}
        try:
            db.add_measurements([row])
            acked.append(10000 + i)
        except Exception as exc:
            failed.append(repr(exc)[:200])
        time.sleep(0.005)
    print(json.dumps({"acked": acked, "failed": failed}))
""")


def test_db_init_force_racing_a_writer_loses_no_acknowledged_row(tmp_path):
    """`gpemu db init --force` three times while another process writes: every row the writer was
    told was written is in the database afterwards, and no write failed."""
    data = tmp_path / "data"
    ensure_default_db(data)
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, "25"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(data)
    )
    time.sleep(3)  # the writer is writing
    for _ in range(3):
        init = _gpemu(data, "db", "init", "--force")
        assert init.returncode == 0, init.stderr
        assert "refreshed in place (gpemu db init --force)" in init.stderr
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["failed"] == [] and len(result["acked"]) > 50
    con = sqlite3.connect(default_db_path(data))
    stored = {r[0] for r in con.execute("SELECT batch_size FROM measurements WHERE source = 'writer'")}
    con.close()
    lost = sorted(set(result["acked"]) - stored)
    assert lost == [], f"{len(lost)} acknowledged row(s) lost: {lost[:10]}"


def _fill_with_user_rows(data: Path, tmp_path: Path) -> None:
    """A user's GPU, measurements and an op calibration, as today's gpemu writes them."""
    mine = tmp_path / "mine.csv"
    mine.write_text("gpu,model,kind,batch_size,value,source\nV100,resnet50,forward,7,0.05,my lab\n")
    assert _gpemu(data, "db", "import", str(mine)).returncode == 0
    added = _gpemu(data, "gpus", "add", "Lab Card", "--alias", "LAB", "--generation", "ampere", "--sms", "82",
                   "--memory-gb", "24", "--bandwidth-gbs", "936", "--fp32-tflops", "35.6", "--tf32-tensor-tflops",
                   "35.6", "--fp16-tensor-tflops", "71", "--bf16-tensor-tflops", "71", "--pcie-gen", "4")  # fmt: skip
    assert added.returncode == 0, added.stderr
    con = sqlite3.connect(default_db_path(data))
    con.execute("CREATE TABLE op_curves_lab (gpu TEXT, key TEXT, value REAL)")
    con.execute("INSERT INTO op_curves_lab VALUES ('Lab Card', 'gemm.fwd', 1.5)")
    con.commit()
    con.close()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# A gpemu of another schema version: the same code, told its schema is `version`.
_OTHER_SCHEMA = textwrap.dedent("""
    import importlib, sys
    import gpemu.db.schema as S
    S.SCHEMA_VERSION = int(sys.argv[1])
    import gpemu.db.build as B
    importlib.reload(B)
    from gpemu.config import EmuConfig
    path = B.ensure_default_db(EmuConfig.from_env().default_data_dir)
    print(path.name)
""")


def test_a_gpemu_of_another_schema_never_touches_this_schemas_file(tmp_path):
    data = tmp_path / "data"
    _fill_with_user_rows(data, tmp_path)
    path = default_db_path(data)
    before = _digest(path)
    for version, name in (("1", "profiles-v1.sqlite"), ("3", "profiles-v3.sqlite")):
        other = subprocess.run(
            [sys.executable, "-c", _OTHER_SCHEMA, version], capture_output=True, text=True, env=_env(data), timeout=300
        )
        assert other.returncode == 0, other.stderr
        assert other.stdout.strip() == name and (data / name).exists()
        assert _digest(path) == before  # not opened for writing, not rebuilt
    # The newer schema's first build carried the user's rows over; the older one had nothing to carry.
    con = sqlite3.connect(data / "profiles-v3.sqlite")
    assert con.execute("SELECT count(*) FROM gpus WHERE name = 'Lab Card'").fetchone() == (1,)
    assert con.execute("SELECT value FROM op_curves_lab").fetchall() == [(1.5,)]
    con.close()
    shown = _gpemu(data, "show", "resnet50", "--gpu", "V100", "-b", "7", "--json")
    assert shown.returncode == 0 and "rebuilt" not in shown.stderr and "refreshed" not in shown.stderr
    assert json.loads(shown.stdout)["measurements"]["forward"]["value"] == 0.05
    assert "Lab Card" in _gpemu(data, "gpus", "--json").stdout


def test_first_use_carries_rows_from_an_older_releases_file_and_leaves_it_alone(tmp_path):
    """A data dir of a release before per-schema names (profiles.sqlite): this release builds its
    own file with the user's rows, and the old release still finds its file as it left it."""
    data = tmp_path / "data"
    _fill_with_user_rows(data, tmp_path)
    legacy = data / LEGACY_DB_NAME
    default_db_path(data).rename(legacy)  # what an older release left behind
    before = _digest(legacy)
    shown = _gpemu(data, "show", "resnet50", "--gpu", "V100", "-b", "7", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["measurements"]["forward"]["value"] == 0.05
    assert f"{DEFAULT_DB_NAME} built (first use of schema 2): kept 1 GPU(s), 1 measurement(s)" in shown.stderr
    assert "1 row(s) of op_curves_lab" in shown.stderr and f"from {legacy}" in shown.stderr
    assert _digest(legacy) == before


def test_a_build_killed_midway_leaves_nothing_behind_for_long(tmp_path):
    """kill -9 of the first build: its *.building file is removed by the next build."""
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-c", _MAIN, "db", "init"],
        env=_env(data),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not [p for p in data.glob("*.building") if p.stat().st_size > 1 << 20]:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert list(data.glob("*.building")), "the build was not caught mid-way"
    assert not default_db_path(data).exists()
    listed = _gpemu(data, "gpus")
    assert listed.returncode == 0, listed.stderr
    assert list(data.glob("*.building")) == []
