"""The sharing protocol: JSON messages between jobs and the sharing manager, their validation,
and how both sides prove who sent them.

Independent of the emulator: any program that speaks this schema over AMQP can share an emuGPU.

Topology (all names under ``gpemu.sharing``; the manager declares it):

* ``REQUEST_EXCHANGE`` (direct, durable) routes to ``REQUEST_QUEUE`` (durable): jobs publish
  every message to the exchange with ``reply_to`` naming one of their own reply queues. Only
  the manager may read the queue. The manager acknowledges a GPU-time request only once it has
  answered it, so a manager that dies leaves unanswered requests queued.
* Reply queues ``gpemu.sharing.reply.<random>``: exclusive to the job's connection (no one else
  can consume, bind or delete them). The manager replies only to names with this prefix.
* ``STATUS_EXCHANGE`` (fanout): the manager publishes a status snapshot periodically.

:data:`JOB_PERMISSIONS` are the broker permissions (configure, write, read regular expressions)
of the user jobs connect as: publish requests, own reply queues, read status; nothing else (no
reading the request queue, no publishing through the default exchange into other jobs' queues).

Authentication: every job has a secret 32-byte key. Messages from a registered job and every
reply to it carry ``HMAC-SHA256(key, body)`` in the AMQP header :data:`SIG_HEADER`; a job drops
replies without a valid signature, so a forged reply is told apart from the manager's. The key
is either derived by the manager from its job secret (:func:`derive_job_key`; Kubernetes: the
device plugin hands each container its job id and derived key through Allocate, so the key
never travels over the broker) or, for a manager without a job secret, chosen by the job and
sent once in ``register`` (readable only by the manager, given the permissions above).

Messages from jobs (``type``):

``register``   job_id, request_id, device, persistent_bytes (optional: weight, host — see
               :func:`host_identity`; equal on both sides means a shared CLOCK_MONOTONIC —,
               key: the job's own key in hex when the manager has no job secret, presence: the
               job's presence queue, see below; clock, vtime: see "Virtual time")
``request``    job_id, request_id, device, seconds, peak_bytes (optional: kind,
               persistent_bytes — the job's persistent memory now, which may have grown since
               it registered, e.g. optimizer state created at the first step —, grant: true to
               get a ``granted`` reply when the request is scheduled instead of ``done`` when it
               ends, sent_at: the job's ``time.monotonic()`` when it published the request,
               presence, vtime: see "Virtual time")
``heartbeat``  job_id (optional: presence)
``deregister`` job_id, request_id
``status``     (optional: request_id; unauthenticated, answered on reply_to)

Presence: a job holds a single-active-consumer queue (``presence``, under the reply prefix)
with one unacknowledged message from the manager; the manager waits behind it as the standby
consumer. When the job's connection closes (the process died, even with ``kill -9``), the broker
hands the message to the manager at once, which frees the job's GPU time and memory without
waiting for its lease.

Routes: the ``registered`` reply gives the job its *route*, a secret routing key (``job.<32 hex>``)
under which the manager consumes a queue of that job's own (``gpemu.sharing.job.<hex>``, exclusive
to the manager's connection). The job publishes its requests, heartbeats and deregistration
with it, so they never wait behind other jobs' messages (nor a flood of malformed ones) in the
shared request queue, which then carries registrations and status requests only. A route that
is gone (the manager restarted) makes a publish unroutable: the job registers again.

Replies from the manager (``type``): ``registered`` (same_host, lease_s, route), ``done`` (waited_s,
served_s), ``granted`` (start, end: the manager's ``time.monotonic()`` when the work starts and
ends on the emuGPU's timeline; remaining_s: end minus the manager's clock when the grant was
written; waited_s, idle_s — sent before the work starts, so the job waits locally until
``end``), ``refused`` (reason: out of memory), ``error`` (code, reason), ``heartbeat-ack``,
``deregistered``, ``status`` (snapshot). Every reply repeats the ``request_id`` it answers.

``peak_bytes`` is the job's whole GPU memory at the request's peak (persistent memory included,
as ``torch.cuda.max_memory_allocated`` reports it). A request fits when the persistent memory
of all *other* registered jobs on the emuGPU plus this peak is within the GPU's capacity.

Virtual time: a manager started with ``--clock virtual`` serves jobs on virtual time only (each
registers with ``clock: "virtual"`` and its ``vtime``; a mismatch is refused with an ``error``). A
request's ``vtime`` is when the job could have sent it (issued, and not before its previous
request ended); the manager grants in virtual time, answering ``granted`` with ``start`` and
``end`` on the emuGPU's virtual timeline, and the job does not wait for real. A slot starting at
virtual time T is decided only when every job without a request queued has said it will send
nothing before T (its registration's or its last grant's time): jobs run at whatever real speed
their hosts allow and the schedule is the same (``SharingCore``, docs/sharing.md).

Hostile input: a body is at most :data:`MAX_BODY` bytes and one flat JSON object (nested arrays
or objects are refused before decoding, so no input can exhaust the decoder's recursion); every
failure is a :class:`ProtocolError` whose reason quotes at most a few dozen characters of input.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PROTOCOL_VERSION",
    "REQUEST_EXCHANGE",
    "REQUEST_QUEUE",
    "REQUEST_ROUTING_KEY",
    "STATUS_EXCHANGE",
    "REPLY_PREFIX",
    "SIG_HEADER",
    "JOB_QUEUE_PREFIX",
    "new_route",
    "valid_route",
    "route_queue",
    "JOB_PERMISSIONS",
    "ProtocolError",
    "Message",
    "parse_message",
    "encode",
    "MAX_SECONDS",
    "MAX_BYTES",
    "CLOCKS",
    "MAX_BODY",
    "MAX_ID_LEN",
    "MIN_WEIGHT",
    "MAX_WEIGHT",
    "check_job_settings",
    "KEY_BYTES",
    "ERR_UNKNOWN_JOB",
    "ERR_BAD_SIGNATURE",
    "ERR_BAD_MESSAGE",
    "ERR_JOB_EXISTS",
    "ERR_UNKNOWN_DEVICE",
    "ERR_BUSY",
    "host_identity",
    "sign",
    "verify",
    "derive_job_key",
    "new_key",
    "valid_queue_name",
    "reply_queue_name",
    "declare_topology",
    "short",
    "decode",
]

PROTOCOL_VERSION = 2
REQUEST_EXCHANGE = "gpemu.sharing.in"
REQUEST_QUEUE = "gpemu.sharing.requests"
REQUEST_ROUTING_KEY = "request"
STATUS_EXCHANGE = "gpemu.sharing.status"
REPLY_PREFIX = "gpemu.sharing.reply."
SIG_HEADER = "gpemu-sig"
JOB_QUEUE_PREFIX = "gpemu.sharing.job."  # the manager's per-job request queues

# Broker permissions of the user jobs connect as (RabbitMQ configure / write / read patterns).
JOB_PERMISSIONS: dict[str, str] = {
    "configure": r"^gpemu\.sharing\.reply\.[A-Za-z0-9_-]+$",
    "write": r"^(gpemu\.sharing\.in|gpemu\.sharing\.reply\.[A-Za-z0-9_-]+)$",
    "read": r"^(gpemu\.sharing\.status|gpemu\.sharing\.reply\.[A-Za-z0-9_-]+)$",
}

MAX_SECONDS = 3600.0  # one request longer than an hour of GPU time is a bug in the sender
MAX_BYTES = 1 << 50
MAX_BODY = 16 * 1024  # a real message is a few hundred bytes
MAX_ID_LEN = 200
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e6  # a job's weight under the weighted policies
CLOCKS = ("real", "virtual")  # a job's and a manager's time: see "Virtual time" above
MAX_CLOCK = 1e12  # a time.monotonic() reading (seconds since boot) is far below this
KEY_BYTES = 32
_QUOTE = 60  # characters of hostile input a reason may quote

# Error codes in ``error`` replies; clients react to the first one by registering again.
ERR_UNKNOWN_JOB = "unknown-job"
ERR_BAD_SIGNATURE = "bad-signature"
ERR_BAD_MESSAGE = "bad-message"
ERR_JOB_EXISTS = "job-exists"
ERR_UNKNOWN_DEVICE = "unknown-device"
ERR_BUSY = "too-many-requests"

_FIELDS: dict[str, tuple[str, ...]] = {
    "register": ("job_id", "request_id", "device", "persistent_bytes"),
    "request": ("job_id", "request_id", "device", "seconds", "peak_bytes"),
    "heartbeat": ("job_id",),
    "deregister": ("job_id", "request_id"),
    "status": (),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "register": ("weight", "host", "key", "presence", "clock", "vtime"),
    "request": ("kind", "persistent_bytes", "grant", "sent_at", "presence", "vtime"),
    "heartbeat": ("presence",),
    "deregister": (),
    "status": ("request_id",),
}
_ROUTE_RE = re.compile(r"^job\.[0-9a-f]{32}$")
_QUEUE_RE = re.compile(r"^gpemu\.sharing\.reply\.[A-Za-z0-9_-]{8,128}$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
# JSON strings (escapes included): what is left after removing them must hold one object only.
_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


class ProtocolError(ValueError):
    """A message does not follow the schema; the text says what was wrong and what is valid."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id
        # Who sent it, when the message says so legibly (job id; a register's own key): lets the
        # manager sign the rejection for a sender that proves it holds that job's key.
        self.job_id: str | None = None
        self.key: bytes | None = None


@dataclass(frozen=True)
class Message:
    type: str
    job_id: str = ""
    request_id: str = ""
    device: str = ""
    seconds: float = 0.0
    peak_bytes: int = 0
    persistent_bytes: int | None = None  # always set on register; on request only when sent
    weight: float = 1.0
    kind: str = ""
    host: str = ""  # register: the job's host_identity() (empty: unknown, never "same host")
    grant: bool = False  # request: answer with a grant at the start (deadline scheduling)
    sent_at: float | None = None  # request: the job's CLOCK_MONOTONIC when it sent it
    key: bytes | None = None  # register: the job's own key (managers without a job secret)
    presence: str | None = None  # the job's presence queue
    clock: str = "real"  # register: "virtual" for a job on virtual time (see "Virtual time" above)
    vtime: float | None = None  # register, request: the job's virtual time (see "Virtual time")


def host_identity() -> str:
    """``hostname/boot_id``: two processes with the same value read the same CLOCK_MONOTONIC.

    The boot id changes at every boot of the kernel, so equal ids mean one running kernel,
    whose monotonic clock ``time.monotonic()`` reads in every process (outside Linux time
    namespaces, which come with their own hostname in practice). Empty when it cannot be read.
    """
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}" if boot else ""


def encode(payload: Mapping[str, Any]) -> bytes:
    return json.dumps({"v": PROTOCOL_VERSION, **payload}, separators=(",", ":")).encode()


def new_key() -> bytes:
    import secrets

    return secrets.token_bytes(KEY_BYTES)


def sign(key: bytes, body: bytes) -> str:
    """The signature header value of ``body`` under ``key`` (HMAC-SHA256, hex)."""
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def verify(key: bytes | None, body: bytes, sig: Any) -> bool:
    """True when ``sig`` is ``body``'s signature under ``key`` (constant-time comparison)."""
    if key is None or not isinstance(sig, str) or not _HEX_RE.match(sig):
        return False
    return hmac.compare_digest(sign(key, body), sig)


def derive_job_key(secret: bytes, job_id: str) -> bytes:
    """The key of ``job_id`` under a manager's job secret (the device plugin derives the same)."""
    return hmac.new(secret, b"gpemu-sharing-job\0" + job_id.encode(), hashlib.sha256).digest()


def new_route() -> str:
    """A fresh, unguessable routing key for one job's requests (see "Routes" above)."""
    import secrets

    return "job." + secrets.token_hex(16)


def valid_route(route: Any) -> bool:
    return isinstance(route, str) and bool(_ROUTE_RE.match(route))


def route_queue(route: str) -> str:
    """The manager's queue for the job with this route."""
    return JOB_QUEUE_PREFIX + route[len("job.") :]


def reply_queue_name() -> str:
    """A fresh, unguessable queue name under the reply prefix."""
    import uuid

    return REPLY_PREFIX + uuid.uuid4().hex


def valid_queue_name(name: Any) -> bool:
    """A queue the manager may write to: under the reply prefix, plain ASCII, at most 149 chars."""
    return isinstance(name, str) and bool(_QUEUE_RE.match(name))


def declare_topology(ch: Any) -> None:
    """Declare the exchanges, the request queue and its binding on a blocking pika channel
    (idempotent; needs configure rights, which the jobs' broker user does not have)."""
    ch.exchange_declare(REQUEST_EXCHANGE, exchange_type="direct", durable=True)
    ch.queue_declare(REQUEST_QUEUE, durable=True)
    ch.queue_bind(REQUEST_QUEUE, REQUEST_EXCHANGE, REQUEST_ROUTING_KEY)
    ch.exchange_declare(STATUS_EXCHANGE, exchange_type="fanout", durable=True)


def short(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters: reasons quote hostile input, bounded."""
    text = repr(value)
    return text if len(text) <= _QUOTE else text[:_QUOTE] + f"...({len(text)} chars)"


def _text(name: str, value: Any, request_id: str | None) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN or not value.isprintable():
        raise ProtocolError(
            f"{name} must be a non-empty printable string of at most {MAX_ID_LEN} characters, got {short(value)}",
            request_id,
        )
    return value


def _number(name: str, value: Any, lo: float, hi: float, request_id: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number from {lo:g} to {hi:g}, got {short(value)}", request_id)
    if not lo <= value <= hi:
        raise ProtocolError(f"{name} must be from {lo:g} to {hi:g}, got {short(value)}", request_id)
    return value


def check_job_settings(job_id: Any, device: Any, persistent_bytes: Any, weight: Any) -> None:
    """What a job registers with, checked against the bounds the manager checks it against, so a
    job with a setting the manager would reject fails when it starts, with the same reason."""
    _text("job_id", job_id, None)
    _text("device", device, None)
    _bytes("persistent_bytes", persistent_bytes, None)
    _number("weight", weight, MIN_WEIGHT, MAX_WEIGHT, None)


def _bytes(name: str, value: Any, request_id: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer number of bytes, got {short(value)}", request_id)
    return int(_number(name, value, 0, MAX_BYTES, request_id))


def decode(body: Any) -> Any:
    """Bounded JSON decoding: size and nesting are checked before the decoder sees the bytes.

    Raises :class:`ProtocolError`; jobs use it for replies they cannot authenticate."""
    if not isinstance(body, (bytes, bytearray)) or len(body) > MAX_BODY:
        size = len(body) if isinstance(body, (bytes, bytearray)) else type(body).__name__
        raise ProtocolError(f"message body must be JSON of at most {MAX_BODY} bytes, got {size}")
    body = bytes(body)
    # Fast path: a body with at most one bracket cannot nest; otherwise count them outside strings.
    if body.count(b"{") + body.count(b"[") > 1 and sum(_STRING_RE.sub(b"", body).count(c) for c in (b"{", b"[")) > 1:
        raise ProtocolError("message must be one flat JSON object (no nested arrays or objects)")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("message body is not valid JSON (UTF-8, one object)") from None


def parse_message(body: bytes) -> Message:
    """Decode and validate one message from a job. Raises :class:`ProtocolError`, which names the
    sender's job id (and a register's own key) when those fields are well-formed."""
    data = decode(body)
    try:
        return _validated(data)
    except ProtocolError as exc:
        if isinstance(data, dict):
            job_id, key = data.get("job_id"), data.get("key")
            if isinstance(job_id, str) and 0 < len(job_id) <= MAX_ID_LEN and job_id.isprintable():
                exc.job_id = job_id
            if isinstance(key, str) and _HEX_RE.match(key):
                exc.key = bytes.fromhex(key)
        raise


def _validated(data: Any) -> Message:
    if not isinstance(data, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(data).__name__}")
    rid = data.get("request_id") if isinstance(data.get("request_id"), str) else None
    if rid is not None and (not rid or len(rid) > MAX_ID_LEN or not rid.isprintable()):
        rid = None
    if data.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version must be {PROTOCOL_VERSION}, got {short(data.get('v'))}", rid)
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise ProtocolError(f"type must be one of {', '.join(_FIELDS)}, got {short(kind)}", rid)
    missing = [f for f in _FIELDS[kind] if f not in data]
    if missing:
        raise ProtocolError(f"'{kind}' message lacks {', '.join(missing)}", rid)
    unknown = set(data) - set(_FIELDS[kind]) - set(_OPTIONAL[kind]) - {"v", "type"}
    if unknown:
        names = sorted(unknown)
        shown = ", ".join(short(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ProtocolError(
            f"'{kind}' message has unknown fields {shown}; valid: {', '.join(_FIELDS[kind] + _OPTIONAL[kind])}", rid
        )
    out: dict[str, Any] = {"type": kind}
    for name in ("job_id", "request_id", "device"):
        if name in data:
            out[name] = _text(name, data[name], rid)
    if "presence" in data:
        if not valid_queue_name(data["presence"]):
            raise ProtocolError(
                f"presence must name a queue {REPLY_PREFIX}<8-128 letters, digits, _ or ->, "
                f"got {short(data['presence'])}",
                rid,
            )
        out["presence"] = data["presence"]
    if kind == "request":
        out["seconds"] = float(_number("seconds", data["seconds"], 0.0, MAX_SECONDS, rid))
        out["peak_bytes"] = _bytes("peak_bytes", data["peak_bytes"], rid)
        if "kind" in data:
            out["kind"] = _text("kind", data["kind"], rid)
        if "persistent_bytes" in data:
            out["persistent_bytes"] = _bytes("persistent_bytes", data["persistent_bytes"], rid)
        if "grant" in data:
            if not isinstance(data["grant"], bool):
                raise ProtocolError(f"grant must be true or false, got {short(data['grant'])}", rid)
            out["grant"] = data["grant"]
        if "sent_at" in data:
            out["sent_at"] = float(_number("sent_at", data["sent_at"], 0.0, MAX_CLOCK, rid))
    if "vtime" in data:
        out["vtime"] = float(_number("vtime", data["vtime"], 0.0, MAX_CLOCK, rid))
    if kind == "register":
        if "clock" in data:
            if data["clock"] not in CLOCKS:
                raise ProtocolError(f"clock must be one of {', '.join(CLOCKS)}, got {short(data['clock'])}", rid)
            out["clock"] = data["clock"]
        if "host" in data:
            out["host"] = _text("host", data["host"], rid)
        out["persistent_bytes"] = _bytes("persistent_bytes", data["persistent_bytes"], rid)
        if "weight" in data:
            out["weight"] = float(_number("weight", data["weight"], MIN_WEIGHT, MAX_WEIGHT, rid))
        if "key" in data:
            if not isinstance(data["key"], str) or not _HEX_RE.match(data["key"]):
                raise ProtocolError(f"key must be {KEY_BYTES} bytes as 64 lower-case hex digits", rid)
            out["key"] = bytes.fromhex(data["key"])
    return Message(**out)
