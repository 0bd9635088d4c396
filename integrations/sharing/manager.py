"""The sharing manager: time-slices each emuGPU among registered jobs, one request at a time.

Two layers:

* :class:`SharingCore` — the scheduler. Pure state machine, no I/O, clock passed in: every
  input (a message, the passage of time) returns the replies to send. Unit-testable with a
  virtual clock.
* :class:`SharingManager` — the daemon: a pika consumer on the durable request queue that
  feeds the core, sleeps until the next absolute deadline (the earliest running request's end,
  lease expiry, status publication), publishes replies (acking a request after its reply, on the
  same channel), and reconnects
  when the broker goes away.

Reliability rules: a GPU-time request is acknowledged to the broker only after it has been
answered, so requests of a manager that dies are redelivered to the next one; request ids make
duplicate deliveries harmless (a request already queued or running is not queued again, one
already answered is answered again, never served again); jobs that stop sending heartbeats
for a lease period are dropped and their running request, queue and memory freed.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import protocol as P
from .policies import JobView, PendingView, Policy, load_policy

__all__ = ["SharingCore", "SharingManager", "Outgoing", "DeviceSpec", "parse_device", "DEFAULT_LOOKAHEAD_S",
           "DEFAULT_BACKDATE_S"]

log = logging.getLogger("gpemu.sharing.manager")

# Grant the next request this long before the emuGPU frees up: covers a late timer and the
# grant's delivery on a busy host (2 ms left 2-14 % of grants late with 16 jobs on 2 CPUs).
DEFAULT_LOOKAHEAD_S = 0.01
DEFAULT_BACKDATE_S = 0.05  # a request to an idle emuGPU may start up to this long before it arrived
_DONE_MEMORY = 512  # answered request ids remembered per job (dedup of late duplicates)
_SHARE_WINDOW_S = 5.0  # "recent share" in the status covers this many seconds


@dataclass(frozen=True)
class DeviceSpec:
    name: str  # emuGPU id jobs name in their messages, e.g. "0"
    gpu: str  # GPU model, e.g. "V100"
    capacity_bytes: int


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def _parse_size(text: str) -> int:
    low = text.strip().lower()
    num = low.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = low[len(num):]
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
        raise ValueError(f"--device {spec!r}: no profile database to look up {gpu}'s memory; "
                         f"give it explicitly, e.g. {name}={gpu}:16GiB")
    return DeviceSpec(name, gpu, int(gpu_memory(gpu)))


@dataclass
class Outgoing:
    """A reply to publish (``reply_to`` may be None: nothing to send) and delivery tags to ack after."""

    reply_to: str | None
    payload: dict[str, Any] | None
    ack: list[Any] = field(default_factory=list)


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
    started: float | None = None
    deadline: float | None = None
    grant: bool = False  # answered with a grant when scheduled, not with "done" at its end
    origin: float = 0.0  # when the job sent it (same host), else when it arrived
    sent_at: float | None = None  # the job's send time on our clock (same host only)


@dataclass
class _Job:
    job_id: str
    device: str
    token: str
    persistent_bytes: int
    register_rid: str
    view: JobView
    last_seen: float
    reply_to: str | None
    same_host: bool = False  # its time.monotonic() is ours: absolute deadlines, send times
    served_count: int = 0
    done: "OrderedDict[str, dict[str, Any]]" = field(default_factory=OrderedDict)
    active: dict[str, _Request] = field(default_factory=dict)


@dataclass
class _Device:
    spec: DeviceSpec
    policy: Policy
    jobs: dict[str, JobView] = field(default_factory=dict)
    pending: list[_Request] = field(default_factory=list)
    running: _Request | None = None
    # Scheduled after ``running`` (granted ahead by the lookahead), back to back, in order.
    reserved: deque = field(default_factory=deque)
    free_at: float = 0.0  # when the last request ended (chains back-to-back work exactly)
    busy_s: float = 0.0
    served: int = 0
    recent: deque = field(default_factory=deque)  # (end, job_id, seconds)


class SharingCore:
    """Scheduler state of every emuGPU. Not thread-safe: one caller (the daemon loop)."""

    def __init__(self, devices: Iterable[DeviceSpec], policy: str | type[Policy] = "fifo",
                 lease_s: float = 10.0, host: str = "", lookahead_s: float = 0.0,
                 backdate_s: float = 0.05) -> None:
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
        # host_identity() of the manager: jobs that register with the same one share its clock.
        self.host = host
        # Decide (and grant) the next request this long before the GPU frees up, so the grant
        # is at the job before its slot starts; the policy then chooses among the requests
        # that arrived up to this much before the slot boundary.
        self.lookahead_s = float(lookahead_s)
        # A same-host request that finds the emuGPU idle starts when the job sent it (at most
        # this long ago), as under a manager with no message latency; never before the end of
        # work already scheduled, so nothing overlaps.
        self.backdate_s = float(backdate_s)
        self.jobs: dict[str, _Job] = {}
        self._seq = 0
        self.rejected = 0
        self.refused = 0
        self.expired = 0
        self.started_at: float | None = None

    # ------------------------------------------------------------------ input: messages
    def receive(self, body: bytes, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        if self.started_at is None:
            self.started_at = now
        try:
            msg = P.parse_message(body)
        except P.ProtocolError as exc:
            return [self._reject(exc.reason, exc.request_id, reply_to, tag, None)]
        handler = getattr(self, "_on_" + msg.type.replace("-", "_"))
        out = handler(msg, reply_to, tag, now)
        return out + self.advance(now)

    def _reject(self, reason: str, rid: str | None, reply_to: str | None, tag: Any, job_id: str | None,
                code: str = P.ERR_BAD_MESSAGE) -> Outgoing:
        self.rejected += 1
        log.warning("rejected message%s: %s", f" from job {job_id!r}" if job_id else "", reason)
        payload = {"type": "error", "code": code, "reason": reason, "request_id": rid}
        return Outgoing(reply_to, payload, [tag])

    def _authorised(self, msg: P.Message) -> _Job | str:
        job = self.jobs.get(msg.job_id)
        if job is None:
            return P.ERR_UNKNOWN_JOB
        if not secrets.compare_digest(job.token, msg.token):
            return P.ERR_BAD_TOKEN
        return job

    def _on_register(self, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        dev = self.devices.get(msg.device)
        if dev is None:
            return [self._reject(f"unknown emuGPU {msg.device!r}; this manager has {', '.join(self.devices)}",
                                 msg.request_id, reply_to, tag, msg.job_id, P.ERR_UNKNOWN_DEVICE)]
        job = self.jobs.get(msg.job_id)
        if job is not None:
            # A duplicate delivery, or the same job registering again with its token (it took a
            # stale heartbeat error for a lost registration): the same answer, nothing changes.
            if job.register_rid == msg.request_id or (msg.token and secrets.compare_digest(job.token, msg.token)):
                job.last_seen, job.reply_to = now, reply_to
                return [Outgoing(reply_to, self._registered(job, msg.request_id), [tag])]
            return [self._reject(f"job id {msg.job_id!r} is already registered", msg.request_id, reply_to, tag,
                                 msg.job_id, P.ERR_JOB_EXISTS)]
        used = sum(self.jobs[j].persistent_bytes for j in dev.jobs)
        if used + msg.persistent_bytes > dev.spec.capacity_bytes:
            self.refused += 1
            reason = (f"registration refused: persistent memory {_gib(msg.persistent_bytes)} does not fit on "
                      f"emuGPU {dev.spec.name} ({dev.spec.gpu}, {_gib(dev.spec.capacity_bytes)}): "
                      f"{_gib(used)} is held by {len(dev.jobs)} other job(s)")
            log.info("%s (job %r)", reason, msg.job_id)
            return [Outgoing(reply_to, {"type": "refused", "request_id": msg.request_id, "reason": reason}, [tag])]
        view = JobView(msg.job_id, msg.weight)
        job = _Job(msg.job_id, msg.device, secrets.token_hex(16), msg.persistent_bytes, msg.request_id, view,
                   now, reply_to, same_host=bool(self.host) and msg.host == self.host)
        self.jobs[msg.job_id] = job
        dev.jobs[msg.job_id] = view
        dev.policy.registered(view, dev.jobs)
        log.info("job %r registered on emuGPU %s (persistent %s, weight %g)", msg.job_id, dev.spec.name,
                 _gib(msg.persistent_bytes), msg.weight)
        return [Outgoing(reply_to, self._registered(job), [tag])]

    def _registered(self, job: _Job, rid: str | None = None) -> dict[str, Any]:
        return {"type": "registered", "request_id": rid or job.register_rid, "job_id": job.job_id, "token": job.token,
                "lease_s": self.lease_s, "same_host": job.same_host}

    def _on_request(self, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        job = self._authorised(msg)
        if isinstance(job, str):
            return [self._reject(f"{job}: request {msg.request_id!r} for job {msg.job_id!r}", msg.request_id,
                                 reply_to, tag, msg.job_id, job)]
        job.last_seen = now
        if msg.device != job.device:
            return [self._reject(f"job {msg.job_id!r} is registered on emuGPU {job.device!r}, not {msg.device!r}",
                                 msg.request_id, reply_to, tag, msg.job_id, P.ERR_UNKNOWN_DEVICE)]
        if msg.request_id in job.done:  # answered before: answer again, never serve again
            payload = job.done[msg.request_id]
            if payload.get("type") == "granted":  # a job on another host counts from the reply
                payload = {**payload, "remaining_s": max(0.0, payload["end"] - now)}
            return [Outgoing(reply_to, payload, [tag])]
        if msg.persistent_bytes is not None:
            # What the job holds between iterations now; checked against others' requests from now on.
            job.persistent_bytes = msg.persistent_bytes
        req = job.active.get(msg.request_id)
        if req is not None:  # queued or running: remember where to answer, ack with it
            req.reply_to = reply_to or req.reply_to
            req.tags.append(tag)
            return []
        self._seq += 1
        req = _Request(msg.request_id, job.job_id, msg.seconds, msg.peak_bytes, self._seq, now, reply_to, [tag],
                       msg.kind, grant=msg.grant, origin=now)
        if job.same_host and msg.sent_at is not None:
            # Never later than now (a clock cannot run ahead) nor more than backdate_s ago.
            req.sent_at = min(msg.sent_at, now)
            req.origin = max(req.sent_at, now - self.backdate_s)
        job.active[req.rid] = req
        self.devices[job.device].pending.append(req)
        return []

    def _on_heartbeat(self, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        job = self._authorised(msg)
        if isinstance(job, str):
            return [self._reject(f"{job}: heartbeat for job {msg.job_id!r}", None, reply_to, tag, msg.job_id, job)]
        job.last_seen = now
        return [Outgoing(reply_to, {"type": "heartbeat-ack", "job_id": job.job_id}, [tag])]

    def _on_deregister(self, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        job = self._authorised(msg)
        if job == P.ERR_UNKNOWN_JOB:  # already gone (duplicate, or expired): the outcome is the same
            return [Outgoing(reply_to, {"type": "deregistered", "request_id": msg.request_id}, [tag])]
        if isinstance(job, str):
            return [self._reject(f"{job}: deregister for job {msg.job_id!r}", msg.request_id, reply_to, tag,
                                 msg.job_id, job)]
        out = self._drop_job(job, now, "deregistered")
        out.append(Outgoing(reply_to, {"type": "deregistered", "request_id": msg.request_id}, [tag]))
        return out

    def _on_status(self, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
        snap = self.status(now)
        snap["request_id"] = msg.request_id or None
        return [Outgoing(reply_to, snap, [tag])]

    # ------------------------------------------------------------------ input: time
    def advance(self, now: float) -> list[Outgoing]:
        """Finish requests whose deadline passed, start the next ones, expire silent jobs."""
        out: list[Outgoing] = []
        for job in [j for j in self.jobs.values() if now - j.last_seen > self.lease_s]:
            self.expired += 1
            log.warning("job %r sent nothing for %.1f s (lease %.1f s): dropped, its GPU time and memory freed",
                        job.job_id, now - job.last_seen, self.lease_s)
            out += self._drop_job(job, now, "lease expired")
        for dev in self.devices.values():
            while True:
                run = dev.running
                if run is not None and run.deadline <= now:
                    out.append(self._finish(dev, run, run.deadline))
                    dev.running = dev.reserved.popleft() if dev.reserved else None
                    continue
                tail = dev.reserved[-1] if dev.reserved else run
                if not dev.pending or (tail is not None and tail.deadline - self.lookahead_s > now):
                    break
                out += self._start_next(dev, now, tail)
        return out

    def _start_next(self, dev: _Device, now: float, tail: _Request | None) -> list[Outgoing]:
        pending = [PendingView(r.job_id, r.seq, r.seconds) for r in dev.pending]
        chosen = dev.policy.pick(pending, dev.jobs)
        req = next(r for r in dev.pending if r.seq == chosen.seq)
        dev.pending.remove(req)
        job = self.jobs[req.job_id]
        others = sum(self.jobs[j].persistent_bytes for j in dev.jobs if j != req.job_id)
        need = max(req.peak_bytes, job.persistent_bytes)
        if others + need > dev.spec.capacity_bytes:
            self.refused += 1
            reason = (f"CUDA out of memory on emuGPU {dev.spec.name} ({dev.spec.gpu}, "
                      f"{_gib(dev.spec.capacity_bytes)} total): this request's peak {_gib(need)} plus "
                      f"{_gib(others)} persistent memory of {len(dev.jobs) - 1} other job(s) sharing it")
            payload = {"type": "refused", "request_id": req.rid, "reason": reason}
            return [self._answer(job, req, payload)]
        # Back-to-back work starts when the previous request ends, not when the loop noticed;
        # on an idle emuGPU it starts when the job sent it (same host, see backdate_s).
        free = tail.deadline if tail is not None else min(now, dev.free_at)
        req.started = max(req.origin, free)
        req.deadline = req.started + req.seconds
        if tail is None:
            dev.running = req
        else:
            dev.reserved.append(req)
        # Charged when scheduled: a lookahead decision then sees the slots already given (a job
        # is not picked again for time it has not been charged yet), and the figures are in
        # place before the grant reaches the job. A dropped job's unused time is taken back.
        job.view.served_s += req.seconds
        dev.policy.served(job.view, req.seconds)
        dev.busy_s += req.seconds
        dev.served += 1
        job.served_count += 1
        dev.recent.append((req.deadline, job.job_id, req.seconds))
        if not req.grant:
            return []
        # GPU time lost while the request travelled to us: idle emuGPU, request already sent.
        idle = max(0.0, req.started - max(req.sent_at, free)) if req.sent_at is not None else None
        payload = {"type": "granted", "request_id": req.rid, "start": req.started, "end": req.deadline,
                   "remaining_s": max(0.0, req.deadline - now), "seconds": req.seconds,
                   "waited_s": max(0.0, req.started - req.origin), "idle_s": idle}
        return [self._answer(job, req, payload)]

    def _finish(self, dev: _Device, req: _Request, end: float) -> Outgoing:
        job = self.jobs[req.job_id]
        dev.free_at = end
        if req.grant:  # answered (and acknowledged) when it was granted
            return Outgoing(None, None, [])
        payload = {"type": "done", "request_id": req.rid, "served_s": max(0.0, end - req.started),
                   "waited_s": max(0.0, req.started - req.origin)}
        return self._answer(job, req, payload)

    def _answer(self, job: _Job, req: _Request, payload: dict[str, Any]) -> Outgoing:
        job.active.pop(req.rid, None)
        job.done[req.rid] = payload
        while len(job.done) > _DONE_MEMORY:
            job.done.popitem(last=False)
        return Outgoing(req.reply_to, payload, req.tags)

    def _drop_job(self, job: _Job, now: float, why: str) -> list[Outgoing]:
        dev = self.devices[job.device]
        out: list[Outgoing] = []
        # Slots granted ahead to other jobs keep their times (their grants are out); the
        # dropped job's own future slots are freed.
        for req in [r for r in dev.reserved if r.job_id == job.job_id]:
            dev.reserved.remove(req)
            dev.busy_s -= req.seconds
            dev.served -= 1
            out.append(Outgoing(None, None, [] if req.grant else req.tags))
        if dev.running is not None and dev.running.job_id == job.job_id:
            run = dev.running
            dev.free_at = max(run.started, min(now, run.deadline))
            dev.busy_s -= run.deadline - dev.free_at  # the slot's unused rest is free again
            dev.running = dev.reserved.popleft() if dev.reserved else None
            out.append(Outgoing(None, None, [] if run.grant else run.tags))
        for req in [r for r in dev.pending if r.job_id == job.job_id]:
            dev.pending.remove(req)
            out.append(Outgoing(None, None, req.tags))
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
                ends.append(d.running.deadline)
                if d.pending:  # the next decision, a lookahead before the tail of the timeline ends
                    ends.append((d.reserved[-1] if d.reserved else d.running).deadline - self.lookahead_s)
        if self.jobs:
            ends.append(min(j.last_seen for j in self.jobs.values()) + self.lease_s + 1e-3)
        return min(ends) if ends else None

    def precise_deadline(self) -> float | None:
        """The earliest end that is answered with a "done" reply at that moment (legacy clients).

        Only those need the loop on time to the microsecond; a granted request's end only
        frees the emuGPU on the timeline, which was fixed when it was granted.
        """
        ends = [d.running.deadline for d in self.devices.values() if d.running is not None and not d.running.grant]
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
            devices.append({
                "device": dev.spec.name, "gpu": dev.spec.gpu, "capacity_bytes": dev.spec.capacity_bytes,
                "persistent_bytes": sum(self.jobs[j].persistent_bytes for j in dev.jobs),
                "jobs": len(dev.jobs), "queue": len(dev.pending),
                "running": dev.running.job_id if dev.running else None,
                "served_requests": dev.served, "busy_s": dev.busy_s, "utilisation": min(1.0, dev.busy_s / up),
            })
            for view in dev.jobs.values():
                job = self.jobs[view.job_id]
                jobs.append({
                    "job_id": view.job_id, "device": dev.spec.name, "weight": view.weight,
                    "persistent_bytes": job.persistent_bytes, "served_s": view.served_s,
                    "served_requests": job.served_count, "queued": len(job.active),
                    "share": view.served_s / total, "recent_share": recent.get(view.job_id, 0.0) / total_recent,
                })
        return {"type": "status", "policy": self.policy_name, "lease_s": self.lease_s, "time": time.time(),
                "devices": devices, "jobs": jobs,
                "rejected": self.rejected, "refused": self.refused, "expired": self.expired}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


class SharingManager:
    """The daemon around :class:`SharingCore`: consume, schedule, reply, reconnect.

    Asynchronous (pika ``SelectConnection``): one I/O loop, no blocking round trips. A reply and
    the ack of the request it answers are written together, in that order, on one channel; one
    timer is kept armed for the core's next deadline (the earliest running request's end, a
    lease expiry) and another publishes the status.
    """

    # The epoll timer fires up to ~1 ms late (millisecond resolution plus scheduling); this
    # much before the end of a request answered with "done" the loop stops sleeping and spins
    # to reply on time. Granted requests need no spin: their times were fixed when granted, and
    # the lookahead covers a late timer (spinning took a CPU from the broker and the jobs).
    SPIN_S = 0.001

    def __init__(self, url: str, devices: Iterable[DeviceSpec], policy: str | type[Policy] = "fifo",
                 lease_s: float = 10.0, status_interval_s: float = 1.0, reconnect_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic, prefetch: int = 2000,
                 lookahead_s: float = DEFAULT_LOOKAHEAD_S, backdate_s: float = DEFAULT_BACKDATE_S) -> None:
        from gpemu.units import redact_url

        self.url = url
        self.safe_url = redact_url(url)
        # Grants carry absolute times on our clock; only time.monotonic is shared with jobs.
        host = P.host_identity() if clock is time.monotonic else ""
        self.core = SharingCore(devices, policy, lease_s, host=host, lookahead_s=lookahead_s,
                                backdate_s=backdate_s)
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
        self._props: Any = None
        self._lost: str | None = None
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

        log.info("sharing manager on %s: emuGPUs %s, policy %s, lease %.1f s", self.safe_url,
                 ", ".join(f"{d.spec.name}={d.spec.gpu} ({_gib(d.spec.capacity_bytes)})"
                           for d in self.core.devices.values()), self.core.policy_name, self.core.lease_s)
        self._props = pika.BasicProperties(delivery_mode=1, content_type="application/json")
        while not self._stop.is_set():
            params = pika.URLParameters(self.url)
            params.connection_attempts = 1
            params.socket_timeout = 2
            self._lost = None
            try:
                self._conn = amqp.SelectConnection(params, on_open_callback=self._on_open,
                                                   on_open_error_callback=self._on_open_error,
                                                   on_close_callback=self._on_closed)
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
            self.connected.clear()
            self.core.forget_delivery_tags()
            self._conn = self._ch = self._timer = self._status_timer = None
            self._timer_at = None
            if self._stop.is_set():
                break
            log.warning("lost the broker at %s (%s); reconnecting every %.1f s", self.safe_url,
                        self._lost or "connection closed", self.reconnect_s)
            self._stop.wait(self.reconnect_s)

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
        ch.exchange_declare(P.STATUS_EXCHANGE, exchange_type="fanout", durable=True,
                            callback=lambda _: ch.queue_declare(P.REQUEST_QUEUE, durable=True,
                                                                callback=self._on_queue))

    def _on_queue(self, _frame: Any) -> None:
        self._ch.basic_qos(prefetch_count=self.prefetch, callback=self._on_qos)

    def _on_qos(self, _frame: Any) -> None:
        self._ch.basic_consume(P.REQUEST_QUEUE, self._on_message, auto_ack=False)
        # Jobs could not reach us while the broker was away: their leases restart now.
        now = self.clock()
        for job in self.core.jobs.values():
            job.last_seen = max(job.last_seen, now)
        self.connected.set()
        log.info("connected to %s", self.safe_url)
        self._publish_status()
        self._tick()

    def _on_returned(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        # The job's reply queue is gone (the job died); it resends if it comes back.
        log.info("reply to a vanished queue %r dropped (%s)", method.routing_key, method.reply_text)

    # ------------------------------------------------------------------ work
    def _on_message(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        self._send(self.core.receive(body, props.reply_to, method.delivery_tag, self.clock()))
        self._arm()

    def _send(self, outs: list[Outgoing]) -> None:
        ch = self._ch
        for out in outs:
            if out.reply_to and out.payload is not None:
                ch.basic_publish("", out.reply_to, P.encode(out.payload), self._props, mandatory=True)
            for tag in out.ack:
                if tag is not None:
                    ch.basic_ack(tag)

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
        if deadline is None:
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

        self._ch.basic_publish(P.STATUS_EXCHANGE, "", P.encode(self.core.status(self.clock())),
                               pika.BasicProperties(content_type="application/json", expiration="5000"))
        self._status_timer = self._conn.ioloop.call_later(self.status_interval_s, self._publish_status)
