"""A job's side of GPU sharing: :class:`SharingClient` (standalone) and the emulator component.

Standalone (no emulator needed)::

    with SharingClient(url, job_id="job-a", device="0", persistent_bytes=300 << 20) as job:
        for _ in range(iterations):
            job.run(seconds=0.075, peak_bytes=5 << 30)   # blocks until the manager ran it

Inside the emulator the component ``install(rt)`` is a no-op unless ``config.sharing`` is set
(``patch(sharing="amqp://…")``, ``GPEMU_SHARING``, ``gpemu run --share``). It then plugs a
GPU-time backend into the time engine: GPU work is collected per device and sent as one
request per iteration (``sharing_granularity``), and the wait is recorded as a host wait
with reason ``"sharing"`` plus the ``sharing_wait_s`` counter.

Security: every message is signed with the job's key and every reply must carry the manager's
signature under the same key; anything else is dropped and counted in ``forged_replies`` (see
:mod:`.protocol`). Reply queues are exclusive to the job's connection. Under Kubernetes the
device plugin hands each container its job id and key (and the broker password) in the file
``sharing.json`` next to its emuGPU files; elsewhere the job makes up its own key.

Reliability: a request keeps its id when it is resent (after a lost reply, a broker restart or
a manager restart), so the manager never serves it twice; a heartbeat thread keeps the job's
lease and holds its presence queue (the manager learns at once when this process dies); if the
manager forgot the job (restart) the client registers again and resends. If the broker or the
manager stays away for ``manager_timeout_s`` the client raises :class:`SharingUnavailableError`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpemu.clock import REAL
from gpemu.units import redact_url

from . import protocol as P

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime
    from gpemu.time import Grant

__all__ = [
    "SharingClient",
    "SharingUnavailableError",
    "SharingRefusedError",
    "RunResult",
    "SharingBackend",
    "JobCredentials",
    "load_job_credentials",
    "with_password",
    "CREDENTIALS_FILE",
    "install",
]

CREDENTIALS_FILE = "sharing.json"  # in GPEMU_DEVICE_DIR, written by the device plugin's Allocate
# Re-deliver the held presence message this often: RabbitMQ closes a channel that keeps a
# delivery unacknowledged longer than its consumer timeout (30 min by default).
_PRESENCE_RENEW_S = 600.0


class SharingUnavailableError(RuntimeError):
    """The broker or the sharing manager did not answer for too long."""


class _RouteGone(Exception):
    """Our own request queue is gone (a new manager): register again, then resend."""


class SharingRefusedError(ValueError):
    """The manager refused to register the job (its persistent memory does not fit, bad id, ...)."""


@dataclass(frozen=True)
class JobCredentials:
    """What the device plugin gives one container: its job id, keys and broker password."""

    job_id: str
    # job id (the container's, or "<id>.<device index>") -> key; empty when the manager has no
    # job secret (each job then brings its own key)
    keys: dict[str, bytes]
    amqp_password: str | None = None

    def __repr__(self) -> str:  # never print a secret
        return f"JobCredentials(job_id={self.job_id!r}, keys=<{len(self.keys)} hidden>, amqp_password=<hidden>)"


def load_job_credentials(device_dir: str | os.PathLike[str] | None) -> JobCredentials | None:
    """The credentials file in ``device_dir`` (None when there is none). ValueError when unreadable."""
    if not device_dir:
        return None
    path = Path(device_dir) / CREDENTIALS_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read the sharing credentials {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw[:65536])
        keys = {str(k): bytes.fromhex(v) for k, v in data["keys"].items()}
        job_id = data["job_id"]
        password = data.get("amqp_password")
        if (
            not isinstance(job_id, str)
            or not job_id
            or (keys and job_id not in keys)
            or not all(len(k) == P.KEY_BYTES for k in keys.values())
            or not isinstance(password, (str, type(None)))
        ):
            raise ValueError
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ValueError(
            f"the sharing credentials {path} are not valid (expected JSON with job_id, keys, "
            "amqp_password as written by `gpemu k8s plugin`)"
        ) from None
    return JobCredentials(job_id, keys, password)


def with_password(url: str, password: str | None) -> str:
    """``url`` with ``password`` filled in when the URL names a user but no password."""
    from gpemu.config import fill_amqp_password

    return fill_amqp_password(url, password)


@dataclass(frozen=True)
class RunResult:
    request_id: str
    seconds: float  # GPU time asked for
    waited_s: float  # time the manager kept the request queued behind other jobs
    elapsed_s: float  # wall time from sending the request to returning
    # Deadline scheduling (a ``granted`` reply); all on this process's time.monotonic():
    scheduled_end: float | None = None  # where the work ends on the emuGPU's timeline
    resumed_at: float | None = None  # when run() stopped waiting (>= scheduled_end)
    idle_s: float = 0.0  # emuGPU idle because this request was still travelling to the manager
    exact: bool = False  # scheduled_end is the manager's own (shared clock), not reply + remaining
    scheduled_start: float | None = None  # the manager's start of the work (exact only)
    granted_at: float | None = None  # when the grant reached this job

    @property
    def added_s(self) -> float | None:
        """Time lost to the manager against one with no latency following the same schedule."""
        if self.scheduled_end is None or self.resumed_at is None:
            return None
        return max(0.0, self.resumed_at - self.scheduled_end) + self.idle_s


class _Heartbeat(threading.Thread):
    """Own connection (pika connections are single-threaded): keeps the job's lease alive and
    holds its presence queue, so the manager learns at once when this process is gone."""

    def __init__(self, client: SharingClient) -> None:
        super().__init__(name=f"gpemu-sharing-heartbeat-{client.job_id}", daemon=True)
        self.client = client
        self.stop_event = threading.Event()
        self.wake = threading.Event()  # send a heartbeat now (just registered)
        self._marker: tuple[Any, float] | None = None  # (delivery tag, when) of the held message

    def run(self) -> None:
        from .amqp import blocking_connection, request_channel

        c = self.client
        conn = ch = queue = None
        while not self.stop_event.is_set():
            period = max(0.05, c.lease_s / 3.0)
            try:
                if conn is None or not conn.is_open:
                    conn = blocking_connection(c._params())
                    ch = request_channel(conn)
                    queue = P.reply_queue_name()
                    ch.queue_declare(queue, exclusive=True)
                    ch.basic_consume(queue, self._on_reply, auto_ack=True)
                    # Single active consumer: we are first, so the manager (consuming after us)
                    # waits as the standby and gets the held message only when we are gone.
                    presence = P.reply_queue_name()
                    ch.queue_declare(
                        presence,
                        auto_delete=True,
                        arguments={"x-single-active-consumer": True, "x-expires": int(max(60.0, 4 * c.lease_s) * 1000)},
                    )
                    ch.basic_qos(prefetch_count=1)
                    ch.basic_consume(presence, self._on_presence, auto_ack=False)
                    self._marker = None
                    c.presence = presence
                self.wake.clear()
                if c.registered:
                    c._publish_on(
                        ch,
                        {"type": "heartbeat", "job_id": c.job_id, "presence": c.presence},
                        queue,
                        expiration=str(int(c.lease_s * 1000)),
                    )
                if (
                    ch is not None
                    and self._marker is not None
                    and time.monotonic() - self._marker[1] > _PRESENCE_RENEW_S
                ):
                    tag, self._marker = self._marker[0], None
                    ch.basic_reject(tag, requeue=True)  # comes straight back to us, the active consumer
                deadline = time.monotonic() + period
                while not self.stop_event.is_set() and not self.wake.is_set() and time.monotonic() < deadline:
                    conn.process_data_events(time_limit=min(0.05, max(0.0, deadline - time.monotonic())))
            except Exception:
                conn = None
                self.stop_event.wait(min(period, 0.5))
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:
                pass

    def _on_presence(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        if self._marker is None:
            self._marker = (method.delivery_tag, time.monotonic())
        else:  # one held message is enough; a second one (a restarted manager's) waits in the queue
            ch.basic_reject(method.delivery_tag, requeue=True)

    def _on_reply(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        c = self.client
        reply = c._accept(props, body)
        if reply is None:
            return
        c.last_manager_contact = time.monotonic()
        if reply.get("type") == "error" and reply.get("code") == P.ERR_UNKNOWN_JOB:
            c.needs_register = True


class SharingClient:
    """One job's connection to a sharing manager. Thread-safe ``run`` (one request at a time).

    ``key``: the job's key when it was handed out (Kubernetes: the device plugin derives it from
    the manager's job secret); None makes up a fresh one, sent once when registering.
    """

    # While waiting for a granted slot, serve the connection until this long before its end.
    SERVICE_MARGIN_S = 0.02
    # gpemu.clock spins this long before a slot's end after sleeping (see gpemu.clock). Less
    # than the engine's 1 ms: jobs sharing a GPU share a host, and every job spinning takes a
    # CPU from the next job, the manager and the broker (16 jobs of 2 ms slots on 2 CPUs:
    # added p99 0.09-0.81 ms at 0.3 ms against 0.95-1.34 ms at 1 ms, benchmarks/sharing_latency.py
    # --client-spin, interleaved runs).
    SPIN_MARGIN_S = 3e-4

    def __init__(
        self,
        url: str,
        job_id: str | None = None,
        device: str = "0",
        persistent_bytes: int = 0,
        weight: float = 1.0,
        lease_s: float = 10.0,
        manager_timeout_s: float = 60.0,
        resend_s: float | None = None,
        heartbeat: bool = True,
        deadlines: bool = True,
        key: bytes | None = None,
        clock: str = "real",
        vtime: float = 0.0,
    ) -> None:
        """``clock="virtual"``: on virtual time (protocol, "Virtual time"), from ``vtime`` on (see
        :meth:`run` and :meth:`advance`)."""
        if not url.startswith(("amqp://", "amqps://")):
            raise ValueError(f"sharing URL must be amqp:// or amqps://, got {redact_url(url)!r}")
        if not lease_s > 0 or not manager_timeout_s > 0:
            raise ValueError("lease_s and manager_timeout_s must be positive seconds")
        if key is not None and (not isinstance(key, bytes) or len(key) != P.KEY_BYTES):
            raise ValueError(f"a job key must be {P.KEY_BYTES} bytes")
        if clock not in P.CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(P.CLOCKS)}, got {clock!r}")
        if clock == "virtual" and not deadlines:
            raise ValueError("a job on virtual time is answered with grants (deadlines=True)")
        job_id = job_id or f"{socket.gethostname()}-{os.getpid()}"
        try:  # what the manager would refuse, refused here: at start, with its reason
            P.check_job_settings(job_id, str(device), persistent_bytes, weight)
        except P.ProtocolError as exc:
            raise ValueError(f"sharing job setting: {exc.reason}") from None
        self.url = url
        self.safe_url = redact_url(url)
        self.job_id = job_id
        self.device = str(device)
        self.persistent_bytes = int(persistent_bytes)
        self.weight = float(weight)
        self.lease_s = float(lease_s)
        self.manager_timeout_s = float(manager_timeout_s)
        self.resend_s = float(resend_s) if resend_s else max(0.5, self.lease_s)
        # A handed-out key stays with the manager's secret; a made-up one goes out in register.
        self.provisioned = key is not None
        self.key = key if key is not None else P.new_key()
        self.registered = False
        self.same_host = False  # the manager shares our CLOCK_MONOTONIC (told at registration)
        self.host = P.host_identity()
        self.needs_register = True
        self.last_manager_contact = time.monotonic()
        self.reply_queue: str | None = None
        self.presence: str | None = None  # set by the heartbeat thread
        self.route: str | None = None  # our own request queue's routing key (from "registered")
        self.resends = 0
        self.reconnects = 0
        self.forged_replies = 0  # replies dropped: not signed by the manager with our key
        # Ask for grants (deadline scheduling; the wait for the end happens here, overlapping
        # the messages with GPU time) instead of a "done" reply when the work has ended.
        self.deadlines = bool(deadlines)
        self.virtual = clock == "virtual"
        self.vtime = float(vtime)  # on virtual time: this job's time now (see __init__)
        from gpemu.clock import RealClock

        self._clock = RealClock(self.SPIN_MARGIN_S)
        self._lock = threading.RLock()
        self._conn = None
        self._ch = None
        self._replies: dict[str, dict[str, Any]] = {}
        self._awaiting: str | None = None
        self._heartbeat = _Heartbeat(self) if heartbeat else None

    def __repr__(self) -> str:
        return f"SharingClient({self.safe_url!r}, job_id={self.job_id!r}, device={self.device!r})"

    # ------------------------------------------------------------------ connection
    def _params(self) -> Any:
        import pika

        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 2
        return params

    def _connect(self) -> None:
        from .amqp import blocking_connection, request_channel

        self._conn = blocking_connection(self._params())
        ch = request_channel(self._conn)
        ch.confirm_delivery()
        # Exclusive: no other connection can consume, bind or delete it. A reply sent while
        # we reconnect is lost with it; resending the request (same id) gets it again.
        self.reply_queue = P.reply_queue_name()
        ch.queue_declare(self.reply_queue, exclusive=True)
        ch.basic_consume(self.reply_queue, self._on_reply, auto_ack=True)
        self._ch = ch

    def _accept(self, props: Any, body: bytes) -> dict[str, Any] | None:
        """The reply if the manager signed it with our key, else None (counted as forged).

        An unsigned "unknown job" error is let through when our key is our own: a manager that
        restarted no longer knows it, and the error only makes us register again."""
        headers = props.headers if isinstance(getattr(props, "headers", None), dict) else {}
        signed = P.verify(self.key, body, headers.get(P.SIG_HEADER))
        try:
            reply = json.loads(body) if signed else P.decode(body)
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict):
            self.forged_replies += 1
            return None
        if not signed and not (
            not self.provisioned and reply.get("type") == "error" and reply.get("code") == P.ERR_UNKNOWN_JOB
        ):
            self.forged_replies += 1
            return None
        return reply

    def _on_reply(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        reply = self._accept(props, body)
        if reply is None:
            return
        self.last_manager_contact = time.monotonic()
        rid = reply.get("request_id")
        if isinstance(rid, str) and rid == self._awaiting:  # late duplicates of old answers are dropped
            self._replies[rid] = reply

    def _ensure_connected(self, give_up_at: float) -> None:
        import pika.exceptions as pex

        from .amqp import TopologyMissing

        delay = 0.05
        while self._conn is None or not self._conn.is_open:
            try:
                self._connect()
                return
            except (pex.ProbableAuthenticationError, pex.ProbableAccessDeniedError, pex.AuthenticationError) as exc:
                self._conn = None
                raise SharingUnavailableError(
                    f"the RabbitMQ broker at {self.safe_url} refused this job's credentials "
                    f"({type(exc).__name__}); check the user and password"
                ) from None
            except (pex.AMQPError, OSError, TopologyMissing) as exc:
                self._conn = None
                if time.monotonic() > give_up_at:
                    why = str(exc) if isinstance(exc, TopologyMissing) else type(exc).__name__
                    raise SharingUnavailableError(
                        f"cannot reach the sharing manager through the RabbitMQ broker at {self.safe_url} ({why}) "
                        f"for {self.manager_timeout_s:.0f} s; are the broker and `gpemu share-manager` running?"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                self.reconnects += 1

    def _publish_on(
        self,
        ch: Any,
        payload: dict[str, Any],
        reply_to: str | None,
        expiration: str | None = None,
        mandatory: bool = False,
    ) -> None:
        """Sign and publish one message on ``ch`` (the caller's connection)."""
        import pika

        body = P.encode({k: v for k, v in payload.items() if v is not None})
        props = pika.BasicProperties(
            delivery_mode=1,
            reply_to=reply_to,
            content_type="application/json",
            expiration=expiration,
            headers={P.SIG_HEADER: P.sign(self.key, body)},
        )
        # Registered: through the job's own queue (see protocol, "Routes"); else the shared one.
        route = self.route if payload.get("type") != "register" and self.route else P.REQUEST_ROUTING_KEY
        ch.basic_publish(P.REQUEST_EXCHANGE, route, body, props, mandatory=mandatory)

    def _publish(self, payload: dict[str, Any]) -> None:
        if payload.get("type") == "request":  # every (re)send says when it left: see backdate_s
            payload["sent_at"] = time.monotonic()
        if payload.get("type") in ("request", "register"):
            payload["presence"] = self.presence
        self._publish_on(self._ch, payload, self.reply_queue, mandatory=True)

    def _call(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Send ``payload`` and wait for the reply with its request id, resending as needed."""
        import pika.exceptions as pex

        rid = payload["request_id"]
        self._awaiting = rid
        self._replies.clear()
        sent = False
        next_resend = 0.0
        self.last_manager_contact = max(self.last_manager_contact, time.monotonic() - self.resend_s)
        while True:
            now = time.monotonic()
            if now - self.last_manager_contact > self.manager_timeout_s:
                raise SharingUnavailableError(
                    f"the sharing manager on {self.safe_url} has not answered for {self.manager_timeout_s:.0f} s "
                    f"(job {self.job_id!r}); is `gpemu share-manager` running?"
                )
            try:
                self._ensure_connected(self.last_manager_contact + self.manager_timeout_s)
                if not sent or now >= next_resend:
                    if sent:
                        self.resends += 1
                    self._publish(payload)
                    sent = True
                    next_resend = now + self.resend_s
                reply = self._replies.pop(rid, None)
                if reply is None and self._conn is not None:
                    self._conn.process_data_events(time_limit=min(self.resend_s, max(0.0, next_resend - now)))
                    reply = self._replies.pop(rid, None)
                if reply is not None:
                    return reply
            except pex.UnroutableError:
                if payload.get("type") == "register" or self.route is None:
                    raise SharingUnavailableError(
                        f"the sharing manager's request queue on {self.safe_url} is gone; "
                        "is `gpemu share-manager` running?"
                    ) from None
                # Our route's queue is gone with the manager that made it: register again.
                self.route, self.needs_register = None, True
                raise _RouteGone() from None
            except (pex.AMQPError, OSError):
                # Broker gone (restart): reconnect and resend with the same id.
                self._conn = None
                sent = False
                time.sleep(0.05)

    # ------------------------------------------------------------------ protocol
    def register(self) -> None:
        """Register (again; idempotent with the same key)."""
        with self._lock:
            if self._heartbeat is not None and not self._heartbeat.is_alive():
                self._heartbeat.start()  # its presence queue exists before the manager hears of it
            payload: dict[str, Any] = {
                "type": "register",
                "job_id": self.job_id,
                "request_id": uuid.uuid4().hex,
                "device": self.device,
                "persistent_bytes": self.persistent_bytes,
                "weight": self.weight,
            }
            if self.host:
                payload["host"] = self.host
            if self.virtual:
                payload["clock"], payload["vtime"] = "virtual", self.vtime
            if not self.provisioned:
                payload["key"] = self.key.hex()
            reply = self._call(payload)
            if reply.get("type") != "registered":
                raise SharingRefusedError(
                    f"the sharing manager refused job {self.job_id!r}: {reply.get('reason', reply.get('type'))}"
                )
            self.same_host = reply.get("same_host") is True
            self.route = reply["route"] if P.valid_route(reply.get("route")) else None
            self.needs_register = False
            self.registered = True
            lease = reply.get("lease_s")
            if isinstance(lease, (int, float)) and 0 < lease < self.lease_s:
                self.lease_s = float(lease)  # heartbeat often enough for the manager's lease
            if self._heartbeat is not None:
                self._heartbeat.wake.set()  # tell the manager our presence queue now

    def advance(self, seconds: float) -> float:
        """On virtual time: the job's host spends ``seconds``; returns its time."""
        if not seconds >= 0:
            raise ValueError(f"a job's time cannot go back (advance by {seconds!r} s)")
        self.vtime += seconds
        return self.vtime

    def run(
        self,
        seconds: float,
        peak_bytes: int = 0,
        kind: str = "iteration",
        persistent_bytes: int | None = None,
        at: float | None = None,
    ) -> RunResult:
        """Block until the manager has run ``seconds`` of GPU work for this job.

        On virtual time, ``at`` is the job's virtual time when it sends the request (default and
        at least :attr:`vtime`); the grant moves :attr:`vtime` to the work's end, and the call
        returns as soon as the manager has scheduled it.

        With ``deadlines`` (default) the manager answers when it schedules the work, with its
        end on the emuGPU's timeline, and this waits locally until then (absolute deadline on
        the shared CLOCK_MONOTONIC when job and manager share a host, else the remaining time
        counted from the reply).

        ``peak_bytes``: the job's whole GPU memory at this work's peak; ``persistent_bytes``
        (optional): what the job holds between iterations now, when it changed since it
        registered. Raises ``torch.cuda.OutOfMemoryError`` when the manager refuses it for memory.
        """
        if persistent_bytes is not None:
            self.persistent_bytes = int(persistent_bytes)  # also what a (re-)registration reports
        if not isinstance(seconds, (int, float)) or not 0 <= seconds <= P.MAX_SECONDS:
            raise ValueError(f"seconds must be from 0 to {P.MAX_SECONDS:g}, got {seconds!r}")
        for name, value in (("peak_bytes", peak_bytes), ("persistent_bytes", persistent_bytes)):
            if value is not None and (isinstance(value, bool) or not 0 <= int(value) <= P.MAX_BYTES):
                raise ValueError(f"{name} must be a byte count from 0 to {P.MAX_BYTES}, got {value!r}")
        with self._lock:
            rid = uuid.uuid4().hex
            start = time.monotonic()
            for _ in range(10):
                if self.needs_register or not self.registered:
                    self.register()
                payload = {
                    "type": "request",
                    "job_id": self.job_id,
                    "request_id": rid,
                    "device": self.device,
                    "seconds": float(seconds),
                    "peak_bytes": int(peak_bytes),
                    "kind": kind,
                    "grant": self.deadlines,
                }
                if persistent_bytes is not None:
                    payload["persistent_bytes"] = self.persistent_bytes
                if self.virtual:
                    payload["vtime"] = self.vtime if at is None or at < self.vtime else float(at)
                try:
                    reply = self._call(payload)
                except _RouteGone:
                    continue  # register again (same request id: never served twice)
                kind_ = reply.get("type")
                if kind_ == "granted":
                    return self._wait_for_grant(rid, float(seconds), reply, start)
                if kind_ == "done":
                    return RunResult(rid, float(seconds), float(reply.get("waited_s", 0.0)), time.monotonic() - start)
                if kind_ == "refused":
                    import torch

                    raise torch.cuda.OutOfMemoryError(reply.get("reason", "refused by the sharing manager"))
                if kind_ == "error" and reply.get("code") == P.ERR_UNKNOWN_JOB:
                    self.needs_register = True  # the manager restarted or dropped us: join again
                    continue
                raise ValueError(f"the sharing manager rejected the request: {reply.get('reason', kind_)}")
            raise SharingUnavailableError(f"job {self.job_id!r} could not stay registered with the sharing manager")

    def _wait_for_grant(self, rid: str, seconds: float, reply: dict[str, Any], start: float) -> RunResult:
        """The manager scheduled the work: wait here until it ends on the emuGPU's timeline."""
        if self.virtual:
            return self._virtual_grant(rid, seconds, reply, start)
        received = time.monotonic()
        end, remaining = reply.get("end"), reply.get("remaining_s")
        exact = self.same_host and isinstance(end, (int, float))
        if exact and isinstance(end, (int, float)):
            deadline = float(end)
        elif isinstance(remaining, (int, float)):
            # Another host's clock: count from the reply (late by the reply's travel time).
            deadline = received + max(0.0, float(remaining))
        else:
            deadline = received + seconds
        self._wait_until(deadline)
        resumed = time.monotonic()
        idle = reply.get("idle_s")
        begin = reply.get("start")
        return RunResult(
            rid,
            seconds,
            float(reply.get("waited_s") or 0.0),
            resumed - start,
            deadline,
            resumed,
            float(idle) if isinstance(idle, (int, float)) else 0.0,
            exact,
            float(begin) if exact and isinstance(begin, (int, float)) else None,
            received,
        )

    def _virtual_grant(self, rid: str, seconds: float, reply: dict[str, Any], start: float) -> RunResult:
        """On virtual time: the work ends at the grant's end; the job's time moves there, now."""
        begin, end = reply.get("start"), reply.get("end")
        if not isinstance(begin, (int, float)) or not isinstance(end, (int, float)) or end < begin:
            raise ValueError(f"the sharing manager's grant has no virtual start and end: {P.short(reply)}")
        self.vtime = max(self.vtime, float(end))
        waited, elapsed = float(reply.get("waited_s") or 0.0), time.monotonic() - start
        return RunResult(rid, seconds, waited, elapsed, end, end, 0.0, True, begin, end)

    def _wait_until(self, deadline: float) -> None:
        """Block until ``deadline`` (time.monotonic) with gpemu.clock's sleep-then-spin, serving
        the connection meanwhile so the broker does not drop it during long work."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= self.SERVICE_MARGIN_S:
                break
            chunk = min(remaining - self.SERVICE_MARGIN_S, 1.0)
            conn = self._conn
            try:
                if conn is None or not conn.is_open:
                    raise OSError("not connected")
                conn.process_data_events(time_limit=chunk)
            except Exception:  # the broker went away: the grant stands; reconnect on the next call
                self._conn = None
                time.sleep(chunk)
        # perf_counter and monotonic are both CLOCK_MONOTONIC on Linux; the offset is ~0 there
        # and keeps this right where they differ.
        self._clock.wait_until(deadline + (time.perf_counter() - time.monotonic()))

    def close(self) -> None:
        """Deregister (frees this job's memory on the emuGPU at once) and disconnect."""
        if self._heartbeat is not None:
            self._heartbeat.stop_event.set()
        with self._lock:
            if self.registered and self._conn is not None and self._conn.is_open:
                old = self.manager_timeout_s
                try:
                    self.manager_timeout_s = min(old, 5.0)  # do not hang at exit
                    self._call({"type": "deregister", "job_id": self.job_id, "request_id": uuid.uuid4().hex})
                except Exception:
                    pass  # its connection closing (or the lease) frees it anyway
                finally:
                    self.manager_timeout_s = old
            self.registered = False
            if self._conn is not None and self._conn.is_open:
                try:
                    self._conn.close()  # its exclusive reply queue goes with it
                except Exception:
                    pass
            self._conn = None
        if self._heartbeat is not None and self._heartbeat.is_alive():
            self._heartbeat.join(timeout=2)

    def __enter__(self) -> SharingClient:
        self.register()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- emulator component
class SharingBackend:
    """GPU-time backend for the time engine: ``run(device, seconds, peak_bytes, kind)``.

    The engine batches GPU work by ``sharing_granularity`` (one batch per iteration by default)
    and calls ``run`` from its per-device worker thread; ``run`` blocks while the manager serves
    other jobs. Counters on the run's recorder: ``sharing_requests``, ``sharing_gpu_s`` (GPU
    time the manager ran for this job), ``sharing_queued_s`` (time the manager kept requests
    queued behind other jobs) and ``sharing_wait_s`` (time ``run`` blocked beyond the GPU time:
    queueing plus messaging) and ``sharing_added_s`` (time lost to the manager's messages against a
    manager with no latency: resuming after the scheduled end, emuGPU idle while the request
    travelled). Host waits with reason ``"sharing"`` are recorded by the engine at sync points.

    Memory comes from the device's memory tracker when there is one (``memory``): the job
    registers at its first request (so the model, gradients and optimizer state exist by then)
    with the bytes allocated at that moment as its persistent memory, and every request carries
    the current allocation (persistent memory may grow, e.g. optimizer state created at the first
    step) and the tracker's peak (the most the job has held since the run or the last
    ``torch.cuda.reset_peak_memory_stats``) as the request's peak.
    """

    def __init__(
        self,
        clients: dict[int, SharingClient],
        recorder: Any = None,
        memory: list[Any] | None = None,
        persistent_bytes: int | None = None,
    ) -> None:
        self.clients = clients
        self.recorder = recorder
        self.memory = memory
        self.fixed_persistent = persistent_bytes  # a configured figure overrides the tracker's

    def run(self, device: int, seconds: float, peak_bytes: int, kind: str, at: float | None = None) -> Grant | None:
        """Run ``seconds`` of GPU work on ``device`` through the manager. On virtual time ``at``
        is the job's virtual time when it sends the request, and the grant's virtual start and
        end come back (on real time: None, the call returns when the work has ended)."""
        client = self.clients[device]
        tracker = self.memory[device] if self.memory is not None and device < len(self.memory) else None
        persistent = self.fixed_persistent
        peak = int(peak_bytes)
        if tracker is not None:
            if persistent is None:
                persistent = int(tracker.allocated)
            peak = max(peak, int(tracker.peak_allocated))
        start = REAL.perf_counter()
        result = client.run(seconds, peak, kind, persistent_bytes=persistent, at=at)
        grant = None
        if client.virtual and result.scheduled_start is not None and result.scheduled_end is not None:
            from gpemu.time import Grant  # (the time engine's; a standalone client needs no torch)

            grant = Grant(result.scheduled_start, result.scheduled_end)
        if self.recorder is not None:
            waited = (grant.end - (at or grant.start)) if grant is not None else REAL.perf_counter() - start
            self.recorder.add("sharing_wait_s", max(0.0, waited - seconds))
            self.recorder.add("sharing_queued_s", result.waited_s)
            self.recorder.add("sharing_requests", 1)
            self.recorder.add("sharing_gpu_s", seconds)
            if result.added_s is not None:  # deadline scheduling: what the manager's messages cost
                self.recorder.add("sharing_added_s", result.added_s)
        return grant

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def install(rt: Runtime) -> None:
    """Route the run's GPU time through the sharing manager when ``config.sharing`` is set."""
    cfg = rt.config
    if not cfg.sharing:
        return
    engine = rt.engine
    if engine is None:
        raise RuntimeError("GPU sharing needs the time engine (gpemu.time); it is not installed")
    # Under Kubernetes the device plugin gave this container its job id, keys and password.
    creds = load_job_credentials(cfg.device_dir)
    base = creds.job_id if creds else cfg.job_id or f"{socket.gethostname()}-{os.getpid()}"
    url = with_password(cfg.sharing, creds.amqp_password if creds else None)
    fixed = cfg.sharing_persistent_bytes
    clients: dict[int, SharingClient] = {}
    for index in range(len(rt.gpus)):
        # The emuGPU id on the manager: the k8s-allocated id when there is one, else the index.
        device = cfg.visible_devices[index] if cfg.visible_devices and index < len(cfg.visible_devices) else str(index)
        job_id = base if len(rt.gpus) == 1 else f"{base}.{index}"
        key = creds.keys.get(job_id) if creds else None
        if creds and creds.keys and key is None:
            raise ValueError(
                f"the sharing credentials hold no key for job {job_id!r} (emuGPU {index}); "
                "the device plugin allocated fewer emuGPUs than this process uses"
            )
        clients[index] = SharingClient(
            url,
            job_id=job_id,
            device=device,
            persistent_bytes=int(fixed or 0),
            weight=float(cfg.sharing_weight),
            lease_s=float(cfg.sharing_lease_s),
            key=key,
            clock="virtual" if cfg.virtual_time else "real",
            vtime=engine.now(),
        )
    # Jobs register at their first request (real persistent memory by then), not here.
    backend = SharingBackend(clients, rt.recorder, rt.memory, int(fixed) if fixed is not None else None)
    rt.sharing = backend
    engine.set_backend(backend)
    # Restored newest first: detach (waits for work in flight), then deregister.
    rt.patcher.on_restore(backend.close)
    rt.patcher.on_restore(lambda: engine.set_backend(None))
    rt.say_once(
        f"GPU time shared through the sharing manager at {redact_url(cfg.sharing)} "
        f"(one request per {cfg.sharing_granularity})"
    )
