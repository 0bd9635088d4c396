"""``gpemu run --values real`` on third-party scripts, unmodified, on small synthetic data: the
loss falls and the checkpoint is written (with placeholders neither happens).

The scripts are not part of this repository: the tests look for a checkout of
karpathy/nanoGPT and pytorch/examples in ``$GPEMU_THIRD_PARTY`` (default: ``compat-src`` beside
this repository), as ``nanoGPT/`` and ``examples/``, and skip with one line without them.
tests/test_values.py has the same behaviour on a loop of its own, always run.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

_SOURCES = Path(os.environ.get("GPEMU_THIRD_PARTY") or Path(__file__).resolve().parents[2] / "compat-src")


def _checkout(name: str, tmp_path: Path) -> Path:
    src = _SOURCES / name
    if not src.is_dir():
        pytest.skip(f"no {name} checkout in {_SOURCES} (set GPEMU_THIRD_PARTY)")
    dst = tmp_path / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git", "*.bin", "*.pt", "input.txt", "dataset"))
    return dst


def _gpemu_run(args: list[str], cwd: Path, timeout: int = 400) -> str:
    cmd = [sys.executable, "-m", "gpemu.cli", "run", *args]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _shakespeare_like(path: Path) -> None:
    """A small play-shaped text for nanoGPT's character-level prepare.py (no download)."""
    rng = random.Random(1)
    words = "the and of to my thou thee love night day heart sweet fair lord lady come go speak see".split()
    lines = []
    while sum(map(len, lines)) < 60_000:
        lines.append(rng.choice(["ROMEO", "JULIET", "NURSE"]) + ":\n")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 9))).capitalize() + ".\n\n")
    path.write_text("".join(lines))


def test_nanogpt_shakespeare_char_loss_falls_and_best_checkpoint_is_written(tmp_path):
    repo = _checkout("nanoGPT", tmp_path)
    data = repo / "data" / "shakespeare_char"
    _shakespeare_like(data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True, timeout=120)
    config = (
        "config/train_shakespeare_char.py --device=cuda --compile=False --n_layer=1 --n_head=2 --n_embd=32 "
        "--block_size=32 --batch_size=8 --max_iters=20 --eval_interval=10 --eval_iters=2 --log_interval=10 "
        "--lr_decay_iters=20 --warmup_iters=2"
    ).split()
    out = _gpemu_run(["--gpu", "A100", "--values", "real", "--", "python", "train.py", *config], repo)
    val = [float(v) for v in re.findall(r"step \d+: train loss [\d.]+, val loss ([\d.]+)", out)]
    assert len(val) == 3 and val[-1] < val[0] - 0.3, out[-2000:]
    assert "saving checkpoint" in out and (repo / "out-shakespeare-char" / "ckpt.pt").is_file()


def test_super_resolution_loss_falls_psnr_is_finite_and_checkpoints_are_written(tmp_path):
    try:
        import torchvision  # noqa: F401
        from PIL import Image
    except Exception as exc:  # (a torchvision built for another torch raises RuntimeError)
        pytest.skip(f"super_resolution needs torchvision and PIL: {type(exc).__name__}")

    repo = _checkout("examples", tmp_path) / "super_resolution"
    for split, count in (("train", 4), ("test", 2)):
        folder = repo / "dataset" / "BSDS300" / "images" / split
        folder.mkdir(parents=True)
        for i in range(count):  # smooth synthetic images of BSDS300's size
            img = Image.linear_gradient("L").resize((481, 321)).rotate(30 * i + 10 * len(split)).convert("RGB")
            img.save(folder / f"{i}.jpg")
    args = "--upscale_factor 3 --batchSize 2 --testBatchSize 2 --nEpochs 2 --lr 0.001 --accel --threads 0".split()
    out = _gpemu_run(["--gpu", "A100", "--values", "real", "--", "python", "main.py", *args], repo)
    losses = [float(v) for v in re.findall(r"Avg. Loss: ([\d.]+)", out)]
    psnr = [float(v) for v in re.findall(r"Avg. PSNR: ([\d.]+) dB", out)]
    assert len(losses) == 2 and losses[1] < losses[0] and all(p > 0 for p in psnr), out[-2000:]
    assert (repo / "model_epoch_2.pth").is_file()
