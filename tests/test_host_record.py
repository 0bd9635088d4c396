"""``gpemu profile --host-side``: a GPU host's issue times recorded in the database (issue 29).

The test double is gpemu itself, as for ``--ops`` (tests/test_profile_ops.py): under
``gpemu.patch(host=...)`` the emulated host issues each op at the modelled host's issue time, so
profiling the host side of an emulated GPU must read back that host model's figures. Real SQLite
files throughout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gpemu
from gpemu.cli import main
from gpemu.clock import VirtualClock
from gpemu.config import EmuConfig
from gpemu.db import open_profile_db
from gpemu.db.host_records import HostRecord, read_host, read_hosts, write_host
from gpemu.profiler.hostside import HostSideTiming, measure_host_side
from gpemu.time.launch import HOST_PRESETS, HostModel

XEON = HOST_PRESETS["h100-xeon"]


def _emulated_issue_times(host: str, db_url: str | None = None) -> tuple[HostSideTiming, HostModel | None]:
    # (a manual clock: only modelled host time and waits move it; the timer is the host's time
    # on the emulated timeline, which `gpemu run --clock virtual` gives the program's clocks)
    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False, host=host, db_url=db_url) as rt:
        timing = measure_host_side(torch.device("cuda:0"), samples=3, inner=4, timer=rt.engine.now)
        return timing, rt.engine.host_model


def test_profiling_an_emulated_gpu_reads_back_the_modelled_hosts_issue_times():
    # (the ops counted on the CPU build are the ops the emulator charged an issue time)
    timing, _ = _emulated_issue_times("h100-xeon")
    assert timing.covered and timing.forward_ops > 10 and timing.backward_ops > timing.forward_ops
    assert timing.forward_op_s == pytest.approx(XEON.op_s, rel=1e-6)  # 40 us
    assert timing.backward_op_s == pytest.approx(XEON.backward_op_s, rel=1e-6)  # 41 us
    assert 0 < timing.launch_s <= timing.backward_op_s


def test_host_records_round_trip_through_sqlite(db_copy):
    db = open_profile_db(EmuConfig.from_env(db_url=db_copy))
    try:
        assert read_hosts(db.engine) == []  # (no table yet: nothing recorded)
        rec = HostRecord("lab-a", "Some CPU", "2.5.0", "H100", 20e-6, 15e-6, 5e-6, 9.0, metadata={"forward_ops": 16})
        stored = write_host(db.engine, rec)
        assert stored.measured_at and stored.metadata == {"forward_ops": 16}
        write_host(db.engine, HostRecord("lab-a", "Other CPU", "2.5.0", "H100", 30e-6, 15e-6, 5e-6, 9.0))
        again = read_host(db.engine, "lab-a")
        assert again is not None and again.cpu == "Other CPU" and again.forward_op_s == 30e-6  # replaced
        assert [h.name for h in read_hosts(db.engine)] == ["lab-a"]
        with pytest.raises(ValueError, match="lower-case letters"):
            write_host(db.engine, HostRecord("Lab A", "", "", "", 1e-6, 1e-6, 0.0, 1.0))
    finally:
        db.close()


def test_gpemu_profile_host_side_records_the_emulated_host(db_copy, capsys):
    # The command as a lab runs it, on virtual time so the program's clock is the emulated host's
    # (its own Python counts there as CPU time: a little above the preset's figures).
    gpemu.patch(gpu="A100", clock="virtual", host="h100-xeon", summary=False)
    try:
        rc = main(["profile", "--host-side", "--host-name", "lab-xeon", "--iterations", "3", "--db", db_copy])
    finally:
        gpemu.unpatch()
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "recorded host 'lab-xeon'" in err and "--host db:lab-xeon" in err
    db = open_profile_db(EmuConfig.from_env(db_url=db_copy))
    try:
        rec = read_host(db.engine, "lab-xeon")
    finally:
        db.close()
    assert rec is not None
    assert rec.torch_version == torch.__version__ and rec.cpu and "A100" in rec.gpu
    assert XEON.op_s <= rec.forward_op_s < 1.5 * XEON.op_s
    assert XEON.backward_op_s is not None and XEON.backward_op_s <= rec.backward_op_s < 2 * XEON.backward_op_s
    assert rec.reference_ms > 0 and rec.metadata["forward_ops"] > 10


def test_host_side_refuses_what_it_cannot_measure_in_one_line(db_copy, capsys):
    assert main(["profile", "--host-side", "--host-name", "Bad Name!", "--db", db_copy]) == 2
    assert "lower-case letters" in capsys.readouterr().err
    assert main(["profile", "--host-side", "--device", "cpu", "--db", db_copy]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert main(["profile", "--host-name", "x", "--model", "resnet18", "--db", db_copy]) == 2
    assert "--host-name goes with --host-side" in capsys.readouterr().err
    gpemu.patch(gpu="A100", host="h100-xeon", summary=False)  # (the real clock)
    try:
        assert main(["profile", "--host-side", "--db", db_copy]) == 2
    finally:
        gpemu.unpatch()
    assert "--clock virtual" in capsys.readouterr().err


def _record(db_url: str, *records: HostRecord) -> None:
    db = open_profile_db(EmuConfig.from_env(db_url=db_url))
    try:
        for rec in records:
            write_host(db.engine, rec)
    finally:
        db.close()


def test_a_recorded_host_is_modelled_as_recorded_and_profiles_back_to_its_figures(db_copy):
    _record(db_copy, HostRecord("lab-a", "Lab CPU", "2.5.0", "H100", 20e-6, 12e-6, 5e-6, 9.0))
    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False, host="db:lab-a", db_url=db_copy) as rt:
        model = rt.engine.host_model
        assert model is not None and "Lab CPU" in model.source
        assert (model.op_s, model.backward_op_s, model.launch_s) == pytest.approx((20e-6, 12e-6, 5e-6))
        x = torch.ones(64, 64, device="cuda")
        torch.cuda.synchronize()
        t0 = rt.engine.now()
        for _ in range(100):
            x = x + 1
        assert rt.engine.now() - t0 == pytest.approx(100 * 20e-6)  # each op issued at the recorded figure
    # the calibration loop closes: profiling the host side behind the recorded host reads it back
    timing, _ = _emulated_issue_times("db:lab-a", db_copy)
    assert (timing.forward_op_s, timing.backward_op_s) == pytest.approx((20e-6, 12e-6))


def test_unknown_recorded_hosts_get_one_line_listing_what_is_valid(db_copy, capsys):
    _record(db_copy, HostRecord("lab-a", "Lab CPU", "2.5.0", "H100", 20e-6, 12e-6, 5e-6, 9.0))
    with pytest.raises(ValueError, match="db:lab-a") as err:
        gpemu.patch(gpu="A100", host="db:lab-b", db_url=db_copy, summary=False)
    assert "h100-xeon" in str(err.value)
    assert not gpemu.is_patched()
    # (refused before it starts)
    rc = main(["run", "--db", db_copy, "--host", "db:lab-b", "--", "python", "-c", "pass"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "db:lab-a" in lines[0] and "'db:lab-b'" in lines[0]


def test_gpemu_hosts_lists_presets_and_recorded_hosts(db_copy, capsys):
    assert main(["hosts", "--db", db_copy]) == 0
    out = capsys.readouterr().out
    assert "h100-xeon" in out and "no recorded hosts yet" in out
    _record(db_copy, HostRecord("lab-a", "Lab CPU", "2.5.0", "H100", 20e-6, 12e-6, 5e-6, 9.0))
    assert main(["hosts", "--db", db_copy, "--json"]) == 0
    rows = {r["host"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["db:lab-a"]["forward_op_us"] == pytest.approx(20) and rows["db:lab-a"]["kind"] == "recorded"
    assert rows["h100-xeon"]["backward_op_us"] == pytest.approx(1e6 * XEON.backward_op_s)
    assert main(["run", "--help"]) == 0
    assert "db:NAME" in capsys.readouterr().out


@pytest.fixture
def two_dbs(tmp_path: Path):
    """Two fresh (empty) databases: where a host was recorded, and a lab machine importing it."""
    from gpemu.db.build import open_url

    source, lab = (open_url(f"sqlite:///{tmp_path / name}") for name in ("source.sqlite", "lab.sqlite"))
    yield source, lab
    source.close()
    lab.close()


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_db_export_carries_recorded_hosts_to_the_machines_that_emulate(two_dbs, tmp_path, fmt):
    from gpemu.db.io import export_db, import_path

    source, lab = two_dbs
    write_host(
        source.engine, HostRecord("lab-a", "Lab CPU", "2.5", "H100", 20e-6, 12e-6, 5e-6, 9.0, metadata={"n": 16})
    )
    out = tmp_path / ("hosts.json" if fmt == "json" else "hosts_csv")
    assert export_db(source, out)["host_records"] == 1
    report = import_path(lab, out)
    assert report.rejected == [] and report.host_records == 1
    assert read_hosts(lab.engine) == read_hosts(source.engine)  # (its time stamp too)


def test_import_rejects_bad_host_records_with_their_reasons(two_dbs, tmp_path):
    from gpemu.db.io import export_db, import_path

    source, lab = two_dbs
    write_host(source.engine, HostRecord("lab-a", "Lab CPU", "2.5.0", "H100", 20e-6, 12e-6, 5e-6, 9.0))
    export_db(source, tmp_path / "good.json")
    data = json.loads((tmp_path / "good.json").read_text())
    good = data["host_records"][0]
    data["host_records"] = [
        good,
        {**good, "name": "Lab B"},
        {**good, "forward_op_s": 0},
        {**good, "launch_s": -1e-6},
        {**good, "speed": "fast"},
    ]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    report = import_path(lab, tmp_path / "bad.json")
    reasons = [r.reason for r in report.rejected]
    assert report.host_records == 1 and len(reasons) == 4
    for needle in ("lower-case letters", "forward_op_s must be a finite number > 0", "launch_s must be", "speed"):
        assert any(needle in r for r in reasons), (needle, reasons)
