"""A flood of hostile messages against a live sharing manager while a good job is served.

    python benchmarks/sharing_fuzz.py                      # private loopback broker, 10,000 messages
    python benchmarks/sharing_fuzz.py --messages 2000 --seed 3

The manager runs as its own process (`gpemu share-manager`, its log in a file); a good job
(one process) asks for 5 ms of GPU time again and again. The benchmark publishes the poison
message (``[`` * 5000 + ``]`` * 5000) and then ``--messages`` generated ones, every one of which
must be rejected: random bytes,
nesting thousands deep, bodies over the size limit, JSON of every type in every field,
well-formed requests, heartbeats and deregistrations for the good job signed with a wrong key,
registrations whose signature does not match, status requests whose answer would go into the
request queue, all with random AMQP properties (headers of every
AMQP type, a forged signature header, reply_to naming the request queue, a stranger's queue,
nothing at all). It prints, before and after the flood: the manager's resident memory and log
size, the good job's longest wait (run() time beyond its 5 ms), and at the end whether every
message was rejected, the queue is empty (nothing left to redeliver) and how often the
manager (re)connected.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = r"""
import json, sys, time
from gpemu.integrations.sharing.client import SharingClient
url, stop_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
samples = []
with SharingClient(url, job_id="good", persistent_bytes=1 << 30, lease_s=10.0) as c:
    print("ready", flush=True)
    import os
    while not os.path.exists(stop_file):
        r = c.run(0.005, 1 << 30)
        samples.append((time.time(), r.elapsed_s - 0.005))
    json.dump({"samples": samples, "forged_replies": c.forged_replies}, open(out, "w"))
"""


def _junk(rng: random.Random, depth: int = 0) -> object:
    """A JSON-ish value of any type (nested up to 3 deep, floats up to inf, NaN)."""
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.randint(-(2**70), 2**70)
    if kind == 3:
        return float(f"{rng.random()}e{rng.randint(-5, 400)}")  # up to inf
    if kind == 4:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 50)))
    if kind == 5:
        return float("nan")
    if kind == 6:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(3))]
    if kind == 7:
        return {str(rng.randrange(99)): _junk(rng, depth + 1) for _ in range(rng.randrange(3))}
    return "good"


_FIELDS = ["v", "type", "job_id", "request_id", "device", "seconds", "peak_bytes", "key", "presence"]
_FIELDS += ["persistent_bytes", "grant", "sent_at", "weight", "host", "kind", "token"]


def _forged_for_the_good_job(rng: random.Random, good: dict) -> bytes:
    """A well-formed message for the good job (signed, below, with a wrong key or none)."""
    msg = {**good, "type": rng.choice(["request", "heartbeat", "deregister"])}
    if msg["type"] == "heartbeat":
        msg = {"v": msg["v"], "type": "heartbeat", "job_id": "good"}
    elif msg["type"] == "deregister":
        msg = {"v": msg["v"], "type": "deregister", "job_id": "good", "request_id": msg["request_id"]}
    return json.dumps(msg).encode()


def _body(rng: random.Random) -> tuple[bytes, dict | None]:
    """One generated body; properties too when the body needs particular ones."""
    from gpemu.integrations.sharing import protocol as P

    good = {"v": P.PROTOCOL_VERSION, "job_id": "good", "request_id": f"x{rng.randrange(10**9)}", "device": "0",
            "seconds": 0.5, "peak_bytes": 0}  # fmt: skip
    kind = rng.randrange(10)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))), None
    if kind == 1:
        n = rng.randrange(2, 30000)
        return (b"[" * n + b"]" * n if rng.random() < 0.5 else b'{"a":' * n + b"1" + b"}" * n), None
    if kind == 2:
        return b'{"v":2,"type":"request","job_id":"' + b"x" * rng.randrange(P.MAX_BODY, 4 * P.MAX_BODY) + b'"}', None
    if kind == 3:  # every field with a value of any type
        return json.dumps({f: _junk(rng) for f in rng.sample(_FIELDS, rng.randrange(1, len(_FIELDS)))}).encode(), None
    if kind in (4, 5):
        return _forged_for_the_good_job(rng, good), None
    if kind == 6:  # registrations whose signature does not match their key
        reg = {"v": P.PROTOCOL_VERSION, "type": "register", "job_id": rng.choice(["good", "intruder"]),
               "request_id": "r", "device": "0", "persistent_bytes": rng.randrange(2**40),
               "key": os.urandom(32).hex()}  # fmt: skip
        return json.dumps(reg).encode(), None
    if kind == 7:  # a status request whose answer would go into the request queue or a stranger's queue
        queue = rng.choice([P.REQUEST_QUEUE, "amq.gen-x", "some.other.queue"])
        return json.dumps({"v": P.PROTOCOL_VERSION, "type": "status"}).encode(), {"reply_to": queue}
    return json.dumps({**good, "type": "request", "seconds": _junk(rng)}).encode(), None  # bad GPU time


def _header_value(rng: random.Random) -> object:
    """A header value of the types AMQP tables carry (pika cannot encode floats or huge ints)."""
    return rng.choice(
        [
            None,
            True,
            rng.randint(-(2**63), 2**63 - 1),
            os.urandom(8).hex(),
            "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(0, 80))),
            [rng.randrange(9) for _ in range(rng.randrange(4))],
            {"k": "v" * rng.randrange(50)},
        ]
    )


def _properties(rng: random.Random) -> dict:
    from gpemu.integrations.sharing import protocol as P

    headers = {str(rng.randrange(10**6)): _header_value(rng) for _ in range(rng.randrange(4))}
    if rng.random() < 0.7:
        headers[P.SIG_HEADER] = rng.choice([os.urandom(32).hex(), "", "z" * 64, _header_value(rng)])
    reply_to = rng.choice(
        [
            None,
            P.REQUEST_QUEUE,
            "amq.gen-x",
            P.reply_queue_name(),
            "gpemu.sharing.reply.../../",
            "".join(chr(rng.randrange(33, 127)) for _ in range(rng.randrange(1, 200))),
        ]
    )
    return {
        "headers": headers,
        "reply_to": reply_to,
        "priority": rng.randrange(10),
        "correlation_id": str(rng.random()),
        "content_type": rng.choice(["application/json", "text/x", "\x00"]),
    }


def hostile(rng: random.Random) -> tuple[bytes, dict]:
    """One generated (body, properties) pair."""
    body, props = _body(rng)
    return body, props if props is not None else _properties(rng)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def status(url: str) -> dict:
    from gpemu.integrations.sharing.status import fetch_status

    return fetch_status(url, 10.0)


def _start_manager(url: str, log: Path) -> subprocess.Popen:
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, "share-manager", "--amqp", url, "--device", "0=P100:16GiB"]
        + ["--policy", "round-robin"],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )


def _flood(url: str, messages: int, seed: int) -> dict:
    """The poison message, then ``messages`` generated ones; what was published, and when."""
    import pika

    from gpemu.integrations.sharing import protocol as P

    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    rng = random.Random(seed)
    start = time.time()
    poison = pika.BasicProperties(reply_to=P.reply_queue_name())
    ch.basic_publish(P.REQUEST_EXCHANGE, P.REQUEST_ROUTING_KEY, b"[" * 5000 + b"]" * 5000, poison)
    published, unencodable, statuses = 1, 0, 0
    status_body = json.dumps({"v": P.PROTOCOL_VERSION, "type": "status"}).encode()
    while published < messages + 1:
        body, props = hostile(rng)
        try:
            ch.basic_publish(P.REQUEST_EXCHANGE, P.REQUEST_ROUTING_KEY, body, pika.BasicProperties(**props))
        except (ValueError, TypeError, UnicodeError, OverflowError, struct.error, pika.exceptions.AMQPError):
            unencodable += 1  # pika cannot encode these properties: they never reach the broker
            continue
        published += 1
        statuses += body == status_body and P.valid_queue_name(props.get("reply_to"))
    conn.close()
    return {"start": start, "published_at": time.time(), "published": published,
            "unencodable": unencodable, "statuses": statuses}  # fmt: skip


def _queued(url: str) -> int:
    import pika

    from gpemu.integrations.sharing import protocol as P

    conn = pika.BlockingConnection(pika.URLParameters(url))
    n = conn.channel().queue_declare(P.REQUEST_QUEUE, passive=True).method.message_count
    conn.close()
    return n


def _report(flood: dict, before: dict, after: dict, result: dict, text: str, handled_at: float, queued: int) -> None:
    during = [w for t, w in result["samples"] if flood["start"] <= t <= handled_at]
    quiet = [w for t, w in result["samples"] if t < flood["start"]]
    published, statuses = flood["published"], flood["statuses"]
    print(
        f"published {published} (+{flood['unencodable']} pika could not encode), of them {statuses} well-formed "
        f"status requests; published in {flood['published_at'] - flood['start']:.1f} s, all handled "
        f"{handled_at - flood['start']:.1f} s after the first"
    )
    print(
        f"rejected by the manager: {after['status']['rejected'] - before['status']['rejected']} "
        f"(expected {published - statuses}); internal errors: {text.count('handling it failed')}; "
        f"request queue afterwards: {queued} message(s); manager connected {text.count('connected to')} time(s)"
    )
    print(
        f"good job: {len(result['samples'])} requests served in all, {len(during)} during the flood; "
        f"longest wait beyond its 5 ms: {max(quiet) * 1e3:.1f} ms before the flood, "
        f"{max(during) * 1e3:.1f} ms during it; replies it dropped as forged: {result['forged_replies']}; "
        f"still registered: {[j['job_id'] for j in after['status']['jobs']]}"
    )
    print(f"manager memory (VmRSS): {before['rss'] / 1024:.1f} MiB before, {after['rss'] / 1024:.1f} MiB after")
    print(
        f"manager log: {before['log']} bytes before, {after['log']} bytes after "
        f"({text.count('rejected message')} rejection lines, "
        f"{text.count('more message(s) rejected')} summary lines)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    from gpemu.integrations.sharing.broker import RabbitBroker

    work = Path(tempfile.mkdtemp(prefix="gpemu-fuzz-"))
    broker = RabbitBroker.start()
    url, log = broker.url, work / "manager.log"
    manager = _start_manager(url, log)
    job = None
    try:
        time.sleep(3.0)
        stop_file, out = work / "stop", work / "job.json"
        job = subprocess.Popen(
            [sys.executable, "-c", JOB, url, str(stop_file), str(out)], stdout=subprocess.PIPE, text=True
        )
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        time.sleep(3.0)
        before = {"rss": rss_kib(manager.pid), "log": log.stat().st_size, "status": status(url)}
        print(
            f"# {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f}; "
            f"manager pid {manager.pid}; {args.messages} generated messages (seed {args.seed}) after the poison one"
        )
        flood = _flood(url, args.messages, args.seed)
        target = before["status"]["rejected"] + flood["published"] - flood["statuses"]
        deadline = time.time() + 600
        while time.time() < deadline and status(url)["rejected"] < target:
            time.sleep(0.5)
        handled_at = time.time()
        queued = _queued(url)
        time.sleep(2.0)
        after = {"rss": rss_kib(manager.pid), "log": log.stat().st_size, "status": status(url)}
        stop_file.touch()
        job.wait(60)
        print(f"manager still running: {manager.poll() is None}")
        _report(flood, before, after, json.loads(out.read_text()), log.read_text(errors="replace"), handled_at, queued)
        manager.terminate()  # SIGTERM: the manager logs the rejections its log budget left out
        manager.wait(10)
        tail = [line for line in log.read_text(errors="replace").splitlines() if "more message(s) rejected" in line]
        print(
            f"manager stopped (exit {manager.returncode}); its log, {log.stat().st_size} bytes, ends the flood with: "
            f"{tail[-1].split(' WARNING ')[-1] if tail else 'no summary line'}"
        )
        print(f"# load average {os.getloadavg()[0]:.2f} at the end; log: {log}")
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        if manager.poll() is None:
            manager.terminate()
            manager.wait(10)
        broker.stop()


if __name__ == "__main__":
    main()
