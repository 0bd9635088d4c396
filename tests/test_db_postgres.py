"""The profile database on a real PostgreSQL server (`--db postgresql+psycopg://...`).

Starts a throw-away PostgreSQL (initdb + pg_ctl, Unix socket only) when its binaries and the
psycopg driver are installed; skipped otherwise.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile

import pytest

from gpemu.config import EmuConfig
from gpemu.db import Measurement, open_profile_db
from gpemu.db.build import open_url
from gpemu.db.io import export_db, import_path
from gpemu.db.schema import SCHEMA_VERSION

pytestmark = pytest.mark.postgres

pytest.importorskip("psycopg")


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


@pytest.fixture(scope="module")
def pg_url():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not installed")
    prefix: list[str] = []
    base = tempfile.mkdtemp(prefix="gpemu-pg-")  # not pytest's tmp: it is private to root
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server")
        os.chown(base, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data = os.path.join(base, "data")
    run = lambda *cmd: subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)  # noqa: E731
    res = run(initdb, "-D", data, "-A", "trust", "-U", "gpemu", "--no-sync", "-E", "UTF8")
    if res.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"initdb failed: {res.stderr.strip()[-300:]}")
    res = run(
        pg_ctl, "-D", data, "-o", f"-k {base} -c listen_addresses='' -F", "-w", "-l", os.path.join(base, "log"), "start"
    )
    if res.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {res.stderr.strip()[-300:]}")
    try:
        yield f"postgresql+psycopg://gpemu@/postgres?host={base}"
    finally:
        run(pg_ctl, "-D", data, "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def sqlite_db():
    return open_profile_db(EmuConfig.from_env())


def test_postgres_holds_an_import_and_answers_like_sqlite(pg_url, sqlite_db, tmp_path):
    src = tmp_path / "part.json"
    export_db(sqlite_db, src, gpus=["V100", "P100"], models=["resnet50"])
    pg = open_profile_db(EmuConfig(db_url=pg_url))
    assert pg.count() == 0 and pg.meta()["schema_version"] == str(SCHEMA_VERSION)

    first = import_path(pg, src)
    assert first.rejected == [] and first.measurements == 2 * (5 * 256 + 1)
    second = import_path(pg, src)  # upsert: nothing doubles
    assert second.measurements == first.measurements and pg.count() == first.measurements

    for bs, kind in ((128, "forward"), (300, "backward"), (64, "peak_memory"), (7, "model_transfer")):
        assert pg.lookup("v100", "ResNet50", bs, kind) == sqlite_db.lookup("V100", "resnet50", bs, kind)
    assert (pg.distribution("decode-dali") == sqlite_db.distribution("decode-dali")).all()

    again = tmp_path / "again.json"
    export_db(pg, again)
    assert again.read_text() == src.read_text()


def test_postgres_profiler_writes_are_upserts(pg_url):
    pg = open_url(pg_url)
    if not pg.has("P100", "resnet50", "forward"):
        pytest.skip("needs the import of the previous test")
    row = Measurement(gpu="P100", model="resnet50", kind="optimizer_step", batch_size=32, value=0.01, samples=20)
    pg.add_measurements([row])
    pg.add_measurements([Measurement(**{**row.__dict__, "value": 0.02})])
    assert pg.series("P100", "resnet50", "optimizer_step") == [(32.0, 0.02)]
    with pytest.raises(ValueError, match="value must be a finite number"):
        pg.add_measurements([row, Measurement(**{**row.__dict__, "batch_size": 64, "value": float("inf")})])
    assert pg.series("P100", "resnet50", "optimizer_step") == [(32.0, 0.02)]
