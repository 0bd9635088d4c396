"""The sharing manager daemon: AMQP in and out around :class:`~.core.SharingCore`.

A pika consumer on the durable request queue that feeds the core, sleeps until the next absolute
deadline (the earliest slot's end, a lease expiry, the status publication), publishes signed
replies (acking a request after its reply, on the same channel), watches every job's presence
queue, and reconnects when the broker goes away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import protocol as P
from .core import SharingCore
from .policies import Policy
from .state import (
    DEFAULT_BACKDATE_S,
    DEFAULT_LOOKAHEAD_S,
    DEFAULT_QUANTUM_S,
    MAX_ACTIVE_PER_JOB,
    DeviceSpec,
    Outgoing,
    gib,
)

__all__ = ["SharingManager", "ManagerConflict"]


class ManagerConflict(RuntimeError):
    """Another sharing manager already serves this broker's emuGPUs."""


log = logging.getLogger("gpemu.sharing.manager")

# Unacknowledged deliveries of the shared request queue in flight to the manager: registrations
# and status requests, acknowledged at once. Small, so a flood of malformed messages there holds
# at most this many ahead of a job's own queue in the manager's socket.
SHARED_PREFETCH = 64


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
        prefetch: int = SHARED_PREFETCH,
        lookahead_s: float = DEFAULT_LOOKAHEAD_S,
        backdate_s: float = DEFAULT_BACKDATE_S,
        quantum_s: float | None = DEFAULT_QUANTUM_S,
        job_secret: bytes | None = None,
        time_mode: str = "real",
        expected_jobs: int = 0,
    ) -> None:
        """``time_mode="virtual"``: serve jobs on virtual time (protocol, "Virtual time"), the
        first slot once ``expected_jobs`` jobs registered."""
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
            clock=time_mode,
            expected_jobs=expected_jobs,
        )
        self.status_interval_s = status_interval_s
        self.reconnect_s = reconnect_s
        self.clock = clock
        # Unacked deliveries of the shared queue the broker may push ahead (registrations; jobs'
        # requests come through their own queues, each with its own window).
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
        self.conflict: str | None = None  # set when another manager holds the request queue
        self._routes: dict[str, str] = {}  # job id -> the route whose queue this connection consumes
        self._ready_routes: set[str] = set()  # routes whose queue is declared, bound and consumed
        self._held: dict[str, list[Outgoing]] = {}  # "registered" replies waiting for their route

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
            ", ".join(f"{d.spec.name}={d.spec.gpu} ({gib(d.spec.capacity_bytes)})" for d in self.core.devices.values()),
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
            self._routes.clear()  # and every job's queue (exclusive): declared again on reconnect
            self._ready_routes.clear()
            self._held.clear()
            if self._stop.is_set():
                self.core.flush_log(self.clock(), final=True)  # rejections of the last window
                if self.conflict is not None:
                    raise ManagerConflict(self.conflict)
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
        ch.add_on_close_callback(lambda ch_, reason: self._on_channel_closed(reason))
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
        # The lease on the emuGPUs: an exclusive consumer of the request queue. A second manager
        # on the same broker would split the queue and run two timelines for one GPU (19.9 s of
        # GPU time granted in 10.1 s of wall time); the broker refuses its consumer instead, and
        # releases ours the moment our connection closes (a killed manager's successor starts).
        self._ch.basic_consume(
            P.REQUEST_QUEUE, self._on_message, auto_ack=False, exclusive=True, callback=self._on_consuming
        )

    def _on_channel_closed(self, reason: BaseException) -> None:
        text = str(getattr(reason, "reply_text", reason))
        if getattr(reason, "reply_code", None) == 403 and "exclusive" in text:
            self.conflict = (
                f"another sharing manager already serves the emuGPUs of {self.safe_url} (the broker gives "
                f"{P.REQUEST_QUEUE} to one manager at a time); stop it first, or give one manager every --device"
            )
            log.error("%s", self.conflict)
            self._stop.set()
        self._close()

    def _on_consuming(self, _frame: Any) -> None:
        self._sync_routes()
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
        self._sync_routes()
        for out in outs:
            payload = out.payload or {}
            if payload.get("type") == "registered" and payload.get("route") not in self._ready_routes:
                # The job publishes to its route as soon as it reads this: not before it exists.
                self._held.setdefault(payload["route"], []).append(out)
                continue
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

    # ------------------------------------------------------------------ each job's own queue
    def _sync_routes(self) -> None:
        """Consume a queue of its own for every registered job (see protocol, "Routes"), and stop
        consuming those of jobs that left. Declared, bound and consumed in a chain of callbacks
        (pika sends a channel's RPCs one at a time); the job's "registered" reply is held until
        the chain ends, so the job never publishes to a route that does not exist yet."""
        ch = self._ch
        if ch is None or not ch.is_open or not self.connected.is_set():
            return
        for job_id, job in self.core.jobs.items():
            if self._routes.get(job_id) != job.route and job.route:
                old = self._routes.get(job_id)
                if old is not None:
                    self._drop_route(old)
                self._routes[job_id] = job.route
                self._open_route(job.route)
        for job_id in [j for j in self._routes if j not in self.core.jobs]:
            self._drop_route(self._routes.pop(job_id))

    def _open_route(self, route: str) -> None:
        ch, queue = self._ch, P.route_queue(route)
        steps = [
            lambda cb: ch.queue_declare(queue, exclusive=True, callback=cb),
            lambda cb: ch.queue_bind(queue, P.REQUEST_EXCHANGE, routing_key=route, callback=cb),
            lambda cb: ch.basic_qos(prefetch_count=2 * MAX_ACTIVE_PER_JOB, callback=cb),
            lambda cb: ch.basic_consume(queue, self._on_message, consumer_tag=route, callback=cb),
        ]

        def run(i: int) -> None:
            if ch is not self._ch or not ch.is_open:
                return
            if i < len(steps):
                steps[i](lambda _frame: run(i + 1))
                return
            self._ready_routes.add(route)
            held = self._held.pop(route, [])
            if held:
                self._send(held)

        run(0)

    def _drop_route(self, route: str) -> None:
        self._held.pop(route, None)
        ch = self._ch
        if ch is None or not ch.is_open:
            return
        if route in self._ready_routes:
            self._ready_routes.discard(route)
            ch.basic_cancel(route)
        ch.queue_delete(P.route_queue(route))  # (its unacked messages were acknowledged by the core)

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
        deadline, next_one = self.core.precise_deadline(), self.core.next_deadline()
        if deadline is not None and next_one is not None and deadline <= next_one + self.SPIN_S:
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
