"""Three attacks one job can try on another job sharing its emuGPU, against a real broker.

* **token theft**: read other jobs' messages (the request queue, copies of it through a binding
  of one's own, another job's reply queue) to learn what it sends, then act as it (deregister
  it, which would free its memory and drop its work).
* **forged reply**: put a fake "out of memory" answer into another job's reply queue.
* **hog**: ask for an hour of GPU time in one request, so a 2 ms request of another job waits.

Each function returns what the attacker got; ``succeeded`` is False when the defence held.
The attacker connects as the jobs' broker user (``JOB_PERMISSIONS``); the forged reply is also
tried with the manager's own full rights, where only the reply's signature stops it.

    python tests/sharing_attacks.py      # private broker + manager on loopback; prints each attack
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gpemu.integrations.sharing import protocol as P
from gpemu.integrations.sharing.client import SharingClient

GiB = 1 << 30


@dataclass
class AttackResult:
    name: str
    succeeded: bool
    attacker_got: list[str] = field(default_factory=list)

    def report(self) -> str:
        verdict = "SUCCEEDED" if self.succeeded else "failed"
        return f"{self.name}: attack {verdict}\n" + "\n".join(f"    {line}" for line in self.attacker_got)


def _try(what: str, fn: Any, got: list[str]) -> Any:
    """Run one step of an attack on a fresh channel; record what the broker answered."""
    try:
        value = fn()
    except Exception as exc:
        got.append(f"{what}: {type(exc).__name__} {getattr(exc, 'args', '')}")
        return None
    got.append(f"{what}: allowed, got {value!r}"[:300])
    return value


def token_theft(jobs_url: str, victim: SharingClient) -> AttackResult:
    """Read the victim's messages from the broker, then deregister it."""
    import pika

    got: list[str] = []
    conn = pika.BlockingConnection(pika.URLParameters(jobs_url))
    stolen: list[bytes] = []
    try:

        def read_requests() -> Any:
            method, _props, body = conn.channel().basic_get(P.REQUEST_QUEUE, auto_ack=False)
            if body:
                stolen.append(body)
            return body

        def copy_requests() -> Any:
            ch = conn.channel()
            mine = P.reply_queue_name()
            ch.queue_declare(mine, exclusive=True)
            ch.queue_bind(mine, P.REQUEST_EXCHANGE, P.REQUEST_ROUTING_KEY)  # a copy of every request
            victim.run(0.001, GiB)  # the victim sends something
            time.sleep(0.2)
            method, _props, body = ch.basic_get(mine, auto_ack=True)
            if body:
                stolen.append(body)
            return body

        def read_victims_replies() -> Any:
            method, _props, body = conn.channel().basic_get(victim.reply_queue, auto_ack=True)
            if body:
                stolen.append(body)
            return body

        _try("basic.get on the request queue", read_requests, got)
        _try("bind an own queue to the request exchange", copy_requests, got)
        _try(f"basic.get on the victim's reply queue {victim.reply_queue}", read_victims_replies, got)
        key = None
        for body in stolen:  # whatever was read: the victim's key, if it ever travelled
            try:
                key = bytes.fromhex(json.loads(body).get("key", "")) or None
            except (ValueError, AttributeError):
                pass
        got.append(f"messages read: {len(stolen)}; victim's key learned: {key is not None}")
        # Act as the victim anyway: deregister it, signed with whatever key the attacker has.
        reply = _call(
            conn, {"type": "deregister", "job_id": victim.job_id, "request_id": uuid.uuid4().hex}, key or P.new_key()
        )
        got.append(f"deregister as {victim.job_id!r}: manager answered {reply}")
        still = victim.run(0.001, GiB)  # the victim is still registered and served
        got.append(f"victim afterwards: served normally (waited {still.waited_s * 1e3:.1f} ms)")
        succeeded = bool(stolen) or (reply or {}).get("type") == "deregistered"
    finally:
        conn.close()
    return AttackResult("token theft", succeeded, got)


def _call(conn: Any, payload: dict[str, Any], key: bytes, timeout: float = 5.0) -> dict[str, Any] | None:
    """Publish one signed message the way a job does and wait for the manager's answer."""
    import pika

    ch = conn.channel()
    queue = P.reply_queue_name()
    ch.queue_declare(queue, exclusive=True)
    body = P.encode(payload)
    ch.basic_publish(
        P.REQUEST_EXCHANGE,
        P.REQUEST_ROUTING_KEY,
        body,
        pika.BasicProperties(reply_to=queue, headers={P.SIG_HEADER: P.sign(key, body)}),
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        method, _props, reply = ch.basic_get(queue, auto_ack=True)
        if reply:
            data = json.loads(reply)
            return {k: data[k] for k in ("type", "code") if k in data}
        conn.process_data_events(time_limit=0.05)
    return None


def forged_reply(jobs_url: str, admin_url: str, victim: SharingClient) -> AttackResult:
    """Put a fake "out of memory" refusal for the victim's request in flight into its reply queue."""
    import pika

    got: list[str] = []
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(_run_catching(victim, 1.0)))
    forged_before = victim.forged_replies
    t.start()
    deadline = time.monotonic() + 5
    while victim._awaiting is None and time.monotonic() < deadline:
        time.sleep(0.005)
    rid = victim._awaiting  # an insider's knowledge: the id of the request the victim waits for
    fake = json.dumps(
        {"v": P.PROTOCOL_VERSION, "type": "refused", "request_id": rid, "reason": "CUDA out of memory (forged)"}
    ).encode()
    for who, url in (("jobs' user", jobs_url), ("manager's own user", admin_url)):
        conn = pika.BlockingConnection(pika.URLParameters(url))
        try:

            def publish(conn: pika.BlockingConnection = conn) -> str:
                ch = conn.channel()
                ch.confirm_delivery()
                ch.basic_publish("", victim.reply_queue, fake, pika.BasicProperties(headers={P.SIG_HEADER: "0" * 64}))
                return "delivered to the victim's reply queue"

            _try(f"publish a forged refusal as the {who}", publish, got)
        finally:
            conn.close()
    t.join(30)
    outcome = box[0] if box else "no answer within 30 s"
    dropped = victim.forged_replies - forged_before
    got.append(f"victim's run(): {outcome}; replies it dropped as not signed by the manager: {dropped}")
    return AttackResult("forged reply", not (isinstance(outcome, str) and outcome.startswith("granted")), got)


def _run_catching(client: SharingClient, seconds: float) -> str:
    try:
        client.run(seconds, GiB)
        return f"granted and served ({seconds:g} s of GPU time)"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


HOG_SCRIPT = """
import sys
from gpemu.integrations.sharing.client import SharingClient
c = SharingClient(sys.argv[1], job_id="hog", persistent_bytes=1 << 30, lease_s=10.0)
c.register()
print("registered", flush=True)
c.run(3600.0, 1 << 30)
"""


def hog(jobs_url: str, victim: SharingClient, quantum_s: float) -> AttackResult:
    """A job asks for an hour of GPU time; how long does the victim's 2 ms request wait?"""
    got: list[str] = []
    proc = subprocess.Popen([sys.executable, "-c", HOG_SCRIPT, jobs_url], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        if line != "registered":
            raise RuntimeError(f"the hog did not register: {line!r}")
        time.sleep(0.5)  # the hour-long request is on the emuGPU
        waits = []
        for _ in range(5):
            r = victim.run(0.002, GiB)
            waits.append(r.elapsed_s - 0.002)
        got.append(
            f"hog asked for 3600 s in one request; victim's 2 ms requests waited "
            f"{', '.join(f'{w * 1e3:.0f}' for w in waits)} ms (quantum {quantum_s * 1e3:.0f} ms)"
        )
        return AttackResult("hog", max(waits) > 2 * quantum_s + 0.5, got)
    finally:
        proc.kill()
        proc.wait(10)


def main() -> int:
    from gpemu.integrations.sharing.broker import RabbitBroker
    from gpemu.integrations.sharing.manager import DEFAULT_QUANTUM_S, DeviceSpec, SharingManager

    broker = RabbitBroker.start()
    try:
        jobs_url = broker.add_user("gpemu-jobs", uuid.uuid4().hex, **P.JOB_PERMISSIONS)
        manager = SharingManager(broker.url, [DeviceSpec("0", "P100", 16 * GiB)], "round-robin", lease_s=10.0)
        t = threading.Thread(target=manager.serve_forever, daemon=True)
        t.start()
        manager.connected.wait(30)
        print(f"broker {broker.url.split('@')[1]} (loopback); jobs connect as 'gpemu-jobs' with {P.JOB_PERMISSIONS}\n")
        results = []
        with SharingClient(jobs_url, job_id="victim", persistent_bytes=2 * GiB, lease_s=10.0) as victim:
            results.append(token_theft(jobs_url, victim))
            results.append(forged_reply(jobs_url, broker.url, victim))
            results.append(hog(jobs_url, victim, DEFAULT_QUANTUM_S))
        for r in results:
            print(r.report(), end="\n\n")
        manager.stop()
        t.join(10)
        return 1 if any(r.succeeded for r in results) else 0
    finally:
        broker.stop()


if __name__ == "__main__":
    sys.exit(main())
