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

import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from gpemu.units import redact_url

from . import api_pb2, api_pb2_grpc
from .devices import DEFAULT_DEVICE_DIR, DeviceFileError, EmuGpu, device_file, scan_devices

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
DEFAULT_RESOURCE_NAME = "gpemu.io/emugpu"
DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
CONTAINER_DEVICE_DIR = "/var/run/gpemu/devices"
ALLOCATION_RECORD = "gpemu-allocations.json"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
REPLICA_SEP = "::"
DEFAULT_CREDENTIALS_DIR = "/var/lib/gpemu/credentials"
CREDENTIALS_KEEP = 1000  # per-container credential files kept (the oldest are removed)
# Input limits of the RPCs: far above any real node, far below what could hurt the plugin.
MAX_ID_LEN = 128
MAX_IDS = 4096
MAX_CONTAINERS = 64
# gRPC's own limit on a request; kept above a megabyte so an oversized id reaches our checks
# and gets INVALID_ARGUMENT with a short message instead of a transport error.
MAX_MESSAGE_BYTES = 4 << 20
_RESOURCE_RE = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


class PluginConfigError(ValueError):
    """A plugin setting or config file is invalid; the message says what is valid."""


@dataclass(frozen=True)
class PluginOptions:
    """Settings of one device-plugin process (CLI flags and the ``--config`` YAML file)."""

    # Where the emuGPU files are, as the plugin sees it.
    device_dir: str = DEFAULT_DEVICE_DIR
    # The same directory as the kubelet/container runtime sees it (the plugin usually runs in a
    # container with the host directory mounted elsewhere); Allocate mounts from here.
    host_device_dir: str | None = None
    # Where the emuGPU files appear inside workload containers (GPEMU_DEVICE_DIR there).
    container_device_dir: str = CONTAINER_DEVICE_DIR
    device_plugin_dir: str = DEFAULT_DEVICE_PLUGIN_DIR
    resource_name: str = DEFAULT_RESOURCE_NAME
    # Time-slicing: each emuGPU is advertised this many times (NVIDIA's replicas).
    replicas: int = 1
    # NVIDIA's renameByDefault: shared emuGPUs are advertised as "<resource>.shared".
    rename_by_default: bool = False
    # NVIDIA's failRequestsGreaterThanOne: refuse asking for more than one shared emuGPU.
    fail_requests_greater_than_one: bool = False
    # amqp:// URL of the node's sharing manager, handed to containers as GPEMU_SHARING (any
    # password in it goes to the containers' credentials file instead).
    sharing: str | None = None
    # The broker password of the jobs' user (from --sharing-password-file / $GPEMU_SHARING_PASSWORD).
    sharing_password: str | None = field(default=None, repr=False)
    # The sharing manager's job secret: each container's key is derived from it and its job id.
    job_secret: bytes | None = field(default=None, repr=False)
    # Per-container credential files, as the plugin sees the directory and as the node does.
    credentials_dir: str = DEFAULT_CREDENTIALS_DIR
    host_credentials_dir: str | None = None
    # Where the allocation record is kept (default: the device-plugin directory).
    state_dir: str | None = None
    poll_interval_s: float = 1.0
    # How long a removed emuGPU stays advertised as Unhealthy before it is dropped.
    removed_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not _RESOURCE_RE.match(self.resource_name) or len(self.resource_name) > 253:
            raise PluginConfigError(
                f"resource name must look like <domain>/<name> (e.g. {DEFAULT_RESOURCE_NAME}), "
                f"got {self.resource_name!r}"
            )
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or not 1 <= self.replicas <= 64:
            raise PluginConfigError(f"replicas must be an integer from 1 to 64, got {self.replicas!r}")
        if self.sharing is not None and not self.sharing.startswith(("amqp://", "amqps://")):
            raise PluginConfigError(f"sharing must be an amqp:// or amqps:// URL, got {redact_url(self.sharing)!r}")
        if not self.poll_interval_s > 0 or self.removed_grace_s < 0:
            raise PluginConfigError("poll interval must be > 0 s and the removal grace period >= 0 s")

    def __repr__(self) -> str:  # never print a secret (logs, tracebacks)
        from dataclasses import fields

        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "sharing" and value:
                value = redact_url(value)
            elif f.name in ("sharing_password", "job_secret") and value is not None:
                value = "<hidden>"
            shown.append(f"{f.name}={value!r}")
        return f"PluginOptions({', '.join(shown)})"

    @property
    def advertised_resource(self) -> str:
        if self.replicas > 1 and self.rename_by_default:
            return self.resource_name + ".shared"
        return self.resource_name

    @property
    def endpoint(self) -> str:
        """Socket file name of this plugin, relative to the device-plugin directory."""
        return self.advertised_resource.replace("/", "-") + ".sock"

    @property
    def mount_source_dir(self) -> str:
        return self.host_device_dir or self.device_dir


def load_plugin_config(path: str | os.PathLike[str], base: PluginOptions | None = None) -> PluginOptions:
    """Read the plugin's YAML config (modelled on NVIDIA's device-plugin config)::

    version: v1
    flags:
      resourceName: gpemu.io/emugpu
      deviceDir: /var/lib/gpemu/devices
    sharing:
      manager: amqp://gpemu:gpemu@10.0.0.5:5672/%2F
      timeSlicing:
        renameByDefault: false
        failRequestsGreaterThanOne: false
        resources:
          - name: gpemu.io/emugpu
            replicas: 4
    """
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except OSError as exc:
        raise PluginConfigError(f"cannot read plugin config {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PluginConfigError(f"plugin config {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise PluginConfigError(f"plugin config {p} must be a mapping with version/flags/sharing")
    unknown = set(data) - {"version", "flags", "sharing"}
    if unknown:
        raise PluginConfigError(f"plugin config {p}: unknown key(s) {sorted(unknown)}; valid: version, flags, sharing")
    if data.get("version", "v1") != "v1":
        raise PluginConfigError(f"plugin config {p}: version must be v1, got {data.get('version')!r}")
    opts = base or PluginOptions()
    changes: dict[str, Any] = {}
    flags = data.get("flags") or {}
    flag_map = {
        "resourceName": "resource_name",
        "deviceDir": "device_dir",
        "hostDeviceDir": "host_device_dir",
        "containerDeviceDir": "container_device_dir",
        "devicePluginDir": "device_plugin_dir",
        "stateDir": "state_dir",
        "pollInterval": "poll_interval_s",
        "removedGracePeriod": "removed_grace_s",
    }
    for key, value in flags.items():
        if key not in flag_map:
            raise PluginConfigError(f"plugin config {p}: unknown flag {key!r}; valid: {', '.join(flag_map)}")
        changes[flag_map[key]] = value
    sharing = data.get("sharing") or {}
    if "manager" in sharing:
        changes["sharing"] = sharing["manager"] or None
    slicing = sharing.get("timeSlicing") or {}
    resource = changes.get("resource_name", opts.resource_name)
    for entry in slicing.get("resources") or []:
        if not isinstance(entry, dict) or "name" not in entry or "replicas" not in entry:
            raise PluginConfigError(f"plugin config {p}: each timeSlicing resource needs name and replicas")
        if entry["name"] != resource:
            raise PluginConfigError(
                f"plugin config {p}: timeSlicing resource {entry['name']!r} is not served by this plugin "
                f"(it serves {resource!r})"
            )
        changes["replicas"] = entry["replicas"]
    if "renameByDefault" in slicing:
        changes["rename_by_default"] = bool(slicing["renameByDefault"])
    if "failRequestsGreaterThanOne" in slicing:
        changes["fail_requests_greater_than_one"] = bool(slicing["failRequestsGreaterThanOne"])
    return replace(opts, **changes)


@dataclass
class _DeviceState:
    device: EmuGpu | None  # last good content of the file
    health: str
    problem: str = ""
    missing_since: float | None = None


class _AllocationError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class EmuGpuPlugin(api_pb2_grpc.DevicePluginServicer):
    """One device plugin serving one resource. ``start()``, then ``stop()``."""

    def __init__(self, options: PluginOptions) -> None:
        self.options = options
        self._devices: dict[str, _DeviceState] = {}
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

    @property
    def record_path(self) -> Path:
        return Path(self.options.state_dir or self.options.device_plugin_dir) / ALLOCATION_RECORD

    # ------------------------------------------------------------------ lifecycle
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
                    new = _DeviceState(old.device if old else None, UNHEALTHY, str(item))
                elif not item.healthy:
                    new = _DeviceState(item, UNHEALTHY, "file says healthy: false")
                else:
                    new = _DeviceState(item, HEALTHY)
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
        for dev_id in sorted(self._devices, key=_index_of):
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
            _check_count(len(request.container_requests), MAX_CONTAINERS, "container requests")
            with self._cond:
                advertised = {d for d, _ in self._advertised_locked()}
            for creq in request.container_requests:
                available = _checked_ids(creq.available_deviceIDs, "available")
                must = _checked_ids(creq.must_include_deviceIDs, "must-include")
                unknown = [d for d in must if d not in advertised]
                if unknown:
                    raise _AllocationError(
                        grpc.StatusCode.NOT_FOUND,
                        f"must-include id(s) {_show_ids(unknown)} are not advertised by this node",
                    )
                # Only ids this plugin advertises may come back, whatever the request lists.
                available = [d for d in dict.fromkeys(available) if d in advertised]
                chosen = self._prefer(available, list(dict.fromkeys(must)), creq.allocation_size)
                responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        except _AllocationError as exc:
            context.abort(exc.code, exc.message)
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def _prefer(self, available: list[str], must: list[str], size: int) -> list[str]:
        """Spread a request over distinct emuGPUs, least-shared first.

        With time-slicing the kubelet's ``available`` list tells how busy each emuGPU is (its
        replicas not in the list are taken), so prefer emuGPUs with the most free replicas and
        avoid putting two replicas of one emuGPU in the same container while others are free.
        """
        if size < 1:
            raise _AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"allocation size must be >= 1, got {size}")
        if size > len(available):
            raise _AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"asked for {size} emuGPU(s) but only {len(available)} are available",
            )
        missing = [d for d in must if d not in available]
        if missing or len(must) > size:
            raise _AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"must-include devices {_show_ids(must)} must be available and at most {size}",
            )
        free: dict[str, list[str]] = {}
        for dev_id in available:
            free.setdefault(_physical(dev_id), []).append(dev_id)
        chosen = list(must)
        for dev_id in must:
            free[_physical(dev_id)].remove(dev_id)
        used = {_physical(d) for d in chosen}
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
            best = min(fresh, key=lambda p: (-len(free[p]), _index_of(p)))
            chosen.append(free[best].pop(0))
            used.add(best)
        return chosen

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        try:
            response = self.allocate(request)
        except _AllocationError as exc:
            log.warning("Allocate refused: %s", exc.message)
            context.abort(exc.code, exc.message)
        except OSError as exc:  # the credentials directory: the node's problem, said once, plainly
            log.error("Allocate failed: %s: %s", exc.filename, exc.strerror)
            context.abort(grpc.StatusCode.INTERNAL, f"the device plugin cannot write {exc.filename}: {exc.strerror}")
        return response

    def allocate(self, request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        """Build the containers' mounts and environment; _AllocationError for bad requests."""
        _check_count(len(request.container_requests), MAX_CONTAINERS, "container requests")
        containers = [_checked_ids(c.devices_ids, "device") for c in request.container_requests]
        responses = []
        with self._cond:
            advertised = dict(self._advertised_locked())
            states = dict(self._devices)
        for ids in containers:
            responses.append(self._allocate_container(ids, advertised, states))
        self._record(containers, responses)
        return api_pb2.AllocateResponse(container_responses=responses)

    def _allocate_container(
        self, ids: list[str], advertised: dict[str, str], states: dict[str, _DeviceState]
    ) -> api_pb2.ContainerAllocateResponse:
        if not ids:
            raise _AllocationError(grpc.StatusCode.INVALID_ARGUMENT, "Allocate request names no device ids")
        if len(ids) > len(advertised):
            raise _AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"asked for {len(ids)} {self.options.advertised_resource} but this node advertises {len(advertised)}",
            )
        dupes = sorted({d for d in ids if ids.count(d) > 1})
        if dupes:
            raise _AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"device id(s) listed twice: {_show_ids(dupes)}")
        unknown = [d for d in ids if d not in advertised]
        if unknown:
            known = list(advertised)
            shown = ", ".join(known[:8]) + (f", ... ({len(known)} in all)" if len(known) > 8 else "")
            raise _AllocationError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown emuGPU id(s) {_show_ids(unknown)}; this node advertises: {shown or 'none'}",
            )
        if self.options.fail_requests_greater_than_one and self.options.replicas > 1 and len(ids) > 1:
            raise _AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"time-sliced emuGPUs are configured with failRequestsGreaterThanOne: request 1 "
                f"{self.options.advertised_resource}, not {len(ids)}",
            )
        physical: list[str] = []
        for dev_id in ids:
            p = _physical(dev_id)
            if p not in physical:
                physical.append(p)
        physical.sort(key=_index_of)
        bad = [p for p in physical if states[p].health != HEALTHY or states[p].device is None]
        if bad:
            why = "; ".join(f"{p}: {states[p].problem or 'unhealthy'}" for p in bad)
            raise _AllocationError(grpc.StatusCode.FAILED_PRECONDITION, f"emuGPU(s) not healthy: {why}")
        devices = [states[p].device for p in physical]
        return self.container_response(ids, devices)  # type: ignore[arg-type]

    def container_response(self, ids: list[str], devices: list[EmuGpu]) -> api_pb2.ContainerAllocateResponse:
        """Mounts and environment for a container given these emuGPUs (and, with a sharing
        manager, the container's own sharing credentials)."""
        o = self.options
        envs = {
            "GPEMU_ENABLE": "1",
            "GPEMU_GPUS": ",".join(d.gpu for d in devices),
            "GPEMU_NUM_GPUS": str(len(devices)),
            "GPEMU_VISIBLE_DEVICES": ",".join(d.id for d in devices),
            "GPEMU_DEVICE_DIR": o.container_device_dir,
        }
        mounts = [
            api_pb2.Mount(
                container_path=str(device_file(o.container_device_dir, d.index)),
                host_path=str(device_file(o.mount_source_dir, d.index)),
                read_only=True,
            )
            for d in devices
        ]
        if o.sharing:
            url, password = _split_password(o.sharing)
            envs["GPEMU_SHARING"] = url
            job_id, host_file = self._write_credentials(len(devices), o.sharing_password or password)
            envs["GPEMU_JOB_ID"] = job_id
            mounts.append(
                api_pb2.Mount(
                    container_path=str(Path(o.container_device_dir) / _CREDENTIALS_NAME),
                    host_path=host_file,
                    read_only=True,
                )
            )
        return api_pb2.ContainerAllocateResponse(
            envs=envs, mounts=mounts, annotations={"gpemu.io/emugpu-ids": ",".join(ids)}
        )

    def _write_credentials(self, n_devices: int, password: str | None) -> tuple[str, str]:
        """A fresh job id, its keys and the broker password in a file for one container.

        Returns (job id, the file's path as the node sees it). The directory is root-only; the
        file itself is readable once bind-mounted, whatever user the container runs as."""
        o = self.options
        job_id = f"k8s-{secrets.token_hex(8)}"
        keys = {}
        if o.job_secret is not None:
            # The names the sharing client uses: the job id, or "<id>.<index>" per emuGPU.
            for name in [job_id] + [f"{job_id}.{i}" for i in range(n_devices)]:
                keys[name] = derive_job_key(o.job_secret, name).hex()
        directory = Path(o.credentials_dir)
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        path = directory / f"{job_id}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        with os.fdopen(fd, "w") as fh:
            json.dump({"job_id": job_id, "keys": keys, "amqp_password": password}, fh)
        self._prune_credentials(directory)
        return job_id, str(Path(o.host_credentials_dir or o.credentials_dir) / path.name)

    def _prune_credentials(self, directory: Path) -> None:
        try:
            files = sorted(directory.glob("k8s-*.json"), key=lambda f: f.stat().st_mtime)
        except OSError:
            return
        for old in files[:-CREDENTIALS_KEEP]:
            try:
                old.unlink()
            except OSError:
                pass

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()

    # ------------------------------------------------------------------ allocation record
    def _load_record(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.record_path.read_text())
            return list(data.get("allocations", []))
        except FileNotFoundError:
            return []
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("ignoring unreadable allocation record %s: %s", self.record_path, exc)
            return []

    def _record(self, containers: list[list[str]], responses: list[api_pb2.ContainerAllocateResponse]) -> None:
        with self._record_lock:
            self._record_locked(containers, responses)

    def _record_locked(self, containers: list[list[str]], responses: list[api_pb2.ContainerAllocateResponse]) -> None:
        for ids, resp in zip(containers, responses, strict=False):
            entry = {
                "devices": ids,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "envs": {k: (redact_url(v) if k == "GPEMU_SHARING" else v) for k, v in sorted(resp.envs.items())},
                "mounts": [m.host_path for m in resp.mounts],
            }
            # Keep the newest record per device set (the kubelet may re-allocate the same ids).
            self.allocations = ([a for a in self.allocations if a.get("devices") != ids] + [entry])[-1000:]
        path = self.record_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({"allocations": self.allocations}, indent=1))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not write allocation record %s: %s", path, exc)


# Two facts of the sharing protocol the plugin needs, restated here because gpemu.k8s and the
# sharing package are independent of each other (.importlinter); tests/test_k8s_plugin.py checks
# them equal to gpemu.integrations.sharing's.
_CREDENTIALS_NAME = "sharing.json"  # the sharing client's CREDENTIALS_FILE


def derive_job_key(secret: bytes, job_id: str) -> bytes:
    """The sharing manager's key of ``job_id`` under its job secret (protocol.derive_job_key)."""
    import hashlib
    import hmac

    return hmac.new(secret, b"gpemu-sharing-job\0" + job_id.encode(), hashlib.sha256).digest()


def _split_password(url: str) -> tuple[str, str | None]:
    """``amqp://user:pw@host/`` -> (``amqp://user@host/``, ``pw``); the password leaves the URL."""
    from urllib.parse import unquote

    if "://" not in url or "@" not in url:
        return url, None
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    if ":" not in creds:
        return url, None
    user, password = creds.split(":", 1)
    return f"{scheme}://{user}@{host}", unquote(password)


def _check_count(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise _AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"{n} {what} in one call; at most {limit}")


def _checked_ids(ids: Any, what: str) -> list[str]:
    """The ids of one container request, refused (without echoing them) when oversized."""
    _check_count(len(ids), MAX_IDS, f"{what} ids")
    out = list(ids)
    for dev_id in out:
        if len(dev_id) > MAX_ID_LEN:
            raise _AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a {what} id of {len(dev_id)} characters is longer than {MAX_ID_LEN}; "
                f"emuGPU ids look like emugpu-0 or emugpu-0::1",
            )
    return out


def _show_ids(ids: list[str]) -> str:
    """At most five ids of a refused request, each cut to 40 characters."""
    shown = [d if len(d) <= 40 else d[:40] + "..." for d in ids[:5]]
    return ", ".join(shown) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


def _physical(dev_id: str) -> str:
    return dev_id.split(REPLICA_SEP, 1)[0]


def _index_of(dev_id: str) -> tuple[int, int]:
    phys, _, rep = dev_id.partition(REPLICA_SEP)
    try:
        return int(phys.rsplit("-", 1)[1]), int(rep or 0)
    except (IndexError, ValueError):
        return (1 << 30, 0)


def _stat_key(path: Path) -> tuple[int, int] | None:
    """Identity of a socket file: changes when it is deleted and re-created."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns
