"""The sharing manager's core: every input (a message, the passage of time, a job's connection
closing) turns into the replies to send. Pure state machine, no I/O, clock passed in.

:class:`SharingCore` validates and authenticates each message (:mod:`.protocol`), keeps the
registered jobs and their memory, and hands GPU-time requests to the scheduler it extends
(:class:`~.scheduler.Scheduler`). Every rejection of a job's message goes back to the job
signed with its key whenever the message proves it holds that key, so the job hears the reason
at once instead of waiting for a reply it would drop as forged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from . import protocol as P
from .policies import JobView, Policy, load_policy
from .scheduler import Scheduler
from .state import (
    DEFAULT_QUANTUM_S,
    MAX_ACTIVE_PER_JOB,
    MAX_JOBS,
    DeviceSpec,
    DeviceState,
    JobState,
    LogBudget,
    Outgoing,
    QueuedRequest,
    gib,
)

__all__ = ["SharingCore"]

log = logging.getLogger("gpemu.sharing.manager")


class SharingCore(Scheduler):
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
        clock: str = "real",
        expected_jobs: int = 0,
    ) -> None:
        policy_cls = load_policy(policy) if isinstance(policy, str) else policy
        self.policy_name = getattr(policy_cls, "name", policy_cls.__name__)
        self.devices: dict[str, DeviceState] = {d.name: DeviceState(d, policy_cls()) for d in devices}
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
        if clock not in P.CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(P.CLOCKS)}, got {clock!r}")
        if not 0 <= expected_jobs <= self.max_jobs:
            raise ValueError(f"expected jobs must be from 0 to {self.max_jobs}, got {expected_jobs!r}")
        # Virtual time (protocol, "Virtual time"): jobs say when they send; the emuGPUs' timeline
        # is virtual, decided as far as every job has spoken; the first slot waits for
        # ``expected_jobs`` registrations (a closed set of jobs, e.g. a scheduling study's).
        self.virtual = clock == "virtual"
        self.expected_jobs = int(expected_jobs)
        self.jobs_seen = 0
        self.jobs: dict[str, JobState] = {}
        self._seq = 0
        self.rejected = 0
        self.refused = 0
        self.expired = 0
        self.disconnected = 0  # jobs dropped because the broker closed their connection
        self.started_at: float | None = None
        self._log_budget = LogBudget()
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
            key = self._sender_key(exc, body, sig)
            return [self._reject(exc.reason, exc.request_id, reply_to, tag, exc.job_id, now, P.ERR_BAD_MESSAGE, key)]
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

    def _sender_key(self, exc: P.ProtocolError, body: bytes, sig: str | None) -> bytes | None:
        """The key of the job that sent a message we reject, when the message is signed with it
        (its registered key, the key derived from the job secret, or a register's own key): the
        rejection is then signed with it and reaches the job, which drops unsigned replies."""
        if exc.job_id is None:
            return None
        job = self.jobs.get(exc.job_id)
        candidates = [job.key if job is not None else None]
        if self.job_secret is not None:
            candidates.append(P.derive_job_key(self.job_secret, exc.job_id))
        elif job is None:
            candidates.append(exc.key)
        return next((k for k in candidates if k is not None and P.verify(k, body, sig)), None)

    def _saw_presence(self, job: JobState, queue: str) -> None:
        job.presence = queue
        self.presence_seen.append((job.job_id, queue))

    def _refuse(
        self,
        msg: P.Message,
        reply_to: str | None,
        tag: Any,
        now: float,
        reason: str,
        code: str = P.ERR_BAD_MESSAGE,
        key: bytes | None = None,
    ) -> list[Outgoing]:
        """A rejection of ``msg`` (see :meth:`_reject`), as the handlers return it."""
        return [self._reject(reason, msg.request_id or None, reply_to, tag, msg.job_id, now, code, key)]

    def _register_key(self, msg: P.Message, body: bytes, sig: str | None) -> tuple[bytes | None, str | None]:
        """(the registering job's key, why it is refused): derived from the job secret, or the
        job's own; the register must be signed with it."""
        if self.job_secret is not None:
            key: bytes | None = P.derive_job_key(self.job_secret, msg.job_id)
            if msg.key is not None and msg.key != key:
                key = None  # a key of its own where the manager derives them: not a job it issued
        else:
            key = msg.key
            if key is None:
                return None, (
                    f"register of job {P.short(msg.job_id)} carries no key; this manager has no "
                    "job secret, so each job sends its own"
                )
        if not P.verify(key, body, sig):
            return None, f"{P.ERR_BAD_SIGNATURE}: register of job {P.short(msg.job_id)} is not signed with its key"
        return key, None

    def _on_register(
        self, msg: P.Message, reply_to: str | None, tag: Any, now: float, body: bytes, sig: str | None
    ) -> list[Outgoing]:
        key, problem = self._register_key(msg, body, sig)
        if key is None:
            code = P.ERR_BAD_SIGNATURE if problem and problem.startswith(P.ERR_BAD_SIGNATURE) else P.ERR_BAD_MESSAGE
            return self._refuse(msg, reply_to, tag, now, problem or "", code)
        dev = self.devices.get(msg.device)
        if dev is None:
            reason = f"unknown emuGPU {P.short(msg.device)}; this manager has {', '.join(self.devices)}"
            return self._refuse(msg, reply_to, tag, now, reason, P.ERR_UNKNOWN_DEVICE, key)
        problem = self._clock_problem(msg)
        if problem is not None:
            return self._refuse(msg, reply_to, tag, now, problem, P.ERR_BAD_MESSAGE, key)
        job = self.jobs.get(msg.job_id)
        if job is not None:
            # A duplicate delivery, or the same job registering again with its key (it took an
            # error for a lost registration): the same answer, nothing changes.
            if job.key == key and job.device == msg.device:
                job.last_seen, job.reply_to = now, reply_to
                if msg.presence:
                    self._saw_presence(job, msg.presence)
                return [Outgoing(reply_to, self._registered(job, msg.request_id), [tag], job.key)]
            reason = f"job id {P.short(msg.job_id)} is already registered"
            return self._refuse(msg, reply_to, tag, now, reason, P.ERR_JOB_EXISTS, key)
        if len(self.jobs) >= self.max_jobs:
            return self._refuse(msg, reply_to, tag, now, f"this manager already serves {self.max_jobs} jobs",
                                P.ERR_BUSY, key)  # fmt: skip
        used = sum(self.jobs[j].persistent_bytes for j in dev.jobs)
        persistent = int(msg.persistent_bytes or 0)  # (always set on a register: see protocol)
        if used + persistent > dev.spec.capacity_bytes:
            self.refused += 1
            reason = (
                f"registration refused: persistent memory {gib(persistent)} does not fit on "
                f"emuGPU {dev.spec.name} ({dev.spec.gpu}, {gib(dev.spec.capacity_bytes)}): "
                f"{gib(used)} is held by {len(dev.jobs)} other job(s)"
            )
            log.info("%s (job %r)", reason, msg.job_id)
            return [Outgoing(reply_to, {"type": "refused", "request_id": msg.request_id, "reason": reason}, [tag], key)]
        return [Outgoing(reply_to, self._registered(self._admit(msg, dev, key, reply_to, now)), [tag], key)]

    def _clock_problem(self, msg: P.Message) -> str | None:
        """Why a job's clock does not fit this manager's (one line for the job), or None."""
        if self.virtual and msg.clock != "virtual":
            return (
                "this sharing manager runs on virtual time (share-manager --clock virtual): run the job on "
                "virtual time too (gpemu run --clock virtual, or SharingClient(clock='virtual'))"
            )
        if not self.virtual and msg.clock == "virtual":
            return (
                "this sharing manager runs on real time: a job on virtual time needs a manager started with "
                "`gpemu share-manager --clock virtual`"
            )
        if self.virtual and msg.vtime is None:
            return "a job on virtual time must register with its vtime"
        return None

    def _admit(self, msg: P.Message, dev: DeviceState, key: bytes, reply_to: str | None, now: float) -> JobState:
        """A new job on ``dev``: its state, its place in the policy, its route."""
        view = JobView(msg.job_id, msg.weight)
        job = JobState(
            msg.job_id,
            msg.device,
            key,
            int(msg.persistent_bytes or 0),
            msg.request_id,
            view,
            now,
            reply_to,
            same_host=bool(self.host) and msg.host == self.host,
            route=P.new_route(),
        )
        if msg.vtime is not None:
            job.frontier = msg.vtime
        self.jobs_seen += 1
        self.jobs[msg.job_id] = job
        dev.jobs[msg.job_id] = view
        if self.virtual:  # the policy hears of it when the virtual timeline reaches its arrival
            dev.joining.append((job.frontier, msg.job_id))
        else:
            dev.policy.registered(view, dev.jobs)
        if msg.presence:
            self._saw_presence(job, msg.presence)
        log.info(
            "job %r registered on emuGPU %s (persistent %s, weight %g)",
            msg.job_id,
            dev.spec.name,
            gib(job.persistent_bytes),
            msg.weight,
        )
        return job

    def _registered(self, job: JobState, rid: str | None = None) -> dict[str, Any]:
        return {
            "type": "registered",
            "request_id": rid or job.register_rid,
            "job_id": job.job_id,
            "lease_s": self.lease_s,
            "same_host": job.same_host,
            "route": job.route,
            "clock": "virtual" if self.virtual else "real",
        }

    def _on_request(self, job: JobState, msg: P.Message, reply_to: str | None, tag: Any, now: float) -> list[Outgoing]:
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
        if self.virtual and (msg.vtime is None or not msg.grant):
            reason = "on virtual time a request needs its vtime and grant: true (SharingClient(clock='virtual'))"
            return [self._reject(reason, msg.request_id, reply_to, tag, msg.job_id, now, P.ERR_BAD_MESSAGE, job.key)]
        if msg.persistent_bytes is not None:
            # What the job holds between iterations now; checked against others' requests from now on.
            job.persistent_bytes = msg.persistent_bytes
        self._seq += 1
        req = QueuedRequest(
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
        if self.virtual and msg.vtime is not None:
            # Sent at its virtual time, and never before the end of the job's previous grant.
            req.origin = max(msg.vtime, job.frontier)
        elif job.same_host and msg.sent_at is not None:
            # Never later than now (a clock cannot run ahead) nor more than backdate_s ago.
            req.sent_at = min(msg.sent_at, now)
            req.origin = max(req.sent_at, now - self.backdate_s)
        job.active[req.rid] = req
        self.devices[job.device].pending.append(req)
        return []

    def _on_heartbeat(
        self, job: JobState, msg: P.Message, reply_to: str | None, tag: Any, now: float
    ) -> list[Outgoing]:
        return [Outgoing(reply_to, {"type": "heartbeat-ack", "job_id": job.job_id}, [tag], job.key)]

    def _on_deregister(
        self, job: JobState, msg: P.Message, reply_to: str | None, tag: Any, now: float
    ) -> list[Outgoing]:
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
