"""The device plugin's settings: :class:`PluginOptions` (CLI flags) and its YAML config file
(modelled on NVIDIA's device-plugin config: ``sharing.timeSlicing.resources[].replicas``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpemu.units import redact_url

from .devices import DEFAULT_DEVICE_DIR

__all__ = [
    "PluginOptions",
    "PluginConfigError",
    "load_plugin_config",
    "DEFAULT_RESOURCE_NAME",
    "DEFAULT_DEVICE_PLUGIN_DIR",
    "CONTAINER_DEVICE_DIR",
    "DEFAULT_CREDENTIALS_DIR",
]

DEFAULT_RESOURCE_NAME = "gpemu.io/emugpu"
DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
CONTAINER_DEVICE_DIR = "/var/run/gpemu/devices"
DEFAULT_CREDENTIALS_DIR = "/var/lib/gpemu/credentials"

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
