"""The emuGPU device plugin, driven over real gRPC on Unix sockets by a kubelet stand-in that
implements the v1beta1 Registration service (tests/kubelet_standin.py).

Run with ``-s`` to see the stand-in's log (registration, device lists, allocations, health).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from kubelet_standin import KubeletStandIn  # noqa: E402

from gpemu.k8s import api_pb2  # noqa: E402
from gpemu.k8s.devices import create_devices, device_file  # noqa: E402
from gpemu.k8s.plugin import EmuGpuPlugin, PluginConfigError, PluginOptions, load_plugin_config  # noqa: E402

pytestmark = pytest.mark.k8s

RES = "gpemu.io/emugpu"


@pytest.fixture
def node():
    # Unix socket paths are limited to ~107 bytes: keep the directory short.
    root = Path(tempfile.mkdtemp(prefix="gpk-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def devices(node):
    create_devices(node / "dev", "V100", 4)
    return node / "dev"


@pytest.fixture
def kubelet(node):
    k = KubeletStandIn(node / "dp").start()
    yield k
    k.stop()


@pytest.fixture
def start_plugin(node):
    started: list[EmuGpuPlugin] = []

    def start(**overrides) -> EmuGpuPlugin:
        opts = dict(
            device_dir=str(node / "dev"), device_plugin_dir=str(node / "dp"), poll_interval_s=0.05, removed_grace_s=0.6
        )
        opts.update(overrides)
        p = EmuGpuPlugin(PluginOptions(**opts)).start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def _ids(n: int) -> list[str]:
    return [f"emugpu-{i}" for i in range(n)]


def test_registers_and_lists_devices(devices, kubelet, start_plugin):
    start_plugin()
    ep = kubelet.plugin(RES)
    assert ep.endpoint == "gpemu.io-emugpu.sock"
    assert ep.options.get_preferred_allocation_available and not ep.options.pre_start_required
    assert ep.devices == {i: "Healthy" for i in _ids(4)}
    assert any("Register: resource=gpemu.io/emugpu" in line and "version=v1beta1" in line for line in kubelet.lines)


def test_allocate_mounts_device_files_and_sets_environment(node, devices, kubelet, start_plugin):
    secret = b"j" * 32
    plugin = start_plugin(
        host_device_dir="/host/gpemu/devices",
        sharing="amqp://gpemu-jobs:s3cret@10.0.0.5:5672/%2F",
        job_secret=secret,
        credentials_dir=str(node / "creds"),
        host_credentials_dir="/host/gpemu/credentials",
    )
    ids, resp = kubelet.allocate(RES, 2)
    assert len(ids) == 2 and len(set(ids)) == 2
    env = dict(resp.envs)
    visible = env["GPEMU_VISIBLE_DEVICES"].split(",")
    assert sorted(visible) == sorted(ids)
    assert env["GPEMU_GPUS"] == "V100,V100" and env["GPEMU_NUM_GPUS"] == "2"
    assert env["GPEMU_DEVICE_DIR"] == "/var/run/gpemu/devices" and env["GPEMU_ENABLE"] == "1"
    # The broker URL without its password; the password and the container's own key are in a file.
    assert env["GPEMU_SHARING"] == "amqp://gpemu-jobs@10.0.0.5:5672/%2F"
    job_id = env["GPEMU_JOB_ID"]
    device_mounts, creds = resp.mounts[:-1], resp.mounts[-1]
    assert [m.container_path for m in device_mounts] == [f"/var/run/gpemu/devices/{i}.json" for i in visible]
    assert [m.host_path for m in device_mounts] == [f"/host/gpemu/devices/{i}.json" for i in visible]
    assert (creds.container_path, creds.host_path) == (
        "/var/run/gpemu/devices/sharing.json",
        f"/host/gpemu/credentials/{job_id}.json",
    )
    assert all(m.read_only for m in resp.mounts)
    assert not resp.devices  # emuGPUs are files, not device nodes
    written = node / "creds" / f"{job_id}.json"
    data = json.loads(written.read_text())
    from gpemu.integrations.sharing.protocol import derive_job_key

    assert data["amqp_password"] == "s3cret" and data["job_id"] == job_id
    assert data["keys"] == {n: derive_job_key(secret, n).hex() for n in (job_id, f"{job_id}.0", f"{job_id}.1")}
    assert oct(written.stat().st_mode & 0o777) == "0o444" and oct((node / "creds").stat().st_mode & 0o777) == "0o700"
    # A second container gets its own job id and key; nothing secret in the record or the env.
    _, other = kubelet.allocate(RES, 1)
    assert other.envs["GPEMU_JOB_ID"] != job_id
    record = (node / "dp" / "gpemu-allocations.json").read_text()
    assert "s3cret" not in record and secret.hex() not in record and data["keys"][job_id] not in record
    assert "s3cret" not in repr(plugin.options) and "jjjj" not in repr(plugin.options)
    # The environment is what EmuConfig reads in the container, the file what the client reads.
    from gpemu.config import EmuConfig
    from gpemu.integrations.sharing.client import load_job_credentials

    cfg = EmuConfig.from_env(env)
    assert cfg.gpus_per_device == ("V100", "V100") and cfg.visible_devices == tuple(visible)
    assert cfg.sharing and cfg.device_dir == "/var/run/gpemu/devices"
    (node / "ctr").mkdir()
    (node / "ctr" / "sharing.json").write_text(written.read_text())
    loaded = load_job_credentials(node / "ctr")
    assert loaded.job_id == job_id and loaded.keys[job_id] == derive_job_key(secret, job_id)
    assert "s3cret" not in repr(loaded)


def test_allocate_without_host_dir_mounts_plugin_dir_and_no_sharing(devices, kubelet, start_plugin):
    start_plugin()
    ids, resp = kubelet.allocate(RES, 1)
    assert "GPEMU_SHARING" not in resp.envs
    host = Path(resp.mounts[0].host_path)
    assert host == devices / f"{ids[0]}.json"
    assert json.loads(host.read_text())["gpu"] == "V100"


def test_removed_device_turns_unhealthy_then_disappears(devices, kubelet, start_plugin):
    start_plugin(removed_grace_s=0.8)
    ep = kubelet.plugin(RES)
    device_file(devices, 3).unlink()
    kubelet.wait_for(lambda: ep.devices.get("emugpu-3") == "Unhealthy", 5, "emugpu-3 Unhealthy")
    assert all(ep.devices[i] == "Healthy" for i in _ids(3))
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate_ids(RES, ["emugpu-3"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "file removed" in err.value.details()
    kubelet.wait_for(lambda: "emugpu-3" not in ep.devices, 5, "emugpu-3 dropped")
    # A device added later is advertised without restarting anything.
    create_devices(devices, "V100", 1)
    kubelet.wait_for(lambda: ep.devices.get("emugpu-3") == "Healthy", 5, "new emugpu-3")


def test_health_flag_and_corrupt_file_are_unhealthy(devices, kubelet, start_plugin):
    start_plugin()
    ep = kubelet.plugin(RES)
    data = json.loads(device_file(devices, 1).read_text())
    device_file(devices, 1).write_text(json.dumps({**data, "healthy": False}))
    device_file(devices, 2).write_text("{not json")
    kubelet.wait_for(lambda: ep.devices.get("emugpu-1") == ep.devices.get("emugpu-2") == "Unhealthy", 5, "unhealthy")
    assert ep.devices["emugpu-0"] == "Healthy"
    ids, resp = kubelet.allocate(RES, 2)  # only healthy ones are offered
    assert sorted(ids) == ["emugpu-0", "emugpu-3"]
    device_file(devices, 1).write_text(json.dumps(data))
    kubelet.wait_for(lambda: ep.devices.get("emugpu-1") == "Healthy", 5, "emugpu-1 healthy again")


def test_kubelet_restart_reregisters_within_5s(devices, kubelet, start_plugin):
    plugin = start_plugin()
    kubelet.plugin(RES)
    elapsed = kubelet.restart()
    assert elapsed < 5.0
    kubelet.wait_for(lambda: plugin.registrations == 2, 5, "the plugin to count its second registration")
    ep = kubelet.plugin(RES)  # the new ListAndWatch stream lists the same devices
    assert ep.devices == {i: "Healthy" for i in _ids(4)}
    ids, _ = kubelet.allocate(RES, 1)
    assert ids


def test_plugin_restart_keeps_allocations(node, devices, kubelet, start_plugin):
    first = start_plugin()
    ids, before = kubelet.allocate(RES, 2)
    old = kubelet.plugin(RES)
    first.stop()
    second = start_plugin()
    kubelet.wait_for(
        lambda: kubelet.plugins[RES] is not old and kubelet.plugins[RES].updates > 0,
        5,
        "the restarted plugin to register and list devices",
    )
    ep = kubelet.plugins[RES]
    # Same ids, so the kubelet's checkpointed assignment of the running pod stays valid ...
    assert set(ids) <= set(ep.devices) and all(ep.devices[i] == "Healthy" for i in ids)
    # ... the record survived the restart ...
    assert [a["devices"] for a in second.allocations] == [ids]
    assert json.loads((node / "dp" / "gpemu-allocations.json").read_text())["allocations"][0]["devices"] == ids
    # ... and allocating the same ids again gives the same mounts and environment.
    again = kubelet.allocate_ids(RES, ids).container_responses[0]
    assert dict(again.envs) == dict(before.envs)
    assert [(m.host_path, m.container_path) for m in again.mounts] == [
        (m.host_path, m.container_path) for m in before.mounts
    ]


def test_bad_requests_get_grpc_errors(devices, kubelet, start_plugin):
    start_plugin()
    ep = kubelet.plugin(RES)
    cases = [
        (["emugpu-9"], grpc.StatusCode.NOT_FOUND, "unknown emuGPU id(s) emugpu-9; this node advertises: emugpu-0"),
        (
            _ids(4) + ["emugpu-7"],
            grpc.StatusCode.INVALID_ARGUMENT,
            "asked for 5 gpemu.io/emugpu but this node advertises 4",
        ),
        ([], grpc.StatusCode.INVALID_ARGUMENT, "names no device ids"),
        (["emugpu-1", "emugpu-1"], grpc.StatusCode.INVALID_ARGUMENT, "listed twice: emugpu-1"),
    ]
    for ids, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate_ids(RES, ids)
        assert err.value.code() == code, ids
        assert text in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        ep.stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=_ids(2), allocation_size=3)
                ]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "only 2 are available" in err.value.details()
    # The plugin keeps serving after refusing.
    assert kubelet.allocate(RES, 4)[0]


def _write_config(path: Path, replicas: int, **slicing) -> Path:
    extra = "".join(f"    {k}: {str(v).lower()}\n" for k, v in slicing.items())
    path.write_text(
        "version: v1\n"
        "sharing:\n"
        "  manager: amqp://gpemu:gpemu@127.0.0.1:5672/%2F\n"
        "  timeSlicing:\n" + extra + "    resources:\n"
        f"      - name: {RES}\n"
        f"        replicas: {replicas}\n"
    )
    return path


def test_time_slicing_replicas_spread_over_emugpus(node, devices, kubelet, start_plugin):
    opts = load_plugin_config(
        _write_config(node / "cfg.yaml", 3),
        PluginOptions(device_dir=str(devices), device_plugin_dir=str(node / "dp"), poll_interval_s=0.05),
    )
    assert opts.replicas == 3 and opts.sharing.startswith("amqp://")
    plugin = start_plugin(**{k: getattr(opts, k) for k in ("replicas", "sharing")})
    ep = kubelet.plugin(RES)
    assert len(ep.devices) == 12 and "emugpu-0::1" in ep.devices
    # Two replicas for one pod land on two different emuGPUs.
    ids, resp = kubelet.allocate(RES, 2)
    assert len({i.split("::")[0] for i in ids}) == 2
    assert resp.envs["GPEMU_NUM_GPUS"] == "2" and "GPEMU_SHARING" in resp.envs
    # Further single-replica pods go to the least shared emuGPUs first.
    firsts = [kubelet.allocate(RES, 1)[0][0].split("::")[0] for _ in range(2)]
    assert set(firsts).isdisjoint({i.split("::")[0] for i in ids})
    # Two replicas of one emuGPU are one visible GPU to the container.
    same = plugin.allocate(
        api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["emugpu-0::1", "emugpu-0::2"])]
        )
    ).container_responses[0]
    assert same.envs["GPEMU_VISIBLE_DEVICES"] == "emugpu-0" and same.envs["GPEMU_NUM_GPUS"] == "1"


def test_time_slicing_rename_and_fail_greater_than_one(node, devices, kubelet, start_plugin):
    opts = load_plugin_config(
        _write_config(node / "cfg.yaml", 2, renameByDefault=True, failRequestsGreaterThanOne=True)
    )
    start_plugin(
        replicas=opts.replicas,
        rename_by_default=opts.rename_by_default,
        fail_requests_greater_than_one=opts.fail_requests_greater_than_one,
    )
    ep = kubelet.plugin(RES + ".shared")
    assert len(ep.devices) == 8
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate_ids(RES + ".shared", ["emugpu-0::0", "emugpu-1::0"])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "failRequestsGreaterThanOne" in err.value.details()


@pytest.mark.parametrize(
    "text, message",
    [
        ("version: v2\n", "version must be v1"),
        ("flags: {colour: red}\n", "unknown flag 'colour'"),
        ("shareing: {}\n", "unknown key(s) ['shareing']"),
        ("sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n", "not served by this plugin"),
        (
            "sharing: {timeSlicing: {resources: [{name: gpemu.io/emugpu, replicas: 0}]}}\n",
            "replicas must be an integer from 1 to 64",
        ),
        ("sharing: {manager: http://x}\n", "amqp://"),
        ("flags: {resourceName: emugpu}\n", "<domain>/<name>"),
        ("[1, 2\n", "not valid YAML"),
    ],
)
def test_config_errors_are_clear(node, text, message):
    path = node / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(PluginConfigError) as err:
        load_plugin_config(path)
    assert message in str(err.value)


def test_refused_registration_is_not_retried_in_a_loop(devices, node, start_plugin):
    # A kubelet that refuses the version: the plugin logs it once and waits for a new kubelet.
    class Refusing(KubeletStandIn):
        def Register(self, request, context):
            self.log("Register REFUSED")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")

    k = Refusing(node / "dp", echo=False).start()
    try:
        plugin = start_plugin()
        time.sleep(1.0)
        assert sum("REFUSED" in line for line in k.lines) == 1 and plugin.registrations == 0
    finally:
        k.stop()


def test_plugin_process_via_cli_demo():
    """`gpemu k8s plugin` as its own process: register, allocate, removal, kubelet restart,
    plugin restart (SIGTERM + new process), bad requests; see tests/kubelet_standin.py."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "kubelet_standin.py")], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for text in (
        "Unhealthy: emugpu-3",
        "plugin re-registered",
        "reloaded 1 recorded allocation(s)",
        "error NOT_FOUND: unknown emuGPU id(s) emugpu-9",
        "error INVALID_ARGUMENT: asked for 4",
    ):
        assert text in out, text


def test_preferred_allocation_keeps_a_container_on_one_gpu_model(node, kubelet, start_plugin):
    create_devices(node / "dev", "A100", 2)
    create_devices(node / "dev", "V100", 3)
    start_plugin()
    ep = kubelet.plugin(RES)
    # emugpu-1 (an A100) is taken: 2 alike GPUs are only available among the V100s.
    available = ["emugpu-0", "emugpu-2", "emugpu-3", "emugpu-4"]
    pref = ep.stub.GetPreferredAllocation(
        api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=2)
            ]
        )
    )
    assert sorted(pref.container_responses[0].deviceIDs) == ["emugpu-2", "emugpu-3"]
    # A must-include A100 pins the model; with no second A100 free, it mixes rather than fail.
    pref = ep.stub.GetPreferredAllocation(
        api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=["emugpu-0"], allocation_size=2
                )
            ]
        )
    )
    ids = list(pref.container_responses[0].deviceIDs)
    assert ids[0] == "emugpu-0" and len(set(ids)) == 2
    ids, resp = kubelet.allocate(RES, 3)
    assert resp.envs["GPEMU_GPUS"] == "V100,V100,V100"


def test_oversized_ids_are_refused_without_being_echoed(devices, kubelet, start_plugin):
    start_plugin()
    ep = kubelet.plugin(RES)
    huge = "emugpu-" + "9" * (1 << 20)  # a 1 MB device id
    for call in (
        lambda: kubelet.allocate_ids(RES, [huge]),
        lambda: ep.stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[huge, "emugpu-0"], allocation_size=1
                    )
                ]
            )
        ),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "longer than 128" in err.value.details() and len(err.value.details()) < 300
    many = [f"emugpu-{i}" for i in range(5000)]
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate_ids(RES, many)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 4096" in err.value.details()
    assert kubelet.allocate(RES, 1)[0]  # still serving


def test_preferred_allocation_names_only_advertised_ids(devices, kubelet, start_plugin):
    start_plugin()
    ep = kubelet.plugin(RES)
    bogus = ["emugpu-99", "not-ours", "emugpu-0::7"]
    pref = ep.stub.GetPreferredAllocation(
        api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=bogus + ["emugpu-2", "emugpu-3"], allocation_size=2
                )
            ]
        )
    )
    assert sorted(pref.container_responses[0].deviceIDs) == ["emugpu-2", "emugpu-3"]
    with pytest.raises(grpc.RpcError) as err:  # only bogus ids available: nothing to offer
        ep.stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=bogus, allocation_size=1)
                ]
            )
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "only 0 are available" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        ep.stub.GetPreferredAllocation(
            api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["emugpu-1"], must_include_deviceIDs=["not-ours"], allocation_size=1
                    )
                ]
            )
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "not-ours" in err.value.details()


def test_a_killed_plugins_socket_is_replaced_at_start(node, devices, kubelet, start_plugin):
    """kill -9 of `gpemu k8s plugin` leaves its socket; the next plugin removes it and serves."""
    import signal
    import subprocess

    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "k8s",
            "plugin",
            "--device-dir",
            str(devices),
            "--device-plugin-dir",
            str(node / "dp"),
            "--poll-interval",
            "0.05",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        kubelet.wait_for(lambda: RES in kubelet.plugins, 60, "the plugin process to register")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    sock = node / "dp" / "gpemu.io-emugpu.sock"
    assert sock.is_socket()  # left behind
    old = kubelet.plugins[RES]
    start_plugin()
    kubelet.wait_for(
        lambda: kubelet.plugins[RES] is not old and kubelet.plugins[RES].updates > 0,
        10,
        "the new plugin to register on a fresh socket",
    )
    assert kubelet.allocate(RES, 1)[0]
    probe = subprocess.run(
        [sys.executable, "-c", code, "k8s", "probe", "--device-plugin-dir", str(node / "dp")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0 and "ok:" in probe.stdout
