"""The emuGPU device plugin: advertises emulated GPUs to the kubelet (device-plugin API v1beta1).

Lifecycle, as the kubelet expects of a device plugin:

1. serve ``DevicePlugin`` on a Unix socket in the device-plugin directory
   (``/var/lib/kubelet/device-plugins/gpemu.io-emugpu.sock`` by default);
2. ``Registration.Register`` on ``kubelet.sock`` with version ``v1beta1``, the socket's name,
   the resource name (``gpemu.io/emugpu``) and the plugin's options;
3. the kubelet opens ``ListAndWatch`` and, for each pod asking for ``gpemu.io/emugpu: N``,
   calls ``GetPreferredAllocation`` then ``Allocate``.

Health: the plugin polls the emuGPU directory. A file that is present and valid is
``Healthy``; a file that is invalid or says ``"healthy": false`` is ``Unhealthy``; a file that
disappears is advertised ``Unhealthy`` for ``removed_grace_s`` (so the kubelet stops placing pods
on it and pods already using it can be noticed) and then dropped from the list.

Reliability: a watcher notices when ``kubelet.sock`` is re-created (kubelet restart; the kubelet
also deletes every plugin socket when it starts) or the plugin's own socket disappears, and then
restarts the gRPC server and registers again. Device ids are derived from the files alone
(``emugpu-<index>`` or ``emugpu-<index>::<replica>``), so a restarted plugin advertises the same
ids and the kubelet's checkpointed allocations of running pods stay valid; every allocation is
also recorded in ``gpemu-allocations.json`` in the state directory and reloaded at start. A socket
left behind by a killed plugin is removed when the plugin starts.

Sharing credentials: with a sharing manager configured, ``Allocate`` gives each container its
own job id and key (derived from the manager's job secret, so the manager needs no list of
them) and the broker password, in a file mounted read-only as ``sharing.json`` next to the
emuGPU files; ``GPEMU_SHARING`` holds the broker URL without a password. Nothing secret goes
into the environment, the allocation record or the log.

Hostile input: every RPC checks sizes before looking anything up (at most 64 containers per
request, 4096 ids per container, 128 characters per id) and quotes at most a few dozen
characters of what it refuses; preferred allocations only ever name advertised ids.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from . import api_pb2, api_pb2_grpc
from .allocation import (
    HEALTHY,
    MAX_CONTAINERS,
    MAX_ID_LEN,
    MAX_IDS,
    REPLICA_SEP,
    UNHEALTHY,
    AllocationError,
    Allocator,
    DeviceState,
    check_count,
    checked_ids,
    index_of,
    physical_id,
    show_ids,
)
from .devices import DeviceFileError, scan_devices
from .options import (
    CONTAINER_DEVICE_DIR,
    DEFAULT_DEVICE_PLUGIN_DIR,
    DEFAULT_RESOURCE_NAME,
    PluginConfigError,
    PluginOptions,
    load_plugin_config,
)

__all__ = [
    "PluginOptions",
    "PluginConfigError",
    "EmuGpuPlugin",
    "load_plugin_config",
    "API_VERSION",
    "DEFAULT_RESOURCE_NAME",
    "DEFAULT_DEVICE_PLUGIN_DIR",
    "CONTAINER_DEVICE_DIR",
    "HEALTHY",
    "UNHEALTHY",
    "MAX_ID_LEN",
    "MAX_IDS",
]

log = logging.getLogger("gpemu.k8s.plugin")

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
# gRPC's own limit on a request; kept above a megabyte so an oversized id reaches our checks
# and gets INVALID_ARGUMENT with a short message instead of a transport error.
MAX_MESSAGE_BYTES = 4 << 20


class EmuGpuPlugin(Allocator, api_pb2_grpc.DevicePluginServicer):
    """One device plugin serving one resource. ``start()``, then ``stop()``."""

    def __init__(self, options: PluginOptions) -> None:
        self.options = options
        self._devices: dict[str, DeviceState] = {}
        self._cond = threading.Condition()
        self._version = 0  # bumped on every change of the advertised list
        self._stop = threading.Event()
        self._server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        self._kubelet_seen: tuple[int, int] | None = None
        self._server_lock = threading.Lock()
        self.registrations = 0  # successful Register calls (for status and tests)
        self.registered = threading.Event()
        self._record_lock = threading.Lock()
        self.allocations: list[dict[str, Any]] = self._load_record()

    # ------------------------------------------------------------------ paths
    @property
    def socket_path(self) -> Path:
        return Path(self.options.device_plugin_dir) / self.options.endpoint

    @property
    def kubelet_socket(self) -> Path:
        return Path(self.options.device_plugin_dir) / KUBELET_SOCKET

    def start(self) -> EmuGpuPlugin:
        if not Path(self.options.device_dir).is_dir():
            log.warning(
                "emuGPU directory %s does not exist (yet); advertising no emuGPUs until it does "
                "(create some: gpemu k8s devices create --gpu V100 --count 8 --dir %s)",
                self.options.device_dir,
                self.options.device_dir,
            )
        self.refresh_devices()
        log.info(
            "emuGPU plugin: resource %s, %d emuGPU(s) x %d replica(s) from %s",
            self.options.advertised_resource,
            len(self._devices),
            self.options.replicas,
            self.options.device_dir,
        )
        if self.allocations:
            log.info("reloaded %d recorded allocation(s) from %s", len(self.allocations), self.record_path)
        self._start_server()
        for target in (self._watch_devices, self._watch_kubelet):
            t = threading.Thread(target=target, name=f"gpemu-plugin-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        with self._server_lock:
            if self._server is not None:
                self._server.stop(grace=0.5).wait(2)
                self._server = None
        for t in self._threads:
            t.join(timeout=5)
        self._threads.clear()
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass

    def run_forever(self) -> None:
        """Serve until SIGTERM/SIGINT (the DaemonSet's container stop)."""
        import signal

        stopped = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopped.set())
        self.start()
        try:
            while not stopped.wait(1.0):
                pass
        finally:
            self.stop()

    def _start_server(self) -> None:
        """(Re)start the gRPC server on a fresh socket (the kubelet deletes sockets on restart)."""
        with self._server_lock:
            if self._server is not None:
                # No grace: the kubelet that held these streams is gone, and waiting would delay
                # re-registration.
                self._server.stop(grace=None).wait(2)
                self._server = None
            path = self.socket_path
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.unlink()  # a killed plugin's socket: binding would fail with EADDRINUSE
                log.info("removed the stale socket %s", path)
            except FileNotFoundError:
                pass
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="gpemu-dp"),
                options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
            )
            api_pb2_grpc.add_DevicePluginServicer_to_server(self, server)
            server.add_insecure_port(f"unix://{path}")
            server.start()
            self._server = server
        with self._cond:
            # Streams of the old server end (ListAndWatch checks which server it belongs to).
            self._cond.notify_all()

    def _register(self, kubelet: tuple[int, int]) -> None:
        """One Register call on kubelet.sock; on a transient failure the watcher tries again."""
        request = api_pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=self.options.endpoint,
            resource_name=self.options.advertised_resource,
            options=self._plugin_options(),
        )
        try:
            # Its own subchannel: C-core shares one per target within a process, and one still
            # backing off from the previous kubelet would fail this call fast with UNAVAILABLE.
            with grpc.insecure_channel(
                f"unix://{self.kubelet_socket}", options=[("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
                api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=5)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                log.warning("kubelet not answering on %s (%s); retrying", self.kubelet_socket, exc.code().name)
                return
            # The kubelet refused us (version, resource name): retrying the same request will not
            # help; wait for the next kubelet (a new kubelet.sock).
            log.error("kubelet refused registration of %s: %s", request.resource_name, exc.details())
            self._kubelet_seen = kubelet
            return
        # Stat again after the answer: the socket's ctime may change right after it was created
        # (chmod), which must not look like another kubelet restart.
        self._kubelet_seen = _stat_key(self.kubelet_socket) or kubelet
        self.registrations += 1
        self.registered.set()
        log.info("registered %s with the kubelet (endpoint %s)", request.resource_name, request.endpoint)

    def _watch_kubelet(self) -> None:
        """Register, and re-serve + re-register whenever kubelet.sock is re-created (kubelet
        restart) or the plugin's own socket disappears."""
        interval = min(0.25, self.options.poll_interval_s)
        while not self._stop.is_set():
            kubelet = _stat_key(self.kubelet_socket)
            own_missing = not self.socket_path.exists()
            if kubelet is not None and (kubelet != self._kubelet_seen or own_missing):
                if self._kubelet_seen is not None or own_missing:
                    log.info(
                        "kubelet restart detected (kubelet.sock re-created or plugin socket removed); "
                        "restarting the plugin server and re-registering"
                    )
                    self.registered.clear()
                    self._start_server()
                self._register(kubelet)
            self._stop.wait(interval)

    # ------------------------------------------------------------------ devices
    def _watch_devices(self) -> None:
        while not self._stop.wait(self.options.poll_interval_s):
            try:
                self.refresh_devices()
            except Exception:  # keep serving: a bad scan must not kill the plugin
                log.exception("scanning %s failed", self.options.device_dir)

    def refresh_devices(self, now: float | None = None) -> bool:
        """Re-read the emuGPU directory; returns True (and wakes ListAndWatch) on a change."""
        now = time.monotonic() if now is None else now
        found = scan_devices(self.options.device_dir)
        changed = False
        with self._cond:
            for dev_id, item in found.items():
                old = self._devices.get(dev_id)
                if isinstance(item, DeviceFileError):
                    new = DeviceState(old.device if old else None, UNHEALTHY, str(item))
                elif not item.healthy:
                    new = DeviceState(item, UNHEALTHY, "file says healthy: false")
                else:
                    new = DeviceState(item, HEALTHY)
                if old is None or (old.device, old.health, old.problem, old.missing_since) != (
                    new.device,
                    new.health,
                    new.problem,
                    new.missing_since,
                ):
                    if old is None or old.health != new.health:
                        log.info("emuGPU %s: %s%s", dev_id, new.health, f" ({new.problem})" if new.problem else "")
                    self._devices[dev_id] = new
                    changed = True
            for dev_id in list(self._devices):
                if dev_id in found:
                    continue
                state = self._devices[dev_id]
                if state.missing_since is None:
                    state.missing_since, state.health, state.problem = now, UNHEALTHY, "file removed"
                    log.info("emuGPU %s: Unhealthy (file removed)", dev_id)
                    changed = True
                elif now - state.missing_since >= self.options.removed_grace_s:
                    del self._devices[dev_id]
                    log.info("emuGPU %s: dropped (removed %.0f s ago)", dev_id, now - state.missing_since)
                    changed = True
            if changed:
                self._version += 1
                self._cond.notify_all()
        return changed

    def advertised(self) -> list[tuple[str, str]]:
        """(device id, health) of every advertised device, in index/replica order."""
        with self._cond:
            return self._advertised_locked()

    def _advertised_locked(self) -> list[tuple[str, str]]:
        out = []
        for dev_id in sorted(self._devices, key=index_of):
            state = self._devices[dev_id]
            if self.options.replicas == 1:
                out.append((dev_id, state.health))
            else:
                out.extend((f"{dev_id}{REPLICA_SEP}{r}", state.health) for r in range(self.options.replicas))
        return out

    # ------------------------------------------------------------------ DevicePlugin service
    def _plugin_options(self) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return self._plugin_options()

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        sent = -1
        server = self._server
        while context.is_active() and not self._stop.is_set() and server is self._server:
            with self._cond:
                if self._version == sent:
                    self._cond.wait(timeout=0.5)
                version = self._version
                devices = self._advertised_locked()
            if version != sent:
                sent = version
                yield api_pb2.ListAndWatchResponse(
                    devices=[api_pb2.Device(ID=dev_id, health=health) for dev_id, health in devices]
                )

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        responses = []
        try:
            check_count(len(request.container_requests), MAX_CONTAINERS, "container requests")
            with self._cond:
                advertised = {d for d, _ in self._advertised_locked()}
            for creq in request.container_requests:
                available = checked_ids(creq.available_deviceIDs, "available")
                must = checked_ids(creq.must_include_deviceIDs, "must-include")
                unknown = [d for d in must if d not in advertised]
                if unknown:
                    raise AllocationError(
                        grpc.StatusCode.NOT_FOUND,
                        f"must-include id(s) {show_ids(unknown)} are not advertised by this node",
                    )
                # Only ids this plugin advertises may come back, whatever the request lists.
                available = [d for d in dict.fromkeys(available) if d in advertised]
                chosen = self._prefer(available, list(dict.fromkeys(must)), creq.allocation_size)
                responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        except AllocationError as exc:
            context.abort(exc.code, exc.message)
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def _prefer(self, available: list[str], must: list[str], size: int) -> list[str]:
        """Spread a request over distinct emuGPUs, least-shared first.

        With time-slicing the kubelet's ``available`` list tells how busy each emuGPU is (its
        replicas not in the list are taken), so prefer emuGPUs with the most free replicas and
        avoid putting two replicas of one emuGPU in the same container while others are free.
        """
        if size < 1:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"allocation size must be >= 1, got {size}")
        if size > len(available):
            raise AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"asked for {size} emuGPU(s) but only {len(available)} are available",
            )
        missing = [d for d in must if d not in available]
        if missing or len(must) > size:
            raise AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"must-include devices {show_ids(must)} must be available and at most {size}",
            )
        free: dict[str, list[str]] = {}
        for dev_id in available:
            free.setdefault(physical_id(dev_id), []).append(dev_id)
        chosen = list(must)
        for dev_id in must:
            free[physical_id(dev_id)].remove(dev_id)
        used = {physical_id(d) for d in chosen}
        # On a node with several GPU models keep a container on one model when it fits:
        # a job's emulated GPUs should be alike, as on real multi-GPU servers.
        with self._cond:
            model = {p: (s.device.gpu if s.device else "?") for p, s in self._devices.items()}
        need = size - len(chosen)
        models = {model.get(p, "?") for p in used} or {model.get(p, "?") for p in free}
        fitting = [
            m
            for m in sorted(models)
            if sum(len(v) for p, v in free.items() if model.get(p, "?") == m) >= need
            and (not used or {model.get(p, "?") for p in used} == {m})
        ]
        if fitting:
            # The model with the most free distinct emuGPUs, so replicas spread widest.
            best_model = max(
                fitting,
                key=lambda m: (
                    sum(1 for p, v in free.items() if v and model.get(p, "?") == m),
                    -sorted(models).index(m),
                ),
            )
            free = {p: v for p, v in free.items() if model.get(p, "?") == best_model}
        while len(chosen) < size:
            candidates = [p for p in free if free[p]]
            fresh = [p for p in candidates if p not in used] or candidates
            best = min(fresh, key=lambda p: (-len(free[p]), index_of(p)))
            chosen.append(free[best].pop(0))
            used.add(best)
        return chosen

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    # ------------------------------------------------------------------ allocation record


def _stat_key(path: Path) -> tuple[int, int] | None:
    """Identity of a socket file: changes when it is deleted and re-created."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns
