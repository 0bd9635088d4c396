"""`gpemu run`: validation, the child environment, the sitecustomize bootstrap, and end-to-end runs
in real subprocesses (DataLoader workers with fork and spawn, mp.spawn children)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpemu.cli import main
from gpemu.config import ConfigError, EmuConfig
from gpemu.launcher import BOOTSTRAP_DIR, build_config, child_env, command_argv


# ------------------------------------------------------------------ validation (in-process, no exec)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu", "V10"], "did you mean 'V100'"),
        (["--gpus", "0"], "num_gpus must be an integer from 1 to 64"),
        (["--gpus", "V100,Z9000"], "unknown GPU 'Z9000'"),
        (["--db", "nosuchdialect://x"], "--db takes a SQLAlchemy URL"),
        (["--share", "http://broker"], "sharing must be an amqp:// or amqps:// URL"),
        (["--model", "resnet5O"], "did you mean 'resnet50'"),
        ([], "nothing to run"),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(args, message, capsys) -> None:
    rc = main(["run", *args, "--", *(["python", "-c", "pass"] if args else [])])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in " ".join(err.split())
    assert "Traceback" not in err


def test_unknown_command_is_one_line(capsys) -> None:
    assert main(["run", "--gpu", "V100", "--", "no-such-program-gpemu"]) == 2
    assert "command not found: 'no-such-program-gpemu'" in capsys.readouterr().err


def test_flags_build_the_config() -> None:
    cfg = build_config(gpu="A100", gpus="2", memory="profiled", summary=False, metrics_path="m.json")
    assert cfg.gpus_per_device == ("A100", "A100") and cfg.memory == "profiled"
    assert cfg.summary is False and cfg.metrics_path == "m.json"
    mixed = build_config(gpus="V100,A100")
    assert mixed.gpus_per_device == ("V100", "A100")
    with pytest.raises(ConfigError, match="--gpus must be"):
        build_config(gpus=" ")


def test_child_environment() -> None:
    cfg = EmuConfig(gpu="P100", num_gpus=3, summary=False)
    env = child_env(cfg, {"PATH": "/bin", "PYTHONPATH": "/my/lib", "GPEMU_MODEL": "stale", "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BOOTSTRAP_DIR), "/my/lib"]
    assert env["GPEMU_ENABLE"] == "1" and env["GPEMU_GPU"] == "P100" and env["GPEMU_NUM_GPUS"] == "3"
    assert "GPEMU_MODEL" not in env  # stale settings do not leak in
    assert env["HOME"] == "/h" and env["PATH"] == "/bin"
    assert EmuConfig.from_env(env) == cfg.replace(enable=True)  # children rebuild the same config
    assert sorted(os.listdir(BOOTSTRAP_DIR)) in (["sitecustomize.py"], ["__pycache__", "sitecustomize.py"])


def test_command_forms() -> None:
    assert command_argv(["train.py", "--lr", "1"]) == [sys.executable, "train.py", "--lr", "1"]
    assert command_argv(["--lr", "1"], module="pkg.train") == [sys.executable, "-m", "pkg.train", "--lr", "1"]
    assert command_argv(["torchrun", "x.py"]) == ["torchrun", "x.py"]


# ------------------------------------------------------------------ real subprocesses
def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["gpemu", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.subprocess
def test_bootstrap_chains_an_existing_sitecustomize_and_keeps_the_exit_code(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITECUSTOMIZE_RAN = True\n")
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent("""
        import builtins, sys, torch
        print("user sitecustomize:", getattr(builtins, "USER_SITECUSTOMIZE_RAN", False))
        print("cuda:", torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_name(0))
        sys.exit(3)
    """)
    )
    env = dict(os.environ, PYTHONPATH=str(own))
    proc = subprocess.run(
        ["gpemu", "run", "--gpu", "K80", "--no-summary", "--", "python", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 3, proc.stderr
    assert "user sitecustomize: True" in proc.stdout
    assert "cuda: True 1 Tesla K80" in proc.stdout


@pytest.mark.subprocess
def test_bootstrap_failure_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(BOOTSTRAP_DIR), GPEMU_ENABLE="1", GPEMU_GPU="Z9000")
    proc = subprocess.run(
        [sys.executable, "-c", "print('script ran')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "script ran" not in proc.stdout
    assert proc.stderr.startswith("[gpemu] error: could not emulate GPUs in this process: unknown GPU 'Z9000'")
    assert "Fatal Python error" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.subprocess
def test_a_python_without_gpemu_is_refused_as_the_command_and_warned_about_below(tmp_path: Path) -> None:
    """`python` on PATH may not be the Python gpemu is installed in (a venv not activated): run as
    the command it would train on the CPU as if no GPU were asked for. It stops with one line
    naming the right Python; a foreign Python some script starts runs on, with a warning."""
    import venv

    venv.create(tmp_path / "bare", with_pip=False)  # a Python with nothing installed
    bare = str(tmp_path / "bare" / "bin" / "python")
    proc = _run(["run", "--gpu", "V100", "--no-summary", "--", bare, "-c", "print('script ran')"], tmp_path)
    assert proc.returncode == 2 and "script ran" not in proc.stdout
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert line.startswith(f"[gpemu] error: this Python ({bare}) cannot import gpemu")
    assert sys.executable in line and "Traceback" not in proc.stderr
    nested = f"import subprocess, sys; sys.exit(subprocess.run([{bare!r}, '-c', 'print(7)']).returncode)"
    proc = _run(["run", "--gpu", "V100", "--no-summary", "--", sys.executable, "-c", nested], tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "7", proc.stderr
    assert f"[gpemu] warning: this Python ({bare}) cannot import gpemu" in proc.stderr


@pytest.mark.subprocess
def test_bootstrap_does_nothing_without_enable(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(BOOTSTRAP_DIR), GPEMU_ENABLE="0", GPEMU_GPU="Z9000")
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; print('torch' in sys.modules)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False"  # not even torch was imported


CHILDREN_MODULE = '''
import sys
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset


class Probe(Dataset):
    """Each item is what a DataLoader worker process sees of the GPUs."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor([float(torch.cuda.is_available()), float(torch.cuda.device_count())])


def spawned(rank, queue):
    queue.put((rank, torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_name(rank)))


def main():
    for method, workers in (("fork", 2), ("spawn", 1)):
        loader = DataLoader(Probe(), batch_size=1, num_workers=workers, pin_memory=True,
                            multiprocessing_context=method)
        batches = list(loader)
        print(method, "workers:", [b.tolist() for b in batches], "pinned:", all(b.is_pinned() for b in batches))
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(spawned, args=(queue,), nprocs=2, join=True)
    print("mp.spawn:", sorted(queue.get() for _ in range(2)))


if __name__ == "__main__":
    main()
'''


@pytest.mark.subprocess
def test_dataloader_workers_and_mp_spawn_children_see_the_gpus(tmp_path: Path) -> None:
    (tmp_path / "children_probe.py").write_text(CHILDREN_MODULE)
    proc = _run(["run", "--gpu", "A100", "--gpus", "2", "--no-summary", "-m", "children_probe"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "fork workers: [[[1.0, 2.0]], [[1.0, 2.0]]] pinned: True" in out
    assert "spawn workers: [[[1.0, 2.0]], [[1.0, 2.0]]] pinned: True" in out
    assert ("mp.spawn: [(0, True, 2, 'NVIDIA A100-SXM4-40GB'), (1, True, 2, 'NVIDIA A100-SXM4-40GB')]") in out
