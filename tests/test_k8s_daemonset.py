"""The device-plugin DaemonSet's own commands, run as the kubelet would run them on a node.

The manifest's initContainers (`gpemu k8s secrets`, `gpemu k8s devices create`) and its plugin
container (`gpemu k8s plugin ... --sharing amqp://gpemu-jobs@gpemu-sharing... --sharing-password-file
...`) are taken from k8s/device-plugin-daemonset.yaml word for word; only the node's paths are
moved into a temporary directory and $(VARS) expanded the way Kubernetes expands them. A
kubelet stand-in (tests/kubelet_standin.py) then registers the plugin and allocates an emuGPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from kubelet_standin import KubeletStandIn  # noqa: E402

K8S = Path(__file__).resolve().parent.parent / "k8s"
RES = "gpemu.io/emugpu"
_MAIN = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"

pytestmark = pytest.mark.k8s


def _daemonset() -> dict:
    docs = [d for d in yaml.safe_load_all((K8S / "device-plugin-daemonset.yaml").read_text()) if d]
    return next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]


def _config_map() -> dict[str, str]:
    docs = [d for d in yaml.safe_load_all((K8S / "time-slicing-config.yaml").read_text()) if d]
    return next(d for d in docs if d["kind"] == "ConfigMap")["data"]


@pytest.fixture
def node():
    root = Path(tempfile.mkdtemp(prefix="gpd-", dir="/tmp"))  # sockets: keep the path short
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _command(container: dict, node: Path, data: dict[str, str]) -> list[str]:
    """The container's command with its mounts moved under ``node`` and $(VARS) expanded."""
    mounts = sorted(((m["mountPath"], node / m["name"]) for m in container.get("volumeMounts", [])), reverse=True)
    values = {"NODE_IP": "127.0.0.1", **data}
    args = []
    for arg in container["command"]:
        for name, value in values.items():
            arg = arg.replace(f"$({name})", value)
        for mount, local in mounts:
            arg = arg.replace(mount, str(local))
        args.append(arg)
    assert args[0] == "gpemu"
    return [sys.executable, "-c", _MAIN, *args[1:]]


def test_the_device_plugin_starts_as_the_daemonset_runs_it_and_hands_out_credentials(node):
    spec = _daemonset()
    data = _config_map()
    (node / "config").mkdir()
    (node / "config" / "config.yaml").write_text(data["config.yaml"])
    for init in spec["initContainers"]:
        done = subprocess.run(_command(init, node, data), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"initContainer {init['name']}: {done.stderr}"
    plugin = next(c for c in spec["containers"] if c["name"] == "device-plugin")
    kubelet = KubeletStandIn(node / "device-plugin", echo=False).start()
    log = node / "plugin.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(_command(plugin, node, data), stdout=out, stderr=subprocess.STDOUT)
    try:
        kubelet.wait_for(
            lambda: RES in kubelet.plugins or proc.poll() is not None, 60, "the plugin to register or exit"
        )
        assert proc.poll() is None, f"the plugin exited with {proc.returncode}: {log.read_text()}"
        kubelet.wait_for(lambda: kubelet.plugins[RES].updates > 0, 10, "the plugin's device list")
        response = kubelet.allocate(RES, 1)[1]
    finally:
        proc.terminate()
        proc.wait(10)
        kubelet.stop()
    envs = dict(response.envs)
    assert envs["GPEMU_SHARING"] == "amqp://gpemu-jobs@gpemu-sharing.gpemu-system.svc:5672/%2F"  # no password
    mount = next(m for m in response.mounts if m.container_path.endswith("sharing.json"))
    creds = json.loads(Path(mount.host_path).read_text())
    assert creds["amqp_password"] == (node / "secrets" / "jobs-password").read_text().strip()
    assert creds["job_id"] == envs["GPEMU_JOB_ID"] and creds["job_id"] in creds["keys"]
    assert creds["amqp_password"] not in log.read_text()


def test_a_sharing_url_without_any_password_is_one_clear_line(node):
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _MAIN,
            "k8s",
            "plugin",
            "--sharing",
            "amqp://gpemu-jobs@127.0.0.1:5672/%2F",
            "--device-dir",
            str(node / "dev"),
            "--device-plugin-dir",
            str(node / "dp"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "names the broker user 'gpemu-jobs' but no password" in done.stderr
    assert "--sharing-password-file" in done.stderr
