"""`gpemu gpus`, `models`, `show`, `db path|init|export|import` through the real command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpemu.cli import cli


@pytest.fixture()
def runner():
    return CliRunner()


def _gpemu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed console entry point (gpemu.cli:main), as a user runs it."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
        timeout=120,
    )


def test_gpus_lists_measured_and_datasheet_gpus(runner):
    """Every datasheet GPU the issue names is listed, each marked measured or datasheet-only."""
    res = runner.invoke(cli, ["gpus"])
    assert res.exit_code == 0, res.output
    assert "16 GPUs: 6 measured, 10 datasheet-only" in res.output
    # GPU ... compute capability, status (the full-name and source columns come with wide terminals)
    rows = [re.match(r"\s*(\S+)\s.*?\s\d+\.\d\s+(measured|datasheet)\s", ln) for ln in res.output.splitlines()]
    status = {m.group(1): m.group(2) for m in rows if m}
    assert {k for k, v in status.items() if v == "measured"} == {"A100", "RTX6000", "K80", "M40", "P100", "V100"}
    assert {k for k, v in status.items() if v == "datasheet"} == {
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
    }
    data = {d["aliases"][0]: d for d in json.loads(runner.invoke(cli, ["gpus", "--json"]).output)}
    assert len(data) == 16 and all(d["memory_bytes"] > 0 for d in data.values())
    assert data["V100"]["name"] == "Tesla V100-PCIE-32GB" and data["V100"]["memory_bytes"] == 32 << 30
    assert data["V100"]["measurements"] > 0 and data["H100"]["measurements"] == 0
    assert data["H100"]["provenance"] == "datasheet" and data["H100"]["compute_capability"] == [9, 0]
    assert "H100 datasheet" in data["H100"]["source"]


@pytest.mark.slow
def test_show_datasheet_gpu_says_what_is_measured_and_what_is_scaled(runner):
    """A datasheet-only GPU: forward/backward scaled from the reference GPU with the cost model's
    ±, the other kinds labelled as the reference GPU's measurements."""
    out = json.loads(runner.invoke(cli, ["show", "resnet50", "--gpu", "H100", "-b", "64", "--json"]).output)
    assert out["gpu"] == "NVIDIA H100 80GB HBM3" and out["gpu_provenance"] == "datasheet"
    assert out["measured_on"] == "NVIDIA A100-SXM4-40GB"
    m = out["measurements"]
    ref = json.loads(runner.invoke(cli, ["show", "resnet50", "--gpu", "A100", "-b", "64", "--json"]).output)
    for kind in ("forward", "backward"):
        assert m[kind]["provenance"] == "scaled from A100" and m[kind]["uncertainty"].startswith("±")
        # 3x the A100's tensor-core peak and 2x its bandwidth: faster, but not by more than the peaks
        assert ref["measurements"][kind]["value"] / 3.5 < m[kind]["value"] < ref["measurements"][kind]["value"] / 1.2
    assert m["peak_memory"] == {**ref["measurements"]["peak_memory"], "provenance": "measured on A100"}
    table = runner.invoke(cli, ["show", "resnet50", "--gpu", "H100", "-b", "64"]).output
    assert "not measured on it (datasheet)" in table and "scaled from A100 ±" in table


def test_models_lists_36_with_class_and_params(runner):
    res = runner.invoke(cli, ["models"])
    assert res.exit_code == 0
    assert "36 models" in res.output and "resnet50" in res.output and "25,557,032" in res.output
    data = json.loads(runner.invoke(cli, ["models", "--json"]).output)
    assert len(data) == 36
    assert {"name": "alexnet", "class_name": "AlexNet"}.items() <= next(
        d for d in data if d["name"] == "alexnet"
    ).items()


def test_show_measured_values(runner):
    res = runner.invoke(cli, ["show", "resnet50", "--gpu", "V100", "--batch-size", "128"])
    assert res.exit_code == 0, res.output
    lines = {ln.split()[0]: ln.split() for ln in res.output.splitlines() if ln.strip()}
    assert lines["forward"][1:3] == ["0.1193", "s"] and lines["forward"][-1] == "measured"
    assert lines["backward"][1:3] == ["0.2655", "s"] and lines["backward"][-1] == "measured"
    assert {"h2d_transfer", "model_transfer", "peak_memory", "persistent_memory"} <= set(lines)
    # the shipped backward is its loop's, optimizer step included; a run charges less (costs.model_times)
    assert "SGD step" in res.output and "a run charges it less" in " ".join(res.output.split())


def test_show_provenance_beyond_and_between(runner, tmp_path):
    out = json.loads(
        runner.invoke(cli, ["show", "RESNET50", "--gpu", "tesla v100-pcie-32gb", "-b", "300", "--json"]).output
    )
    assert out["gpu"] == "Tesla V100-PCIE-32GB" and out["batch_size"] == 300
    m = out["measurements"]
    assert m["forward"]["provenance"] == m["backward"]["provenance"] == "extrapolated"
    assert m["model_transfer"]["provenance"] == "measured"
    table = runner.invoke(cli, ["show", "resnet50", "--gpu", "V100", "--batch-size", "300"]).output
    assert "extrapolated" in table


@pytest.mark.subprocess
def test_unknown_gpu_is_one_line_suggesting_v100():
    res = _gpemu("show", "resnet50", "--gpu", "V1000", "--batch-size", "128")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("error: unknown GPU 'V1000'; did you mean 'V100'")


@pytest.mark.parametrize("bad", ["0", "3.5", "x"])
def test_bad_batch_size_is_refused(runner, bad):
    res = runner.invoke(cli, ["show", "resnet50", "--gpu", "V100", "--batch-size", bad])
    assert res.exit_code == 2 and "batch-size" in res.output


@pytest.mark.slow
def test_db_path_init_export_import_with_db_url(runner, tmp_path):
    default = runner.invoke(cli, ["db", "path"])
    # (its first line: a second one says when the default database is not built yet, which
    # depends on whether an earlier test of this session built it)
    assert default.exit_code == 0 and default.output.splitlines()[0].strip().endswith("profiles-v2.sqlite")

    url = f"sqlite:///{tmp_path / 'sub.sqlite'}"
    assert runner.invoke(cli, ["db", "path", "--db", url]).output.strip() == url
    export = tmp_path / "v100_alexnet.json"
    res = runner.invoke(cli, ["db", "export", str(export), "--gpu", "V100", "--model", "alexnet"])
    assert res.exit_code == 0 and "1 GPUs, 1 models, 1281 measurements" in res.output

    res = runner.invoke(cli, ["db", "import", str(export), "--db", url])
    assert res.exit_code == 0, res.output
    assert "imported 1 GPUs, 1 models, 1281 measurements" in res.output
    again = runner.invoke(cli, ["db", "import", str(export), "--db", url])
    assert again.exit_code == 0 and "1281 measurements" in again.output
    shown = json.loads(
        runner.invoke(cli, ["show", "alexnet", "--gpu", "v100", "-b", "64", "--db", url, "--json"]).output
    )
    assert shown["measurements"]["forward"]["provenance"] == "measured"
    gpus = json.loads(runner.invoke(cli, ["gpus", "--db", url, "--json"]).output)
    assert [g["aliases"][0] for g in gpus] == ["V100"]

    csv_dir = tmp_path / "csv"
    assert runner.invoke(cli, ["db", "export", str(csv_dir), "--db", url]).exit_code == 0
    assert sorted(p.name for p in csv_dir.iterdir()) == [
        "distributions.csv",
        "gpus.csv",
        "host_records.csv",
        "measurements.csv",
        "models.csv",
        "op_curves.csv",
        "op_measurements.csv",
    ]


@pytest.mark.slow
def test_db_import_reports_rejected_rows_and_fails(runner, tmp_path):
    src = tmp_path / "mine.csv"
    src.write_text(
        "gpu,model,kind,batch_size,value\nV100,resnet50,forward,8,0.01\nV100,resnet50,warp,8,1\n"
        "V100,resnet50,backward,8,-2\n"
    )
    url = f"sqlite:///{tmp_path / 'target.sqlite'}"
    assert runner.invoke(cli, ["db", "init", "--db", url]).exit_code == 0
    res = runner.invoke(cli, ["db", "import", str(src), "--db", url])
    assert res.exit_code == 1
    assert "imported 0 GPUs, 0 models, 1 measurements" in res.stdout
    assert "rejected 2 rows" in res.stderr
    assert "mine.csv:3: unknown measurement kind 'warp'" in res.stderr
    assert "mine.csv:4: value must be a finite number >= 0" in res.stderr


@pytest.mark.subprocess
def test_gpemu_db_env_var_is_honoured(tmp_path):
    url = f"sqlite:///{tmp_path / 'env.sqlite'}"
    res = _gpemu("gpus", "--json", env={"GPEMU_DB": url})
    assert res.returncode == 0 and json.loads(res.stdout) == []
    res = _gpemu("show", "resnet50", "--gpu", "V100", "-b", "8", env={"GPEMU_DB": url})
    assert res.returncode == 2 and "gpemu db init" in res.stderr


@pytest.mark.slow
def test_show_lists_ddp_iterations_per_world_size(runner, tmp_path):
    url = f"sqlite:///{tmp_path / 'ddp.sqlite'}"
    src = tmp_path / "base.json"
    assert runner.invoke(cli, ["db", "export", str(src), "--gpu", "P100", "--model", "resnet18"]).exit_code == 0
    assert runner.invoke(cli, ["db", "import", str(src), "--db", url]).exit_code == 0
    ddp = tmp_path / "ddp.csv"
    ddp.write_text(
        "gpu,model,kind,batch_size,world_size,value\nP100,resnet18,ddp_iteration,64,2,0.21\n"
        "P100,resnet18,ddp_iteration,64,4,0.25\n"
    )
    assert runner.invoke(cli, ["db", "import", str(ddp), "--db", url]).exit_code == 0
    out = json.loads(
        runner.invoke(cli, ["show", "resnet18", "--gpu", "P100", "-b", "64", "--db", url, "--json"]).output
    )
    m = out["measurements"]
    assert m["ddp_iteration[world_size=2]"]["value"] == 0.21
    assert m["ddp_iteration[world_size=4]"] == {"value": 0.25, "unit": "seconds", "provenance": "measured"}
    assert m["forward"]["provenance"] == "measured"


def test_db_init_default_reports_counts(runner):
    res = runner.invoke(cli, ["db", "init"])
    assert res.exit_code == 0, res.output
    assert "16 GPUs, 36 models, 276640 measurements, 14 distributions" in res.output


# ------------------------------------------------------------------ gpemu gpus add
@pytest.fixture()
def gpus_only_db(tmp_path):
    """A real SQLite file holding the shipped GPU rows (no measurements: quick to make)."""
    from gpemu.db.build import open_url
    from gpemu.db.specs import shipped_gpus

    url = f"sqlite:///{tmp_path / 'gpus.sqlite'}"
    pdb = open_url(url)
    for spec in shipped_gpus():
        pdb.add_gpu(spec)
    pdb.close()
    return url


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    from gpemu.cli import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


_MYGPU = [
    "--generation",
    "hopper",
    "--sms",
    "66",
    "--memory-gb",
    "48",
    "--bandwidth-gbs",
    "1500",
    "--fp32-tflops",
    "30",
    "--tf32-tensor-tflops",
    "200",
    "--fp16-tensor-tflops",
    "400",
    "--bf16-tensor-tflops",
    "400",
    "--pcie-gen",
    "5",
]


def test_gpus_add_from_options_stores_every_figure(capsys, gpus_only_db):
    from gpemu.db.build import open_url

    rc, out, err = _main(
        capsys, "gpus", "add", "ACME H50", "--alias", "H50", *_MYGPU, "--source", "ACME sheet", "--db", gpus_only_db
    )
    assert rc == 0, err
    assert "added ACME H50 (H50): hopper, compute capability 9.0, 66 SMs, 48 GiB" in out
    spec = open_url(gpus_only_db).gpu("h50")
    assert (spec.name, spec.provenance, spec.generation, spec.compute_capability) == (
        "ACME H50",
        "user",
        "hopper",
        (9, 0),
    )
    assert spec.memory_bytes == 48 << 30 and spec.memory_bandwidth == 1500e9 and spec.sm_count == 66
    assert spec.fp32_flops == 30e12 and spec.fp16_flops == 400e12 == spec.bf16_tensor_flops
    assert spec.tf32_tensor_flops == 200e12 and spec.pcie_gen == 5 and spec.source == "ACME sheet"
    # defaults: pinned copies at 0.8 x a Gen5 x16 link; no NVLink
    assert spec.host_link_bandwidth_pinned == pytest.approx(0.8 * 63e9) and spec.nvlink_bandwidth == 0
    rc, out, _ = _main(capsys, "gpus", "--db", gpus_only_db)
    assert rc == 0 and "17 GPUs: 0 measured, 17 datasheet-only" in out
    assert re.search(r"H50 .* hopper +9\.0 +added ", out)


def test_gpus_add_file_matches_the_export_example(capsys, gpus_only_db, tmp_path):
    """examples/rtx3090.yaml (datasheet units) and examples/rtx3090.json (`gpemu db import`) are
    the same GPU."""
    from gpemu.db.build import open_url

    root = os.path.join(os.path.dirname(__file__), "..", "examples")
    rc, out, err = _main(capsys, "gpus", "add", "--file", os.path.join(root, "rtx3090.yaml"), "--db", gpus_only_db)
    assert rc == 0, err
    other = f"sqlite:///{tmp_path / 'other.sqlite'}"
    rc, _, err = _main(capsys, "db", "import", os.path.join(root, "rtx3090.json"), "--db", other)
    assert rc == 0, err
    a, b = open_url(gpus_only_db).gpu("RTX3090"), open_url(other).gpu("RTX3090")
    assert (a.name, a.generation, a.compute_capability, a.sm_count, a.memory_bytes, a.pcie_gen) == (
        b.name,
        b.generation,
        b.compute_capability,
        b.sm_count,
        b.memory_bytes,
        b.pcie_gen,
    )
    for f in (
        "fp32_flops",
        "memory_bandwidth",
        "tf32_tensor_flops",
        "fp16_tensor_flops",
        "bf16_tensor_flops",
        "nvlink_bandwidth",
    ):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=0.01), f
    # adding it again is refused (names are unique); --replace updates the user's own GPU
    rc, _, err = _main(capsys, "gpus", "add", "--file", os.path.join(root, "rtx3090.yaml"), "--db", gpus_only_db)
    assert rc == 2 and "already in the database: pass --replace" in err
    rc, _, err = _main(
        capsys, "gpus", "add", "--file", os.path.join(root, "rtx3090.yaml"), "--replace", "--db", gpus_only_db
    )
    assert rc == 0, err


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--generation", "ampre"],
            "generation (--generation) must be one of kepler, maxwell, pascal, volta, turing, "
            "ampere, ada, hopper, blackwell, got 'ampre'",
        ),
        (["--bandwidth-gbs", None], "bandwidth_gbs (--bandwidth-gbs) is required"),
        (
            ["--fp32-tflops", "30e12"],
            "fp32_tflops (--fp32-tflops) must be a number from 0.01 to 10000 TFLOP/s, got 3e+13",
        ),
        (
            ["--bf16-tensor-tflops", "4"],
            "bf16_tensor_tflops (--bf16-tensor-tflops) = 4 TFLOP/s is under a quarter of "
            "the FP32 peak (30): give TFLOP/s",
        ),
        (
            ["--generation", "turing"],
            "tf32_tensor_tflops (--tf32-tensor-tflops): turing GPUs have no such tensor cores",
        ),
        (["--sms", "0"], "sms (--sms) must be a whole number from 1 to 1024, got 0"),
        (["--compute-capability", "nine"], "compute_capability (--compute-capability) must be MAJOR.MINOR"),
        (["--alias", "A100"], "'A100' already names NVIDIA A100-SXM4-40GB (A100); pick another alias"),
        (
            ["--name", "NVIDIA H100 80GB HBM3"],
            "'NVIDIA H100 80GB HBM3' ships with gpemu (datasheet): add yours under another name",
        ),
        (["--sms", "many"], "Invalid value for '--sms': 'many' is not a valid integer"),
    ],
)
def test_gpus_add_bad_input_is_one_line_and_writes_nothing(capsys, gpus_only_db, argv, says):
    from gpemu.db.build import open_url

    args = {k: v for k, v in zip(_MYGPU[::2], _MYGPU[1::2], strict=False)}
    name = "ACME H50"
    if argv[0] == "--name":
        name = argv[1]
    elif argv[1] is None:
        args.pop(argv[0])
    else:
        args[argv[0]] = argv[1]
    flat = [x for kv in args.items() for x in kv]
    rc, out, err = _main(capsys, "gpus", "add", name, *flat, "--db", gpus_only_db)
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and says in " ".join(err.split()), err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2  # usage errors add "(see --help)"
    assert len(open_url(gpus_only_db).gpus()) == 16


def test_gpus_add_bad_file_names_the_gpu_and_field(capsys, gpus_only_db, tmp_path):
    bad = tmp_path / "two.yaml"
    bad.write_text(
        "- {name: Good One, generation: ada, sms: 10, memory_gb: 8, bandwidth_gbs: 100, fp32_tflops: 5}\n"
        "- {name: Bad One, generation: ada, sms: 10, memory_gb: 8, bandwidth_gbs: 100, fp32_tflops: 5,"
        " memory_bytes: 8}\n"
    )
    rc, _, err = _main(capsys, "gpus", "add", "--file", str(bad), "--db", gpus_only_db)
    assert rc == 2 and f"{bad}: Bad One:" in err and "`gpemu db export` format" in err
    bad.write_text("name: X\ngeneration: ada\nsms: 10\nmemory_gb: 8\nbandwidth_gbs: 100\nfp32_tflops: 5\nclock: 2\n")
    rc, _, err = _main(capsys, "gpus", "add", "--file", str(bad), "--db", gpus_only_db)
    assert rc == 2 and "unknown field(s) clock; valid fields: name, aliases, generation" in err
    from gpemu.db.build import open_url

    assert len(open_url(gpus_only_db).gpus()) == 16  # the good first entry was not written either
