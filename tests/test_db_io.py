"""Export / import of the profile database: round trips, idempotence, per-row rejection."""

from __future__ import annotations

import json

import pytest

from gpemu.config import EmuConfig
from gpemu.db import open_profile_db
from gpemu.db.build import open_url
from gpemu.db.io import export_db, import_path

# A slice of the shipped data big enough to hold every kind and a few series.
SUBSET = {"gpus": ["V100", "K80"], "models": ["resnet50", "alexnet", "resnet152"]}


@pytest.fixture(scope="module")
def pdb():
    return open_profile_db(EmuConfig.from_env())


@pytest.fixture()
def fresh(tmp_path):
    db = open_url(f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    yield db
    db.close()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_round_trip_into_empty_database_reproduces_every_row(pdb, fresh, tmp_path, fmt):
    out = tmp_path / ("subset.json" if fmt == "json" else "subset_csv")
    counts = export_db(pdb, out, **SUBSET)
    # 2 GPUs x 3 models x (3 time kinds + 2 memory kinds) x 256 + model_transfer, less K80 resnet152's
    # 56 dropped persistent-memory rows.
    assert counts["measurements"] == 2 * 3 * (5 * 256 + 1) - 56
    report = import_path(fresh, out)
    assert report.rejected == []
    assert (report.gpus, report.models, report.measurements) == (2, 3, counts["measurements"])
    assert report.distributions == counts["distributions"] == 14
    again = tmp_path / "again.json"
    export_db(fresh, again)
    if fmt == "json":
        assert again.read_text() == out.read_text()
    else:
        export_db(pdb, tmp_path / "ref.json", **SUBSET)
        assert json.loads(again.read_text()) == json.loads((tmp_path / "ref.json").read_text())
    for kind in ("forward", "peak_memory", "model_transfer"):
        assert fresh.lookup("V100", "resnet50", 128, kind) == pdb.lookup("V100", "resnet50", 128, kind)
    assert (fresh.distribution("norm-ffcv") == pdb.distribution("norm-ffcv")).all()


@pytest.mark.slow
def test_reimport_is_idempotent(pdb, fresh, tmp_path):
    out = tmp_path / "subset.json"
    export_db(pdb, out, gpus=["A100"], models=["vgg16"])
    first = import_path(fresh, out)
    before = (fresh.count(), len(fresh.gpus()), len(fresh.models()), len(fresh.distributions()))
    second = import_path(fresh, out)
    assert second.measurements == first.measurements and second.rejected == []
    assert (fresh.count(), len(fresh.gpus()), len(fresh.models()), len(fresh.distributions())) == before
    export_db(fresh, tmp_path / "after.json")
    assert (tmp_path / "after.json").read_text() == out.read_text()


BAD_CSV = """gpu,model,kind,batch_size,value,unit
V100,resnet50,forward,8,0.01,seconds
V100,resnet50,fwd,8,0.01,
V100,resnet50,forward,8,-0.5,
V100,resnet50,forward,3.5,0.01,
V100,resnet50,forward,0,0.01,
H100,resnet50,forward,8,0.01,
V100,bert,forward,8,0.01,
V100,resnet50,peak_memory,8,1000,seconds
V100,resnet50,forward,eight,0.01,
V100,resnet50,model_transfer,0,0.02,
V100,resnet50,backward,16,nan,
"""


def test_import_reports_each_rejected_row_with_its_reason(pdb, fresh, tmp_path):
    export_db(pdb, tmp_path / "base.json", gpus=["V100"], models=["resnet50"])
    import_path(fresh, tmp_path / "base.json")
    n0 = fresh.count()
    src = tmp_path / "mine.csv"
    src.write_text(BAD_CSV)
    report = import_path(fresh, src)
    assert report.measurements == 2  # the first row and the model_transfer row
    reasons = {r.where: r.reason for r in report.rejected}
    assert set(reasons) == {f"mine.csv:{n}" for n in (3, 4, 5, 6, 7, 8, 9, 10, 12)}
    assert "unknown measurement kind 'fwd'" in reasons["mine.csv:3"]
    assert "value must be a finite number >= 0" in reasons["mine.csv:4"]
    assert "bad batch size '3.5'" in reasons["mine.csv:5"]
    assert "batch_size must be >= 1 for forward" in reasons["mine.csv:6"]
    assert "unknown GPU 'H100' and the import has no spec for it" in reasons["mine.csv:7"]
    assert "unknown model 'bert'" in reasons["mine.csv:8"]
    assert "peak_memory is stored in bytes" in reasons["mine.csv:9"]
    assert "bad batch size 'eight'" in reasons["mine.csv:10"]
    assert "finite" in reasons["mine.csv:12"]
    assert fresh.count() == n0  # both valid rows replaced existing measurements
    assert fresh.lookup("V100", "resnet50", 8, "forward").value == 0.01
    assert fresh.lookup("V100", "resnet50", 8, "model_transfer").value == 0.02


def test_import_accepts_new_gpu_when_the_file_carries_its_spec(pdb, fresh, tmp_path):
    data = {
        "format": "gpemu-profile-db",
        "schema_version": 1,
        "gpus": [
            {
                "name": "NVIDIA H100 80GB HBM3",
                "aliases": ["H100"],
                "memory_bytes": 80 << 30,
                "fp32_flops": 67e12,
                "fp16_flops": 989e12,
                "memory_bandwidth": 3.35e12,
                "host_link_bandwidth_pinned": 50e9,
                "host_link_bandwidth_pageable": 10e9,
                "sm_count": 132,
            },
            {
                "name": "Broken",
                "aliases": [],
                "memory_bytes": -1,
                "fp32_flops": 1,
                "fp16_flops": 1,
                "memory_bandwidth": 1,
                "host_link_bandwidth_pinned": 1,
                "host_link_bandwidth_pageable": 1,
                "sm_count": 1,
            },
        ],
        "models": [
            {
                "name": "tiny",
                "class_name": "Tiny",
                "param_count": 10,
                "param_bytes": 40,
                "buffer_bytes": 0,
                "fwd_flops_per_sample": 100.0,
                "fwd_bwd_flops_per_sample": 300.0,
            }
        ],
        "measurements": {
            "columns": ["gpu", "model", "kind", "batch_size", "value"],
            "rows": [["H100", "tiny", "forward", 4, 0.001], ["Broken", "tiny", "forward", 4, 0.001]],
        },
        "distributions": [{"name": "bad", "unit": "seconds", "samples": []}],
    }
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(data))
    report = import_path(fresh, path)
    assert (report.gpus, report.models, report.measurements) == (1, 1, 1)
    reasons = [r.reason for r in report.rejected]
    assert any("bad GPU spec" in r and "memory_bytes" in r for r in reasons)
    assert any("unknown GPU 'Broken'" in r for r in reasons)
    assert any("bad distribution" in r for r in reasons)
    assert fresh.lookup("h100", "TINY", 4, "forward").value == 0.001


def test_import_refuses_files_it_cannot_read(fresh, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        import_path(fresh, tmp_path / "nope.json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a gpemu profile database export"):
        import_path(fresh, tmp_path / "other.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        import_path(fresh, tmp_path / "broken.json")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="holds none of gpus.csv"):
        import_path(fresh, tmp_path / "emptydir")
    with pytest.raises(ValueError, match="format must be 'json' or 'csv'"):
        export_db(fresh, tmp_path / "x", "xml")


def test_import_refuses_a_gpu_whose_alias_names_another_gpu(pdb, tmp_path):
    """Lookups resolve a name to the first GPU that has it: an imported GPU taking the H100's
    alias would be unreachable by it, so the row is rejected, saying whose name it is."""
    spec = {
        "aliases": ["H100"],
        "memory_bytes": 80 << 30,
        "fp32_flops": 60e12,
        "fp16_flops": 900e12,
        "memory_bandwidth": 3e12,
        "host_link_bandwidth_pinned": 50e9,
        "host_link_bandwidth_pageable": 10e9,
        "sm_count": 132,
    }
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"format": "gpemu-profile-db", "gpus": [{"name": "My Hopper", **spec}]}))
    report = import_path(pdb, path)
    assert report.gpus == 0
    assert [r.reason for r in report.rejected] == [
        "bad GPU spec: 'H100' already names NVIDIA H100 80GB HBM3; give My Hopper another alias"
    ]
    assert pdb.gpu("H100").name == "NVIDIA H100 80GB HBM3" and "My Hopper" not in {g.name for g in pdb.gpus()}


def _calibrate(db, gpu: str) -> tuple[list, list]:
    """What `gpemu profile --ops` stores for ``gpu``: two kernels and their curve."""
    from gpemu.db.op_measurements import OpCurveRow, OpMeasurement, write_curves, write_measurements

    ops = [
        OpMeasurement(
            "norm.fwd",
            "memory",
            "float32",
            f"norm {n} elements",
            "native_batch_norm",
            8.0 * n,
            0.0,
            8.0 * n / 9e11,
            10,
            3.35e12,
            132,
            p10=None if n == 4096 else 1e-5,
            p90=2e-5,
            metadata={"torch": "2.11.0"},
        )
        for n in (4096, 1 << 20)
    ]
    curves = [OpCurveRow("norm.fwd", "memory", 0.289, 25942.0, 1.0, 0.0, 3.5e-6, 2, 0.137)]
    write_measurements(db.engine, gpu, ops)
    write_curves(db.engine, gpu, curves)
    return ops, curves


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_export_carries_a_gpus_own_calibration(fresh, tmp_path, fmt):
    from gpemu.db.op_measurements import read_curves, read_measurements, stamps

    ops, curves = _calibrate(fresh, "NVIDIA H100 80GB HBM3")
    _calibrate(fresh, "Some Other GPU")
    out = tmp_path / ("h100.json" if fmt == "json" else "h100_csv")
    counts = export_db(fresh, out)
    assert (counts["op_measurements"], counts["op_curves"]) == (4, 2)
    target = open_url(f"sqlite:///{tmp_path / 'lab.sqlite'}")
    report = import_path(target, out)
    assert report.rejected == [] and (report.op_measurements, report.op_curves) == (4, 2)
    # The calibration arrives as it was measured: rows, and when each was measured and fitted.
    assert read_curves(target.engine, "NVIDIA H100 80GB HBM3") == curves
    assert read_measurements(target.engine, "NVIDIA H100 80GB HBM3") == ops
    assert stamps(target.engine, "NVIDIA H100 80GB HBM3") == stamps(fresh.engine, "NVIDIA H100 80GB HBM3")
    # Re-exported, the calibration is the same text (rows in a fixed order, stamps kept).
    export_db(target, tmp_path / "again.json")
    export_db(fresh, tmp_path / "first.json")
    again, first = (json.loads((tmp_path / f).read_text()) for f in ("again.json", "first.json"))
    assert (again["op_measurements"], again["op_curves"]) == (first["op_measurements"], first["op_curves"])
    # Importing again replaces, never duplicates.
    import_path(target, out)
    assert len(read_measurements(target.engine, "Some Other GPU")) == 2
    target.close()


@pytest.mark.slow
def test_export_of_some_gpus_carries_only_their_calibration(pdb, fresh, tmp_path):
    export_db(pdb, tmp_path / "v100.json", gpus=["V100"], models=["alexnet"])
    import_path(fresh, tmp_path / "v100.json")
    _calibrate(fresh, "Tesla V100-PCIE-32GB")
    _calibrate(fresh, "NVIDIA H100 80GB HBM3")
    data = export_db(fresh, tmp_path / "only.json", gpus=["V100"])
    assert (data["op_measurements"], data["op_curves"]) == (2, 1)
    rows = json.loads((tmp_path / "only.json").read_text())["op_curves"]
    assert [r["gpu"] for r in rows] == ["Tesla V100-PCIE-32GB"]


def test_import_rejects_bad_calibration_rows_with_their_reasons(fresh, tmp_path):
    from gpemu.db.op_measurements import read_curves

    _calibrate(fresh, "G")
    export_db(fresh, tmp_path / "good.json")
    data = json.loads((tmp_path / "good.json").read_text())
    good = data["op_curves"][0]
    data["op_curves"] = [
        good,
        {**good, "e": 0},
        {**good, "path": "fast"},
        {**good, "key": "norm"},
        {**good, "gpu": ""},
        {**good, "rows": 1.5},
        {**good, "color": "red"},
    ]
    data["op_measurements"] = [{**data["op_measurements"][0], "seconds": -1.0}]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    target = open_url(f"sqlite:///{tmp_path / 'lab.sqlite'}")
    report = import_path(target, tmp_path / "bad.json")
    reasons = [r.reason for r in report.rejected]
    assert report.op_curves == 1 and report.op_measurements == 0 and len(reasons) == 7
    for needle in (
        "e must be a finite number > 0",
        "path must be one of simt, tensor, memory",
        "key must be a curve key",
        "needs the GPU's name",
        "rows must be an integer >= 1",
        "unknown field(s) color",
        "seconds must be a finite number > 0",
    ):
        assert any(needle in r for r in reasons), (needle, reasons)
    assert [c.e for c in read_curves(target.engine, "G")] == [good["e"]]  # the good row, and only it
    target.close()
