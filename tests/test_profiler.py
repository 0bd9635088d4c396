"""`gpemu profile --device cpu`: the whole profiling pipeline into a real SQLite database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gpemu.cli import main
from gpemu.config import EmuConfig
from gpemu.db import open_profile_db
from gpemu.profiler.cli import parse_memory_size
from gpemu.profiler.models import ModelSpecError, load_model, structural_fingerprint
from gpemu.profiler.store import ProfileStore
from gpemu.profiler.sweep import BatchSizeError, parse_batch_sizes

# The gpemu command in a child process (the same interpreter as the tests).
GPEMU = [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())"]
UNIT_KINDS = (
    "forward",
    "backward",
    "optimizer_step",
    "h2d_transfer",
    "h2d_transfer_pinned",
    "d2h_transfer",
    "peak_memory",
    "persistent_memory",
)

FACTORIES = textwrap.dedent('''
    import time
    import torch
    from torch import nn

    def mlp(num_classes=10):
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def cnn():
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
        return net, torch.randn(2, 3, 16, 16)

    def small():
        return nn.Sequential(nn.Linear(16, 4)), torch.randn(2, 16)

    def depthwise():
        return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.Flatten()), torch.randn(2, 8, 6, 6)

    class Slow(nn.Module):
        """Slow enough that a run of many batch sizes can be interrupted in the middle."""
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)
        def forward(self, x):
            time.sleep(0.03)
            return self.fc(x)

    def slow():
        return Slow(), torch.randn(2, 8)
''')


@pytest.fixture()
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "profmodels.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(pkg))
    sys.modules.pop("profmodels", None)
    return pkg


@pytest.fixture()
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'profile.sqlite'}"


def run_profile(db_url: str, *args: str) -> int:
    return main(
        ["profile", "--device", "cpu", "--db", db_url, "--warmup", "1", "--iterations", "2", "--no-progress", *args]
    )


def open_db(url: str):
    return open_profile_db(EmuConfig.from_env(db_url=url))


def err_text(capsys: pytest.CaptureFixture[str]) -> str:
    """Captured stderr with whitespace collapsed (rich wraps long lines at the console width)."""
    return " ".join(capsys.readouterr().err.split())


# ------------------------------------------------------------------ parsing
def test_batch_size_sweeps() -> None:
    assert parse_batch_sizes("1-4,8,16") == [1, 2, 3, 4, 8, 16]
    assert parse_batch_sizes("pow2", max_batch=64) == [1, 2, 4, 8, 16, 32, 64]
    assert parse_batch_sizes("dense:1-4+step:16", max_batch=64) == [1, 2, 3, 4, 16, 32, 48, 64]
    assert parse_batch_sizes("32-128:32,4,4") == [4, 32, 64, 96, 128]
    assert parse_batch_sizes("step:8:10-40") == [16, 24, 32, 40]
    default = parse_batch_sizes("default")
    assert default[:16] == list(range(1, 17)) and default[-1] == 256
    for bad in ("", "0", "4-2", "a,b", "pow2:x", "1,,2", "dense:1-2-3"):
        with pytest.raises(BatchSizeError, match="valid forms|backwards|from 1 to"):
            parse_batch_sizes(bad)


def test_memory_sizes() -> None:
    assert parse_memory_size("200MiB") == 200 * 2**20
    assert parse_memory_size("1.5GB") == 1_500_000_000
    assert parse_memory_size("4096") == 4096
    import click

    with pytest.raises(click.BadParameter, match="200MiB"):
        parse_memory_size("lots")


def test_model_specs(factories: Path) -> None:
    lm = load_model("net=profmodels:mlp", (3, 8, 8), num_classes=7)
    assert lm.name == "net" and lm.num_classes == 7 and lm.sample_shape == (3, 8, 8)
    x, y = lm.make_batch(5)
    assert x.shape == (5, 3, 8, 8) and y is not None and int(y.max()) < 7
    lm2 = load_model("profmodels:cnn")  # sample batch decides the input shape
    assert lm2.name == "cnn" and lm2.sample_shape == (3, 16, 16)
    fp = structural_fingerprint(lm2.module)
    from gpemu.identify import structural_fingerprint as emulator_fingerprint

    # The profiler stores what the emulator computes to recognise a user's model.
    assert fp == emulator_fingerprint(lm2.module) == structural_fingerprint(load_model("profmodels:cnn").module)
    assert fp != structural_fingerprint(lm.module)
    with pytest.raises(ModelSpecError, match="no callable"):
        load_model("profmodels:nothing")
    with pytest.raises(ModelSpecError, match="cannot import"):
        load_model("no_such_module_xyz:f")
    # A bare name is a torchvision model: loaded where torchvision imports (the CUDA build),
    # else one error naming what is missing (torchvision cannot be imported with the CPU build).
    try:
        import torchvision  # noqa: F401
    except Exception:
        with pytest.raises(ModelSpecError, match="torchvision"):
            load_model("resnet50")
    else:
        tv = load_model("resnet50")
        assert tv.name == "resnet50" and sum(p.numel() for p in tv.module.parameters()) == 25_557_032


def test_a_grouped_convolution_s_backward_flops_are_two_forwards(factories: Path) -> None:
    """The FLOPs a profiled model is stored with count a convolution's backward as one
    forward-sized convolution per gradient (input, weight), grouped or not: torch's own formula
    counts a depthwise convolution's weight gradient ``groups`` times over (9x its forward here)."""
    from gpemu.profiler.measure import Measurer

    fwd, total = Measurer(load_model("profmodels:depthwise", None), torch.device("cpu")).flops_per_sample()
    assert fwd == 2 * 8 * 6 * 6 * 9  # 2 x outputs x (1 input channel x 3 x 3) per output
    # the input needs no gradient: only the weight's, one forward's worth
    assert total == pytest.approx(2 * fwd)


def test_cpu_memory_estimate_counts_activations_once(factories: Path) -> None:
    from gpemu.profiler.measure import Measurer

    lm = load_model("profmodels:small")  # Linear(16, 4): saves only its input and weight
    m = Measurer(lm, torch.device("cpu"))
    m.to_device()
    r = {bs: m.measure(bs, warmup=1, iterations=1) for bs in (1, 2, 4)}  # warm-up creates momentum
    params = sum(p.numel() * 4 for p in lm.module.parameters())
    assert {x.persistent_memory for x in r.values()} == {3 * params}  # weights, grads, momentum
    # Linear saves the batch itself (counted once, as the input); cross entropy saves the logits'
    # log-softmax; targets are int64. Per sample: 16*4 input + 4*4 logits + 4*4 log-softmax + 8 target.
    per_sample = 16 * 4 + 4 * 4 + 4 * 4 + 8
    assert r[2].peak_memory - r[1].peak_memory == per_sample
    assert r[4].peak_memory - r[2].peak_memory == 2 * per_sample
    # Parameters, momentum and gradients are live at the peak, plus the batch's bytes and a
    # batch-independent rest (the scalar loss).
    assert 0 <= r[1].peak_memory - (3 * params + per_sample) <= 64


# ------------------------------------------------------------------ the pipeline
@pytest.mark.subprocess
def test_rows_metadata_and_model_info(factories: Path, db_url: str) -> None:
    assert (
        run_profile(
            db_url,
            "--model",
            "profmodels:mlp",
            "--model",
            "cnn=profmodels:cnn",
            "--input-shape",
            "3,8,8",
            "--batch-sizes",
            "1,2,4",
        )
        == 0
    )
    db = open_db(db_url)
    gpu = db.gpu("cpu")
    assert gpu.memory_bytes > 0 and gpu.fp32_flops > 0
    for model in ("mlp", "cnn"):
        for kind in UNIT_KINDS:
            pts = db.series("cpu", model, kind)
            assert [b for b, _ in pts] == [1.0, 2.0, 4.0], (model, kind)
            assert all(v > 0 for _, v in pts)
        assert db.has("cpu", model, "model_transfer")
    # Memory: persistent = params + grads + SGD momentum (+ buffers), exactly, at every batch size.
    cnn = db.model("cnn")
    expected = 3 * cnn.param_bytes + cnn.buffer_bytes
    assert {v for _, v in db.series("cpu", "cnn", "persistent_memory")} == {float(expected)}
    peaks = [v for _, v in db.series("cpu", "cnn", "peak_memory")]
    assert peaks[0] < peaks[1] < peaks[2] and peaks[0] > expected - cnn.param_bytes
    # Model info: structure for identification, FLOPs counted.
    mlp = db.model("mlp")
    assert mlp.class_name == "Sequential" and mlp.param_count == 3 * 8 * 8 * 32 + 32 + 32 * 10 + 10
    from gpemu.identify import structural_fingerprint as emulator_fingerprint

    assert mlp.fingerprint == emulator_fingerprint(load_model("profmodels:mlp", (3, 8, 8)).module)
    assert mlp.fwd_flops_per_sample == 2 * (3 * 8 * 8 * 32 + 32 * 10)
    assert mlp.fwd_bwd_flops_per_sample > mlp.fwd_flops_per_sample
    # Every row carries its provenance.
    from sqlalchemy import text

    with db.engine.connect() as conn:
        rows = conn.execute(text("select kind, samples, p50, p99, measured_at, metadata_json from measurements")).all()
    assert len(rows) == 2 * (len(UNIT_KINDS) * 3 + 1)
    import json

    for kind, samples, _p50, _p99, measured_at, meta_json in rows:
        meta = json.loads(meta_json)
        for key in ("gpu_name", "gpu_memory_bytes", "torch", "cuda", "driver", "host", "tool_version"):
            assert key in meta, (kind, key)
        assert meta["gpu_name"] == "cpu" and meta["torch"] == torch.__version__ and measured_at
        if kind != "model_transfer":
            assert samples == 2
    db.close()


def test_resume_skips_done_units_and_force_remeasures(
    factories: Path, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--model", "profmodels:mlp", "--input-shape", "3,8,8")
    assert run_profile(db_url, *args, "--batch-sizes", "1,2") == 0
    capsys.readouterr()
    assert run_profile(db_url, *args, "--batch-sizes", "1,2,4") == 0
    err = err_text(capsys)
    assert "1 unit(s) measured, 2 already in the database" in err
    db = open_db(db_url)
    before = {r for r in db.series("cpu", "mlp", "forward")}
    db.close()
    assert run_profile(db_url, *args, "--batch-sizes", "1,2,4", "--force") == 0
    assert "3 unit(s) measured, 0 already" in err_text(capsys)
    db = open_db(db_url)
    after = {r for r in db.series("cpu", "mlp", "forward")}
    assert len(after) == 3 and after != before  # re-measured (upserted, not duplicated)
    db.close()


def test_out_of_memory_records_limit_and_goes_on(
    factories: Path, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # cnn at 3x16x16 needs ~50 KB at batch 2 and ~95 KB at batch 4 (estimate); small needs far less.
    args = (
        "--model",
        "profmodels:cnn",
        "--model",
        "profmodels:small",
        "--batch-sizes",
        "1,2,4,8",
        "--memory-limit",
        "70000",
    )
    assert run_profile(db_url, *args) == 0
    err = err_text(capsys)
    assert "out of memory at batch size 4" in err
    db = open_db(db_url)
    assert [b for b, _ in db.series("cpu", "cnn", "forward")] == [1.0, 2.0]
    assert [b for b, _ in db.series("cpu", "small", "forward")] == [1.0, 2.0, 4.0, 8.0]
    assert all(v <= 70000 for _, v in db.series("cpu", "cnn", "peak_memory"))
    store = ProfileStore(db)
    limit = store.limit("cpu", "cnn")
    assert limit is not None and (limit.oom_batch_size, limit.largest_fitting) == (4, 2)
    assert "memory limit" in limit.message
    assert store.limit("cpu", "small") is None
    assert db.lookup("cpu", "cnn", 1, "max_batch_size").value == 2  # exported with the measurements
    assert not db.has("cpu", "small", "max_batch_size")
    db.close()
    # A rerun does not try the batch sizes that ran out of memory again.
    assert run_profile(db_url, *args) == 0
    err = err_text(capsys)
    assert "0 unit(s) measured, 8 already in the database" in err and "out of memory" in err


def test_export_import_round_trip(factories: Path, db_url: str, tmp_path: Path) -> None:
    out_json, out_csv = tmp_path / "lab.json", tmp_path / "lab-csv"
    assert run_profile(db_url, "--model", "profmodels:small", "--batch-sizes", "1,2", "--export", str(out_json)) == 0
    assert main(["profile", "--db", db_url, "--gpu-name", "cpu", "--export", str(out_csv)]) == 0  # export alone
    src = open_db(db_url)
    for i, exported in enumerate((out_json, out_csv)):
        other_url = f"sqlite:///{tmp_path / f'other{i}.sqlite'}"
        assert main(["db", "import", str(exported), "--db", other_url]) == 0  # the lab's import command
        other = open_db(other_url)
        assert other.gpu("cpu") == src.gpu("cpu")
        assert other.model("small") == src.model("small")
        for kind in UNIT_KINDS + ("model_transfer",):
            assert other.series("cpu", "small", kind) == src.series("cpu", "small", kind), kind
        other.close()
    src.close()


def test_refuses_without_gpu_and_bad_input(factories: Path, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["profile", "--model", "profmodels:small", "--db", db_url]) == 2
    err = err_text(capsys)
    assert "measures real GPUs" in err and "--device cpu" in err
    assert (
        main(["profile", "--device", "cpu", "--model", "profmodels:small", "--db", db_url, "--batch-sizes", "8-1"]) == 2
    )
    assert "backwards" in err_text(capsys)
    assert main(["profile", "--device", "cpu", "--db", db_url]) == 2
    assert "nothing to do" in err_text(capsys)
    # Two different models under one name would blend in lookups: refused, the first one kept.
    assert run_profile(db_url, "--model", "small=profmodels:cnn", "--batch-sizes", "1") == 0
    assert run_profile(db_url, "--model", "small=profmodels:mlp", "--input-shape", "3,8,8", "--batch-sizes", "1") == 2
    assert "already in the database and differs" in err_text(capsys)
    db = open_db(db_url)
    assert db.model("small").class_name == "Sequential" and db.model("small").param_count == 330
    db.close()
    # A model that cannot take the given input: one line naming the option to fix.
    assert run_profile(db_url, "--model", "profmodels:mlp", "--input-shape", "3,4,4", "--batch-sizes", "1") == 2
    err = err_text(capsys)
    assert "failed at batch size 1" in err and "--input-shape (now 3,4,4)" in err and "Traceback" not in err


def _child_env(factories: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(factories), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.subprocess
def test_sigint_leaves_database_consistent_and_rerun_completes(
    factories: Path, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cmd = [
        *GPEMU,
        "profile",
        "--device",
        "cpu",
        "--db",
        db_url,
        "--model",
        "profmodels:slow",
        "--batch-sizes",
        "1-12",
        "--warmup",
        "1",
        "--iterations",
        "3",
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, env=_child_env(factories), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    deadline = time.monotonic() + 90
    done = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with engine.connect() as conn:
                done = conn.execute(text("select count(*) from measurements where kind='forward'")).scalar_one()
        except Exception:  # tables not created yet
            done = 0
        if done >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "consistent" in err
    with engine.connect() as conn:
        per_batch = conn.execute(
            text("select batch_size, count(*) from measurements where batch_size > 0 group by batch_size")
        ).all()
    assert 2 <= len(per_batch) < 12
    assert all(n == len(UNIT_KINDS) for _, n in per_batch), per_batch  # whole units only
    engine.dispose()
    # The rerun measures only what is missing.
    capsys.readouterr()
    assert run_profile(db_url, "--model", "profmodels:slow", "--batch-sizes", "1-12") == 0
    assert f"{12 - len(per_batch)} unit(s) measured, {len(per_batch)} already" in err_text(capsys)
    db = open_db(db_url)
    assert [b for b, _ in db.series("cpu", "slow", "forward")] == [float(b) for b in range(1, 13)]
    db.close()


@pytest.mark.torchrun
def test_ddp_iteration_times_with_gloo(factories: Path, db_url: str) -> None:
    # Real torch.distributed: two spawned ranks, gloo, DDP's all-reduce in backward.
    assert run_profile(db_url, "--model", "profmodels:small", "--batch-sizes", "2,4", "--ddp-world-sizes", "2") == 0
    db = open_db(db_url)
    pts = db.series("cpu", "small", "ddp_iteration", world_size=2)
    assert [b for b, _ in pts] == [2.0, 4.0] and all(v > 0 for _, v in pts)
    assert not db.series("cpu", "small", "ddp_iteration")  # world size 1 has none
    db.close()


def test_factory_module_in_the_current_directory(
    tmp_path: Path, db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpemu profile --model mymodels:build` next to mymodels.py. The console script's sys.path
    starts with its own directory, not the current one: here neither '' nor the directory is on it."""
    (tmp_path / "mymodels.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(12, 3)\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_profile(db_url, "--model", "mymodels:build", "--input-shape", "12", "--batch-sizes", "1") == 2
    err = err_text(capsys)
    assert "run gpemu from the directory that holds mymodels.py" in err and "PYTHONPATH" in err
    assert "Traceback" not in err
    monkeypatch.chdir(tmp_path)
    assert run_profile(db_url, "--model", "mymodels:build", "--input-shape", "12", "--batch-sizes", "1") == 0
    assert open_db(db_url).has("cpu", "build", "forward")
