"""The one configuration object of an emulated run.

Every setting reaches the engine through :class:`EmuConfig`. It is built from, in rising
priority, the defaults below, the environment (``GPEMU_*``), and explicit arguments
(``gpemu.patch(...)`` keyword arguments or ``gpemu run`` flags). This module is the only place
that reads environment variables: everything else receives an ``EmuConfig``.

``EmuConfig.to_env()`` is the inverse of ``from_env``: ``gpemu run`` exports it so child
processes (DataLoader workers, ``torchrun`` and ``mp.spawn`` children) configure themselves the
same way.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

__all__ = ["EmuConfig", "ConfigError", "ENV_PREFIX"]

ENV_PREFIX = "GPEMU_"


class ConfigError(ValueError):
    """A setting has a value gpemu cannot use; the message says which values are valid."""


_MEMORY_MODES = ("tracked", "profiled")
_GRANULARITIES = ("iteration", "sync", "forward-backward")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EmuConfig:
    """Settings of one emulated run. Field docs name the environment variable that sets each."""

    # GPEMU_GPU: GPU model every emulated device has (name or alias, e.g. "V100", "a100").
    gpu: str = "V100"
    # GPEMU_NUM_GPUS: how many emulated GPUs the process sees.
    num_gpus: int = 1
    # GPEMU_GPUS: per-device GPU models, comma separated (overrides gpu/num_gpus), e.g. from k8s.
    device_gpus: tuple[str, ...] | None = None
    # GPEMU_MODEL: take GPU time for the user's model from this dataset model (e.g. "resnet50")
    # instead of identifying it from its structure.
    model: str | None = None
    # GPEMU_DB: SQLAlchemy URL of the profile database; None means the per-user SQLite default.
    db_url: str | None = None
    # GPEMU_DATA_DIR: where the default database is built (default: $XDG_DATA_HOME/gpemu).
    data_dir: str | None = None
    # GPEMU_MEMORY: "tracked" (count every emulated allocation) or "profiled" (use the
    # database's measured peak/persistent memory for an identified model).
    memory: str = "tracked"
    # GPEMU_REPLAY: replay a module's recorded forward/backward instead of re-dispatching every
    # op (the fast path that keeps the emulator's own host time small).
    replay: bool = True
    # GPEMU_PINNED: back pin_memory() with a page-locked (mlock) pool.
    pinned: bool = True
    # GPEMU_SHARING: amqp:// URL of a sharing manager; GPU time then goes through it.
    sharing: str | None = None
    # GPEMU_SHARING_GRANULARITY: what one request to the sharing manager covers.
    sharing_granularity: str = "iteration"
    # GPEMU_JOB_ID: this job's id towards the sharing manager (default: host-pid).
    job_id: str | None = None
    # GPEMU_VISIBLE_DEVICES: emuGPU ids allocated to this process (set by the k8s plugin).
    visible_devices: tuple[str, ...] | None = None
    # GPEMU_DEVICE_DIR: directory holding the emuGPU files named in visible_devices.
    device_dir: str | None = None
    # GPEMU_SUMMARY: print a per-GPU summary at exit.
    summary: bool = True
    # GPEMU_METRICS: write the summary as JSON to this path at exit.
    metrics_path: str | None = None
    # GPEMU_TRACE: write a Chrome trace (Perfetto / chrome://tracing) to this path at exit.
    trace_path: str | None = None
    # GPEMU_DEBUG: show tracebacks and log more.
    debug: bool = False
    # GPEMU_ENABLE: set by `gpemu run`; the sitecustomize bootstrap patches every Python process
    # started with it (the script, DataLoader spawn workers, torchrun / mp.spawn children).
    enable: bool = False
    # Anything else the user passed that a component may understand (kept, not validated here).
    extra: Mapping[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "EmuConfig":
        """Build from the environment (``os.environ`` when ``env`` is None), then overrides.

        Overrides whose value is None are ignored, so CLI flags left unset fall through to the
        environment and defaults.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "extra":
                continue
            raw = env.get(_env_name(f.name))
            if raw is not None:
                values[f.name] = raw
        xdg = env.get("XDG_DATA_HOME")
        if "data_dir" not in values and xdg:
            values["data_dir"] = str(Path(xdg) / "gpemu")
        extra = dict(overrides.pop("extra", None) or {})
        known = {f.name for f in fields(cls)}
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in known:
                raise ConfigError(
                    f"unknown setting {key!r}; valid settings: {', '.join(sorted(known - {'extra'}))}"
                )
            values[key] = value
        return cls(**{k: _coerce(k, v) for k, v in values.items()}, extra=extra)

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or isinstance(self.num_gpus, bool) or not 1 <= self.num_gpus <= 64:
            raise ConfigError(f"num_gpus must be an integer from 1 to 64, got {self.num_gpus!r}")
        if not isinstance(self.gpu, str) or not self.gpu.strip():
            raise ConfigError("gpu must be a GPU name such as 'V100' (see `gpemu gpus`)")
        if self.memory not in _MEMORY_MODES:
            raise ConfigError(f"memory must be one of {', '.join(_MEMORY_MODES)}, got {self.memory!r}")
        if self.sharing_granularity not in _GRANULARITIES:
            raise ConfigError(
                f"sharing_granularity must be one of {', '.join(_GRANULARITIES)}, got {self.sharing_granularity!r}"
            )
        if self.sharing is not None and not self.sharing.startswith(("amqp://", "amqps://")):
            raise ConfigError(f"sharing must be an amqp:// or amqps:// URL, got {_redact(self.sharing)!r}")
        if self.device_gpus is not None and len(self.device_gpus) == 0:
            raise ConfigError("device_gpus, when given, must name at least one GPU")
        if self.device_gpus is not None and self.num_gpus != len(self.device_gpus):
            # device_gpus decides the count; keep num_gpus consistent with it.
            object.__setattr__(self, "num_gpus", len(self.device_gpus))

    # ------------------------------------------------------------------ derived
    @property
    def gpus_per_device(self) -> tuple[str, ...]:
        """The GPU model name of each emulated device, index order."""
        return self.device_gpus if self.device_gpus is not None else (self.gpu,) * self.num_gpus

    @property
    def default_data_dir(self) -> Path:
        if self.data_dir:
            return Path(self.data_dir).expanduser()
        return Path.home() / ".local" / "share" / "gpemu"

    def replace(self, **changes: Any) -> "EmuConfig":
        return dataclasses.replace(self, **{k: _coerce(k, v) for k, v in changes.items()})

    def to_env(self) -> dict[str, str]:
        """Environment that makes ``from_env`` rebuild this config in a child process."""
        out: dict[str, str] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool):
                text = "1" if value else "0"
            elif isinstance(value, tuple):
                text = ",".join(value)
            else:
                text = str(value)
            out[_env_name(f.name)] = text
        return out

    def describe(self) -> str:
        """A one-line, credential-free description for logs."""
        gpus = ",".join(self.gpus_per_device)
        share = f" sharing={_redact(self.sharing)}" if self.sharing else ""
        return f"gpus=[{gpus}] model={self.model or 'auto'} memory={self.memory}{share}"


def _env_name(field_name: str) -> str:
    special = {"db_url": "DB", "metrics_path": "METRICS", "trace_path": "TRACE", "device_gpus": "GPUS"}
    return ENV_PREFIX + special.get(field_name, field_name.upper())


def _coerce(name: str, value: Any) -> Any:
    """Turn strings from the environment / CLI into the field's type, with clear errors."""
    if name in ("num_gpus",):
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise ConfigError(f"num_gpus must be an integer from 1 to 64, got {value!r}") from None
        return value
    if name in ("replay", "pinned", "summary", "debug", "enable"):
        if isinstance(value, str):
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ConfigError(f"{name} must be a boolean (1/0, true/false, yes/no, on/off), got {value!r}")
        return bool(value)
    if name in ("device_gpus", "visible_devices"):
        if isinstance(value, str):
            items = tuple(v.strip() for v in value.split(",") if v.strip())
            return items or None
        return tuple(value) if value is not None else None
    if name in ("model", "db_url", "sharing", "job_id", "metrics_path", "trace_path", "device_dir", "data_dir"):
        if isinstance(value, str):
            value = value.strip()
            return value or None
        return None if value is None else str(value)
    if name in ("memory", "sharing_granularity") and isinstance(value, str):
        return value.strip().lower()
    return value


def _redact(url: str | None) -> str:
    """Hide the password in a URL so credentials never reach logs."""
    if not url or "@" not in url or "://" not in url:
        return url or ""
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
