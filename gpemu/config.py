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
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .units import redact_url

if TYPE_CHECKING:  # pragma: no cover
    from .clock import Clock
    from .costmodel.topology import Cluster

__all__ = [
    "EmuConfig",
    "Tuning",
    "ConfigError",
    "ENV_PREFIX",
    "GRANULARITIES",
    "CLOCKS",
    "VALUE_MODES",
    "values_note",
    "amqp_url_problem",
    "fill_amqp_password",
    "costmodel_cache_dir",
    "load_cluster",
]

ENV_PREFIX = "GPEMU_"


class ConfigError(ValueError):
    """A setting has a value gpemu cannot use; the message says which values are valid."""


_MEMORY_MODES = ("tracked", "profiled")
# What a sharing manager accepts from a job (gpemu.integrations.sharing.protocol's MAX_BYTES,
# MAX_ID_LEN, MIN_WEIGHT, MAX_WEIGHT; the core cannot import that plugin).
SHARING_MAX_BYTES = 1 << 50
SHARING_MAX_ID_LEN = 200
SHARING_MIN_WEIGHT, SHARING_MAX_WEIGHT = 1e-3, 1e6
# What one request to a sharing manager covers (the time engine hands work over at these points).
GRANULARITIES = ("iteration", "sync", "forward-backward")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Tuning:
    """Knobs of the emulator's own machinery. Defaults are what runs use; benchmarks turn them
    for A/B comparisons (``GPEMU_TUNING="hub_after=-1,spare_limit=0"``). None changes emulated
    GPU time or memory, only the emulator's own host time (and, for ``spin_margin`` and
    ``return_allowance``, how precisely the host meets GPU deadlines)."""

    # Replayed loss.backward() may run without the autograd engine for an ordinary step's graph.
    direct_backward: bool = True
    # Plain backwards of a recording before its replays pass one "hub" leaf to autograd instead
    # of every parameter; -1 never.
    hub_after: int = 2
    # Gradient wrappers pooled for reuse between steps at most; 0 turns reuse (and gradient
    # sets) off.
    spare_limit: int = 100_000
    # Seconds before a deadline at which a host wait stops sleeping and spins.
    spin_margin: float = 1e-3
    # Host seconds after a sync wait forgiven as the emulator's own return path: one value or
    # (after a short wait, after a long one); None calibrates it once per process.
    return_allowance: float | tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hub_after, int) or isinstance(self.hub_after, bool) or self.hub_after < -1:
            raise ConfigError(f"tuning hub_after must be an integer >= -1, got {self.hub_after!r}")
        if not isinstance(self.spare_limit, int) or isinstance(self.spare_limit, bool) or self.spare_limit < 0:
            raise ConfigError(f"tuning spare_limit must be an integer >= 0, got {self.spare_limit!r}")
        if not isinstance(self.spin_margin, (int, float)) or not 0 <= self.spin_margin <= 0.1:
            raise ConfigError(f"tuning spin_margin must be seconds in [0, 0.1], got {self.spin_margin!r}")

    @classmethod
    def parse(cls, text: str) -> Tuning:
        """``"hub_after=-1, spare_limit=0"`` (the ``GPEMU_TUNING`` form) -> Tuning."""
        values: dict[str, Any] = {}
        known = {f.name: f for f in fields(cls)}
        for item in (x.strip() for x in text.split(",")):
            if not item:
                continue
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise ConfigError(f"tuning entries are name=value with names {', '.join(known)}; got {item!r}")
            values[key] = _parse_tuning_value(key, raw.strip())
        return cls(**values)

    def to_text(self) -> str:
        """The non-default knobs in :meth:`parse`'s form ("" when all are defaults)."""
        default = Tuning()
        items = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                text = ";".join(str(v) for v in value) if isinstance(value, tuple) else str(value)
                items.append(f"{f.name}={text}")
        return ",".join(items)


def _parse_tuning_value(key: str, raw: str) -> Any:
    try:
        if key == "direct_backward":
            return _coerce("replay", raw)  # the boolean spellings of every other setting
        if key in ("hub_after", "spare_limit"):
            return int(raw)
        if key == "spin_margin":
            return float(raw)
        if raw.lower() in ("", "none", "auto"):
            return None
        parts = tuple(float(v) for v in raw.split(";"))
        return parts[0] if len(parts) == 1 else parts
    except ValueError:
        raise ConfigError(f"tuning {key} has a value of the wrong type: {raw!r}") from None


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
    # GPEMU_SHARING_WEIGHT: this job's weight under the manager's weighted policies.
    sharing_weight: float = 1.0
    # GPEMU_SHARING_LEASE_S: seconds the manager keeps this job's emuGPU reservation without
    # hearing from it (a killed job's memory is freed after this at the latest).
    sharing_lease_s: float = 10.0
    # GPEMU_SHARING_PERSISTENT_BYTES: GPU memory to register with the manager instead of what the
    # job's tracker holds at its first request (None: the tracked amount).
    sharing_persistent_bytes: int | None = None
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
    # GPEMU_TUNING: the emulator's own knobs (see Tuning), e.g. "hub_after=-1,spare_limit=0".
    tuning: Tuning = field(default_factory=Tuning)
    # GPEMU_CLUSTER: the cluster the run's GPUs are in: a preset (dgx-h100, ...) or a YAML file
    # (docs/clusters.md). Unset: one node of the run's GPUs (as many nodes as torchrun says).
    cluster: str | None = None
    # GPEMU_NODES: how many nodes the cluster has (wins over the description's count).
    nodes: int | None = None
    # GPEMU_NODE_RANK (else torchrun's GROUP_RANK): the node this process runs on. Unset: ranks
    # fill nodes in order (rank // GPUs per node).
    node_rank: int | None = None
    # GPEMU_WORLD_SIZE: more GPUs than processes: the job has this many ranks, and `processes`
    # processes run them, each standing for world_size / processes identical ranks (a symmetric
    # job: data parallel, FSDP, TP; docs/clusters.md). Unset: one process per rank (torchrun).
    world_size: int | None = None
    # GPEMU_PROCESSES: how many processes run the world_size ranks (one per pipeline stage).
    processes: int = 1
    # GPEMU_FOLD_PROCESS: which of those processes this one is (set by `gpemu run` per process).
    fold_process: int = 0
    # GPEMU_CLOCK: the host clock of the run: "real" (default: the wall clock) or "virtual" (each
    # thread's CPU time; waits jump to their deadline; see docs/time.md). Tests and overhead
    # benchmarks may pass a gpemu.clock.VirtualClock object instead (not sent to child processes).
    clock: Clock | str | None = field(default=None, compare=False)
    # GPEMU_CLOCK_ORIGIN: where virtual time starts for every process of a run (perf_counter
    # seconds, i.e. CLOCK_MONOTONIC on Linux); set by `gpemu run --clock virtual`, None: this
    # process's own start.
    clock_origin: float | None = field(default=None, compare=False)
    # "virtual" when `clock` asks for virtual time, else "real": compared between runs.
    time_mode: str = field(default="real", init=False)
    # GPEMU_HOST: the host that issues the GPU work (gpemu.time.launch): "this" (this machine's
    # eager dispatch, measured once, plus the CUDA build's per-op work), a speed relative to it
    # ("0.7x"), a measured host's preset ("h100-xeon"), a host recorded in the database by
    # `gpemu profile --host-side` ("db:NAME"), or "none" (the default: no modelled host time; the
    # cost model's fitted per-op host term stays in GPU prices until the curves are refitted
    # without it).
    host: str = "none"
    # GPEMU_VALUES: what emulated tensors hold: "placeholders" (default: no values; a loss reads
    # 0.000) or "real" (every tensor also carries its values, computed on the CPU: a CPU-speed
    # run; emulated times and memory unchanged; implies clock="virtual" unless a clock is given).
    values: str = "placeholders"

    # ------------------------------------------------------------------ building
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> EmuConfig:
        """Build from the environment (``os.environ`` when ``env`` is None), then overrides.

        Overrides whose value is None are ignored, so CLI flags left unset fall through to the
        environment and defaults.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in _NOT_IN_ENV:
                continue
            raw = env.get(_env_name(f.name))
            if raw is not None:
                values[f.name] = raw
        xdg = env.get("XDG_DATA_HOME")
        if "data_dir" not in values and xdg:
            values["data_dir"] = str(Path(xdg) / "gpemu")
        if "node_rank" not in values and env.get("GROUP_RANK"):
            values["node_rank"] = env["GROUP_RANK"]  # torchrun's node rank, for its workers
        known = {f.name for f in fields(cls) if f.init}
        for key, value in overrides.items():
            if value is None:
                continue
            if key not in known:
                raise ConfigError(f"unknown setting {key!r}; valid settings: {', '.join(sorted(known))}")
            values[key] = value
        coerced = {k: _coerce(k, v) for k, v in values.items()}
        if coerced.get("cluster"):
            # The cluster says which GPUs it has and how many a node holds, unless the run says.
            described = load_cluster(coerced["cluster"], coerced.get("nodes"))
            coerced.setdefault("gpu", described.gpu)
            if "num_gpus" not in coerced and "device_gpus" not in coerced:
                coerced["num_gpus"] = min(described.gpus_per_node, 64)
        elif isinstance(coerced.get("world_size"), int) and "num_gpus" not in coerced and "device_gpus" not in coerced:
            # A folded run without a cluster: nodes of 8 GPUs (the emulated ranks' neighbours)
            coerced["num_gpus"] = max(1, min(8, coerced["world_size"]))
        return cls(**coerced)

    def __post_init__(self) -> None:
        if not isinstance(self.num_gpus, int) or isinstance(self.num_gpus, bool) or not 1 <= self.num_gpus <= 64:
            raise ConfigError(f"num_gpus must be an integer from 1 to 64, got {self.num_gpus!r}")
        if not isinstance(self.gpu, str) or not self.gpu.strip():
            raise ConfigError("gpu must be a GPU name such as 'V100' (see `gpemu gpus`)")
        if self.memory not in _MEMORY_MODES:
            raise ConfigError(f"memory must be one of {', '.join(_MEMORY_MODES)}, got {self.memory!r}")
        if self.sharing_granularity not in GRANULARITIES:
            raise ConfigError(
                f"sharing_granularity must be one of {', '.join(GRANULARITIES)}, got {self.sharing_granularity!r}"
            )
        if self.sharing is not None and not self.sharing.startswith(("amqp://", "amqps://")):
            raise ConfigError(f"sharing must be an amqp:// or amqps:// URL, got {redact_url(self.sharing)!r}")
        if (
            not isinstance(self.sharing_weight, (int, float))
            or isinstance(self.sharing_weight, bool)
            or not SHARING_MIN_WEIGHT <= self.sharing_weight <= SHARING_MAX_WEIGHT
        ):
            raise ConfigError(
                f"sharing_weight must be a number from {SHARING_MIN_WEIGHT:g} to {SHARING_MAX_WEIGHT:g}, "
                f"got {self.sharing_weight!r}"
            )
        if (
            not isinstance(self.sharing_lease_s, (int, float))
            or isinstance(self.sharing_lease_s, bool)
            or not 0.5 <= self.sharing_lease_s <= 3600
        ):
            raise ConfigError(f"sharing_lease_s must be seconds from 0.5 to 3600, got {self.sharing_lease_s!r}")
        self._check_sharing_ids()
        if not isinstance(self.tuning, Tuning):
            raise ConfigError(f"tuning must be a gpemu.config.Tuning, got {type(self.tuning).__name__}")
        if self.device_gpus is not None and len(self.device_gpus) == 0:
            raise ConfigError("device_gpus, when given, must name at least one GPU")
        if self.device_gpus is not None and len(self.device_gpus) > 64:
            raise ConfigError(f"device_gpus names {len(self.device_gpus)} GPUs; at most 64 per process")
        if self.data_dir is not None:
            _expanded_dir(self.data_dir)
        self._check_values()
        self._check_clock()
        _check_host(self.host)
        if self.device_gpus is not None and self.num_gpus != len(self.device_gpus):
            # device_gpus decides the count; keep num_gpus consistent with it.
            object.__setattr__(self, "num_gpus", len(self.device_gpus))
        self._check_cluster()
        self._check_fold()

    def _check_fold(self) -> None:
        """world_size, processes and fold_process: counts that divide, a world the cluster holds."""
        for name, low in (("world_size", 1), ("processes", 1), ("fold_process", 0)):
            value = getattr(self, name)
            if value is None and name == "world_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        world = self.world_size
        if world is None:
            if self.processes != 1:
                raise ConfigError("processes needs world_size: give --world-size N (the ranks the processes stand for)")
            return
        if world > _MAX_WORLD or world % self.processes:
            raise ConfigError(
                f"world_size must be at most {_MAX_WORLD} and a multiple of processes ({self.processes}), got {world}"
            )
        if self.fold_process >= self.processes:
            raise ConfigError(f"fold_process must be from 0 to {self.processes - 1}, got {self.fold_process}")
        described = self.described_cluster()
        if described is not None and world > described.nodes * described.gpus_per_node:
            raise ConfigError(
                f"world_size {world} is more than the cluster {described.name!r} holds "
                f"({described.nodes} node(s) x {described.gpus_per_node} GPUs); give --nodes "
                f"{-(-world // described.gpus_per_node)}"
            )

    def _check_cluster(self) -> None:
        """The cluster, node count and node rank: a description that loads, GPUs it has, a node
        it holds."""
        for name in ("nodes", "node_rank"):
            value = getattr(self, name)
            low = 1 if name == "nodes" else 0
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        described = self.described_cluster()
        nodes = described.nodes if described is not None else self.nodes
        if self.node_rank is not None and nodes is not None and self.node_rank >= nodes:
            raise ConfigError(
                f"node_rank {self.node_rank} is not one of the cluster's {nodes} node(s) (0 to {nodes - 1}); "
                "give --nodes (GPEMU_NODES) for a larger cluster"
            )
        if described is None or self.device_gpus is not None:
            return
        from .costmodel.gpus import find_gpu

        if find_gpu(self.gpu) != find_gpu(described.gpu):
            raise ConfigError(
                f"the cluster {described.name!r} has {described.gpu} GPUs but gpu is {self.gpu!r}: leave --gpu out, "
                f"or describe a cluster of {self.gpu} (gpu: {self.gpu} in its YAML)"
            )

    def _check_values(self) -> None:
        if self.values not in VALUE_MODES:
            raise ConfigError(f"values must be one of {', '.join(VALUE_MODES)}, got {self.values!r}")
        if self.values == "real" and self.clock is None:
            # The CPU computes every value, so the wall clock runs at CPU speed; the script's clocks
            # read emulated time instead, so what it prints is the emulated GPU's.
            object.__setattr__(self, "clock", "virtual")

    @property
    def real_values(self) -> bool:
        """Whether emulated tensors carry their real values (``values="real"``)."""
        return self.values == "real"

    @property
    def fast_paths(self) -> bool:
        """Whether the fast paths (:mod:`gpemu.fastpaths`) run: ``replay`` on, and no real values
        (a replayed module, the fused loss and skipped optimizer steps compute no values)."""
        return self.replay and self.values != "real"

    def _check_clock(self) -> None:
        clock = self.clock
        if isinstance(clock, str) or clock is None:
            if clock not in (None, *CLOCKS):
                raise ConfigError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
            mode = clock or "real"
        elif callable(getattr(clock, "now", None)) and callable(getattr(clock, "wait_until", None)):
            mode = "real"  # (a test's clock object: compared as the default, as before)
        else:
            raise ConfigError(
                f"clock must be one of {', '.join(CLOCKS)} or a clock object with now() and wait_until(), "
                f"got {type(clock).__name__}"
            )
        object.__setattr__(self, "time_mode", mode)
        origin = self.clock_origin
        if origin is not None and (
            isinstance(origin, bool) or not isinstance(origin, (int, float)) or not 0 <= origin < 1e12
        ):
            raise ConfigError(f"clock_origin must be perf_counter seconds (a number >= 0), got {origin!r}")

    @property
    def virtual_time(self) -> bool:
        """Whether the run is on virtual time (``clock="virtual"``)."""
        return self.time_mode == "virtual"

    def _check_sharing_ids(self) -> None:
        """The settings a sharing manager would refuse at a job's registration, refused here
        (bounds restated from the sharing protocol; tests/test_sharing.py checks them equal)."""
        persistent = self.sharing_persistent_bytes
        if persistent is not None and (
            not isinstance(persistent, int) or isinstance(persistent, bool) or not 0 <= persistent <= SHARING_MAX_BYTES
        ):
            raise ConfigError(
                f"sharing_persistent_bytes must be a byte count from 0 to {SHARING_MAX_BYTES} (1 PiB), "
                f"got {persistent!r}"
            )
        ids = [("job_id", self.job_id)] + [("visible_devices", d) for d in self.visible_devices or ()]
        for name, value in ids:
            if value is not None and (len(value) > SHARING_MAX_ID_LEN or not value.isprintable()):
                raise ConfigError(
                    f"{name} must be printable text of at most {SHARING_MAX_ID_LEN} characters, got "
                    f"{value[:40]!r}{'...' if len(value) > 40 else ''}"
                )

    # ------------------------------------------------------------------ derived
    @property
    def gpus_per_device(self) -> tuple[str, ...]:
        """The GPU model name of each emulated device, index order."""
        return self.device_gpus if self.device_gpus is not None else (self.gpu,) * self.num_gpus

    @property
    def default_data_dir(self) -> Path:
        if self.data_dir:
            return _expanded_dir(self.data_dir)
        try:
            return Path.home() / ".local" / "share" / "gpemu"
        except RuntimeError:  # no HOME and no passwd entry (a bare container user)
            raise ConfigError(
                "cannot find a home directory for the default data directory; set GPEMU_DATA_DIR "
                "to a writable directory or GPEMU_DB to a database URL"
            ) from None

    def described_cluster(self) -> Cluster | None:
        """The cluster ``cluster`` describes (with ``nodes`` nodes when given); None without one."""
        return load_cluster(self.cluster, self.nodes) if self.cluster else None

    def replace(self, **changes: Any) -> EmuConfig:
        return dataclasses.replace(self, **{k: _coerce(k, v) for k, v in changes.items()})

    def to_env(self) -> dict[str, str]:
        """Environment that makes ``from_env`` rebuild this config in a child process."""
        out: dict[str, str] = {}
        for f in fields(self):
            if f.name in _NOT_IN_ENV:
                continue
            value = getattr(self, f.name)
            if value is None or (f.name == "clock" and not isinstance(value, str)):
                continue  # (a clock object stays in this process)
            if isinstance(value, Tuning):
                text = value.to_text()
                if not text:
                    continue
            elif isinstance(value, bool):
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
        share = f" sharing={redact_url(self.sharing)}" if self.sharing else ""
        cluster = f" cluster={self.cluster}" + (f" nodes={self.nodes}" if self.nodes else "") if self.cluster else ""
        clock = " clock=virtual" if self.virtual_time else ""
        values = " values=real" if self.real_values else ""
        fold = f" world_size={self.world_size} processes={self.processes}" if self.world_size else ""
        return f"gpus=[{gpus}] model={self.model or 'auto'} memory={self.memory}{share}{cluster}{fold}{clock}{values}"


def values_note(config: EmuConfig) -> str:
    """The first line of a run with real values: what it costs, and what its printed times are."""
    cost = (
        "values: real: every tensor on an emulated GPU also holds its real values, computed on this "
        "machine's CPU, so the run goes at CPU speed (a large model takes as long as training it on "
        "the CPU); emulated times and memory are as with placeholder values"
    )
    if config.virtual_time:
        return f"{cost}; the script's clocks read emulated time (--clock virtual, implied by --values real)"
    return (
        f"{cost}; --clock real: the script's clocks read the wall clock, which runs at CPU speed "
        "(leave --clock out, or give --clock virtual, for the emulated GPU's step times)"
    )


def costmodel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the profiler's tools cache the cost model's recorded op tables
    (``GPEMU_COSTMODEL_CACHE``, default ``~/.cache/gpemu/costmodel``): outside the repository."""
    env = os.environ if environ is None else environ
    text = env.get(f"{ENV_PREFIX}COSTMODEL_CACHE")
    return _expanded_dir(text) if text else Path.home() / ".cache" / "gpemu" / "costmodel"


def _expanded_dir(text: str) -> Path:
    """``text`` as a directory path with ``~`` / ``~user`` expanded; ConfigError when that fails."""
    try:
        return Path(text).expanduser()
    except RuntimeError:
        raise ConfigError(
            f"data_dir {text!r} starts with a home directory that does not exist here; give an "
            "existing path (e.g. ~/gpemu-data or /tmp/gpemu)"
        ) from None


def _name_list(name: str, value: str) -> tuple[str, ...] | None:
    """A comma-separated list of names (``V100,A100``); None for an empty setting. A list with an
    empty entry (``' , '``, ``',,,'``, ``'V100,,A100'``) is refused instead of silently dropped."""
    if not value.strip():
        return None
    items = tuple(v.strip() for v in value.split(","))
    if not all(items):
        what = "GPU models" if name == "device_gpus" else "emuGPU ids"
        raise ConfigError(
            f"{name} ({_env_name(name)}) must be {what} separated by commas (e.g. V100,A100), got {value!r}, "
            "which has an empty entry"
        )
    return items


def _check_host(host: object) -> None:
    """``host``'s form: this, none, a speed (``0.7x``), a preset's name or ``db:NAME``
    (gpemu.time.launch checks the name: this module imports no torch)."""
    text = host if isinstance(host, str) else ""
    speed = text[:-1] if text.endswith("x") else text
    try:
        ok = 0.01 <= float(speed) <= 100
    except ValueError:
        # a preset's name, or db: and a recorded host's name (gpemu.db.host_records.HOST_NAME_FORM)
        ok = bool(re.fullmatch(r"[a-z][a-z0-9-]*|db:[a-z0-9][a-z0-9._-]{0,63}", text))
    if not ok:
        raise ConfigError(
            "host must be 'this' (this machine), 'none' (no modelled host time), a speed relative to this machine "
            f"from 0.01x to 100x (e.g. 0.7x), a measured host's preset (e.g. h100-xeon) or db:NAME (a host recorded "
            f"by `gpemu profile --host-side`; `gpemu hosts` lists them); got {host!r}"
        )


# Settings that are free text (stripped; empty means unset).
_TEXT_SETTINGS = frozenset(
    ("model", "db_url", "sharing", "job_id", "metrics_path", "trace_path", "device_dir", "data_dir", "cluster")
)
# Settings that are not read from the environment (derived from others).
_NOT_IN_ENV = frozenset(("time_mode",))
CLOCKS = ("real", "virtual")
VALUE_MODES = ("placeholders", "real")
_MAX_WORLD = 1_000_000  # emulated ranks of one folded job


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
    if name in ("nodes", "node_rank", "world_size", "processes", "fold_process") and isinstance(value, str):
        try:
            return int(value.strip()) if value.strip() else None
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {value!r}") from None
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
            return _name_list(name, value)
        return tuple(value) if value is not None else None
    if name in _TEXT_SETTINGS:
        if isinstance(value, str):
            value = value.strip()
            return value or None
        return None if value is None else str(value)
    if name in ("memory", "sharing_granularity") and isinstance(value, str):
        return value.strip().lower()
    if name == "clock" and isinstance(value, str):
        return value.strip().lower() or None
    if name == "clock_origin" and isinstance(value, str):
        try:
            return float(value.strip()) if value.strip() else None
        except ValueError:
            raise ConfigError(f"clock_origin must be a number of seconds, got {value!r}") from None
    if name == "host" and isinstance(value, str):
        return value.strip().lower() or "none"
    if name == "values" and isinstance(value, str):
        return value.strip().lower()
    if name in ("sharing_weight", "sharing_lease_s") and isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if name == "sharing_persistent_bytes" and isinstance(value, str):
        try:
            return int(value.strip()) if value.strip() else None
        except ValueError:
            raise ConfigError(f"sharing_persistent_bytes must be a byte count, got {value!r}") from None
    if name == "tuning":
        if isinstance(value, str):
            return Tuning.parse(value)
        if isinstance(value, Mapping):
            unknown = set(value) - {f.name for f in fields(Tuning)}
            if unknown:
                raise ConfigError(
                    f"unknown tuning knob(s) {', '.join(sorted(unknown))}; valid: "
                    f"{', '.join(f.name for f in fields(Tuning))}"
                )
            return Tuning(**value)
    return value


@functools.lru_cache(maxsize=16)
def load_cluster(spec: str, nodes: int | None = None) -> Cluster:
    """The cluster named by ``spec``: a preset name, or a YAML file describing one
    (:func:`gpemu.costmodel.topology.cluster_from_mapping`); ``nodes`` wins over its count."""
    # (imported here: gpemu.costmodel imports torch, which a process started without
    # GPEMU_ENABLE must not pay for at its sitecustomize bootstrap)
    from .costmodel.topology import TopologyError, preset

    try:
        path = Path(spec).expanduser()
        if path.suffix.lower() in (".yaml", ".yml", ".json") or path.is_file():
            return _cluster_file(path, nodes)
        return preset(spec, nodes or 1)
    except TopologyError as exc:
        raise ConfigError(str(exc)) from None


def _cluster_file(path: Path, nodes: int | None) -> Cluster:
    import yaml

    from .costmodel.topology import TopologyError, cluster_from_mapping, preset_names

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cluster file {str(path)!r} cannot be read ({exc.strerror or exc}); give a YAML file or a preset "
            f"({', '.join(preset_names())})"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"cluster file {str(path)!r} is not valid YAML{line}") from None
    try:
        return cluster_from_mapping(data if data is not None else {}, nodes)
    except TopologyError as exc:
        raise ConfigError(f"{path.name}: {exc}") from None


def fill_amqp_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` filled in when the URL names a user but no password (the URL's own
    password wins): how a job, the share-manager and the device plugin's containers build the
    URL they connect with from a password kept off the command line."""
    if not password or "://" not in url:
        return url
    from urllib.parse import quote

    scheme, rest = url.split("://", 1)
    if "@" not in rest:
        return url
    creds, host = rest.rsplit("@", 1)
    if ":" in creds:
        return url
    return f"{scheme}://{creds}:{quote(password, safe='')}@{host}"


def amqp_url_problem(url: str, password: str | None = None) -> str | None:
    """Why ``url`` (with ``password`` filled in where it names a user without one) is no URL a
    broker connection can use, or None when it is. The reason never contains the password.

    A URL that names a user but no password, with no password given, is refused here: pika's
    parser fails on it with a TypeError that says nothing about the URL."""
    if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
        return "it must be an amqp:// or amqps:// URL"
    rest = url.split("://", 1)[1]
    creds = rest.rsplit("@", 1)[0] if "@" in rest else None
    if creds is not None and ":" not in creds and not password:
        return f"it names the broker user {creds!r} but no password (give the password in a file, or in the URL)"
    full = fill_amqp_password(url, password)
    try:
        import pika

        pika.URLParameters(full)
    except Exception as exc:
        text = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        secret = full.split("://", 1)[1].rsplit("@", 1)[0].partition(":")[2] if "@" in full else ""
        for hidden in {secret, password or ""} - {""}:
            text = text.replace(hidden, "***")
        return text or type(exc).__name__
    return None
