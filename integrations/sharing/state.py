"""The sharing manager's state: emuGPUs, registered jobs, queued requests, slots on the timeline.

Plain data with no behaviour of its own beyond parsing a ``--device`` argument; the scheduler
(:mod:`.scheduler`) and the message handling (:mod:`.core`) work on it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .policies import JobView, Policy

__all__ = [
    "DeviceSpec",
    "parse_device",
    "parse_size",
    "gib",
    "Outgoing",
    "QueuedRequest",
    "Slot",
    "JobState",
    "DeviceState",
    "LogBudget",
    "DEFAULT_LOOKAHEAD_S",
    "DEFAULT_BACKDATE_S",
    "DEFAULT_QUANTUM_S",
    "MAX_JOBS",
    "MAX_ACTIVE_PER_JOB",
    "DONE_MEMORY",
    "SHARE_WINDOW_S",
    "EPS",
]

log = logging.getLogger("gpemu.sharing.manager")

# Grant the next request this long before the emuGPU frees up: covers a late timer and the
# grant's delivery on a busy host (2 ms left 2-14 % of grants late with 16 jobs on 2 CPUs).
DEFAULT_LOOKAHEAD_S = 0.01
DEFAULT_BACKDATE_S = 0.05  # a request to an idle emuGPU may start up to this long before it arrived
# Longest time one job holds the emuGPU while others wait. Longer than the iterations of the
# shipped measurements at common batch sizes, so ordinary iterations are served whole.
DEFAULT_QUANTUM_S = 0.5
MAX_JOBS = 1024  # registered jobs per manager: bounds the memory a flood of registrations takes
# Requests of one job queued at once: a job has one in flight per emuGPU; more is a flood that
# would hold the broker's prefetch window (unacked deliveries) and starve other jobs.
MAX_ACTIVE_PER_JOB = 16
DONE_MEMORY = 512  # answered request ids remembered per job (dedup of late duplicates)
SHARE_WINDOW_S = 5.0  # "recent share" in the status covers this many seconds
EPS = 1e-9


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # emuGPU id jobs name in their messages, e.g. "0"
    gpu: str  # GPU model, e.g. "V100"
    capacity_bytes: int


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    low = text.strip().lower()
    num = low.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = low[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"memory size must be a positive number with a unit (e.g. 16GiB, 32GB), got {text!r}")
    return int(value * _UNITS[unit])


def parse_device(spec: str, gpu_memory: Callable[[str], int] | None = None) -> DeviceSpec:
    """``ID=GPU`` (memory from the profile database) or ``ID=GPU:SIZE`` (e.g. ``0=P100:16GiB``)."""
    if "=" not in spec:
        raise ValueError(f"--device must look like ID=GPU or ID=GPU:SIZE (e.g. 0=V100, 1=P100:16GiB), got {spec!r}")
    name, _, rest = spec.partition("=")
    gpu, _, size = rest.partition(":")
    name, gpu = name.strip(), gpu.strip()
    if not name or not gpu:
        raise ValueError(f"--device must look like ID=GPU or ID=GPU:SIZE (e.g. 0=V100), got {spec!r}")
    if size:
        return DeviceSpec(name, gpu, parse_size(size))
    if gpu_memory is None:
        raise ValueError(
            f"--device {spec!r}: no profile database to look up {gpu}'s memory; "
            f"give it explicitly, e.g. {name}={gpu}:16GiB"
        )
    return DeviceSpec(name, gpu, int(gpu_memory(gpu)))


@dataclass
class Outgoing:
    """A reply to publish (``reply_to`` may be None: nothing to send), the key to sign it with
    (None: unsigned) and delivery tags to ack after."""

    reply_to: str | None
    payload: dict[str, Any] | None
    ack: list[Any] = field(default_factory=list)
    key: bytes | None = None


@dataclass
class QueuedRequest:
    rid: str
    job_id: str
    seconds: float
    peak_bytes: int
    seq: int
    arrived: float
    reply_to: str | None
    tags: list[Any]
    kind: str = ""
    left: float = 0.0  # GPU time not scheduled yet
    started: float | None = None  # start of its first slice
    deadline: float | None = None  # end of its last slice
    grant: bool = False  # answered with a grant when scheduled, not with "done" at its end
    origin: float = 0.0  # when the job sent it (same host), else when it arrived
    sent_at: float | None = None  # the job's send time on our clock (same host only)
    idle: float | None = None  # emuGPU idle while it travelled (same host only)


@dataclass
class Slot:
    """One stretch of a request on the emuGPU's timeline (a whole request or one slice)."""

    req: QueuedRequest
    start: float
    end: float
    final: bool  # the request's last slice: its answer goes out with it


@dataclass
class JobState:
    job_id: str
    device: str
    key: bytes
    persistent_bytes: int
    register_rid: str
    view: JobView
    last_seen: float
    reply_to: str | None
    same_host: bool = False  # its time.monotonic() is ours: absolute deadlines, send times
    served_count: int = 0
    presence: str | None = None  # the job's presence queue (see protocol)
    route: str = ""  # the routing key of the job's own request queue (see protocol, "Routes")
    # Virtual time: the earliest virtual time the job may still send a request at (its
    # registration's, then its last grant's end); the scheduler decides nothing later while
    # the job has no request queued (see Scheduler._frontier).
    frontier: float = float("-inf")
    done: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    active: dict[str, QueuedRequest] = field(default_factory=dict)


@dataclass
class DeviceState:
    spec: DeviceSpec
    policy: Policy
    jobs: dict[str, JobView] = field(default_factory=dict)
    pending: list[QueuedRequest] = field(default_factory=list)
    running: Slot | None = None
    # Scheduled after ``running`` (granted ahead by the lookahead), back to back, in order.
    reserved: deque = field(default_factory=deque)
    free_at: float = 0.0  # when the last slot ended (chains back-to-back work exactly)
    # Virtual time: jobs registered whose registration time the timeline has not reached yet,
    # (registration time, job id); the policy hears of each when it has (Scheduler._join_arrived).
    joining: list = field(default_factory=list)
    busy_s: float = 0.0
    served: int = 0
    recent: deque = field(default_factory=deque)  # (end, job_id, seconds)


class LogBudget:
    """At most ``limit`` lines per ``window_s``; the rest are counted and summarised once.

    A flood of bad messages must not grow the log without bound (each rejection is one line)."""

    def __init__(self, limit: int = 20, window_s: float = 60.0) -> None:
        self.limit, self.window_s = limit, window_s
        self.start: float | None = None
        self.used = 0
        self.suppressed = 0

    def flush(self, now: float, final: bool = False) -> None:
        """At the end of a window (or of the manager, ``final``): one line for what it did not log."""
        if self.start is not None and (final or now - self.start >= self.window_s):
            if self.suppressed:
                log.warning(
                    "%d more message(s) rejected in the last %.0f s (not logged one by one)",
                    self.suppressed,
                    min(self.window_s, now - self.start) if final else self.window_s,
                )
            self.start, self.used, self.suppressed = None, 0, 0

    def allow(self, now: float) -> bool:
        self.flush(now)
        if self.start is None:
            self.start = now
        if self.used < self.limit:
            self.used += 1
            return True
        self.suppressed += 1
        return False


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
