"""gpemu.db: schema, the shipped data, lookups with each provenance, names, bad input, writes."""

from __future__ import annotations

import csv
import gzip
import io
from importlib import resources

import numpy as np
import pytest
import sqlalchemy as sa

from gpemu.config import EmuConfig
from gpemu.db import (
    KINDS,
    GpuSpec,
    Measurement,
    MissingMeasurementError,
    ModelInfo,
    UnknownNameError,
    open_profile_db,
)
from gpemu.db.build import open_url


@pytest.fixture(scope="module")
def pdb():
    return open_profile_db(EmuConfig.from_env())


def _shipped_rows() -> list[list[str]]:
    raw = resources.files("gpemu.db").joinpath("data", "measurements.csv.gz").read_bytes()
    return list(csv.reader(io.StringIO(gzip.decompress(raw).decode())))[1:]


@pytest.fixture()
def empty_db(tmp_path):
    """A writable database with one GPU and one model of our own and no measurements."""
    db = open_url(f"sqlite:///{tmp_path / 'w.sqlite'}")
    db.add_gpu(
        GpuSpec(
            name="Test GPU-8GB",
            aliases=("TG8",),
            memory_bytes=8 << 30,
            fp32_flops=1e13,
            fp16_flops=2e13,
            memory_bandwidth=5e11,
            host_link_bandwidth_pinned=1.2e10,
            host_link_bandwidth_pageable=5e9,
            sm_count=40,
        )
    )
    db.add_model(
        ModelInfo(
            name="tinynet",
            class_name="TinyNet",
            param_count=1000,
            param_bytes=4000,
            buffer_bytes=0,
            fwd_flops_per_sample=1e6,
            fwd_bwd_flops_per_sample=3e6,
        )
    )
    yield db
    db.close()


def _points(db, kind, pts):
    db.add_measurements([Measurement(gpu="TG8", model="tinynet", kind=kind, batch_size=b, value=v) for b, v in pts])


# ------------------------------------------------------------------ schema
def test_schema_tables_and_unique_measurement_key(pdb):
    insp = sa.inspect(pdb.engine)
    assert {"meta", "gpus", "models", "measurements", "distributions"} <= set(insp.get_table_names())
    uniques = insp.get_unique_constraints("measurements")
    assert any(set(u["column_names"]) == {"gpu_id", "model_id", "kind", "batch_size", "world_size"} for u in uniques)
    meta = pdb.meta()
    assert meta["schema_version"] == "2" and len(meta["data_version"]) == 16
    assert "10.14778/3725688.3725716" in meta["source"]


def test_duplicate_measurement_row_is_refused_by_the_database(empty_db):
    _points(empty_db, "forward", [(8, 1.0)])
    row = empty_db.engine.connect().execute(sa.text("SELECT gpu_id, model_id FROM measurements")).first()
    with pytest.raises(sa.exc.IntegrityError), empty_db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO measurements (gpu_id, model_id, kind, batch_size, world_size, value, unit, source, "
                "metadata_json)"
                f" VALUES ({row[0]}, {row[1]}, 'forward', 8, 1, 2.0, 'seconds', '', '{{}}')"
            )
        )


# ------------------------------------------------------------------ shipped data
def test_shipped_row_counts_per_kind(pdb):
    assert len(pdb.gpus()) == 16 and len(pdb.measured_gpus()) == 6
    assert len(pdb.models()) == 36
    per_pair = 36 * 6
    assert pdb.count("forward") == per_pair * 256
    assert pdb.count("backward") == per_pair * 256
    assert pdb.count("h2d_transfer") == per_pair * 256
    assert pdb.count("model_transfer") == per_pair
    assert pdb.count("peak_memory") == per_pair * 256
    # K80 resnet152's regression fill-ins at batch 201..256 (negative, or below the parameters'
    # bytes) are not shipped.
    assert pdb.count("persistent_memory") == per_pair * 256 - 56
    assert pdb.count() == sum(pdb.count(k) for k in KINDS)


@pytest.mark.slow
def test_measured_values_equal_the_shipped_file(pdb):
    rows = _shipped_rows()
    rng = np.random.default_rng(0)
    for i in rng.choice(len(rows), size=200, replace=False):
        gpu, model, kind, bs, value = rows[i]
        bs = max(int(bs), 1)  # model_transfer rows are batch independent (stored as 0)
        got = pdb.lookup(gpu, model, bs, kind)
        assert got.provenance == "measured"
        assert got.value == pytest.approx(float(value), rel=1e-12)
        assert got.unit == ("bytes" if kind.endswith("memory") else "seconds")


def test_resnet50_v100_reference_values(pdb):
    fwd = pdb.lookup("V100", "resnet50", 128, "forward")
    bwd = pdb.lookup("V100", "resnet50", 128, "backward")
    assert (round(fwd.value, 4), fwd.unit, fwd.provenance) == (0.1193, "seconds", "measured")
    assert (round(bwd.value, 4), bwd.provenance) == (0.2655, "measured")
    peak = pdb.lookup("V100", "resnet50", 128, "peak_memory")
    assert peak.unit == "bytes" and peak.value > pdb.lookup("V100", "resnet50", 128, "persistent_memory").value


def test_shipped_models_backward_flops_are_at_most_two_forwards(pdb):
    """A backward pass computes at most two forward-sized products per layer (the input's and the
    weight's gradient), grouped and depthwise convolutions too: torch's FlopCounterMode counts a
    grouped convolution's weight gradient once per group (MobileNetV2: backward 19x its forward),
    which the shipped model facts must not carry."""
    models = pdb.models()
    assert len(models) == 36
    for m in models:
        assert m.fwd_flops_per_sample < m.fwd_bwd_flops_per_sample <= 3.0 * m.fwd_flops_per_sample, m.name


def test_distributions_shipped(pdb):
    dali = pdb.distribution("decode-dali")
    assert dali.ndim == 1 and len(dali) > 600 and (dali >= 0).all()
    names = {d[0] for d in pdb.distributions()}
    assert {"decode-dali", "norm-ffcv", "iter-resnet50-batch128-v100-forward"} <= names
    it = pdb.distribution("iter-resnet50-batch128-v100-forward")
    # The steady-state iterations agree with the profiled mean forward time (first ones are slow).
    assert np.median(it[5:]) == pytest.approx(pdb.lookup("V100", "resnet50", 128, "forward").value, rel=0.1)
    dali[0] = -1.0  # callers get a copy, not the cache
    assert pdb.distribution("decode-dali")[0] >= 0
    with pytest.raises(UnknownNameError, match="decode-dali"):
        pdb.distribution("decode-dal")


# ------------------------------------------------------------------ names
@pytest.mark.parametrize(
    "alias", ["V100", "v100", "Tesla_V100-PCIE-32GB", "Tesla V100-PCIE-32GB", "tesla v100 pcie 32gb", "V100-PCIE-32GB"]
)
def test_gpu_aliases_resolve_to_one_gpu(pdb, alias):
    spec = pdb.gpu(alias)
    assert spec.name == "Tesla V100-PCIE-32GB" and spec.short_name == "V100"
    assert spec.memory_bytes == 32 << 30 and spec.sm_count == 80


def test_every_gpu_has_short_alias_and_specs(pdb):
    from gpemu.costmodel.gpus import GPUS

    shorts = {s.short_name: s for s in pdb.gpus()}
    assert set(shorts) == {g.short_name for g in GPUS}  # the cost model's datasheet table, all of it
    assert {
        "A100",
        "RTX6000",
        "K80",
        "M40",
        "P100",
        "V100",
        "H100",
        "H100-PCIe",
        "H200",
        "B200",
        "A100-80GB",
        "L40S",
        "L4",
        "A10G",
        "RTX4090",
        "T4",
    } == set(shorts)
    assert shorts["K80"].memory_bytes == 12 << 30  # one GK210 die
    for s in shorts.values():
        assert pdb.gpu(s.short_name) == s
        assert s.fp16_flops >= s.fp32_flops > 1e12
        assert s.host_link_bandwidth_pinned > s.host_link_bandwidth_pageable > 1e9
        assert s.provenance == "datasheet" and s.source and s.generation and s.compute_capability
    measured = {s.short_name for s in pdb.measured_gpus()}
    assert measured == {g.short_name for g in GPUS if g.measured} == {"A100", "RTX6000", "K80", "M40", "P100", "V100"}


def test_shipped_gpu_rows_are_the_datasheet_table(pdb):
    """Every fact the cost model prices with round-trips through the database unchanged."""
    from gpemu.costmodel.gpus import GPUS

    for sheet in GPUS:
        spec = pdb.gpu(sheet.name)
        assert spec.aliases == sheet.aliases and spec.generation == sheet.generation
        assert spec.compute_capability == sheet.compute_capability and spec.sm_count == sheet.sm_count
        assert spec.memory_bytes == sheet.memory_bytes and spec.memory_bandwidth == sheet.memory_bandwidth
        for f in (
            "fp32_flops",
            "fp64_flops",
            "tf32_tensor_flops",
            "fp16_tensor_flops",
            "bf16_tensor_flops",
            "nvlink_bandwidth",
            "host_link_bandwidth_pinned",
            "host_link_bandwidth_pageable",
            "pcie_gen",
        ):
            assert getattr(spec, f) == getattr(sheet, f), (sheet.name, f)
        assert spec.fp16_nontensor_flops == sheet.fp16_flops
        assert spec.fp16_flops == max(sheet.fp16_flops, sheet.fp16_tensor_flops)  # the one-number FP16 peak
        assert spec.source == sheet.source


def test_unknown_gpu_suggests_close_names(pdb):
    with pytest.raises(UnknownNameError) as err:
        pdb.gpu("V1000")
    assert isinstance(err.value, ValueError)
    assert "V100" in err.value.suggestions
    assert "K80, M40, P100, V100, RTX6000, A100, A100-80GB" in str(err.value)


def test_model_names_case_insensitive_and_suggestions(pdb):
    assert pdb.model("ResNet50").name == "resnet50"
    assert pdb.model("resnet50").param_count == 25557032
    with pytest.raises(UnknownNameError, match="did you mean 'resnet50'"):
        pdb.model("resnet-50")
    with pytest.raises(UnknownNameError):
        pdb.lookup("V100", "no-such-net", 8, "forward")


def test_models_by_structure(pdb):
    assert [m.name for m in pdb.models_by_structure("ResNet", 25557032)] == ["resnet50"]
    assert pdb.models_by_structure("ResNet", 1) == []
    vggs = {m.name for m in pdb.models() if m.class_name == "VGG"}
    assert len(vggs) == 8


# ------------------------------------------------------------------ provenance
def test_interpolated_is_piecewise_linear_not_a_global_fit(empty_db):
    _points(empty_db, "forward", [(8, 1.0), (16, 1.0), (32, 3.0)])
    flat = empty_db.lookup("TG8", "tinynet", 12, "forward")
    assert (flat.value, flat.provenance) == (1.0, "interpolated")
    mid = empty_db.lookup("TG8", "tinynet", 24, "forward")
    assert mid.value == pytest.approx(2.0) and mid.provenance == "interpolated"
    assert empty_db.lookup("TG8", "tinynet", 16, "forward").provenance == "measured"


def test_extrapolated_follows_the_upper_range(empty_db):
    # Flat start (a light model saturating nothing), then linear: the fit must use the top.
    pts = [(b, 1.0) for b in range(1, 13)] + [(b, 0.5 * b - 5.0) for b in range(13, 17)]
    _points(empty_db, "forward", pts)
    far = empty_db.lookup("TG8", "tinynet", 40, "forward")
    assert far.provenance == "extrapolated"
    assert far.value == pytest.approx(0.5 * 40 - 5.0)


def test_extrapolation_never_negative(empty_db):
    _points(empty_db, "backward", [(b, 10.0 - b) for b in range(1, 9)])
    out = empty_db.lookup("TG8", "tinynet", 100, "backward")
    assert out.provenance == "extrapolated" and out.value == 0.0
    _points(empty_db, "forward", [(8, 1.0), (16, 9.0), (24, 17.0), (32, 25.0)])
    below = empty_db.lookup("TG8", "tinynet", 1, "forward")
    assert below.provenance == "extrapolated" and below.value == 0.0


def test_shipped_beyond_range_is_extrapolated_and_grows(pdb):
    at256 = pdb.lookup("V100", "resnet50", 256, "forward")
    at300 = pdb.lookup("V100", "resnet50", 300, "forward")
    assert at300.provenance == "extrapolated"
    assert at256.value < at300.value < at256.value * 300 / 256 * 1.2


def test_memory_extrapolation_stays_above_parameter_bytes(pdb, empty_db):
    params = pdb.model("resnet152").param_bytes
    k80 = pdb.lookup("K80", "resnet152", 256, "persistent_memory")  # profiled only up to 200
    assert k80.provenance == "extrapolated" and k80.value >= params
    _points(empty_db, "persistent_memory", [(1, 9000.0), (2, 8000.0), (3, 7000.0), (4, 6000.0)])
    assert empty_db.lookup("TG8", "tinynet", 50, "persistent_memory").value == 4000  # tinynet's param_bytes


def test_batch_independent_kind(pdb):
    a = pdb.lookup("V100", "resnet50", 1, "model_transfer")
    b = pdb.lookup("V100", "resnet50", 999, "model_transfer")
    assert a == b and a.provenance == "measured" and 0 < a.value < 1


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", [0, -3, True, 3.5, 4.0, "8", None])
def test_bad_batch_size_rejected(pdb, bad):
    with pytest.raises(ValueError, match="batch size must be an integer >= 1"):
        pdb.lookup("V100", "resnet50", bad, "forward")


def test_unknown_and_missing_kinds(pdb):
    with pytest.raises(ValueError, match="valid kinds: forward, backward"):
        pdb.lookup("V100", "resnet50", 8, "fwd")
    with pytest.raises(MissingMeasurementError) as err:
        pdb.lookup("V100", "resnet50", 8, "optimizer_step")
    assert "measured kinds for this pair: forward, backward, h2d_transfer" in str(err.value)
    assert not pdb.has("V100", "resnet50", "optimizer_step")
    assert pdb.has("v100", "RESNET50", "forward")


def test_series_are_the_measured_points(pdb):
    s = pdb.series("A100", "alexnet", "backward")
    assert len(s) == 256 and s[0][0] == 1 and s[-1][0] == 256
    assert s[63][1] == pdb.lookup("A100", "alexnet", 64, "backward").value


# ------------------------------------------------------------------ writes
def test_add_measurements_upserts_and_refreshes_cache(empty_db):
    _points(empty_db, "forward", [(8, 1.0), (16, 2.0)])
    assert empty_db.lookup("TG8", "tinynet", 16, "forward").value == 2.0
    _points(empty_db, "forward", [(16, 2.5)])  # re-measured: replaces, no duplicate
    assert empty_db.series("TG8", "tinynet", "forward") == [(8.0, 1.0), (16.0, 2.5)]
    assert empty_db.count("forward") == 2


def test_sources_say_where_a_series_came_from(empty_db, pdb):
    """Each row keeps its source tag; the shipped rows carry the artifact's (whose backward holds
    its loop's optimizer step: gpemu.costs)."""
    from gpemu.db import ARTIFACT_SOURCE

    assert pdb.sources("V100", "resnet50", "backward") == {ARTIFACT_SOURCE}
    assert empty_db.sources("TG8", "tinynet", "backward") == set()
    empty_db.add_measurements(
        [Measurement(gpu="TG8", model="tinynet", kind="backward", batch_size=8, value=1.0, source="gpemu profile")]
    )
    assert empty_db.sources("TG8", "tinynet", "backward") == {"gpemu profile"}
    empty_db.add_measurements(
        [Measurement(gpu="TG8", model="tinynet", kind="backward", batch_size=16, value=2.0, source="imported")]
    )
    assert empty_db.sources("TG8", "tinynet", "backward") == {"gpemu profile", "imported"}


def test_add_measurements_is_atomic_and_names_the_bad_row(empty_db):
    rows = [
        {"gpu": "TG8", "model": "tinynet", "kind": "forward", "batch_size": 8, "value": 1.0},
        {"gpu": "TG8", "model": "tinynet", "kind": "forward", "batch_size": 16, "value": -1.0},
    ]
    with pytest.raises(ValueError, match="measurement 2: value must be a finite number >= 0"):
        empty_db.add_measurements(rows)
    assert empty_db.count() == 0
    with pytest.raises(ValueError, match="forward is stored in seconds"):
        empty_db.add_measurements([{**rows[0], "unit": "ms"}])
    with pytest.raises(UnknownNameError):
        empty_db.add_measurements([{**rows[0], "gpu": "H100"}])
    assert empty_db.count() == 0


def test_ddp_iteration_keeps_world_sizes_apart(empty_db):
    empty_db.add_measurements(
        [
            Measurement(
                gpu="TG8",
                model="tinynet",
                kind="ddp_iteration",
                batch_size=32,
                value=0.2,
                world_size=2,
                samples=50,
                std=0.01,
                p50=0.2,
                p90=0.21,
                p99=0.25,
                source="test",
                metadata={"torch": "2.13"},
            ),
            Measurement(gpu="TG8", model="tinynet", kind="ddp_iteration", batch_size=32, value=0.3, world_size=4),
        ]
    )
    assert empty_db.lookup("TG8", "tinynet", 32, "ddp_iteration", world_size=2).value == 0.2
    assert empty_db.lookup("TG8", "tinynet", 32, "ddp_iteration", world_size=4).value == 0.3
    with pytest.raises(MissingMeasurementError, match="world size 8"):
        empty_db.lookup("TG8", "tinynet", 32, "ddp_iteration", world_size=8)


def test_add_gpu_validates_and_updates(empty_db):
    with pytest.raises(ValueError, match="memory_bytes .* must be a positive number"):
        GpuSpec(
            name="Bad",
            aliases=(),
            memory_bytes=0,
            fp32_flops=1,
            fp16_flops=1,
            memory_bandwidth=1,
            host_link_bandwidth_pinned=1,
            host_link_bandwidth_pageable=1,
            sm_count=1,
        )
    spec = empty_db.gpu("tg8")
    bigger = GpuSpec(**{**spec.__dict__, "memory_bytes": 16 << 30})
    empty_db.add_gpu(bigger)
    assert empty_db.gpu("TG8").memory_bytes == 16 << 30 and len(empty_db.gpus()) == 1


def test_add_distribution(empty_db):
    empty_db.add_distribution("decode-test", "seconds", [0.01, 0.02, 0.03], description="test")
    assert empty_db.distribution("decode-test").tolist() == [0.01, 0.02, 0.03]
    empty_db.add_distribution("decode-test", "seconds", [0.5])
    assert empty_db.distribution("decode-test").tolist() == [0.5]
    with pytest.raises(ValueError, match="finite values >= 0"):
        empty_db.add_distribution("x", "seconds", [-1.0])
    with pytest.raises(ValueError, match="'seconds' or 'bytes'"):
        empty_db.add_distribution("x", "ms", [1.0])


def test_empty_database_says_how_to_fill_it(tmp_path):
    db = open_url(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    with pytest.raises(UnknownNameError, match="gpemu db init"):
        db.gpu("V100")
    assert db.gpus() == [] and db.count() == 0


def test_profiler_kinds_pinned_copy_and_batch_limit(empty_db):
    empty_db.add_measurements(
        [
            {"gpu": "TG8", "model": "tinynet", "kind": "max_batch_size", "batch_size": 0, "value": 192},
            {"gpu": "TG8", "model": "tinynet", "kind": "h2d_transfer_pinned", "batch_size": 64, "value": 0.004},
        ]
    )
    limit = empty_db.lookup("TG8", "tinynet", 512, "max_batch_size")
    assert (limit.value, limit.unit, limit.provenance) == (192.0, "samples", "measured")
    assert empty_db.lookup("TG8", "tinynet", 64, "h2d_transfer_pinned").unit == "seconds"
    with pytest.raises(ValueError, match="store it with batch_size 0"):
        empty_db.add_measurements(
            [{"gpu": "TG8", "model": "tinynet", "kind": "max_batch_size", "batch_size": 8, "value": 192}]
        )


def test_extrapolation_from_a_single_point_scales_with_batch(empty_db):
    _points(empty_db, "forward", [(10, 1.0)])
    assert empty_db.lookup("TG8", "tinynet", 20, "forward").value == pytest.approx(2.0)
    assert empty_db.lookup("TG8", "tinynet", 5, "forward").value == pytest.approx(0.5)
    _points(empty_db, "forward", [(20, 4.0)])  # new data: the cached line is dropped
    assert empty_db.lookup("TG8", "tinynet", 30, "forward").value == pytest.approx(7.0)


def test_every_shipped_gpu_round_trips_through_datasheet_units():
    """`gpemu gpus add`'s units (GB, GB/s, TFLOP/s) and checks accept every shipped datasheet GPU
    and give back the same row: the command and the shipped table describe GPUs alike."""
    from dataclasses import asdict

    from gpemu.db.datasheet import datasheet_of, spec_from_datasheet
    from gpemu.db.specs import shipped_gpus

    for spec in shipped_gpus():
        again = asdict(spec_from_datasheet(datasheet_of(spec), provenance="datasheet"))
        for key, value in asdict(spec).items():  # floats to rounding (GB/s and TFLOP/s, 6 decimals)
            assert again[key] == (pytest.approx(value, rel=1e-5) if isinstance(value, float) else value), (
                spec.name,
                key,
            )


def test_what_a_datasheet_leaves_out_is_what_the_shipped_gpus_have():
    """A GPU added without its PCIe generation, host-copy rates or compute capability gets them
    from the same facts the shipped table is written with: every datasheet-only GPU, entered
    without them, comes back with the table's own figures."""
    from gpemu.costmodel.gpus import DEFAULT_PCIE_GEN, GPUS, generation_capability
    from gpemu.db.datasheet import datasheet_of, spec_from_datasheet
    from gpemu.db.specs import shipped_gpus

    by_name = {g.name: g for g in GPUS}
    left_out = ("host_pinned_gbs", "host_pageable_gbs", "compute_capability")
    checked = 0
    for spec in shipped_gpus():
        sheet = by_name[spec.name]
        if sheet.measured:  # copy rates measured on its host
            continue
        sheet_values = datasheet_of(spec)
        entered = {k: x for k, x in sheet_values.items() if k not in left_out}
        if sheet.pcie_gen == DEFAULT_PCIE_GEN:
            del entered["pcie_gen"]
        added = spec_from_datasheet(entered)
        assert added.pcie_gen == sheet.pcie_gen, sheet.name
        assert added.host_link_bandwidth_pinned == sheet.host_link_bandwidth_pinned, sheet.name
        assert added.host_link_bandwidth_pageable == sheet.host_link_bandwidth_pageable, sheet.name
        usual = generation_capability(sheet.generation)
        assert added.compute_capability == usual and usual[0] == sheet.compute_capability[0], sheet.name
        checked += 1
    assert checked >= 8
