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

Reliability: every message is persistent and publisher-confirmed; a request keeps its id when it
is resent (after a lost reply, a broker restart or a manager restart), so the manager never
serves it twice; a heartbeat thread keeps the job's lease; if the manager forgot the job
(restart) the client registers again and resends. If the broker or the manager stays away for
``manager_timeout_s`` the client raises :class:`SharingUnavailableError` saying so.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpemu.units import redact_url

from . import protocol as P

if TYPE_CHECKING:  # pragma: no cover
    from gpemu.runtime import Runtime

__all__ = ["SharingClient", "SharingUnavailableError", "SharingRefusedError", "RunResult", "SharingBackend",
           "install"]


class SharingUnavailableError(RuntimeError):
    """The broker or the sharing manager did not answer for too long."""


class SharingRefusedError(ValueError):
    """The manager refused to register the job (its persistent memory does not fit, bad id, ...)."""


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
    """Own connection (pika connections are single-threaded): keeps the job's lease alive."""

    def __init__(self, client: "SharingClient") -> None:
        super().__init__(name=f"gpemu-sharing-heartbeat-{client.job_id}", daemon=True)
        self.client = client
        self.stop_event = threading.Event()

    def run(self) -> None:
        import pika

        c = self.client
        conn = None
        period = max(0.05, c.lease_s / 3.0)
        while not self.stop_event.is_set():
            try:
                if conn is None or not conn.is_open:
                    from .amqp import blocking_connection

                    conn = blocking_connection(c._params())
                    ch = conn.channel()
                    queue = ch.queue_declare("", exclusive=True, auto_delete=True).method.queue
                    ch.basic_consume(queue, self._on_reply, auto_ack=True)
                token = c.token
                if token:
                    ch.basic_publish("", P.REQUEST_QUEUE,
                                     P.encode({"type": "heartbeat", "job_id": c.job_id, "token": token}),
                                     pika.BasicProperties(reply_to=queue, expiration=str(int(c.lease_s * 1000))))
                deadline = time.monotonic() + period
                while not self.stop_event.is_set() and time.monotonic() < deadline:
                    conn.process_data_events(time_limit=min(0.1, max(0.0, deadline - time.monotonic())))
            except Exception:
                conn = None
                self.stop_event.wait(min(period, 0.5))
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:
                pass

    def _on_reply(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        c = self.client
        try:
            reply = json.loads(body)
        except ValueError:
            return
        c.last_manager_contact = time.monotonic()
        if reply.get("type") == "error" and reply.get("code") in (P.ERR_UNKNOWN_JOB, P.ERR_BAD_TOKEN):
            c.needs_register = True


class SharingClient:
    """One job's connection to a sharing manager. Thread-safe ``run`` (one request at a time)."""

    # While waiting for a granted slot, serve the connection until this long before its end.
    SERVICE_MARGIN_S = 0.02
    # gpemu.clock spins this long before a slot's end after sleeping (see gpemu.clock). Less
    # than the engine's 1 ms: jobs sharing a GPU share a host, and every job spinning takes a
    # CPU from the next job, the manager and the broker (16 jobs of 2 ms slots on 2 CPUs:
    # added p99 0.09-0.81 ms at 0.3 ms against 0.95-1.34 ms at 1 ms, benchmarks/sharing_latency.py
    # --client-spin, interleaved runs).
    SPIN_MARGIN_S = 3e-4

    def __init__(self, url: str, job_id: str | None = None, device: str = "0", persistent_bytes: int = 0,
                 weight: float = 1.0, lease_s: float = 10.0, manager_timeout_s: float = 60.0,
                 resend_s: float | None = None, heartbeat: bool = True, deadlines: bool = True) -> None:
        if not url.startswith(("amqp://", "amqps://")):
            raise ValueError(f"sharing URL must be amqp:// or amqps://, got {redact_url(url)!r}")
        if not lease_s > 0 or not manager_timeout_s > 0:
            raise ValueError("lease_s and manager_timeout_s must be positive seconds")
        self.url = url
        self.safe_url = redact_url(url)
        self.job_id = job_id or f"{socket.gethostname()}-{os.getpid()}"
        self.device = str(device)
        self.persistent_bytes = int(persistent_bytes)
        self.weight = float(weight)
        self.lease_s = float(lease_s)
        self.manager_timeout_s = float(manager_timeout_s)
        self.resend_s = float(resend_s) if resend_s else max(0.5, self.lease_s)
        self.token: str | None = None
        self.same_host = False  # the manager shares our CLOCK_MONOTONIC (told at registration)
        self.host = P.host_identity()
        self.needs_register = True
        self.last_manager_contact = time.monotonic()
        self.reply_queue = f"gpemu.sharing.reply.{self.job_id}.{uuid.uuid4().hex[:8]}"
        self.resends = 0
        self.reconnects = 0
        # Ask for grants (deadline scheduling; the wait for the end happens here, overlapping
        # the messages with GPU time) instead of a "done" reply when the work has ended.
        self.deadlines = bool(deadlines)
        from gpemu.clock import RealClock

        self._clock = RealClock(self.SPIN_MARGIN_S)
        self._lock = threading.RLock()
        self._conn = None
        self._ch = None
        self._replies: dict[str, dict[str, Any]] = {}
        self._awaiting: str | None = None
        self._heartbeat = _Heartbeat(self) if heartbeat else None

    # ------------------------------------------------------------------ connection
    def _params(self) -> Any:
        import pika

        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 2
        return params

    def _connect(self) -> None:

        from .amqp import blocking_connection

        self._conn = blocking_connection(self._params())
        ch = self._conn.channel()
        ch.confirm_delivery()
        ch.queue_declare(P.REQUEST_QUEUE, durable=True)
        # Durable, named reply queue: survives a broker restart so answers are not lost; it
        # expires on its own once this job is gone.
        ch.queue_declare(self.reply_queue, durable=True,
                         arguments={"x-expires": int(max(30.0, 4 * self.lease_s) * 1000)})
        ch.basic_consume(self.reply_queue, self._on_reply, auto_ack=True)
        self._ch = ch

    def _on_reply(self, ch: Any, method: Any, props: Any, body: bytes) -> None:
        try:
            reply = json.loads(body)
        except ValueError:
            return
        self.last_manager_contact = time.monotonic()
        rid = reply.get("request_id")
        if isinstance(rid, str) and rid == self._awaiting:  # late duplicates of old answers are dropped
            self._replies[rid] = reply

    def _ensure_connected(self, give_up_at: float) -> None:
        import pika.exceptions as pex

        delay = 0.05
        while self._conn is None or not self._conn.is_open:
            try:
                self._connect()
                return
            except (pex.AMQPError, OSError) as exc:
                self._conn = None
                if time.monotonic() > give_up_at:
                    raise SharingUnavailableError(
                        f"cannot reach the RabbitMQ broker at {self.safe_url} ({type(exc).__name__}) "
                        f"for {self.manager_timeout_s:.0f} s; is it running?") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                self.reconnects += 1

    def _publish(self, payload: dict[str, Any]) -> None:
        import pika

        if payload.get("type") == "request":  # every (re)send says when it left: see backdate_s
            payload["sent_at"] = time.monotonic()
        self._ch.basic_publish("", P.REQUEST_QUEUE, P.encode(payload),
                               pika.BasicProperties(delivery_mode=1, reply_to=self.reply_queue,
                                                    content_type="application/json"),
                               mandatory=True)

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
                    f"(job {self.job_id!r}); is `gpemu share-manager` running?")
            try:
                self._ensure_connected(self.last_manager_contact + self.manager_timeout_s)
                if not sent or now >= next_resend:
                    if sent:
                        self.resends += 1
                    self._publish(payload)
                    sent = True
                    next_resend = now + self.resend_s
                reply = self._replies.pop(rid, None)
                if reply is None:
                    self._conn.process_data_events(time_limit=min(self.resend_s, max(0.0, next_resend - now)))
                    reply = self._replies.pop(rid, None)
                if reply is not None:
                    return reply
            except (pex.AMQPError, OSError):
                # Broker gone (restart): reconnect and resend with the same id.
                self._conn = None
                sent = False
                time.sleep(0.05)

    # ------------------------------------------------------------------ protocol
    def register(self) -> str:
        """Register (again): returns the secret token the manager issued."""
        with self._lock:
            payload = {"type": "register", "job_id": self.job_id, "request_id": uuid.uuid4().hex,
                       "device": self.device, "persistent_bytes": self.persistent_bytes, "weight": self.weight}
            if self.host:
                payload["host"] = self.host
            if self.token:  # still registered as far as we know: the manager answers the same
                payload["token"] = self.token
            reply = self._call(payload)
            if reply.get("type") != "registered":
                raise SharingRefusedError(f"the sharing manager refused job {self.job_id!r}: "
                                          f"{reply.get('reason', reply)}")
            self.token = reply["token"]
            self.same_host = reply.get("same_host") is True
            self.needs_register = False
            lease = reply.get("lease_s")
            if isinstance(lease, (int, float)) and 0 < lease < self.lease_s:
                self.lease_s = float(lease)  # heartbeat often enough for the manager's lease
            if self._heartbeat is not None and not self._heartbeat.is_alive():
                self._heartbeat.start()
            return self.token

    def run(self, seconds: float, peak_bytes: int = 0, kind: str = "iteration",
            persistent_bytes: int | None = None) -> RunResult:
        """Block until the manager has run ``seconds`` of GPU work for this job.

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
        with self._lock:
            rid = uuid.uuid4().hex
            start = time.monotonic()
            for _ in range(10):
                if self.needs_register or self.token is None:
                    self.register()
                payload = {"type": "request", "job_id": self.job_id, "token": self.token, "request_id": rid,
                           "device": self.device, "seconds": float(seconds), "peak_bytes": int(peak_bytes),
                           "kind": kind, "grant": self.deadlines}
                if persistent_bytes is not None:
                    payload["persistent_bytes"] = self.persistent_bytes
                reply = self._call(payload)
                kind_ = reply.get("type")
                if kind_ == "granted":
                    return self._wait_for_grant(rid, float(seconds), reply, start)
                if kind_ == "done":
                    return RunResult(rid, float(seconds), float(reply.get("waited_s", 0.0)),
                                     time.monotonic() - start)
                if kind_ == "refused":
                    import torch

                    raise torch.cuda.OutOfMemoryError(reply.get("reason", "refused by the sharing manager"))
                if kind_ == "error" and reply.get("code") in (P.ERR_UNKNOWN_JOB, P.ERR_BAD_TOKEN):
                    self.needs_register = True  # the manager restarted or dropped us: join again
                    continue
                raise ValueError(f"the sharing manager rejected the request: {reply.get('reason', reply)}")
            raise SharingUnavailableError(f"job {self.job_id!r} could not stay registered with the sharing manager")

    def _wait_for_grant(self, rid: str, seconds: float, reply: dict[str, Any], start: float) -> RunResult:
        """The manager scheduled the work: wait here until it ends on the emuGPU's timeline."""
        received = time.monotonic()
        end, remaining = reply.get("end"), reply.get("remaining_s")
        exact = self.same_host and isinstance(end, (int, float))
        if exact:
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
        return RunResult(rid, seconds, float(reply.get("waited_s") or 0.0), resumed - start, deadline, resumed,
                         float(idle) if isinstance(idle, (int, float)) else 0.0, exact,
                         float(begin) if exact and isinstance(begin, (int, float)) else None, received)

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
            if self.token is not None and self._conn is not None and self._conn.is_open:
                try:
                    old = self.manager_timeout_s
                    self.manager_timeout_s = min(old, 5.0)  # do not hang at exit
                    self._call({"type": "deregister", "job_id": self.job_id, "token": self.token,
                                "request_id": uuid.uuid4().hex})
                except Exception:
                    pass  # the lease frees it anyway
                finally:
                    self.manager_timeout_s = old
            self.token = None
            if self._conn is not None and self._conn.is_open:
                try:
                    self._ch.queue_delete(self.reply_queue)
                    self._conn.close()
                except Exception:
                    pass
            self._conn = None
        if self._heartbeat is not None and self._heartbeat.is_alive():
            self._heartbeat.join(timeout=2)

    def __enter__(self) -> "SharingClient":
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

    def __init__(self, clients: dict[int, SharingClient], recorder: Any = None,
                 memory: list[Any] | None = None, persistent_bytes: int | None = None) -> None:
        self.clients = clients
        self.recorder = recorder
        self.memory = memory
        self.fixed_persistent = persistent_bytes  # a configured figure overrides the tracker's

    def run(self, device: int, seconds: float, peak_bytes: int, kind: str) -> None:
        client = self.clients[device]
        tracker = self.memory[device] if self.memory is not None and device < len(self.memory) else None
        persistent = self.fixed_persistent
        peak = int(peak_bytes)
        if tracker is not None:
            if persistent is None:
                persistent = int(tracker.allocated)
            peak = max(peak, int(tracker.peak_allocated))
        start = time.perf_counter()
        result = client.run(seconds, peak, kind, persistent_bytes=persistent)
        if self.recorder is not None:
            self.recorder.add("sharing_wait_s", max(0.0, time.perf_counter() - start - seconds))
            self.recorder.add("sharing_queued_s", result.waited_s)
            self.recorder.add("sharing_requests", 1)
            self.recorder.add("sharing_gpu_s", seconds)
            if result.added_s is not None:  # deadline scheduling: what the manager's messages cost
                self.recorder.add("sharing_added_s", result.added_s)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def install(rt: "Runtime") -> None:
    """Route the run's GPU time through the sharing manager when ``config.sharing`` is set."""
    cfg = rt.config
    if not cfg.sharing:
        return
    engine = rt.engine
    if engine is None:
        raise RuntimeError("GPU sharing needs the time engine (gpemu.engine); it is not installed")
    base = cfg.job_id or f"{socket.gethostname()}-{os.getpid()}"
    fixed = cfg.sharing_persistent_bytes
    clients: dict[int, SharingClient] = {}
    for index, spec in enumerate(rt.gpus):
        # The emuGPU id on the manager: the k8s-allocated id when there is one, else the index.
        device = cfg.visible_devices[index] if cfg.visible_devices and index < len(cfg.visible_devices) else str(index)
        clients[index] = SharingClient(
            cfg.sharing, job_id=base if len(rt.gpus) == 1 else f"{base}.{index}", device=device,
            persistent_bytes=int(fixed or 0), weight=float(cfg.sharing_weight), lease_s=float(cfg.sharing_lease_s))
    # Jobs register at their first request (real persistent memory by then), not here.
    backend = SharingBackend(clients, rt.recorder, rt.memory, int(fixed) if fixed is not None else None)
    rt.sharing = backend
    engine.set_backend(backend)
    # Restored newest first: detach (waits for work in flight), then deregister.
    rt.patcher.on_restore(backend.close)
    rt.patcher.on_restore(lambda: engine.set_backend(None))
    rt.say_once(f"GPU time shared through the sharing manager at {redact_url(cfg.sharing)} "
                f"(one request per {cfg.sharing_granularity})")
