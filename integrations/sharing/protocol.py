"""The sharing protocol: JSON messages between jobs and the sharing manager, and their validation.

Independent of the emulator: any program that speaks this schema over AMQP can share an emuGPU.

Topology (all names under ``gpemu.sharing``):

* ``REQUEST_QUEUE`` (durable): jobs publish every message here (persistent, publisher confirms),
  with ``reply_to`` naming the job's own durable reply queue. The manager acknowledges a GPU-time
  request only once it has answered it, so a manager that dies leaves unanswered requests queued.
* ``STATUS_EXCHANGE`` (fanout): the manager publishes a status snapshot periodically.

Messages from jobs (``type``):

``register``   job_id, request_id, device, persistent_bytes, weight (optional: host — see
               :func:`host_identity`; equal on both sides means a shared CLOCK_MONOTONIC —,
               token: the job's current token, which makes registering again idempotent)
``request``    job_id, token, request_id, device, seconds, peak_bytes (optional: kind,
               persistent_bytes — the job's persistent memory now, which may have grown since
               it registered, e.g. optimizer state created at the first step —, grant: true to
               get a ``granted`` reply when the request is scheduled instead of ``done`` when it
               ends, sent_at: the job's ``time.monotonic()`` when it published the request)
``heartbeat``  job_id, token
``deregister`` job_id, token, request_id
``status``     (no other field; answered on reply_to)

Replies from the manager (``type``): ``registered`` (token, same_host), ``done`` (waited_s, served_s),
``granted`` (start, end: the manager's ``time.monotonic()`` when the work starts and ends on the
emuGPU's timeline; remaining_s: end minus the manager's clock when the grant was written;
waited_s, idle_s — sent before the work starts, so the job waits locally until ``end``),
``refused`` (reason: out of memory), ``error`` (code, reason), ``heartbeat-ack``,
``deregistered``, ``status`` (snapshot). Every reply repeats the ``request_id`` it answers.

``peak_bytes`` is the job's whole GPU memory at the request's peak (persistent memory included,
as ``torch.cuda.max_memory_allocated`` reports it). A request fits when the persistent memory
of all *other* registered jobs on the emuGPU plus this peak is within the GPU's capacity.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "PROTOCOL_VERSION", "REQUEST_QUEUE", "STATUS_EXCHANGE", "ProtocolError", "Message",
    "parse_message", "encode", "MAX_SECONDS", "MAX_BYTES",
    "ERR_UNKNOWN_JOB", "ERR_BAD_TOKEN", "ERR_BAD_MESSAGE", "ERR_JOB_EXISTS", "ERR_UNKNOWN_DEVICE",
    "host_identity",
]

PROTOCOL_VERSION = 1
REQUEST_QUEUE = "gpemu.sharing.requests"
STATUS_EXCHANGE = "gpemu.sharing.status"

MAX_SECONDS = 3600.0  # one request longer than an hour of GPU time is a bug in the sender
MAX_BYTES = 1 << 50
MAX_BODY = 64 * 1024
MAX_ID_LEN = 200
MAX_CLOCK = 1e12  # a time.monotonic() reading (seconds since boot) is far below this

# Error codes in ``error`` replies; clients react to the first two by re-registering.
ERR_UNKNOWN_JOB = "unknown-job"
ERR_BAD_TOKEN = "bad-token"
ERR_BAD_MESSAGE = "bad-message"
ERR_JOB_EXISTS = "job-exists"
ERR_UNKNOWN_DEVICE = "unknown-device"

_FIELDS: dict[str, tuple[str, ...]] = {
    "register": ("job_id", "request_id", "device", "persistent_bytes"),
    "request": ("job_id", "token", "request_id", "device", "seconds", "peak_bytes"),
    "heartbeat": ("job_id", "token"),
    "deregister": ("job_id", "token", "request_id"),
    "status": (),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "register": ("weight", "host", "token"),
    "request": ("kind", "persistent_bytes", "grant", "sent_at"),
    "heartbeat": (),
    "deregister": (),
    "status": ("request_id",),
}


class ProtocolError(ValueError):
    """A message does not follow the schema; the text says what was wrong and what is valid."""

    def __init__(self, reason: str, request_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id


@dataclass(frozen=True)
class Message:
    type: str
    job_id: str = ""
    token: str = ""
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


def _text(name: str, value: Any, request_id: str | None) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN or not value.isprintable():
        raise ProtocolError(f"{name} must be a non-empty printable string of at most {MAX_ID_LEN} characters",
                            request_id)
    return value


def _number(name: str, value: Any, lo: float, hi: float, request_id: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number from {lo:g} to {hi:g}, got {value!r}", request_id)
    if not lo <= value <= hi:
        raise ProtocolError(f"{name} must be from {lo:g} to {hi:g}, got {value!r}", request_id)
    return value


def _bytes(name: str, value: Any, request_id: str | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{name} must be an integer number of bytes, got {value!r}", request_id)
    return int(_number(name, value, 0, MAX_BYTES, request_id))


def parse_message(body: bytes) -> Message:
    """Decode and validate one message from a job. Raises :class:`ProtocolError`."""
    if not isinstance(body, (bytes, bytearray)) or len(body) > MAX_BODY:
        raise ProtocolError(f"message body must be JSON of at most {MAX_BODY} bytes")
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("message body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ProtocolError("message must be a JSON object")
    rid = data.get("request_id") if isinstance(data.get("request_id"), str) else None
    if rid is not None and (len(rid) > MAX_ID_LEN or not rid.isprintable()):
        rid = None
    if data.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version must be {PROTOCOL_VERSION}, got {data.get('v')!r}", rid)
    kind = data.get("type")
    if kind not in _FIELDS:
        raise ProtocolError(f"type must be one of {', '.join(_FIELDS)}, got {kind!r}", rid)
    missing = [f for f in _FIELDS[kind] if f not in data]
    if missing:
        raise ProtocolError(f"'{kind}' message lacks {', '.join(missing)}", rid)
    unknown = set(data) - set(_FIELDS[kind]) - set(_OPTIONAL[kind]) - {"v", "type"}
    if unknown:
        raise ProtocolError(f"'{kind}' message has unknown fields {', '.join(sorted(unknown))}; "
                            f"valid: {', '.join(_FIELDS[kind] + _OPTIONAL[kind])}", rid)
    out: dict[str, Any] = {"type": kind}
    for name in ("job_id", "token", "request_id", "device"):
        if name in data:
            out[name] = _text(name, data[name], rid)
    if kind == "request":
        out["seconds"] = float(_number("seconds", data["seconds"], 0.0, MAX_SECONDS, rid))
        out["peak_bytes"] = _bytes("peak_bytes", data["peak_bytes"], rid)
        if "kind" in data:
            out["kind"] = _text("kind", data["kind"], rid)
        if "persistent_bytes" in data:
            out["persistent_bytes"] = _bytes("persistent_bytes", data["persistent_bytes"], rid)
        if "grant" in data:
            if not isinstance(data["grant"], bool):
                raise ProtocolError(f"grant must be true or false, got {data['grant']!r}", rid)
            out["grant"] = data["grant"]
        if "sent_at" in data:
            out["sent_at"] = float(_number("sent_at", data["sent_at"], 0.0, MAX_CLOCK, rid))
    if kind == "register":
        if "host" in data:
            out["host"] = _text("host", data["host"], rid)
        out["persistent_bytes"] = _bytes("persistent_bytes", data["persistent_bytes"], rid)
        if "weight" in data:
            out["weight"] = float(_number("weight", data["weight"], 1e-3, 1e6, rid))
    return Message(**out)
