"""Bad input to every database, sharing and Kubernetes subcommand: one line on stderr that says
what was wrong and what is valid, no traceback, no password; through the real entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

SECRET = "s3cr3t-pw"
UNREACHABLE_PG = f"postgresql+psycopg://u:{SECRET}@127.0.0.1:1/x"

# One interpreter runs every case (imports once): main() per argv, stderr captured per case.
DRIVER = r"""
import contextlib, io, json, sys
from gpemu.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except BaseException as exc:  # an escaped exception is a failure of the tested promise
            rc = f"raised {type(exc).__name__}: {exc}"
    results.append([rc, err.getvalue(), out.getvalue()])
print(json.dumps(results))
"""


def _run_all(cases: list[list[str]], tmp_path: Path) -> list[tuple[object, str, str]]:
    env = {**os.environ, "COLUMNS": "1000", "GPEMU_DATA_DIR": os.environ["GPEMU_DATA_DIR"]}
    env.pop("GPEMU_DB", None)
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


def _write_bad_files(tmp_path: Path) -> None:
    """A corrupt SQLite file and export files each wrong in one way, in ``tmp_path``."""
    (tmp_path / "corrupt.sqlite").write_bytes(b"this is not a SQLite database" * 50)
    files = {
        "measurements-list.json": json.dumps(
            {"format": "gpemu-profile-db", "schema_version": 1, "measurements": [1, 2]}
        ),
        "models-int.json": json.dumps({"format": "gpemu-profile-db", "schema_version": 1, "models": 5}),
        "deep.json": "[" * 100000 + "]" * 100000,
        "future.json": json.dumps({"format": "gpemu-profile-db", "schema_version": 99}),
        "wide.csv": "gpu,model,kind,batch_size,value\nV100," + "x" * (200 << 10) + ",forward,8,1\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)


def _database_cases(tmp_path: Path, good: str) -> dict[tuple[str, ...], str]:
    """The database subcommands and --db (argv -> what the one line must say)."""
    corrupt = f"sqlite:///{tmp_path / 'corrupt.sqlite'}"
    return {
        ("gpus", "--db", UNREACHABLE_PG): "Connection refused",
        ("models", "--db", f"nosuchdialect://u:{SECRET}@h/x"): "--db takes a SQLAlchemy URL",
        ("show", "resnet50", "--gpu", "V100", "-b", "8", "--db", f"postgresql://u:{SECRET}@[::1"): "--db takes",
        ("db", "init", "--db", corrupt): "not an intact SQLite database",
        ("db", "export", str(tmp_path / "out.json"), "--db", corrupt): "not an intact SQLite",
        ("db", "import", str(tmp_path / "measurements-list.json"), "--db", good): '"measurements" must be an object',
        ("db", "import", str(tmp_path / "models-int.json"), "--db", good): '"models" must be a list of objects',
        ("db", "import", str(tmp_path / "deep.json"), "--db", good): "nests JSON arrays or objects too deeply",
        ("db", "import", str(tmp_path / "future.json"), "--db", good): (
            "schema_version 99; it was written by a newer gpemu"
        ),
        ("db", "import", str(tmp_path / "wide.csv"), "--db", good): "no field longer than 128 KiB",
        ("db", "export", "/proc/no/such/dir/x.json", "--db", good): "/proc/no",
        ("db", "path", "--db", "not a url"): "is not a SQLAlchemy URL",
    }


def _run_and_gpus_cases(tmp_path: Path, good: str) -> dict[tuple[str, ...], str]:
    """``gpemu run`` and ``gpemu gpus add`` (argv -> what the one line must say)."""
    gpu_sheet = ("--generation", "ampere", "--sms", "8", "--memory-gb", "8", "--bandwidth-gbs", "100")
    return {
        ("run", "--gpus", "two", "--", "python", "-c", "1"): "unknown GPU 'two'; valid GPUs: K80, M40, P100, V100",
        ("run", "--gpu", "H900", "--", "python", "-c", "1"): "B200; add one from its datasheet with `gpemu gpus add` "
        "(see docs/adding.md)",
        ("gpus", "add", "X", *gpu_sheet, "--fp32-tflops", "5", "--pcie-gen", "9", "--db", good): (
            "pcie_gen (--pcie-gen) must be a whole number from 1 to 7"
        ),
        (
            "gpus",
            "add",
            "--file",
            str(tmp_path / "future.json"),
            "--db",
            good,
        ): "is a `gpemu db export` file: import it",
        ("gpus", "add", "--file", str(tmp_path / "nope.yaml"), "--db", good): "cannot read",
        ("run", "--db", UNREACHABLE_PG, "--gpu", "V100", "--", "python", "-c", "1"): "postgresql+psycopg://u:***@",
    }


def _service_cases(tmp_path: Path) -> dict[tuple[str, ...], str]:
    """The sharing manager, Kubernetes and profiler subcommands (argv -> what the one line must say)."""
    return {
        ("share-manager", "--amqp", f"amqp://u:{SECRET}@h:notaport/", "--device", "0=V100:1GiB"): (
            "not a usable AMQP URL"
        ),
        (
            "share-manager",
            "--amqp",
            "amqp://u@127.0.0.1/",
            "--amqp-password-file",
            str(tmp_path / "nope"),
            "--device",
            "0=V100",
        ): "cannot read the broker password file",
        ("share-status", "--amqp", f"amqp://u:{SECRET}@127.0.0.1:1/", "--once"): "cannot reach the RabbitMQ broker",
        ("k8s", "devices", "create", "--gpu", "V100", "--dir", "/proc/no/such"): "/proc/no",
        ("k8s", "plugin", "--sharing", f"amqp://u:{SECRET}@h:xx/", "--device-dir", str(tmp_path)): "not a usable AMQP",
        ("k8s", "probe", "--device-plugin-dir", str(tmp_path)): "no plugin socket",
        ("profile", "--device", "cpu", "--model", "resnet18", "--db", UNREACHABLE_PG): "Connection refused",
    }


def test_every_subcommand_fails_in_one_clear_line(tmp_path):
    _write_bad_files(tmp_path)
    good = f"sqlite:///{tmp_path / 'good.sqlite'}"
    cases = {**_database_cases(tmp_path, good), **_run_and_gpus_cases(tmp_path, good), **_service_cases(tmp_path)}
    results = _run_all([list(argv) for argv in cases], tmp_path)
    for (argv, expected), (rc, err, out) in zip(cases.items(), results, strict=True):
        lines = err.strip().splitlines()
        assert rc == 2, (argv, rc, err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err[-2000:])
        assert expected in lines[0], (argv, lines[0])
        assert SECRET not in err + out and "Traceback" not in err, argv


def test_db_path_never_prints_a_password(tmp_path):
    [(rc, err, out)] = _run_all([["db", "path", "--db", f"postgresql://u:{SECRET}@h/d"]], tmp_path)
    assert rc == 0 and out.strip() == "postgresql://u:***@h/d" and SECRET not in err


def test_odd_data_dir_and_empty_gpu_lists_are_one_clear_line(tmp_path):
    """GPEMU_DATA_DIR naming a user that does not exist, and GPU lists with empty entries, as a user
    types them (environment and --gpus): one line each, never a traceback nor a silent 1 x V100."""
    base = {**os.environ, "COLUMNS": "1000"}
    base.pop("GPEMU_DB", None)
    cases = [
        ({"GPEMU_DATA_DIR": "~nosuchuser-gpemu/x"}, ["gpus"], "starts with a home directory that does not exist"),
        ({"GPEMU_GPUS": ",,,"}, ["run", "--", "python", "-c", "1"], "has an empty entry"),
        ({}, ["run", "--gpus", " , ", "--", "python", "-c", "1"], "--gpus must be a count"),
        ({}, ["run", "--gpus", "V100,,A100", "--", "python", "-c", "1"], "has an empty entry"),
        (
            {"GPEMU_SHARING_PERSISTENT_BYTES": str(2**51)},
            ["run", "--share", "amqp://guest:guest@127.0.0.1/", "--", "python", "-c", "1"],
            "sharing_persistent_bytes must be a byte count from 0 to 1125899906842624",
        ),
    ]
    for extra, argv, expected in cases:
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))", *argv],
            capture_output=True,
            text=True,
            env={**base, **extra},
            cwd=tmp_path,
            timeout=120,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (argv, proc.returncode, proc.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (argv, proc.stderr)
