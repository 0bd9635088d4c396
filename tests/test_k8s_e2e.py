"""Container-less end to end: the environment from a real Allocate response configures an
unmodified script run through `gpemu run` (what a pod of the example Job does)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from kubelet_standin import KubeletStandIn  # noqa: E402

from gpemu.k8s.devices import create_devices  # noqa: E402
from gpemu.k8s.plugin import EmuGpuPlugin, PluginOptions  # noqa: E402

pytestmark = pytest.mark.k8s

SCRIPT = "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name(0))"


@pytest.fixture
def allocation():
    root = Path(tempfile.mkdtemp(prefix="gpk-", dir="/tmp"))
    create_devices(root / "dev", "A100", 2)
    create_devices(root / "dev", "V100", 2)
    kubelet = KubeletStandIn(root / "dp").start()
    plugin = EmuGpuPlugin(
        PluginOptions(device_dir=str(root / "dev"), device_plugin_dir=str(root / "dp"), poll_interval_s=0.05)
    ).start()
    try:
        ids, resp = kubelet.allocate("gpemu.io/emugpu", 2)
        yield root, ids, dict(resp.envs), list(resp.mounts)
    finally:
        plugin.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def _container_env(root: Path, envs: dict[str, str], mounts) -> dict[str, str]:
    """The pod's environment; the mounted files are made visible at a stand-in path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPEMU_") or k == "GPEMU_DATA_DIR"}
    env.update(envs)
    # No container runtime here: place the mounted files where GPEMU_DEVICE_DIR points, under root.
    mnt = root / "container" / envs["GPEMU_DEVICE_DIR"].lstrip("/")
    mnt.mkdir(parents=True)
    for m in mounts:
        shutil.copy(m.host_path, mnt / Path(m.container_path).name)
    env["GPEMU_DEVICE_DIR"] = str(mnt)
    env["GPEMU_SUMMARY"] = "0"
    return env


def test_allocated_environment_configures_gpemu_run(allocation):
    root, ids, envs, mounts = allocation
    # The preferred allocation spreads over emuGPUs in index order: the two A100s.
    assert envs["GPEMU_GPUS"] == "A100,A100" and envs["GPEMU_NUM_GPUS"] == "2"
    env = _container_env(root, envs, mounts)
    if not shutil.which("gpemu"):
        pytest.skip("the gpemu console script is not installed")
    proc = subprocess.run(
        ["gpemu", "run", "--", sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, name = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert count == "2" and "A100" in name, proc.stdout


def test_allocated_environment_configures_patch_without_arguments(allocation):
    root, ids, envs, mounts = allocation
    env = _container_env(root, envs, mounts)
    code = "import gpemu; gpemu.patch(); " + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, name = proc.stdout.strip().splitlines()[-1].split(" ", 1)
    assert count == "2" and "A100" in name, proc.stdout
