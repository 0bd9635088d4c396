"""The sharing manager: time-slices each emuGPU among registered jobs, one slot at a time.

Two layers:

* :class:`SharingCore` — the scheduler. Pure state machine, no I/O, clock passed in: every
  input (a message, the passage of time, a job's connection closing) returns the replies to
  send. Unit-testable with a virtual clock.
* :class:`SharingManager` — the daemon: a pika consumer on the durable request queue that
  feeds the core, sleeps until the next absolute deadline (the earliest slot's end, lease
  expiry, status publication), publishes signed replies (acking a request after its reply, on
  the same channel), watches every job's presence queue, and reconnects when the broker goes
  away.

Reliability rules: a GPU-time request is acknowledged to the broker only after it has been
answered, so requests of a manager that dies are redelivered to the next one; request ids make
duplicate deliveries harmless (a request already queued or running is not queued again, one
already answered is answered again, never served again); a job whose broker connection closes
is dropped at once and one silent for a lease period is dropped too, and its slots, queue and
memory are freed. Every message that cannot be parsed, validated or authenticated is
acknowledged and rejected with a logged reason (the log is rate-limited), so no input can stop
the service or come back as a redelivery.

Time slices: a request longer than the quantum (``quantum_s``) is served in slices of at most
one quantum; after each slice the request goes to the back of the queue and the policy chooses
again, so no job holds the emuGPU for more than one quantum while others wait. The job sees
one answer, when its last slice is scheduled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import protocol as P
from .policies import Fifo, JobView, PendingView, Policy, load_policy

__all__ = [
    "SharingCore",
    "SharingManager",
    "Outgoing",
    "DeviceSpec",
    "parse_device",
    "DEFAULT_LOOKAHEAD_S",
    "DEFAULT_BACKDATE_S",
    "DEFAULT_QUANTUM_S",
    "MAX_JOBS",
    "MAX_ACTIVE_PER_JOB",
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
_DONE_MEMORY = 512  # answered request ids remembered per job (dedup of late duplicates)
_SHARE_WINDOW_S = 5.0  # "recent share" in the status covers this many seconds
_EPS = 1e-9


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # emuGPU id jobs name in their messages, e.g. "0"
    gpu: str  # GPU model, e.g. "V100"
    capacity_bytes: int


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def _parse_size(text: str) -> int:
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
        return DeviceSpec(name, gpu, _parse_size(size))
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
class _Request:
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
class _Slot:
    """One stretch of a request on the emuGPU's timeline (a whole request or one slice)."""

    req: _Request
    start: float
    end: float
    final: bool  # the request's last slice: its answer goes out with it


@dataclass
class _Job:
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
    done: OrderedDict[str, dict[str, Any]] = field(default_factory=OrderedDict)
    active: dict[str, _Request] = field(default_factory=dict)


@dataclass
class _Device:
    spec: DeviceSpec
    policy: Policy
    jobs: dict[str, JobView] = field(default_factory=dict)
    pending: list[_Request] = field(default_factory=list)
    running: _Slot | None = None
    # Scheduled after ``running`` (granted ahead by the lookahead), back to back, in order.
    reserved: deque = field(default_factory=deque)
    free_at: float = 0.0  # when the last slot ended (chains back-to-back work exactly)
    busy_s: float = 0.0
    served: int = 0
    recent: deque = field(default_factory=deque)  # (end, job_id, seconds)


class _LogBudget:
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


class SharingCore:
    """Scheduler state of every emuGPU. Not thread-safe: one caller (the daemon loop)."""

    def __init__(
        self,
        devices: Iterable[DeviceSpec],
        policy: str | type[Policy] = "fifo",
        lease_s: float = 10.0,
        host: str = "",
        lookahead_s: float = 0.0,
        backdate_s: float = 0.05,
        quantum_s: float | None = DEFAULT_QUANTUM_S,
        job_secret: bytes | None = None,
        max_jobs: int = MAX_JOBS,
        max_active_per_job: int = MAX_ACTIVE_PER_JOB,
    ) -> None:
        policy_cls = load_policy(policy) if isinstance(policy, str) else policy
        self.policy_name = getattr(policy_cls, "name", policy_cls.__name__)
        self.devices: dict[str, _Device] = {d.name: _Device(d, policy_cls()) for d in devices}
        if not self.devices:
            raise ValueError("the sharing manager needs at least one --device ID=GPU")
        if not lease_s > 0:
            raise ValueError(f"lease must be a positive number of seconds, got {lease_s!r}")
        self.lease_s = float(lease_s)
        if not 0 <= lookahead_s <= 1.0 or not 0 <= backdate_s <= 1.0:
            raise ValueError(f"lookahead and backdate must be from 0 to 1 s, got {lookahead_s!r}, {backdate_s!r}")
        if quantum_s is not None and not 1e-3 <= quantum_s <= P.MAX_SECONDS:
            raise ValueError(
                f"quantum must be from 0.001 to {P.MAX_SECONDS:g} seconds (or None: no slicing), got {quantum_s!r}"
            )
        if job_secret is not None and len(job_secret) < 16:
            raise ValueError("the job secret must be at least 16 bytes")
        # host_identity() of the manager: jobs that register with the same one share its clock.
        self.host = host
        # Decide (and grant) the next slot this long before the GPU frees up, so the grant
        # is at the job before its slot starts; the policy then chooses among the requests
        # that arrived up to this much before the slot boundary.
        self.lookahead_s = float(lookahead_s)
        # A same-host request that finds the emuGPU idle starts when the job sent it (at most
        # this long ago), as under a manager with no message latency; never before the end of
        # work already scheduled, so nothing overlaps.
        self.backdate_s = float(backdate_s)
        self.quantum_s = float(quantum_s) if quantum_s is not None else None
        # With a job secret, a job's key is derived from its id (handed out by the device
        # plugin); without one, a job brings its own key when it registers.
        self.job_secret = job_secret
        self.max_jobs = int(max_jobs)
        self.max_active = int(max_active_per_job)
        self.jobs: dict[str, _Job] = {}
        self._seq = 0
        self.rejected = 0
        self.refused = 0
        self.expired = 0
        self.disconnected = 0  # jobs dropped because the broker closed their connection
        self.started_at: float | None = None
        self._log_budget = _LogBudget()
        self._policy_warned = False
        # (job id, presence queue) seen in authenticated messages, for the daemon to watch.
        self.presence_seen: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ input: messages
    def receive(
        self, body: bytes, reply_to: str | None, tag: Any, now: float, sig: str | None = None
    ) -> list[Outgoing]:
        """One message from the request queue (``sig``: its signature header, if any)."""
        if self.started_at is None:
            self.started_at = now
        if reply_to is not None and not P.valid_queue_name(reply_to):
            # Replies go only to job reply queues, never into the request queue or elsewhere.
            return [
                self._reject(
                    f"reply_to must name a queue {P.REPLY_PREFIX}<id>, got {P.short(reply_to)}",
                    None,
                    None,
                    tag,
                    None,
                    now,
                )
            ]
        try:
            msg = P.parse_message(body)
        except P.ProtocolError as exc:
            return [self._reject(exc.reason, exc.request_id, reply_to, tag, None, now)]
        if msg.type == "status":
            return self._on_status(msg, reply_to, tag, now)
        if msg.type == "register":
            out = self._on_register(msg, reply_to, tag, now, body, sig)
        else:
            job = self.jobs.get(msg.job_id)
            if job is None:
                key = P.derive_job_key(self.job_secret, msg.job_id) if self.job_secret else None
                signed = key is not None and P.verify(key, body, sig)
                if msg.type == "deregister" and signed:
                    # Already gone (duplicate, or expired): the outcome the job wanted.
                    return [Outgoing(reply_to, {"type": "deregistered", "request_id": msg.request_id}, [tag], key)]
                return [
                    self._reject(
                        f"{P.ERR_UNKNOWN_JOB}: {msg.type} for job {P.short(msg.job_id)}",
                        msg.request_id or None,
                        reply_to,
                        tag,
                        msg.job_id,
                        now,
                        P.ERR_UNKNOWN_JOB,
                        key if signed else None,
                    )
                ]
            if not P.verify(job.key, body, sig):
                return [
                    self._reject(
                        f"{P.ERR_BAD_SIGNATURE}: {msg.type} for job {P.short(msg.job_id)} is not signed with its key",
                        msg.request_id or None,
                        reply_to,
                        tag,
                        msg.job_id,
                        now,
                        P.ERR_BAD_SIGNATURE,
                    )
                ]
            job.last_seen = now
            if msg.presence:
                self._saw_presence(job, msg.presence)
            handler = {"request": self._on_request, "heartbeat": self._on_heartbeat, "deregister": self._on_deregister}[
                msg.type
            ]
            out = handler(job, msg, reply_to, tag, now)
        return out + self.advance(now)

    def _reject(
        self,
        reason: str,
        rid: str | None,
        reply_to: str | None,
        tag: Any,
        job_id: str | None,
        now: float,
        code: str = P.ERR_BAD_MESSAGE,
        key: bytes | None = None,
    ) -> Outgoing:
        self.rejected += 1
        if self._log_budget.allow(now):
            log.warning("rejected message%s: %s", f" from job {P.short(job_id)}" if job_id else "", reason)
        payload = {"type": "error", "code": code, "reason": reason, "request_id": rid}
        return Outgoing(reply_to, payload, [tag], key)

    def _saw_presence(self, job: _Job, queue: str) -> None:
        job.presence = queue
        self.presence_seen.append((job.job_id, queue))

    def _on_register(
        self, msg: P.Message, reply_to: str | None, tag: Any, now: float, body: bytes, sig: str | None
    ) -> list[Outgoing]:
        if self.job_secret is not None:
            key = P.derive_job_key(self.job_secret, msg.job_id)
            if msg.key is not None and msg.key != key:
                key = None  # a key of its own where the manager derives them: not a job it issued
        else:
            key = msg.key
            if key is None:
                return [
                    self._reject(
                        f"register of job {P.short(msg.job_id)} carries no key; this manager has no "
                        "job secret, so each job sends its own",
                        msg.request_id,
                        reply_to,
                        tag,
                        msg.job_id,
                        now,
                    )
                ]
        if not P.verify(key, body, sig):
            return [
                self._reject(
                    f"{P.ERR_BAD_SIGNATURE}: register of job {P.short(msg.job_id)} is not signed with its key",
                    msg.request_id,
                    reply_to,
                    tag,
                    msg.job_id,
                    now,
                    P.ERR_BAD_SIGNATURE,
                )
            ]
        dev = self.devices.get(msg.device)
        if dev is None:
            return [
                self._reject(
                    f"unknown emuGPU {P.short(msg.device)}; this manager has {', '.join(self.devices)}",
                    msg.request_id,
                    reply_to,
                    tag,
                    msg.job_id,
                    now,
                    P.ERR_UNKNOWN_DEVICE,
                    key,
                )
            ]
        job = self.jobs.get(msg.job_id)
        if job is not None:
            # A duplicate delivery, or the same job registering again with its key (it took an
            # error for a lost registration): the same answer, nothing changes.
            if job.key == key and job.device == msg.device:
                job.last_seen, job.reply_to = now, reply_to
                if msg.presence:
                    self._saw_presence(job, msg.presence)
                return [Outgoing(reply_to, self._registered(job, msg.request_id), [tag], job.key)]
            return [
                self._reject(
                    f"job id {P.short(msg.job_id)} is already registered",
                    msg.request_id,
                    reply_to,
                    tag,
                    msg.job_id,
                    now,
                    P.ERR_JOB_EXISTS,
                    key,
                )
            ]
        if len(self.jobs) >= self.max_jobs:
            return [
                self._reject(
                    f"this manager already serves {self.max_jobs} jobs",
                    msg.request_id,
                    reply_to,
                    tag,
                    msg.job_id,
                    now,
                    P.ERR_BUSY,
                    key,
                )
            ]
        used = sum(self.jobs[j].persistent_bytes for j in dev.jobs)
        if used + msg.persistent_bytes > dev.spec.capacity_bytes:
            self.refused += 1
            reason = (
                f"registration refused: persistent memory {_gib(msg.persistent_bytes)} does not fit on "
                f"emuGPU {dev.spec.name} ({dev.spec.gpu}, {_gib(dev.spec.capacity_bytes)}): "
                f"{_gib(used)} is held by {len(dev.jobs)} other job(s)"
            )
            log.info("%s (job %r)", reason, msg.job_id)
            return [Outgoing(reply_to, {"type": "refused", "request_id": msg.request_id, "reason": reason}, [tag], key)]
        view = JobView(msg.job_id, msg.weight)
        job = _Job(
            msg.job_id,
            msg.device,
            key,
            msg.persistent_bytes,
            msg.request_id,
            view,
            now,
            reply_to,
            same_host=bool(self.host) and msg.host == self.host,
        )
        self.jobs[msg.job_id] = job
        dev.jobs[msg.job_id] = view
        dev.policy.registered(view, dev.jobs)
        if msg.presence:
            self._saw_presence(job, msg.presence)
        log.info(
            "job %r registered on emuGPU %s (persistent %s, weight %g)",
            msg.job_id,
            dev.spec.name,
            _gib(msg.persistent_bytes),
            msg.weight,
        )
        return [Outgoing(reply_to, self._registered(job), [tag], key)]

    def _registered(self, job: _Job, rid: str | None = None) -> dict[str, Any]:
        return {
            "type": "registered",
            "request_id": rid or job.register_rid,
            "job_id": job.job_id,
            "lease_s": self.lease_s,
            "same_host": job.same_host,
        }

    def _on_request(self, job: _Job, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        if msg.device != job.device:
            return [
                self._reject(
                    f"job {P.short(msg.job_id)} is registered on emuGPU {job.device!r}, not {P.short(msg.device)}",
                    msg.request_id,
                    reply_to,
                    tag,
                    msg.job_id,
                    now,
                    P.ERR_UNKNOWN_DEVICE,
                    job.key,
                )
            ]
        if msg.request_id in job.done:  # answered before: answer again, never serve again
            payload = job.done[msg.request_id]
            if payload.get("type") == "granted":  # a job on another host counts from the reply
                payload = {**payload, "remaining_s": max(0.0, payload["end"] - now)}
            return [Outgoing(reply_to, payload, [tag], job.key)]
        req = job.active.get(msg.request_id)
        if req is not None:  # queued or running: remember where to answer, ack with it
            req.reply_to = reply_to or req.reply_to
            req.tags.append(tag)
            return []
        if len(job.active) >= self.max_active:
            return [
                self._reject(
                    f"job {P.short(msg.job_id)} already has {self.max_active} requests queued",
                    msg.request_id,
                    reply_to,
                    tag,
                    msg.job_id,
                    now,
                    P.ERR_BUSY,
                    job.key,
                )
            ]
        if msg.persistent_bytes is not None:
            # What the job holds between iterations now; checked against others' requests from now on.
            job.persistent_bytes = msg.persistent_bytes
        self._seq += 1
        req = _Request(
            msg.request_id,
            job.job_id,
            msg.seconds,
            msg.peak_bytes,
            self._seq,
            now,
            reply_to,
            [tag],
            msg.kind,
            left=msg.seconds,
            grant=msg.grant,
            origin=now,
        )
        if job.same_host and msg.sent_at is not None:
            # Never later than now (a clock cannot run ahead) nor more than backdate_s ago.
            req.sent_at = min(msg.sent_at, now)
            req.origin = max(req.sent_at, now - self.backdate_s)
        job.active[req.rid] = req
        self.devices[job.device].pending.append(req)
        return []

    def _on_heartbeat(self, job: _Job, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        return [Outgoing(reply_to, {"type": "heartbeat-ack", "job_id": job.job_id}, [tag], job.key)]

    def _on_deregister(self, job: _Job, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        out = self._drop_job(job, now, "deregistered")
        out.append(Outgoing(reply_to, {"type": "deregistered", "request_id": msg.request_id}, [tag], job.key))
        return out

    def _on_status(self, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        snap = self.status(now)
        snap["request_id"] = msg.request_id or None
        return [Outgoing(reply_to, snap, [tag])]

    # ------------------------------------------------------------------ input: the broker
    def connection_gone(self, job_id: str, presence: str, now: float) -> list[Outgoing]:
        """The broker reports the connection holding ``presence`` closed: drop its job now."""
        job = self.jobs.get(job_id)
        if job is None or job.presence != presence:
            return []  # gone already, or it reconnected with another presence queue since
        self.disconnected += 1
        log.warning("job %r: its broker connection closed; dropped, its GPU time and memory freed", job_id)
        return self._drop_job(job, now, "connection closed") + self.advance(now)

    # ------------------------------------------------------------------ input: time
    def flush_log(self, now: float, final: bool = False) -> None:
        """Write the summary of rejections not logged one by one, once their window has passed
        (``final``: now, as the manager stops)."""
        self._log_budget.flush(now, final)

    def advance(self, now: float) -> list[Outgoing]:
        """Finish slots whose end passed, schedule the next ones, expire silent jobs."""
        self.flush_log(now)
        out: list[Outgoing] = []
        for job in [j for j in self.jobs.values() if now - j.last_seen > self.lease_s]:
            self.expired += 1
            log.warning(
                "job %r sent nothing for %.1f s (lease %.1f s): dropped, its GPU time and memory freed",
                job.job_id,
                now - job.last_seen,
                self.lease_s,
            )
            out += self._drop_job(job, now, "lease expired")
        for dev in self.devices.values():
            while True:
                run = dev.running
                if run is not None and run.end <= now:
                    out += self._finish(dev, run)
                    dev.running = dev.reserved.popleft() if dev.reserved else None
                    continue
                tail = dev.reserved[-1] if dev.reserved else run
                if not dev.pending or (tail is not None and tail.end - self.lookahead_s > now):
                    break
                out += self._start_next(dev, now, tail)
        return out

    def _pick(self, dev: _Device) -> _Request:
        pending = [
            PendingView(r.job_id, r.seq, r.left if self.quantum_s is None else min(r.left, self.quantum_s))
            for r in dev.pending
        ]
        try:
            chosen = dev.policy.pick(pending, dev.jobs)
            return next(r for r in dev.pending if r.seq == chosen.seq)
        except Exception as exc:  # a user's policy must not stop the emuGPU
            if not self._policy_warned:
                self._policy_warned = True
                log.error(
                    "policy %s failed to pick a request (%r); serving in arrival order instead", self.policy_name, exc
                )
            chosen = Fifo().pick(pending, dev.jobs)
            return next(r for r in dev.pending if r.seq == chosen.seq)

    def _start_next(self, dev: _Device, now: float, tail: _Slot | None) -> list[Outgoing]:
        req = self._pick(dev)
        dev.pending.remove(req)
        job = self.jobs[req.job_id]
        first = req.started is None
        if first:
            others = sum(self.jobs[j].persistent_bytes for j in dev.jobs if j != req.job_id)
            need = max(req.peak_bytes, job.persistent_bytes)
            if others + need > dev.spec.capacity_bytes:
                self.refused += 1
                reason = (
                    f"CUDA out of memory on emuGPU {dev.spec.name} ({dev.spec.gpu}, "
                    f"{_gib(dev.spec.capacity_bytes)} total): this request's peak {_gib(need)} plus "
                    f"{_gib(others)} persistent memory of {len(dev.jobs) - 1} other job(s) sharing it"
                )
                payload = {"type": "refused", "request_id": req.rid, "reason": reason}
                return [self._answer(job, req, payload)]
        # Back-to-back work starts when the previous slot ends, not when the loop noticed;
        # on an idle emuGPU a new request starts when the job sent it (same host, see backdate_s).
        free = tail.end if tail is not None else min(now, dev.free_at)
        start = max(req.origin, free) if first else free
        piece = req.left if self.quantum_s is None or req.left <= self.quantum_s + _EPS else self.quantum_s
        req.left = max(0.0, req.left - piece)
        final = req.left <= _EPS
        slot = _Slot(req, start, start + piece, final)
        if first:
            req.started = start
            # GPU time lost while the request travelled to us: idle emuGPU, request already sent.
            req.idle = max(0.0, start - max(req.sent_at, free)) if req.sent_at is not None else None
        if tail is None:
            dev.running = slot
        else:
            dev.reserved.append(slot)
        # Charged when scheduled: a lookahead decision then sees the slots already given (a job
        # is not picked again for time it has not been charged yet), and the figures are in
        # place before the grant reaches the job. A dropped job's unused time is taken back.
        job.view.served_s += piece
        dev.policy.served(job.view, piece)
        dev.busy_s += piece
        dev.recent.append((slot.end, job.job_id, piece))
        if not final:  # queued again when this slice ends (see _finish)
            return []
        req.deadline = slot.end
        dev.served += 1
        job.served_count += 1
        if not req.grant:
            return []
        payload = {
            "type": "granted",
            "request_id": req.rid,
            "start": req.started,
            "end": req.deadline,
            "remaining_s": max(0.0, req.deadline - now),
            "seconds": req.seconds,
            "waited_s": max(0.0, req.deadline - req.origin - req.seconds),
            "idle_s": req.idle,
        }
        return [self._answer(job, req, payload)]

    def _finish(self, dev: _Device, slot: _Slot) -> list[Outgoing]:
        dev.free_at = slot.end
        req = slot.req
        if not slot.final:
            # Back of the line, as if it arrived now: requests that came during the slice go
            # first under any policy that honours arrival order.
            self._seq += 1
            req.seq = self._seq
            dev.pending.append(req)
            return []
        if req.grant:  # answered (and acknowledged) when granted
            return []
        job = self.jobs[req.job_id]
        payload = {
            "type": "done",
            "request_id": req.rid,
            "served_s": req.seconds,
            "waited_s": max(0.0, slot.end - req.origin - req.seconds),
        }
        return [self._answer(job, req, payload)]

    def _answer(self, job: _Job, req: _Request, payload: dict[str, Any]) -> Outgoing:
        job.active.pop(req.rid, None)
        job.done[req.rid] = payload
        while len(job.done) > _DONE_MEMORY:
            job.done.popitem(last=False)
        return Outgoing(req.reply_to, payload, req.tags, job.key)

    def _drop_job(self, job: _Job, now: float, why: str) -> list[Outgoing]:
        dev = self.devices[job.device]
        # Slots granted ahead to other jobs keep their times (their grants are out); the
        # dropped job's own future slots are freed.
        for slot in [s for s in dev.reserved if s.req.job_id == job.job_id]:
            dev.reserved.remove(slot)
            dev.busy_s -= slot.end - slot.start
            if slot.final:
                dev.served -= 1
        run = dev.running
        if run is not None and run.req.job_id == job.job_id:
            dev.free_at = max(run.start, min(now, run.end))
            dev.busy_s -= run.end - dev.free_at  # the slot's unused rest is free again
            dev.running = dev.reserved.popleft() if dev.reserved else None
        dev.pending = [r for r in dev.pending if r.job_id != job.job_id]
        # Its unanswered requests leave the queue (acknowledged, never answered).
        out = [Outgoing(None, None, req.tags) for req in job.active.values() if req.tags]
        job.active.clear()
        dev.jobs.pop(job.job_id, None)
        self.jobs.pop(job.job_id, None)
        log.info("job %r left emuGPU %s (%s)", job.job_id, dev.spec.name, why)
        return out

    def forget_delivery_tags(self) -> None:
        """The channel is gone: its unacked messages will be redelivered, so drop their tags."""
        for job in self.jobs.values():
            for req in job.active.values():
                req.tags.clear()

    # ------------------------------------------------------------------ queries
    def next_deadline(self) -> float | None:
        ends = []
        for d in self.devices.values():
            if d.running is not None:
                ends.append(d.running.end)
                if d.pending:  # the next decision, a lookahead before the tail of the timeline ends
                    ends.append((d.reserved[-1] if d.reserved else d.running).end - self.lookahead_s)
        if self.jobs:
            ends.append(min(j.last_seen for j in self.jobs.values()) + self.lease_s + 1e-3)
        return min(ends) if ends else None

    def precise_deadline(self) -> float | None:
        """The earliest end that is answered with a "done" reply at that moment (legacy clients).

        Only those need the loop on time to the microsecond; a granted request's end only
        frees the emuGPU on the timeline, which was fixed when it was granted.
        """
        ends = [
            d.running.end
            for d in self.devices.values()
            if d.running is not None and d.running.final and not d.running.req.grant
        ]
        return min(ends) if ends else None

    def status(self, now: float) -> dict[str, Any]:
        devices, jobs = [], []
        for dev in self.devices.values():
            while dev.recent and dev.recent[0][0] < now - _SHARE_WINDOW_S:
                dev.recent.popleft()
            recent: dict[str, float] = {}
            for _, job_id, s in dev.recent:
                recent[job_id] = recent.get(job_id, 0.0) + s
            total_recent = sum(recent.values()) or 1.0
            total = sum(v.served_s for v in dev.jobs.values()) or 1.0
            up = max(now - (self.started_at or now), 1e-9)
            devices.append(
                {
                    "device": dev.spec.name,
                    "gpu": dev.spec.gpu,
                    "capacity_bytes": dev.spec.capacity_bytes,
                    "persistent_bytes": sum(self.jobs[j].persistent_bytes for j in dev.jobs),
                    "jobs": len(dev.jobs),
                    "queue": len(dev.pending),
                    "running": dev.running.req.job_id if dev.running else None,
                    "served_requests": dev.served,
                    "busy_s": dev.busy_s,
                    "utilisation": min(1.0, dev.busy_s / up),
                }
            )
            for view in dev.jobs.values():
                job = self.jobs[view.job_id]
                jobs.append(
                    {
                        "job_id": view.job_id,
                        "device": dev.spec.name,
                        "weight": view.weight,
                        "persistent_bytes": job.persistent_bytes,
                        "served_s": view.served_s,
                        "served_requests": job.served_count,
                        "queued": len(job.active),
                        "share": view.served_s / total,
                        "recent_share": recent.get(view.job_id, 0.0) / total_recent,
                    }
                )
        return {
            "type": "status",
            "policy": self.policy_name,
            "lease_s": self.lease_s,
            "quantum_s": self.quantum_s,
            "time": time.time(),
            "devices": devices,
            "jobs": jobs,
            "rejected": self.rejected,
            "refused": self.refused,
            "expired": self.expired,
            "disconnected": self.disconnected,
        }


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass
class _Watch:
    """The manager's standby consumer on one job's presence queue (its own channel)."""

    job_id: str
    channel: Any = None
    closing: bool = False


class SharingManager:
    """The daemon around :class:`SharingCore`: consume, schedule, reply, watch jobs, reconnect.

    Asynchronous (pika ``SelectConnection``): one I/O loop, no blocking round trips. A reply and
    the ack of the request it answers are written together, in that order, on one channel; one
    timer is kept armed for the core's next deadline (the earliest slot's end, a lease expiry)
    and another publishes the status. Each job's presence queue is watched on a channel of its
    own, so a queue that vanished (a 404 closes that channel) never disturbs the others.
    """

    # The epoll timer fires up to ~1 ms late (millisecond resolution plus scheduling); this
    # much before the end of a request answered with "done" the loop stops sleeping and spins
    # to reply on time. Granted requests need no spin: their times were fixed when granted, and
    # the lookahead covers a late timer (spinning took a CPU from the broker and the jobs).
    SPIN_S = 0.001
    # A job's presence message reaches us this long before we drop the job: when the broker
    # itself shuts down it closes the job's connection and ours a moment apart, and the job must
    # not be dropped for that (our own connection closing cancels the pending drop).
    PRESENCE_GRACE_S = 1.0
    # Reconnect attempts back off to this; a broker that stays away is reported once a minute.
    MAX_RECONNECT_S = 2.0
    LOST_REPORT_S = 60.0

    def __init__(
        self,
        url: str,
        devices: Iterable[DeviceSpec],
        policy: str | type[Policy] = "fifo",
        lease_s: float = 10.0,
        status_interval_s: float = 1.0,
        reconnect_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        prefetch: int = 2000,
        lookahead_s: float = DEFAULT_LOOKAHEAD_S,
        backdate_s: float = DEFAULT_BACKDATE_S,
        quantum_s: float | None = DEFAULT_QUANTUM_S,
        job_secret: bytes | None = None,
    ) -> None:
        from gpemu.units import redact_url

        self.url = url
        self.safe_url = redact_url(url)
        # Grants carry absolute times on our clock; only time.monotonic is shared with jobs.
        host = P.host_identity() if clock is time.monotonic else ""
        self.core = SharingCore(
            devices,
            policy,
            lease_s,
            host=host,
            lookahead_s=lookahead_s,
            backdate_s=backdate_s,
            quantum_s=quantum_s,
            job_secret=job_secret,
        )
        self.status_interval_s = status_interval_s
        self.reconnect_s = reconnect_s
        self.clock = clock
        # Unacked requests the broker may push ahead: requests stay unacked while queued here,
        # so this bounds how many jobs can wait at once, not throughput.
        self.prefetch = prefetch
        self._stop = threading.Event()
        self._conn: Any = None
        self._ch: Any = None
        self._timer: Any = None
        self._timer_at: float | None = None
        self._status_timer: Any = None
        self._lost: str | None = None
        self._watch: dict[str, _Watch] = {}  # presence queue -> watch
        self._watch_of: dict[str, str] = {}  # job id -> its watched presence queue
        self.internal_errors = 0
        self.connections = 0  # times the manager got ready on a broker connection
        self.connected = threading.Event()

    def stop(self) -> None:
        """Ask the loop to end (thread-safe); it returns within a few milliseconds."""
        self._stop.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.ioloop.add_callback_threadsafe(self._close)
            except Exception:
                pass

    def serve_forever(self) -> None:
        import pika

        from . import amqp

        log.info(
            "sharing manager on %s: emuGPUs %s, policy %s, lease %.1f s, quantum %s, job keys %s",
            self.safe_url,
            ", ".join(
                f"{d.spec.name}={d.spec.gpu} ({_gib(d.spec.capacity_bytes)})" for d in self.core.devices.values()
            ),
            self.core.policy_name,
            self.core.lease_s,
            f"{self.core.quantum_s:g} s" if self.core.quantum_s else "off",
            "derived from the job secret" if self.core.job_secret else "brought by each job",
        )
        failures = 0
        lost_since: float | None = None
        last_report = 0.0
        while not self._stop.is_set():
            params = pika.URLParameters(self.url)
            params.connection_attempts = 1
            params.socket_timeout = 2
            self._lost = None
            try:
                self._conn = amqp.SelectConnection(
                    params,
                    on_open_callback=self._on_open,
                    on_open_error_callback=self._on_open_error,
                    on_close_callback=self._on_closed,
                )
                self._conn.ioloop.start()  # returns when the connection is closed (or failed)
            except Exception as exc:  # a bug in a callback must not end the daemon silently
                log.exception("sharing manager loop failed: %r", exc)
                self._lost = type(exc).__name__
                conn = self._conn
                if conn is not None and conn.is_open:
                    try:  # close cleanly (the loop runs until the broker confirms or the socket fails)
                        conn.close()
                        conn.ioloop.start()
                    except Exception:
                        pass
            was_connected = self.connected.is_set()
            self.connected.clear()
            self.core.forget_delivery_tags()
            self._conn = self._ch = self._timer = self._status_timer = None
            self._timer_at = None
            self._watch.clear()  # every watch channel went with the connection
            self._watch_of.clear()
            if self._stop.is_set():
                self.core.flush_log(self.clock(), final=True)  # rejections of the last window
                break
            now = time.monotonic()
            failures = 0 if was_connected else failures + 1
            if was_connected or lost_since is None:
                lost_since, last_report = now, now
                log.warning(
                    "lost the broker at %s (%s); reconnecting", self.safe_url, self._lost or "connection closed"
                )
            elif now - last_report >= self.LOST_REPORT_S:
                last_report = now
                log.warning(
                    "still cannot reach the broker at %s after %.0f s (%s); still trying",
                    self.safe_url,
                    now - lost_since,
                    self._lost or "connection closed",
                )
            self._stop.wait(
                min(self.reconnect_s * (2 ** min(failures, 6)), max(self.reconnect_s, self.MAX_RECONNECT_S))
            )

    # ------------------------------------------------------------------ connection life
    def _on_open_error(self, conn: Any, exc: BaseException) -> None:
        self._lost = type(exc).__name__
        conn.ioloop.stop()

    def _on_closed(self, conn: Any, reason: BaseException) -> None:
        self._lost = self._lost or type(reason).__name__
        conn.ioloop.stop()

    def _close(self) -> None:
        conn = self._conn
        if conn is None:
            return
        if conn.is_open:
            try:
                conn.close()  # _on_closed stops the loop
                return
            except Exception:
                pass
        if not conn.is_closing:
            conn.ioloop.stop()

    def _on_open(self, conn: Any) -> None:
        conn.channel(on_open_callback=self._on_channel)

    def _on_channel(self, ch: Any) -> None:
        self._ch = ch
        ch.add_on_close_callback(lambda ch_, reason: self._close())
        # No publisher confirms on replies: waiting for one per reply serialised every job
        # behind a broker round trip (it was most of the added latency). Channel order gives
        # what they would: a reply is published before the request is acked, on the same
        # channel, and the broker handles a channel's frames in order, so a request leaves the
        # queue only once its reply was routed. A reply lost after that (job gone, broker
        # crash) is sent again from memory when the job resends the request with the same id.
        ch.add_on_return_callback(self._on_returned)
        steps = [
            lambda cb: ch.exchange_declare(P.REQUEST_EXCHANGE, exchange_type="direct", durable=True, callback=cb),
            lambda cb: ch.queue_declare(P.REQUEST_QUEUE, durable=True, callback=cb),
            lambda cb: ch.queue_bind(
                P.REQUEST_QUEUE, P.REQUEST_EXCHANGE, routing_key=P.REQUEST_ROUTING_KEY, callback=cb
            ),
            lambda cb: ch.exchange_declare(P.STATUS_EXCHANGE, exchange_type="fanout", durable=True, callback=cb),
            lambda cb: ch.basic_qos(prefetch_count=self.prefetch, callback=cb),
        ]

        def run(i: int) -> None:
            if i == len(steps):
                self._on_ready()
            else:
                steps[i](lambda _frame: run(i + 1))

        run(0)

    def _on_ready(self) -> None:
        self._ch.basic_consume(P.REQUEST_QUEUE, self._on_message, auto_ack=False)
        # Jobs could not reach us while the broker was away: their leases restart now.
        now = self.clock()
        for job in self.core.jobs.values():
            job.last_seen = max(job.last_seen, now)
        self.connections += 1
        self.connected.set()
        log.info("connected to %s", self.safe_url)
        self._publish_status()
        self._tick()

    def _on_returned(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        # The job's reply queue is gone (the job died or reconnected); it resends if it comes back.
        log.debug("reply to a vanished queue %r dropped (%s)", method.routing_key, method.reply_text)

    # ------------------------------------------------------------------ work
    def _on_message(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        tag = method.delivery_tag
        try:
            headers = props.headers if isinstance(props.headers, dict) else {}
            sig = headers.get(P.SIG_HEADER)
            reply_to = props.reply_to if isinstance(props.reply_to, str) else None
            outs = self.core.receive(body, reply_to, tag, self.clock(), sig if isinstance(sig, str) else None)
        except Exception as exc:  # never let one message stop the service or come back redelivered
            self.internal_errors += 1
            self.core.rejected += 1
            log.exception("message rejected: handling it failed (%r)", exc)
            outs = [Outgoing(None, None, [tag])]
        self._send(outs)
        self._watch_presence()
        self._arm()

    def _send(self, outs: list[Outgoing]) -> None:
        import pika

        ch = self._ch
        for out in outs:
            if out.reply_to and out.payload is not None:
                body = P.encode(out.payload)
                headers = {P.SIG_HEADER: P.sign(out.key, body)} if out.key is not None else None
                try:
                    ch.basic_publish(
                        "",
                        out.reply_to,
                        body,
                        pika.BasicProperties(delivery_mode=1, content_type="application/json", headers=headers),
                        mandatory=True,
                    )
                except Exception as exc:  # a reply that cannot be written must not stop the others
                    log.warning("could not send a reply to %s: %r", P.short(out.reply_to), exc)
            for tag in out.ack:
                if tag is not None:
                    ch.basic_ack(tag)
        self._unwatch_dropped()

    # ------------------------------------------------------------------ presence of jobs
    def _watch_presence(self) -> None:
        seen = self.core.presence_seen
        if not seen:
            return
        self.core.presence_seen = []
        conn = self._conn
        if conn is None or not conn.is_open:
            return
        for job_id, queue in seen:
            if queue in self._watch or job_id not in self.core.jobs:
                continue
            old = self._watch_of.get(job_id)
            if old is not None:  # it reconnected with a new presence queue: watch that one instead
                self._unwatch(old)
            self._watch[queue] = _Watch(job_id)
            self._watch_of[job_id] = queue
            conn.channel(on_open_callback=lambda ch, q=queue: self._on_watch_channel(q, ch))

    def _on_watch_channel(self, queue: str, ch: Any) -> None:
        import pika

        watch = self._watch.get(queue)
        if watch is None or watch.closing:
            self._forget_watch(queue)
            ch.close()
            return
        watch.channel = ch
        ch.add_on_close_callback(lambda ch_, reason: self._on_watch_closed(queue, reason))
        ch.add_on_return_callback(lambda *_: self._presence_gone(queue, "its presence queue is gone"))
        ch.add_on_cancel_callback(lambda _frame: self._presence_gone(queue, "its presence queue was deleted"))
        # The job's consumer is the active one and holds this message; we are the standby.
        # Only when the job's connection closes does the broker hand the message to us.
        ch.basic_publish("", queue, b"gpemu-presence", pika.BasicProperties(delivery_mode=1), mandatory=True)
        ch.basic_consume(queue, lambda *_: self._presence_gone(queue, "its connection closed"), auto_ack=True)

    def _on_watch_closed(self, queue: str, reason: BaseException) -> None:
        watch = self._watch.get(queue)
        if watch is None or watch.closing:
            self._forget_watch(queue)
            return
        if getattr(reason, "reply_code", None) == 404:  # the queue is gone: so is its job's connection
            self._presence_gone(queue, "its presence queue is gone")
        self._forget_watch(queue)

    def _presence_gone(self, queue: str, why: str) -> None:
        watch = self._watch.get(queue)
        if watch is None or watch.closing:
            return
        log.info("job %r: %s", watch.job_id, why)
        job_id = watch.job_id
        self._unwatch(queue)
        # Timers die with this connection's I/O loop: a broker shutting down cancels the drop.
        self._conn.ioloop.call_later(self.PRESENCE_GRACE_S, lambda: self._drop_gone(job_id, queue))

    def _drop_gone(self, job_id: str, queue: str) -> None:
        if self._ch is None or not self._ch.is_open:
            return
        try:
            outs = self.core.connection_gone(job_id, queue, self.clock())
        except Exception as exc:  # pragma: no cover - a bug must not stop the loop
            log.exception("dropping job %r failed: %r", job_id, exc)
            return
        self._send(outs)
        self._arm()

    def _unwatch(self, queue: str) -> None:
        watch = self._watch.get(queue)
        if watch is None:
            return
        watch.closing = True
        ch = watch.channel
        if ch is not None and ch.is_open:
            try:
                ch.close()
            except Exception:
                pass
        if ch is not None:
            self._forget_watch(queue)

    def _forget_watch(self, queue: str) -> None:
        watch = self._watch.pop(queue, None)
        if watch is not None and self._watch_of.get(watch.job_id) == queue:
            del self._watch_of[watch.job_id]

    def _unwatch_dropped(self) -> None:
        if len(self._watch_of) == 0:
            return
        gone = [j for j in self._watch_of if j not in self.core.jobs]
        for job_id in gone:
            self._unwatch(self._watch_of[job_id])

    # ------------------------------------------------------------------ timers
    def _tick(self) -> None:
        """The timer: finish what is due (spinning the last moment before a close deadline)."""
        self._timer = self._timer_at = None
        if self._ch is None or not self._ch.is_open:
            return
        deadline = self.core.precise_deadline()
        if deadline is not None and deadline <= self.core.next_deadline() + self.SPIN_S:
            while 0 < deadline - self.clock() <= self.SPIN_S:
                pass  # the reply goes out on time instead of one timer granule late
        self._send(self.core.advance(self.clock()))
        self._arm()

    def _arm(self) -> None:
        """Keep one timer set for the core's next deadline."""
        deadline = self.core.next_deadline()
        if deadline is None or self._conn is None:
            return
        precise = self.core.precise_deadline()
        wake = deadline - self.SPIN_S if precise is not None and precise <= deadline else deadline
        if self._timer is not None:
            if self._timer_at is not None and self._timer_at <= wake:
                return
            self._conn.ioloop.remove_timeout(self._timer)
        self._timer_at = wake
        self._timer = self._conn.ioloop.call_later(max(0.0, wake - self.clock()), self._tick)

    def _publish_status(self) -> None:
        if self._ch is None or not self._ch.is_open:
            return
        import pika

        self.core.flush_log(self.clock())
        self._ch.basic_publish(
            P.STATUS_EXCHANGE,
            "",
            P.encode(self.core.status(self.clock())),
            pika.BasicProperties(content_type="application/json", expiration="5000"),
        )
        self._status_timer = self._conn.ioloop.call_later(self.status_interval_s, self._publish_status)
