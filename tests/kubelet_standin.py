"""A stand-in for the kubelet's device manager, for testing device plugins without a cluster.

It serves the real v1beta1 ``Registration`` service on ``kubelet.sock`` in a device-plugin
directory and drives a registered plugin the way the kubelet does: on ``Register`` it dials the
plugin's socket, reads its options and keeps a ``ListAndWatch`` stream open; ``allocate(n)``
picks from the healthy, unallocated devices (asking ``GetPreferredAllocation`` first when the
plugin offers it) and calls ``Allocate``; ``restart()`` does what a kubelet restart does to the
directory (deletes every socket, creates a fresh ``kubelet.sock``) and measures how long the
plugin takes to register again. Everything it sees is logged, with times since start.

Run ``python tests/kubelet_standin.py`` for a demonstration against ``gpemu k8s plugin``
started as a separate process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpemu.k8s import api_pb2, api_pb2_grpc

_RESOURCE_RE = re.compile(r"^[a-z0-9.-]+\.[a-z0-9-]+/[A-Za-z0-9][-A-Za-z0-9_.]*$")


@dataclass
class PluginEndpoint:
    """What the stand-in knows about one registered plugin."""

    resource: str
    endpoint: str
    options: api_pb2.DevicePluginOptions
    channel: grpc.Channel
    stub: api_pb2_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)  # id -> health
    updates: int = 0
    registered_at: float = 0.0


class KubeletStandIn(api_pb2_grpc.RegistrationServicer):
    def __init__(self, plugin_dir: str | os.PathLike[str], echo: bool = True) -> None:
        self.dir = Path(plugin_dir)
        self.echo = echo
        self.lines: list[str] = []
        self.plugins: dict[str, PluginEndpoint] = {}
        self.allocated: dict[str, set[str]] = {}  # the kubelet's checkpoint: resource -> ids in use
        self.registrations: list[tuple[float, str]] = []
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None
        self._t0 = time.monotonic()

    # ------------------------------------------------------------------ logging
    def log(self, message: str) -> None:
        line = f"[kubelet-standin +{time.monotonic() - self._t0:7.3f}s] {message}"
        with self._cond:
            self.lines.append(line)
        if self.echo:
            print(line, flush=True)

    # ------------------------------------------------------------------ lifecycle
    @property
    def socket(self) -> Path:
        return self.dir / "kubelet.sock"

    def start(self) -> KubeletStandIn:
        self.dir.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        self.log(f"serving Registration (v1beta1) on {self.socket}")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait(2)
            self._server = None
        for p in self.plugins.values():
            p.channel.close()
        try:
            self.socket.unlink()
        except FileNotFoundError:
            pass

    def restart(self, timeout: float = 10.0) -> float:
        """Kubelet restart: stop, delete every socket in the directory, serve a fresh
        kubelet.sock; returns seconds until the plugin(s) registered again."""
        before = len(self.registrations)
        self.stop()
        for entry in self.dir.iterdir():
            if entry.is_socket():
                entry.unlink()
        self.plugins.clear()
        self.log("kubelet restarted: deleted all sockets in the device-plugin directory")
        t0 = time.monotonic()
        self.start()
        self.wait_for(lambda: len(self.registrations) > before, timeout, "re-registration")
        elapsed = self.registrations[before][0] - t0
        self.log(f"plugin re-registered {elapsed:.3f} s after kubelet.sock was re-created")
        return elapsed

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kubelet stand-in: timed out after {timeout} s waiting for {what}")
                self._cond.wait(min(left, 0.1))

    # ------------------------------------------------------------------ Registration service
    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        if request.version != "v1beta1":
            self.log(f"Register REFUSED: unsupported version {request.version!r}")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unsupported device plugin API version {request.version!r}; supported: v1beta1",
            )
        if not _RESOURCE_RE.match(request.resource_name):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid resource name {request.resource_name!r}")
        now = time.monotonic()
        self.log(
            f"Register: resource={request.resource_name} endpoint={request.endpoint} version={request.version} "
            f"options(pre_start_required={request.options.pre_start_required}, "
            f"get_preferred_allocation_available={request.options.get_preferred_allocation_available})"
        )
        # Like the kubelet, talk to the plugin after answering Register.
        threading.Thread(target=self._connect, args=(request,), daemon=True).start()
        with self._cond:
            self.registrations.append((now, request.resource_name))
            self._cond.notify_all()
        return api_pb2.Empty()

    def _connect(self, request: api_pb2.RegisterRequest) -> None:
        # Dial like the kubelet: its own connection (grpc-go dials afresh; C-core would otherwise
        # share a subchannel still backing off from a killed plugin on the same path and fail
        # fast with UNAVAILABLE) and blocking until it is up (the kubelet dials WithBlock, 10 s).
        channel = grpc.insecure_channel(
            f"unix://{self.dir / request.endpoint}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        stub = api_pb2_grpc.DevicePluginStub(channel)
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
            options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
        except grpc.FutureTimeoutError:
            self.log(f"dialing {request.endpoint} timed out after 10 s")
            channel.close()
            return
        except grpc.RpcError as exc:
            self.log(f"GetDevicePluginOptions on {request.endpoint} failed ({exc.code().name})")
            channel.close()
            return
        ep = PluginEndpoint(
            request.resource_name, request.endpoint, options, channel, stub, registered_at=time.monotonic()
        )
        with self._cond:
            old = self.plugins.get(request.resource_name)
            self.plugins[request.resource_name] = ep
            self._cond.notify_all()
        if old is not None:
            old.channel.close()
        try:
            for resp in stub.ListAndWatch(api_pb2.Empty()):
                devices = {d.ID: d.health for d in resp.devices}
                with self._cond:
                    ep.devices = devices
                    ep.updates += 1
                    self._cond.notify_all()
                healthy = sum(h == "Healthy" for h in devices.values())
                unhealthy = sorted(i for i, h in devices.items() if h != "Healthy")
                self.log(
                    f"ListAndWatch[{request.resource_name}] update {ep.updates}: {len(devices)} device(s), "
                    f"{healthy} Healthy"
                    + (f", Unhealthy: {', '.join(unhealthy)}" if unhealthy else "")
                    + f" | ids: {', '.join(devices)}"
                )
        except grpc.RpcError as exc:
            self.log(f"ListAndWatch[{request.resource_name}] stream ended ({exc.code().name})")

    # ------------------------------------------------------------------ allocation, like the device manager
    def plugin(self, resource: str, timeout: float = 10.0) -> PluginEndpoint:
        self.wait_for(
            lambda: resource in self.plugins and self.plugins[resource].updates > 0,
            timeout,
            f"{resource} to register and list its devices",
        )
        return self.plugins[resource]

    def allocate(self, resource: str, count: int) -> tuple[list[str], api_pb2.ContainerAllocateResponse]:
        """Admit a container asking for ``count`` devices of ``resource``."""
        ep = self.plugin(resource)
        in_use = self.allocated.setdefault(resource, set())
        available = [i for i, h in ep.devices.items() if h == "Healthy" and i not in in_use]
        if count > len(available):
            raise RuntimeError(f"kubelet: insufficient {resource}: want {count}, {len(available)} available")
        ids = available[:count]
        if ep.options.get_preferred_allocation_available:
            pref = ep.stub.GetPreferredAllocation(
                api_pb2.PreferredAllocationRequest(
                    container_requests=[
                        api_pb2.ContainerPreferredAllocationRequest(
                            available_deviceIDs=available, allocation_size=count
                        )
                    ]
                ),
                timeout=5,
            )
            ids = list(pref.container_responses[0].deviceIDs)
            self.log(f"GetPreferredAllocation({count} of {len(available)} available) -> {', '.join(ids)}")
        resp = ep.stub.Allocate(
            api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]),
            timeout=5,
        )
        container = resp.container_responses[0]
        in_use.update(ids)
        mounts = "; ".join(
            f"{m.host_path} -> {m.container_path}{' (ro)' if m.read_only else ''}" for m in container.mounts
        )
        envs = " ".join(f"{k}={v}" for k, v in sorted(container.envs.items()))
        self.log(f"Allocate({', '.join(ids)}) -> mounts: {mounts}")
        self.log(f"Allocate({', '.join(ids)}) -> env: {envs}")
        return ids, container

    def allocate_ids(self, resource: str, ids: list[str]) -> api_pb2.AllocateResponse:
        """A raw Allocate call (for checking how bad requests are answered)."""
        ep = self.plugin(resource)
        try:
            return ep.stub.Allocate(
                api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]),
                timeout=5,
            )
        except grpc.RpcError as exc:
            self.log(f"Allocate({', '.join(ids) or '<none>'}) -> error {exc.code().name}: {exc.details()}")
            raise


def _demo() -> int:
    """Plugin as a separate process (`gpemu k8s plugin`), driven like a kubelet would."""
    root = Path(tempfile.mkdtemp(prefix="gpk-demo-"))
    dp_dir, dev_dir = root / "dp", root / "dev"
    gpemu = [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())"]
    subprocess.run(
        gpemu + ["k8s", "devices", "create", "--gpu", "V100", "--count", "4", "--dir", str(dev_dir)], check=True
    )
    kubelet = KubeletStandIn(dp_dir).start()
    plugin = subprocess.Popen(
        gpemu
        + [
            "k8s",
            "plugin",
            "--device-dir",
            str(dev_dir),
            "--device-plugin-dir",
            str(dp_dir),
            "--poll-interval",
            "0.2",
            "--removed-grace",
            "2",
        ]
    )
    try:
        kubelet.plugin("gpemu.io/emugpu")
        kubelet.allocate("gpemu.io/emugpu", 2)
        (dev_dir / "emugpu-3.json").unlink()
        kubelet.log("removed emugpu-3.json")
        kubelet.wait_for(
            lambda: kubelet.plugins["gpemu.io/emugpu"].devices.get("emugpu-3") == "Unhealthy", 5, "unhealthy"
        )
        kubelet.wait_for(lambda: "emugpu-3" not in kubelet.plugins["gpemu.io/emugpu"].devices, 10, "emugpu-3 dropped")
        elapsed = kubelet.restart()
        assert elapsed < 5.0, elapsed
        kubelet.plugin("gpemu.io/emugpu")
        # Plugin restart: a new process advertises the same ids; the record keeps the allocation.
        plugin.terminate()
        plugin.wait(10)
        kubelet.log("plugin process stopped (SIGTERM); starting a new one")
        before, old = len(kubelet.registrations), kubelet.plugins["gpemu.io/emugpu"]
        plugin = subprocess.Popen(
            gpemu
            + [
                "k8s",
                "plugin",
                "--device-dir",
                str(dev_dir),
                "--device-plugin-dir",
                str(dp_dir),
                "--poll-interval",
                "0.2",
            ]
        )
        kubelet.wait_for(
            lambda: (
                len(kubelet.registrations) > before
                and kubelet.plugins["gpemu.io/emugpu"] is not old
                and kubelet.plugins["gpemu.io/emugpu"].updates > 0
            ),
            20,
            "plugin re-registration",
        )
        kubelet.log(
            "allocation record after plugin restart: "
            + (dp_dir / "gpemu-allocations.json").read_text().replace("\n", " ")
        )
        for bad in (["emugpu-9"], ["emugpu-0", "emugpu-1", "emugpu-2", "emugpu-5"]):
            try:
                kubelet.allocate_ids("gpemu.io/emugpu", bad)
            except grpc.RpcError:
                pass
    finally:
        plugin.terminate()
        plugin.wait(10)
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(_demo())
