"""Ask a sharing manager for its state, and render it (used by ``gpemu share-status``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from . import protocol as P

__all__ = ["fetch_status", "watch_status", "render_status", "StatusTimeout", "StatusUnavailable"]


class StatusTimeout(RuntimeError):
    """No sharing manager answered."""


class StatusUnavailable(RuntimeError):
    """The broker cannot be reached, or refused the credentials."""


def _connect(url: str) -> Any:
    """A blocking connection, or :class:`StatusUnavailable` saying why there is none."""
    import pika
    import pika.exceptions as pex

    from gpemu.units import redact_url

    try:
        params = pika.URLParameters(url)
    except Exception as exc:
        raise StatusUnavailable(f"not a usable AMQP URL {redact_url(url)!r}: {_first_line(exc)}") from None
    params.connection_attempts = 1
    params.socket_timeout = 2
    try:
        return pika.BlockingConnection(params)
    except (pex.ProbableAuthenticationError, pex.ProbableAccessDeniedError, pex.AuthenticationError):
        raise StatusUnavailable(f"the RabbitMQ broker at {redact_url(url)} refused the user or password") from None
    except (pex.AMQPError, OSError) as exc:
        raise StatusUnavailable(
            f"cannot reach the RabbitMQ broker at {redact_url(url)} ({type(exc).__name__}); is it running?"
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def fetch_status(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """One snapshot, answered by the manager to a ``status`` request."""
    import pika

    from gpemu.units import redact_url

    from .amqp import TopologyMissing, request_channel

    conn = _connect(url)
    try:
        try:
            ch = request_channel(conn)
        except TopologyMissing:
            raise StatusTimeout(
                f"no sharing manager has connected to {redact_url(url)}; start one with "
                "`gpemu share-manager --amqp URL --device 0=V100`"
            ) from None
        queue = P.reply_queue_name()
        ch.queue_declare(queue, exclusive=True)
        rid = uuid.uuid4().hex
        got: list[dict[str, Any]] = []

        def on_reply(_ch: Any, _m: Any, _p: Any, body: bytes) -> None:
            try:
                reply = json.loads(body)
            except (ValueError, RecursionError):
                return
            if isinstance(reply, dict) and reply.get("request_id") == rid:
                got.append(reply)

        ch.basic_consume(queue, on_reply, auto_ack=True)
        ch.basic_publish(
            P.REQUEST_EXCHANGE,
            P.REQUEST_ROUTING_KEY,
            P.encode({"type": "status", "request_id": rid}),
            pika.BasicProperties(reply_to=queue, expiration=str(int(timeout_s * 1000))),
        )
        deadline = time.monotonic() + timeout_s
        while not got and time.monotonic() < deadline:
            conn.process_data_events(time_limit=min(0.1, max(0.0, deadline - time.monotonic())))
        if not got:
            raise StatusTimeout(
                f"no sharing manager answered on {redact_url(url)} within {timeout_s:g} s; "
                f"start one with `gpemu share-manager --amqp URL --device 0=V100`"
            )
        return got[0]
    finally:
        conn.close()


def watch_status(url: str) -> Iterator[dict[str, Any] | None]:
    """Snapshots the manager publishes periodically; yields None every ~0.5 s without one."""
    import pika.exceptions as pex

    from gpemu.units import redact_url

    conn = _connect(url)
    try:
        ch = conn.channel()
        try:
            ch.exchange_declare(P.STATUS_EXCHANGE, passive=True)
        except pex.ChannelClosedByBroker:
            raise StatusTimeout(
                f"no sharing manager has connected to {redact_url(url)}; start one with "
                "`gpemu share-manager --amqp URL --device 0=V100`"
            ) from None
        queue = P.reply_queue_name()
        ch.queue_declare(queue, exclusive=True)
        ch.queue_bind(queue, P.STATUS_EXCHANGE)
        while True:
            method, _props, body = ch.basic_get(queue, auto_ack=True)
            if method is None:
                conn.process_data_events(time_limit=0.5)
                yield None
                continue
            try:
                snap = json.loads(body)
            except (ValueError, RecursionError):
                continue
            if isinstance(snap, dict):
                yield snap
    finally:
        conn.close()


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def render_status(snap: dict[str, Any], title: str = "gpemu sharing manager") -> Any:
    """A rich renderable: one table of emuGPUs and one of jobs."""
    from rich.console import Group
    from rich.table import Table

    gpus = Table(title=f"{title} — policy {snap.get('policy')}, lease {snap.get('lease_s')} s", expand=False)
    for col in ("emuGPU", "GPU", "memory (persistent / total)", "jobs", "queue", "running", "served", "utilisation"):
        gpus.add_column(col)
    for d in snap.get("devices", []):
        gpus.add_row(
            str(d["device"]),
            d["gpu"],
            f"{_gib(d['persistent_bytes'])} / {_gib(d['capacity_bytes'])}",
            str(d["jobs"]),
            str(d["queue"]),
            str(d["running"] or "-"),
            str(d["served_requests"]),
            f"{100 * d['utilisation']:.0f}%",
        )
    jobs = Table(title="jobs", expand=False)
    for col in ("job", "emuGPU", "weight", "persistent", "GPU time", "requests", "queued", "share", "recent share"):
        jobs.add_column(col)
    for j in snap.get("jobs", []):
        jobs.add_row(
            j["job_id"],
            str(j["device"]),
            f"{j['weight']:g}",
            _gib(j["persistent_bytes"]),
            f"{j['served_s']:.2f} s",
            str(j["served_requests"]),
            str(j["queued"]),
            f"{100 * j['share']:.1f}%",
            f"{100 * j['recent_share']:.1f}%",
        )
    footer = (
        f"rejected messages {snap.get('rejected', 0)}, refused (memory) {snap.get('refused', 0)}, "
        f"expired leases {snap.get('expired', 0)}, connections closed {snap.get('disconnected', 0)}"
    )
    return Group(gpus, jobs, footer)


def live(url: str, render: Callable[[dict[str, Any]], Any] = render_status, refresh_per_second: float = 4) -> None:
    """Keep a rich.live view up to date until interrupted."""
    from rich.live import Live
    from rich.text import Text

    with Live(Text("waiting for the sharing manager's status…"), refresh_per_second=refresh_per_second) as view:
        last = time.monotonic()
        for snap in watch_status(url):
            if snap is not None:
                view.update(render(snap))
                last = time.monotonic()
            elif time.monotonic() - last > 5:
                view.update(Text("no status from a sharing manager for 5 s — is it running?"))
