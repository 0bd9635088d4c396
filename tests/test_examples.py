"""The examples are ordinary PyTorch scripts: run each under `gpemu run` in a real subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# gpemu's entry point in this interpreter, found without the venv on PATH; the venv's bin goes
# first on the child's PATH so the examples' own `python` and `torchrun` are this environment's.
GPEMU = [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())"]
ENV = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def _gpemu_run(flags: list[str], command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*GPEMU, "run", *flags, "--", *command], cwd=EXAMPLES, capture_output=True, text=True, timeout=timeout, env=ENV
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_examples_do_not_import_gpemu() -> None:
    for script in ("all_features.py", "imagenet_classifier.py", "language_model.py", "ddp_train.py"):
        text = (EXAMPLES / script).read_text()
        assert not re.search(r"^\s*(import|from)\s+gpemu", text, re.M), script


@pytest.mark.subprocess
@pytest.mark.parametrize("gpus", ["1", "2"])
def test_all_features(gpus: str, tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.json"
    proc = _gpemu_run(
        ["--gpu", "V100", "--gpus", gpus, "--no-summary", "--metrics", str(metrics)],
        ["python", "all_features.py", "--steps", "2", "--workers", "1", "--batch-size", "16"],
    )
    out = proc.stdout
    assert f"GPUs: {gpus}  (Tesla V100-PCIE-32GB" in out
    assert "compute capability 7.0, 32.0 GiB, 80 SMs" in out
    assert "accelerator: cuda (available: True" in out
    assert re.search(r"step 0: loss \d+\.\d{3}  GPU time [\d.]+ ms  scale 65536", out)
    assert "checkpoint saved at step 2" in out and "resumed from step 2 on cuda:0" in out
    assert "step 3: loss" in out  # training went on after resuming
    oom = re.findall(r"out of memory at batch (\d+)", out)
    fits = int(re.search(r"largest batch that fits at 224x224: (\d+)", out).group(1))
    assert oom and int(oom[-1]) == 2 * fits  # recovered with the next smaller batch
    assert ("second GPU: cuda:1" in out) == (gpus == "2")
    assert out.rstrip().endswith("done")
    if metrics.exists():  # written by the observability component at exit
        assert json.loads(metrics.read_text())


@pytest.mark.subprocess
def test_imagenet_classifier_uses_measured_resnet50_times() -> None:
    proc = _gpemu_run(
        ["--gpu", "V100", "--no-summary"],
        ["python", "imagenet_classifier.py", "--steps", "3", "--batch-size", "8", "--workers", "1"],
    )
    assert "resnet50 on Tesla V100-PCIE-32GB, batch 8" in proc.stdout
    assert len(re.findall(r"iter \d: loss 0\.000", proc.stdout)) == 3
    assert "measured" in proc.stderr  # GPU time came from the profile database


@pytest.mark.subprocess
def test_language_model() -> None:
    proc = _gpemu_run(["--gpu", "A100", "--no-summary"], ["python", "language_model.py", "--steps", "3"])
    assert re.search(r"GPT with [\d.]+M parameters on NVIDIA A100", proc.stdout)
    assert len(re.findall(r"step \d: loss \d+\.\d{3}", proc.stdout)) == 3


@pytest.mark.torchrun
@pytest.mark.subprocess
def test_ddp_under_torchrun() -> None:
    proc = _gpemu_run(
        ["--gpu", "V100", "--gpus", "2", "--no-summary"],
        ["torchrun", "--nproc-per-node", "2", "ddp_train.py", "--steps", "2"],
    )
    out = proc.stdout
    assert "rank 0 on cuda:0 (current device 0)" in out and "rank 1 on cuda:1 (current device 1)" in out
    # Host-side counters all-reduced over both ranks (real gloo): 2 steps x 2 micro-batches x 16 x 2 ranks.
    assert "world 2: 2 steps" in out and "128 samples" in out


@pytest.mark.subprocess
def test_gpu_preprocessing_under_gpemu_run() -> None:
    """The example that uses gpemu's own API runs under `gpemu run` too (on the run's GPU)."""
    proc = _gpemu_run(["--gpu", "A100"], ["python", "gpu_preprocessing.py", "--batches", "4"])
    assert "4 batches on emulated NVIDIA A100-SXM4-40GB" in proc.stdout
    assert "preprocess" in proc.stderr and "gpemu summary: 1 emulated GPU(s)" in proc.stderr  # the run's summary
    assert proc.stderr.count("tensor values on emulated GPUs are placeholders") == 1
