"""emuGPU files and `gpemu k8s devices create|list|remove` (real profile database)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from gpemu.k8s.devices import (
    DeviceFileError,
    create_devices,
    device_file,
    list_devices,
    read_device,
    remove_devices,
    scan_devices,
)


def test_create_writes_one_file_per_emugpu_from_the_database(tmp_path):
    made = create_devices(tmp_path, "v100", 3)
    assert [d.id for d in made] == ["emugpu-0", "emugpu-1", "emugpu-2"]
    data = json.loads(device_file(tmp_path, 1).read_text())
    assert data["kind"] == "emuGPU" and data["gpu"] == "V100" and data["index"] == 1
    assert data["memory_bytes"] >= 16 * 2**30 and "V100" in data["product"]
    assert read_device(device_file(tmp_path, 1)) == made[1]
    # A second call appends: a node with mixed GPU models.
    more = create_devices(tmp_path, "A100", 2)
    assert [d.id for d in more] == ["emugpu-3", "emugpu-4"]
    assert [d.gpu for d in list_devices(tmp_path)] == ["V100"] * 3 + ["A100"] * 2
    assert more[0].memory_bytes != made[0].memory_bytes


def test_replace_is_idempotent_and_leaves_unchanged_files_alone(tmp_path):
    create_devices(tmp_path, "V100", 4)
    mtimes = {i: os.stat(device_file(tmp_path, i)).st_mtime_ns for i in range(4)}
    again = create_devices(tmp_path, "V100", 2, replace=True)
    assert [d.id for d in again] == ["emugpu-0", "emugpu-1"]
    assert {i: os.stat(device_file(tmp_path, i)).st_mtime_ns for i in range(2)} == {i: mtimes[i] for i in range(2)}
    assert not device_file(tmp_path, 2).exists() and not device_file(tmp_path, 3).exists()


@pytest.mark.parametrize(
    "gpu, count, message",
    [
        ("H900", 1, "Valid GPUs:"),
        ("V100", 0, "count must be an integer from 1 to 256"),
    ],
)
def test_create_rejects_bad_input(tmp_path, gpu, count, message):
    with pytest.raises(ValueError) as err:
        create_devices(tmp_path, gpu, count)
    assert message in str(err.value)
    assert not list(tmp_path.iterdir())


def test_bad_files_are_reported_not_fatal(tmp_path):
    create_devices(tmp_path, "V100", 2)
    device_file(tmp_path, 1).write_text('{"kind": "emuGPU", "id": "emugpu-1"}')
    device_file(tmp_path, 5).write_text("nope")
    (tmp_path / "notes.txt").write_text("ignored")
    found = scan_devices(tmp_path)
    assert list(found) == ["emugpu-0", "emugpu-1", "emugpu-5"]
    assert isinstance(found["emugpu-1"], DeviceFileError) and "missing or invalid field" in str(found["emugpu-1"])
    assert "not valid JSON" in str(found["emugpu-5"])
    assert [d.id for d in list_devices(tmp_path)] == ["emugpu-0"]


def test_remove(tmp_path):
    create_devices(tmp_path, "V100", 3)
    assert remove_devices(tmp_path, ["emugpu-1"]) == ["emugpu-1"]
    with pytest.raises(DeviceFileError, match="no emuGPU emugpu-7 .* present: emugpu-0, emugpu-2"):
        remove_devices(tmp_path, ["emugpu-7"])
    assert remove_devices(tmp_path) == ["emugpu-0", "emugpu-2"]
    assert list_devices(tmp_path) == []


def test_cli_create_list_remove(tmp_path):
    from gpemu.cli import cli

    runner = CliRunner()
    d = str(tmp_path / "devs")
    res = runner.invoke(cli, ["k8s", "devices", "create", "--gpu", "P100", "--count", "2", "--dir", d])
    assert res.exit_code == 0, res.output
    assert "created 2 emuGPU(s) P100" in res.output
    res = runner.invoke(cli, ["k8s", "devices", "list", "--json", "--dir", d])
    rows = json.loads(res.output)
    assert [(r["id"], r["gpu"]) for r in rows] == [("emugpu-0", "P100"), ("emugpu-1", "P100")]
    res = runner.invoke(cli, ["k8s", "devices", "list", "--share-manager-args", "--dir", d])
    assert res.output.split() == ["--device", "emugpu-0=P100", "--device", "emugpu-1=P100"]
    res = runner.invoke(cli, ["k8s", "devices", "list", "--dir", d])
    assert "emugpu-1" in res.output and "Healthy" in res.output
    res = runner.invoke(cli, ["k8s", "devices", "remove", "emugpu-0", "--dir", d])
    assert res.exit_code == 0 and "removed 1" in res.output
    res = runner.invoke(cli, ["k8s", "devices", "remove", "--dir", d])
    assert res.exit_code == 2 and "or pass --all" in res.output
    res = runner.invoke(cli, ["k8s", "devices", "create", "--gpu", "Z9", "--dir", d])
    assert res.exit_code != 0


def test_cli_bad_gpu_is_one_clear_line(tmp_path, capsys):
    from gpemu.cli import main

    assert main(["k8s", "devices", "create", "--gpu", "Z9", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'Z9'; valid GPUs: " in err and "A100, A100-80GB" in err and "Traceback" not in err
    assert "gpemu gpus add" in err and len(err.strip().splitlines()) == 1
