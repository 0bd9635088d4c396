"""The third-party rows of the compatibility matrix (tests/compat/thirdparty.py): the registry holds
together, the synthetic data is in the formats the scripts' loaders read, and a repository's
snapshot is copied out of a git directory even when it lacks some blobs (fetch's snapshots do).

The rows themselves run in ``benchmarks/compat_matrix.py --repos DIR`` (third-party code and a
torchvision built for the installed torch are not part of the test environment)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "compat"))
import scenarios  # noqa: E402
import synthetic  # noqa: E402
import thirdparty  # noqa: E402


def test_every_row_is_runnable_as_registered() -> None:
    names = [r.name for r in thirdparty.ROWS]
    assert len(names) == len(set(names))
    for i, row in enumerate(thirdparty.ROWS):
        assert row.launcher in ("python", "torchrun") and row.world >= 1
        assert all(d.kind in synthetic.KINDS for d in row.data), row.name
        re.compile(row.done)
        if row.after:  # the row it reads from runs earlier, in the same repository copy
            before = [r for r in thirdparty.ROWS[:i] if r.name == row.after]
            assert before and before[0].repo == row.repo, row.name
    repos = {r.repo for r in thirdparty.ROWS}
    assert repos == {thirdparty.NANOGPT, thirdparty.TIMM, thirdparty.NANOCHAT, thirdparty.TITAN, thirdparty.EXAMPLES}


def test_a_row_says_why_it_cannot_run() -> None:
    row = thirdparty.by_name("torchtitan-llama3-1gpu")
    assert "lacks grain" in str(thirdparty.why_not(row, {"torch": "2.14.1", "missing": ["grain"], "values": False}))
    assert "needs torch >= 2.14" in str(thirdparty.why_not(row, {"torch": "2.13.0+cpu", "missing": [], "values": True}))
    assert thirdparty.why_not(row, {"torch": "2.14.1+cu130", "missing": [], "values": False}) is None
    values_row = thirdparty.by_name("examples-super-resolution")
    assert "--values real" in str(thirdparty.why_not(values_row, {"torch": "2.13.0", "missing": [], "values": False}))
    assert "--values" in thirdparty.command(values_row, Path("m.json"), "python", {"values": True})


def test_mnist_files_are_what_torchvision_reads(tmp_path: Path) -> None:
    synthetic.mnist(tmp_path, 40)
    raw = tmp_path / "MNIST" / "raw"
    images = (raw / "train-images-idx3-ubyte").read_bytes()
    magic, n, rows, cols = struct.unpack(">IIII", images[:16])
    assert (magic, n, rows, cols) == (2051, 40, 28, 28) and len(images) == 16 + 40 * 28 * 28
    labels = (raw / "t10k-labels-idx1-ubyte").read_bytes()
    assert struct.unpack(">II", labels[:8]) == (2049, 256) and max(labels[8:]) <= 9


def test_text_and_token_files(tmp_path: Path) -> None:
    synthetic.char_text(tmp_path, 3000)
    text = (tmp_path / "data" / "shakespeare_char" / "input.txt").read_text()
    assert "\n" in text and len(set(text)) > 20  # sample.py starts from "\n"
    synthetic.token_files(tmp_path, 1000)
    train = np.memmap(tmp_path / "data" / "openwebtext" / "train.bin", dtype=np.uint16, mode="r")
    assert len(train) == 1000 and int(train.max()) < 50257
    synthetic.c4_test(tmp_path, 5)
    lines = (tmp_path / "tests" / "assets" / "c4_test" / "data.json").read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(line)["text"] for line in lines)


def test_nanochat_shards(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    synthetic.nanochat(tmp_path, 30)
    shards = sorted((tmp_path / "base_data_climbmix").glob("shard_*.parquet"))
    assert len(shards) == 3  # nanochat's last shard is its validation split
    table = pq.read_table(shards[0])
    assert table.num_rows == 30 and all(isinstance(t, str) and t for t in table.column("text").to_pylist())


@pytest.mark.subprocess
def test_a_snapshot_without_some_blobs_is_copied_out(tmp_path: Path) -> None:
    work = tmp_path / "work"
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    (work / "train.py").write_text("print('hi')\n")
    (work / "data").mkdir()
    (work / "data" / "big.json").write_text("{}\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    blob = subprocess.run([*git, "rev-parse", "HEAD:data/big.json"], capture_output=True, text=True).stdout.strip()
    (work / ".git" / "objects" / blob[:2] / blob[2:]).unlink()  # as a partial snapshot lacks it
    source = thirdparty.find_source("someone/work", [tmp_path])
    assert source is not None and source.bare is False  # a checkout named like the repository
    bare = thirdparty.Source("someone/work", work / ".git", bare=True)
    missing = thirdparty.copy_out(bare, tmp_path / "copy")
    assert missing == ["data/big.json"] and (tmp_path / "copy" / "train.py").read_text() == "print('hi')\n"
    assert re.fullmatch(r"[0-9a-f]{40}", bare.commit())


def test_gpu_time_per_step_leaves_out_a_ranks_wait_for_a_slower_one() -> None:
    def rank(busy: dict[str, float], waited: float) -> dict:
        steady = {"busy_s": sum(busy.values()), "busy_by_kind_s": busy}
        device = {"iterations": 11, "steady": steady}
        return {"iterations": 11, "communication": {"wait_s": waited}, "devices": [device]}

    # nanoGPT's DDP run: rank 1's all-reduce waited 22 s while rank 0 evaluated and saved a checkpoint
    saver = rank({"forward": 0.3, "backward": 0.4, "comm": 0.016}, 0.002)
    waiter = rank({"forward": 0.3, "backward": 0.4, "comm": 22.4}, 22.38)
    ms = scenarios.gpu_ms_per_step([saver, waiter])
    assert ms is not None and 70 < ms < 75  # the step's own work, 0.7 s over 10 steps (plus its collective)
    assert scenarios.gpu_ms_per_step([saver]) == pytest.approx(1000 * 0.714 / 10)
