"""``Allocate``: what a container gets for its emuGPUs (mounts, environment, its own sharing
credentials), the allocation record, and the checks every RPC makes on its input.

Hostile input: every RPC checks sizes before looking anything up (at most 64 containers per
request, 4096 ids per container, 128 characters per id) and quotes at most a few dozen
characters of what it refuses.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpemu.units import redact_url

from . import api_pb2
from .devices import EmuGpu, device_file
from .options import PluginOptions

__all__ = [
    "Allocator",
    "AllocationError",
    "DeviceState",
    "derive_job_key",
    "split_password",
    "check_count",
    "checked_ids",
    "show_ids",
    "physical_id",
    "index_of",
    "CREDENTIALS_NAME",
    "HEALTHY",
    "UNHEALTHY",
    "REPLICA_SEP",
    "MAX_ID_LEN",
    "MAX_IDS",
    "MAX_CONTAINERS",
]

log = logging.getLogger("gpemu.k8s.plugin")

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
REPLICA_SEP = "::"
CREDENTIALS_KEEP = 1000  # per-container credential files kept (the oldest are removed)
# Input limits of the RPCs: far above any real node, far below what could hurt the plugin.
MAX_ID_LEN = 128
MAX_IDS = 4096
MAX_CONTAINERS = 64


ALLOCATION_RECORD = "gpemu-allocations.json"


@dataclass
class DeviceState:
    device: EmuGpu | None  # last good content of the file
    health: str
    problem: str = ""
    missing_since: float | None = None


class AllocationError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Allocator:
    """The Allocate half of :class:`~.plugin.EmuGpuPlugin`: given the advertised devices, the
    containers' mounts, environment and credentials, and the record of every allocation."""

    options: PluginOptions
    allocations: list[dict[str, Any]]
    _record_lock: threading.Lock
    _cond: threading.Condition
    _devices: dict[str, DeviceState]

    def _advertised_locked(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    @property
    def record_path(self) -> Path:
        return Path(self.options.state_dir or self.options.device_plugin_dir) / ALLOCATION_RECORD

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        try:
            response = self.allocate(request)
        except AllocationError as exc:
            log.warning("Allocate refused: %s", exc.message)
            context.abort(exc.code, exc.message)
        except OSError as exc:  # the credentials directory: the node's problem, said once, plainly
            log.error("Allocate failed: %s: %s", exc.filename, exc.strerror)
            context.abort(grpc.StatusCode.INTERNAL, f"the device plugin cannot write {exc.filename}: {exc.strerror}")
        return response

    def allocate(self, request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
        """Build the containers' mounts and environment; AllocationError for bad requests."""
        check_count(len(request.container_requests), MAX_CONTAINERS, "container requests")
        containers = [checked_ids(c.devices_ids, "device") for c in request.container_requests]
        responses = []
        with self._cond:
            advertised = dict(self._advertised_locked())
            states = dict(self._devices)
        for ids in containers:
            responses.append(self._allocate_container(ids, advertised, states))
        self._record(containers, responses)
        return api_pb2.AllocateResponse(container_responses=responses)

    def _allocate_container(
        self, ids: list[str], advertised: dict[str, str], states: dict[str, DeviceState]
    ) -> api_pb2.ContainerAllocateResponse:
        if not ids:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, "Allocate request names no device ids")
        if len(ids) > len(advertised):
            raise AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"asked for {len(ids)} {self.options.advertised_resource} but this node advertises {len(advertised)}",
            )
        dupes = sorted({d for d in ids if ids.count(d) > 1})
        if dupes:
            raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"device id(s) listed twice: {show_ids(dupes)}")
        unknown = [d for d in ids if d not in advertised]
        if unknown:
            known = list(advertised)
            shown = ", ".join(known[:8]) + (f", ... ({len(known)} in all)" if len(known) > 8 else "")
            raise AllocationError(
                grpc.StatusCode.NOT_FOUND,
                f"unknown emuGPU id(s) {show_ids(unknown)}; this node advertises: {shown or 'none'}",
            )
        if self.options.fail_requests_greater_than_one and self.options.replicas > 1 and len(ids) > 1:
            raise AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"time-sliced emuGPUs are configured with failRequestsGreaterThanOne: request 1 "
                f"{self.options.advertised_resource}, not {len(ids)}",
            )
        physical: list[str] = []
        for dev_id in ids:
            p = physical_id(dev_id)
            if p not in physical:
                physical.append(p)
        physical.sort(key=index_of)
        bad = [p for p in physical if states[p].health != HEALTHY or states[p].device is None]
        if bad:
            why = "; ".join(f"{p}: {states[p].problem or 'unhealthy'}" for p in bad)
            raise AllocationError(grpc.StatusCode.FAILED_PRECONDITION, f"emuGPU(s) not healthy: {why}")
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
            url, password = split_password(o.sharing)
            envs["GPEMU_SHARING"] = url
            job_id, host_file = self._write_credentials(len(devices), o.sharing_password or password)
            envs["GPEMU_JOB_ID"] = job_id
            mounts.append(
                api_pb2.Mount(
                    container_path=str(Path(o.container_device_dir) / CREDENTIALS_NAME),
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
CREDENTIALS_NAME = "sharing.json"  # the sharing client's CREDENTIALS_FILE


def derive_job_key(secret: bytes, job_id: str) -> bytes:
    """The sharing manager's key of ``job_id`` under its job secret (protocol.derive_job_key)."""
    import hashlib
    import hmac

    return hmac.new(secret, b"gpemu-sharing-job\0" + job_id.encode(), hashlib.sha256).digest()


def split_password(url: str) -> tuple[str, str | None]:
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


def check_count(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise AllocationError(grpc.StatusCode.INVALID_ARGUMENT, f"{n} {what} in one call; at most {limit}")


def checked_ids(ids: Any, what: str) -> list[str]:
    """The ids of one container request, refused (without echoing them) when oversized."""
    check_count(len(ids), MAX_IDS, f"{what} ids")
    out = list(ids)
    for dev_id in out:
        if len(dev_id) > MAX_ID_LEN:
            raise AllocationError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a {what} id of {len(dev_id)} characters is longer than {MAX_ID_LEN}; "
                f"emuGPU ids look like emugpu-0 or emugpu-0::1",
            )
    return out


def show_ids(ids: list[str]) -> str:
    """At most five ids of a refused request, each cut to 40 characters."""
    shown = [d if len(d) <= 40 else d[:40] + "..." for d in ids[:5]]
    return ", ".join(shown) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


def physical_id(dev_id: str) -> str:
    return dev_id.split(REPLICA_SEP, 1)[0]


def index_of(dev_id: str) -> tuple[int, int]:
    phys, _, rep = dev_id.partition(REPLICA_SEP)
    try:
        return int(phys.rsplit("-", 1)[1]), int(rep or 0)
    except (IndexError, ValueError):
        return (1 << 30, 0)
