"""``gpemu profile --host-side``: a GPU host's issue times recorded in the database (issue 29).

The test double is gpemu itself, as for ``--ops`` (tests/test_profile_ops.py): under
``gpemu.patch(host=...)`` the emulated host issues each op at the modelled host's issue time, so
profiling the host side of an emulated GPU must read back that host model's figures. Real SQLite
files throughout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import gpemu
from gpemu.cli import main
from gpemu.clock import VirtualClock
from gpemu.config import EmuConfig
from gpemu.db import open_profile_db
from gpemu.db.host_records import HostRecord, read_host, read_hosts, write_host
from gpemu.profiler.hostside import measure_host_side
from gpemu.time.launch import HOST_PRESETS

XEON = HOST_PRESETS["h100-xeon"]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A copy of the session's default database that a test may write to freely."""
    src = Path(open_profile_db(EmuConfig.from_env()).engine.url.database)
    dst = tmp_path / "profile.sqlite"
    shutil.copy(src, dst)
    return f"sqlite:///{dst}"


def _emulated_issue_times(host: str):
    # (a manual clock: only modelled host time and waits move it; the timer is the host's time
    # on the emulated timeline, which `gpemu run --clock virtual` gives the program's clocks)
    with gpemu.emulate(gpu="A100", clock=VirtualClock(), summary=False, host=host) as rt:
        timing = measure_host_side(torch.device("cuda:0"), samples=3, inner=4, timer=rt.engine.now)
        model = rt.engine.host_model
        # the ops counted are the ops the emulator charged: one forward of the chain costs
        # forward_ops issue times
        return timing, model


def test_profiling_an_emulated_gpu_reads_back_the_modelled_hosts_issue_times():
    timing, model = _emulated_issue_times("h100-xeon")
    assert timing.covered and timing.forward_ops > 10 and timing.backward_ops > timing.forward_ops
    assert timing.forward_op_s == pytest.approx(XEON.op_s, rel=1e-6)  # 40 us
    assert timing.backward_op_s == pytest.approx(XEON.backward_op_s, rel=1e-6)  # 28 us
    assert 0 < timing.launch_s <= timing.backward_op_s
    # another host model, another reading: the model's own figure, not the preset's
    timing, model = _emulated_issue_times("0.5x")
    assert model is not None and model.op_s > 0
    assert timing.forward_op_s == pytest.approx(model.op_s, rel=1e-6)
    assert timing.backward_op_s == pytest.approx(model.backward_op_s, rel=1e-6)


def test_host_records_round_trip_through_sqlite(db_url):
    db = open_profile_db(EmuConfig.from_env(db_url=db_url))
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


def test_gpemu_profile_host_side_records_the_emulated_host(db_url, capsys):
    # The command as a lab runs it, on virtual time so the program's clock is the emulated host's
    # (its own Python counts there as CPU time: a little above the preset's figures).
    gpemu.patch(gpu="A100", clock="virtual", host="h100-xeon", summary=False)
    try:
        rc = main(["profile", "--host-side", "--host-name", "lab-xeon", "--iterations", "3", "--db", db_url])
    finally:
        gpemu.unpatch()
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "recorded host 'lab-xeon'" in err and "--host db:lab-xeon" in err
    db = open_profile_db(EmuConfig.from_env(db_url=db_url))
    try:
        rec = read_host(db.engine, "lab-xeon")
    finally:
        db.close()
    assert rec is not None
    assert rec.torch_version == torch.__version__ and rec.cpu and "A100" in rec.gpu
    assert XEON.op_s <= rec.forward_op_s < 1.5 * XEON.op_s
    assert XEON.backward_op_s is not None and XEON.backward_op_s <= rec.backward_op_s < 2 * XEON.backward_op_s
    assert rec.reference_ms > 0 and rec.metadata["forward_ops"] > 10


def test_host_side_refuses_what_it_cannot_measure_in_one_line(db_url, capsys):
    assert main(["profile", "--host-side", "--host-name", "Bad Name!", "--db", db_url]) == 2
    assert "lower-case letters" in capsys.readouterr().err
    assert main(["profile", "--host-side", "--device", "cpu", "--db", db_url]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert main(["profile", "--host-name", "x", "--model", "resnet18", "--db", db_url]) == 2
    assert "--host-name goes with --host-side" in capsys.readouterr().err
    gpemu.patch(gpu="A100", host="h100-xeon", summary=False)  # (the real clock)
    try:
        assert main(["profile", "--host-side", "--db", db_url]) == 2
    finally:
        gpemu.unpatch()
    assert "--clock virtual" in capsys.readouterr().err
