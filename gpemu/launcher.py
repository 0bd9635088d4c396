"""``gpemu run``: run an unmodified command with every Python process in it emulated.

The launcher validates the settings once (unknown GPU, bad counts and URLs fail here with one
line, before the script starts), exports them as ``GPEMU_*`` variables plus ``GPEMU_ENABLE=1``,
prepends :data:`BOOTSTRAP_DIR` (a directory holding only ``sitecustomize.py``) to
``PYTHONPATH`` and replaces itself with the command. Python imports ``sitecustomize`` at every
start, so the script, its spawned DataLoader workers, ``torchrun`` workers and ``mp.spawn``
children all call :func:`bootstrap` and patch themselves from the same environment; forked
DataLoader workers inherit the patched parent.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .clock import VIRTUAL_TIME_NOTE
from .config import ConfigError, EmuConfig, values_note

__all__ = [
    "BOOTSTRAP_DIR",
    "VIRTUAL_TIME_NOTE",
    "values_note",
    "build_config",
    "child_env",
    "command_argv",
    "run_command",
    "fold_line",
    "fold_envs",
    "run_folded",
    "bootstrap",
]

# Holds sitecustomize.py only, so putting it on PYTHONPATH adds nothing else importable.
BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"


def build_config(gpu: str | None = None, gpus: str | int | None = None, **settings: Any) -> EmuConfig:
    """EmuConfig from the environment and ``gpemu run`` flags, validated against the database.

    ``gpus`` is a count (``2``) or a comma-separated list of GPU models (``V100,A100``).
    Raises a ``ValueError`` subclass with one clear line for anything unusable.
    """
    overrides: dict[str, Any] = dict(settings)
    if gpus is not None:
        text = str(gpus).strip()
        if text.lstrip("-").isdigit():
            overrides["num_gpus"] = int(text)
        elif text.replace(",", "").strip():
            overrides["device_gpus"] = text
        else:
            raise ConfigError(
                f"--gpus must be a count (e.g. 2) or GPU models separated by commas (e.g. V100,A100), got {gpus!r}"
            )
    config = EmuConfig.from_env(gpu=gpu, **overrides)
    if config.virtual_time and config.clock_origin is None:
        # Every process of the run (ranks, workers) starts its virtual time from this moment.
        config = config.replace(clock_origin=time.perf_counter())
    if (
        (gpu is not None or "num_gpus" in overrides)
        and "device_gpus" not in overrides
        and config.device_gpus is not None
    ):
        # Explicit --gpu/--gpus flags win over a per-device list inherited from the environment.
        config = config.replace(device_gpus=None, num_gpus=overrides.get("num_gpus", config.num_gpus))
    _validate(config)
    return config


def _validate(config: EmuConfig) -> None:
    """Open the profile database and resolve every GPU (and the model, if one is named)."""
    from gpemu.db import open_profile_db

    try:
        db = open_profile_db(config)
    except ValueError:
        raise  # gpemu.db's own errors: one line, the password redacted
    except Exception as exc:  # anything SQLAlchemy raised past it: same treatment
        from gpemu.db import db_location
        from gpemu.db.build import describe_error

        raise ConfigError(describe_error(db_location(config), exc)) from None
    for name in config.gpus_per_device:
        db.gpu(name)  # UnknownNameError (a ValueError) suggests the close match
    from .time.launch import check_host, recorded_hosts

    # (a preset's or a recorded host's name: one line saying which exist)
    check_host(config.host, recorded_hosts(db.engine))
    if config.model:
        db.model(config.model)
    from .run_outputs import check_output_paths

    check_output_paths(config)  # before the script starts, not after hours of training


def child_env(config: EmuConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the command runs in: ``base`` + the config + the bootstrap on PYTHONPATH."""
    # The launcher passes the user's whole environment through to the command it starts;
    # settings themselves are read only by gpemu.config.
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k.startswith("GPEMU_")]:
        del env[key]  # the config below is complete; stale variables must not mix in
    env.update(config.replace(enable=True).to_env())
    existing = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOTSTRAP_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *existing])
    if config.real_values:
        # Every op's values are computed on the CPU; OpenMP's workers spinning after each one
        # would take the cores from the program's own thread (whose CPU time is its host time).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def command_argv(command: Sequence[str], module: str | None = None) -> list[str]:
    """The argv to exec: ``-m module args`` and ``script.py args`` run with this Python."""
    args = list(command)
    if module:
        return [sys.executable, "-m", module, *args]
    if not args:
        raise ConfigError(
            "nothing to run: give a command after `--`, e.g. `gpemu run --gpu V100 -- python train.py`, or `-m module`"
        )
    if args[0].endswith(".py"):
        return [sys.executable, *args]
    return args


def run_command(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Replace this process with ``argv`` (exit status and signals are the command's own)."""
    program = argv[0]
    resolved = shutil.which(program, path=env.get("PATH")) if os.sep not in program else program
    if resolved is None or not os.path.exists(resolved):
        raise ConfigError(f"command not found: {program!r} (is it installed and on PATH?)")
    env = dict(env)
    # For the bootstrap (not settings): the command keeps this process id through exec, so a
    # Python without gpemu can tell it is the command itself and name the Python to use instead.
    env["GPEMU_RUN_PID"] = str(os.getpid())
    env["GPEMU_RUN_PYTHON"] = sys.executable
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(resolved, list(argv), env)


def fold_line(config: EmuConfig) -> str:
    """The first line of a folded run (``--world-size``): what stands for what."""
    from .distributed.folding import Fold

    world = config.world_size or 1
    described = config.described_cluster()
    per_node = described.gpus_per_node if described is not None else config.num_gpus
    nodes = described.nodes if described is not None else (config.nodes or -(-world // per_node))
    lines = [Fold(world, config.processes, p).describe(config.gpu, nodes, per_node) for p in range(config.processes)]
    return "\n[gpemu] ".join(lines)


def fold_envs(config: EmuConfig, env: Mapping[str, str]) -> list[dict[str, str]]:
    """One environment per process of a folded run: torchrun's variables for the rank it runs
    (RANK, WORLD_SIZE, LOCAL_RANK, ...) and which process it is."""
    world = config.world_size or 1
    per_process = world // config.processes
    port = env.get("MASTER_PORT") or str(_free_port())
    envs = []
    for process in range(config.processes):
        rank = process * per_process
        child = dict(env)
        child.update(config.replace(fold_process=process, enable=True).to_env())
        child.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank % config.num_gpus),
                "LOCAL_WORLD_SIZE": str(config.num_gpus),
                "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
                "MASTER_PORT": port,
            }
        )
        envs.append(child)
    return envs


def run_folded(argv: Sequence[str], envs: Sequence[Mapping[str, str]]) -> int:
    """Run ``argv`` once per environment (the processes of a folded run), all at once; the exit
    status is the first failing process's (0 when all succeed). One process is exec'd in place."""
    import subprocess

    if len(envs) == 1:
        run_command(argv, envs[0])
        return 0  # (not reached: the command replaced this process)
    program = argv[0]
    if shutil.which(program, path=envs[0].get("PATH")) is None and not os.path.exists(program):
        raise ConfigError(f"command not found: {program!r} (is it installed and on PATH?)")
    sys.stdout.flush()
    sys.stderr.flush()
    children = [subprocess.Popen(list(argv), env=dict(env)) for env in envs]
    codes = [child.wait() for child in children]
    return next((code for code in codes if code), 0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bootstrap() -> None:
    """Called by the sitecustomize of ``gpemu run``: patch this process from the environment."""
    config = EmuConfig.from_env()
    if not config.enable:
        return
    import gpemu

    gpemu.patch(config)
