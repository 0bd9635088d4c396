"""The sharing manager over a real broker: isolation between jobs, hostile input, floods, a second
manager, rejections."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sharing_broker_support import (  # noqa: E402
    GiB,
    ThreadManager,
    broker,
    client,
    purge,
    start_manager_process,
)

from gpemu.integrations.sharing import protocol as P  # noqa: E402
from gpemu.integrations.sharing.client import SharingClient  # noqa: E402

__all__ = ["broker", "purge"]  # fixtures, used by name

pytestmark = pytest.mark.broker


def test_a_thousand_malformed_messages_over_the_broker(broker, purge, caplog):
    import pika

    mgr = ThreadManager(broker.url)
    try:
        with client(broker.url, "good") as good:
            conn = pika.BlockingConnection(pika.URLParameters(broker.url))
            ch = conn.channel()
            bodies = []
            for i in range(1000):
                base = {
                    "v": 1,
                    "type": "request",
                    "job_id": "good",
                    "token": "forged-token",
                    "request_id": f"m{i}",
                    "device": "0",
                    "seconds": 0.5,
                    "peak_bytes": 0,
                }
                variant = i % 5
                if variant == 0:
                    bodies.append(b"\xff\x00not json")
                elif variant == 1:
                    bodies.append(json.dumps(base).encode())  # forged job id/token
                elif variant == 2:
                    bodies.append(json.dumps({**base, "seconds": -3}).encode())
                elif variant == 3:
                    bodies.append(json.dumps({**base, "device": "9"}).encode())
                else:
                    bodies.append(
                        json.dumps(
                            {
                                "v": 1,
                                "type": "register",
                                "job_id": "x" * 500,
                                "request_id": "r",
                                "device": "0",
                                "persistent_bytes": 0,
                            }
                        ).encode()
                    )
            for body in bodies:
                ch.basic_publish("", P.REQUEST_QUEUE, body)
            results = [good.run(0.01, GiB) for _ in range(10)]
            deadline = time.monotonic() + 20
            while mgr.m.core.rejected < 1000 and time.monotonic() < deadline:
                time.sleep(0.05)
            conn.close()
            assert mgr.m.core.rejected == 1000
            assert len(results) == 10
            assert mgr.m.core.jobs["good"].served_count == 10  # forged requests got no GPU time
            assert mgr.m.core.devices["0"].busy_s == pytest.approx(0.1, rel=1e-6)
        assert mgr.t.is_alive()
        assert any("rejected message" in r.getMessage() for r in caplog.records)
    finally:
        mgr.stop()


@pytest.fixture(scope="module")
def jobs_url(broker):
    """The restricted broker user jobs connect as (JOB_PERMISSIONS), as deployed in Kubernetes."""
    import uuid

    return broker.add_user(f"jobs-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex, **P.JOB_PERMISSIONS)


def test_every_port_of_the_broker_listens_on_loopback_only(broker):
    import psutil

    ports = {broker.port, broker.dist_port, broker.epmd_port}
    listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port in ports]
    assert {a.port for a in listening} == ports  # each one is open...
    assert all(a.ip in ("127.0.0.1", "::1") for a in listening), listening  # ...on loopback only
    # ...and below the kernel's ephemeral range: an outgoing connection made while the broker
    # restarts (its clients reconnecting) can never take one of them (EADDRINUSE on restart)
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert max(ports) < low, (ports, low)


def test_token_theft_forged_reply_and_hog_attacks_fail(broker, purge, jobs_url):
    """tests/sharing_attacks.py against a manager with the default quantum: the jobs' user reads
    nothing, cannot act as another job, cannot reach its reply queue; a reply forged with full
    rights is dropped by the job; an hour-long request holds the emuGPU one quantum at a time."""
    from sharing_attacks import forged_reply, hog, token_theft

    from gpemu.integrations.sharing.manager import DEFAULT_QUANTUM_S

    mgr = ThreadManager(broker.url, lease=10.0)
    try:
        with SharingClient(jobs_url, job_id="victim", persistent_bytes=2 * GiB, lease_s=10.0) as victim:
            theft = token_theft(jobs_url, victim)
            forged = forged_reply(jobs_url, broker.url, victim)
            hogged = hog(jobs_url, victim, DEFAULT_QUANTUM_S)
        for result in (theft, forged, hogged):
            assert not result.succeeded, result.report()
        text = theft.report()
        assert text.count("ACCESS_REFUSED") == 2 and "RESOURCE_LOCKED" in text and "bad-signature" in text
        assert (
            "ACCESS_REFUSED" in forged.attacker_got[0] and "dropped as not signed by the manager: 1" in forged.report()
        )
        assert mgr.m.core.rejected >= 1 and "victim" not in mgr.m.core.jobs  # left on its own, at exit
    finally:
        mgr.stop()


def test_jobs_with_keys_from_the_job_secret(broker, purge, jobs_url):
    """Kubernetes mode: keys are derived from the manager's job secret and never travel."""
    secret = b"k" * 32
    mgr = ThreadManager(broker.url, job_secret=secret)
    try:
        good = client(jobs_url, "pod-a", key=P.derive_job_key(secret, "pod-a"))
        good.register()
        assert good.run(0.01, GiB).elapsed_s >= 0.01
        impostor = client(
            jobs_url, "pod-a-impostor", key=P.derive_job_key(b"x" * 32, "pod-a-impostor"), manager_timeout_s=3
        )
        from gpemu.integrations.sharing.client import SharingUnavailableError

        with pytest.raises(SharingUnavailableError):  # never answered with its key: nothing to trust
            impostor.register()
        assert set(mgr.m.core.jobs) == {"pod-a"}
        good.close()
        impostor.close()
    finally:
        mgr.stop()


def test_poison_message_is_rejected_once_and_the_service_goes_on(broker, purge, caplog):
    import pika

    mgr = ThreadManager(broker.url)
    try:
        with client(broker.url, "good") as good:
            conn = pika.BlockingConnection(pika.URLParameters(broker.url))
            ch = conn.channel()
            ch.basic_publish(
                P.REQUEST_EXCHANGE,
                P.REQUEST_ROUTING_KEY,
                b"[" * 5000 + b"]" * 5000,
                pika.BasicProperties(reply_to=P.reply_queue_name()),
            )
            results = [good.run(0.01, GiB) for _ in range(5)]
            conn.close()
        assert len(results) == 5 and mgr.m.core.rejected == 1 and mgr.m.internal_errors == 0
        assert mgr.t.is_alive() and mgr.m.connections == 1  # no reconnect, so no redelivery
        assert any("flat JSON object" in r.getMessage() for r in caplog.records)
    finally:
        mgr.stop()


def _hostile_messages():
    """hypothesis strategy: (body, properties) an attacker or a broken client might publish."""
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=40)
    )
    json_values = st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12,
    )
    fields = st.sampled_from(
        [
            "v",
            "type",
            "job_id",
            "request_id",
            "device",
            "seconds",
            "peak_bytes",
            "key",
            "persistent_bytes",
            "grant",
            "sent_at",
            "presence",
            "weight",
            "host",
            "kind",
        ]
    )
    types = st.sampled_from(["register", "request", "heartbeat", "deregister", "status", "granted", ""])
    near_valid = st.fixed_dictionaries(
        {
            "v": st.sampled_from([2, 1, "2", None]),
            "type": types,
            "job_id": st.sampled_from(["good", "x", "", "a" * 300]),
        },
        optional={f: json_values for f in ["request_id", "device", "seconds", "peak_bytes", "key", "presence"]},
    )
    bodies = st.one_of(
        st.binary(max_size=300),
        st.dictionaries(fields, json_values, max_size=8).map(lambda d: json.dumps(d).encode()),
        near_valid.map(lambda d: json.dumps(d).encode()),
        st.integers(1, 20000).map(lambda n: b"[" * n + b"]" * n),
        st.integers(1, 20000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
        st.integers(15000, 70000).map(lambda n: b'{"v":2,"type":"' + b"x" * n + b'"}'),
    )
    header_values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**31), 2**31 - 1),
        st.text(max_size=80),
        st.lists(st.integers(0, 9), max_size=3),
        st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    )
    headers = st.dictionaries(st.one_of(st.just(P.SIG_HEADER), st.text(max_size=10)), header_values, max_size=4)
    reply_to = st.one_of(
        st.none(),
        st.text(max_size=60),
        st.just(P.REQUEST_QUEUE),
        st.builds(lambda: P.reply_queue_name()),
        st.text(alphabet="abcdef0123456789", min_size=8, max_size=12).map(lambda s: P.REPLY_PREFIX + s),
    )
    props = st.fixed_dictionaries(
        {"headers": st.one_of(st.none(), headers), "reply_to": reply_to},
        optional={
            "priority": st.integers(0, 9),
            "content_type": st.text(max_size=20),
            "correlation_id": st.text(max_size=20),
            "expiration": st.integers(1, 10**6).map(str),
        },
    )
    return st.tuples(bodies, props)


def test_manager_survives_hypothesis_generated_messages_while_a_good_job_is_served(broker, purge):
    """Property: whatever bytes and AMQP properties arrive, each message is acknowledged and
    rejected (or answered), the manager never reconnects, and the good job keeps its service."""
    import pika
    from hypothesis import HealthCheck, given, settings

    mgr = ThreadManager(broker.url, lease=5.0)
    waits: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def good_job() -> None:
        try:
            with client(broker.url, "good", lease_s=5.0) as c:
                while not stop.is_set():
                    waits.append(c.run(0.005, GiB).elapsed_s - 0.005)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    job = threading.Thread(target=good_job)
    job.start()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    sent = [0]

    @settings(
        max_examples=250,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_hostile_messages())
    def publish(message) -> None:
        body, props = message
        try:
            ch.basic_publish(P.REQUEST_EXCHANGE, P.REQUEST_ROUTING_KEY, body, pika.BasicProperties(**props))
        except (ValueError, TypeError, UnicodeError, pika.exceptions.AMQPError):
            return  # pika cannot encode it: it never reaches the broker
        sent[0] += 1

    try:
        publish()
        deadline = time.monotonic() + 60
        while mgr.m.core.rejected + mgr.m.core.refused < sent[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        served_during = len(waits)
        time.sleep(0.3)
        stop.set()
        job.join(30)
        assert not errors, errors
        core = mgr.m.core
        status_like = sent[0] - core.rejected  # well-formed status requests are answered, not rejected
        assert 0 <= status_like < sent[0] * 0.2, (sent[0], core.rejected)
        assert mgr.m.internal_errors == 0 and mgr.m.connections == 1 and mgr.t.is_alive()
        assert set(core.jobs) <= {"good"} and core.devices["0"].served == len(waits)
        assert served_during > 10 and max(waits) < 2.0, (served_during, max(waits))
        queue = ch.queue_declare(P.REQUEST_QUEUE, passive=True)
        assert queue.method.message_count == 0  # every message acknowledged: nothing to redeliver
    finally:
        stop.set()
        conn.close()
        mgr.stop()


def test_kubernetes_allocate_gives_each_container_credentials_that_work(broker, purge, jobs_url, tmp_path, caplog):
    """The device plugin's Allocate (over real gRPC) hands a container its job id, key and the
    jobs' broker password; an unmodified script under gpemu.patch() then shares the emuGPU with
    them through the restricted user, against a manager that derives keys from the job secret."""
    import shutil
    import tempfile

    from kubelet_standin import KubeletStandIn

    from gpemu.k8s.devices import create_devices
    from gpemu.k8s.plugin import EmuGpuPlugin, PluginOptions

    caplog.set_level("INFO", logger="gpemu.sharing.manager")
    secret = b"node-job-secret-" * 2
    user, password = jobs_url.split("://", 1)[1].split("@", 1)[0].split(":", 1)
    root = Path(tempfile.mkdtemp(prefix="gpk-", dir="/tmp"))  # short: Unix socket paths
    create_devices(root / "dev", "P100", 1)
    kubelet = KubeletStandIn(root / "dp", echo=False).start()
    plugin = EmuGpuPlugin(
        PluginOptions(
            device_dir=str(root / "dev"),
            device_plugin_dir=str(root / "dp"),
            poll_interval_s=0.05,
            sharing=f"amqp://{user}@127.0.0.1:{broker.port}/%2F",
            sharing_password=password,
            job_secret=secret,
            credentials_dir=str(root / "creds"),
        )
    ).start()
    mgr = ThreadManager(broker.url, job_secret=secret, lease=10.0, device="emugpu-0")  # named as on the node
    try:
        _ids, resp = kubelet.allocate("gpemu.io/emugpu", 1)
        envs = dict(resp.envs)
        assert password not in json.dumps(envs)
        container_dir = tmp_path / "ctr"  # where the mounts would appear in the container
        container_dir.mkdir()
        for m in resp.mounts:
            shutil.copy(m.host_path, container_dir / Path(m.container_path).name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPEMU_") or k == "GPEMU_DATA_DIR"}
        env.update(envs, GPEMU_DEVICE_DIR=str(container_dir), GPEMU_SUMMARY="0")
        code = (
            "import gpemu, torch; gpemu.patch(); m = torch.nn.Linear(8, 8).cuda(); "
            "[m(torch.randn(4, 8).cuda()).sum().backward() for _ in range(3)]; torch.cuda.synchronize(); "
            "print('trained', flush=True); gpemu.unpatch()"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]
        assert password not in proc.stdout + proc.stderr
        core = mgr.m.core
        assert core.devices["emugpu-0"].served >= 1 and core.rejected == 0
        assert not core.jobs  # it left when done; it had registered under its own job id:
        assert any(f"job '{envs['GPEMU_JOB_ID']}' registered" in r.getMessage() for r in caplog.records)
    finally:
        mgr.stop()
        plugin.stop()
        kubelet.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_second_manager_on_the_same_broker_refuses_in_one_line(broker, purge, tmp_path):
    """Two managers for one emuGPU split the request queue and ran two timelines (19.9 s of GPU
    time granted in 10.1 s): the second one now refuses, and the first serves on alone."""
    log = tmp_path / "first.log"
    first = start_manager_process(broker.url, log)
    try:
        c = client(broker.url, "solo")
        c.register()  # the first manager answers: it holds the lease
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))",
                "share-manager",
                "--amqp",
                broker.url,
                "--device",
                "0=P100:16GiB",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = [line for line in second.stderr.splitlines() if line.startswith("error: ")]
        assert second.returncode == 2, second.stderr[-2000:]
        assert len(lines) == 1 and "another sharing manager already serves" in lines[0], second.stderr
        start = time.monotonic()
        results = [c.run(0.05, GiB) for _ in range(20)]
        wall = time.monotonic() - start
        assert wall >= 20 * 0.05 and all(r.waited_s < 0.05 for r in results)  # one timeline, not two
        c.close()
        assert first.poll() is None, log.read_text()
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(10)


def test_a_rejected_request_reaches_the_job_signed_at_once(broker, purge):
    """A request the manager rejects (1e9 s of GPU time, sent raw by a registered job) is
    answered with a signed error the job accepts, instead of a reply dropped as forged and a
    60 s wait; settings the manager would reject are refused when the job starts."""
    mgr = ThreadManager(broker.url)
    try:
        c = client(broker.url, "raw")
        c.register()
        start = time.monotonic()
        reply = c._call(
            {"type": "request", "job_id": "raw", "request_id": "r-1e9", "device": "0", "seconds": 1e9, "peak_bytes": 0}
        )
        assert time.monotonic() - start < 5 and c.forged_replies == 0
        assert reply["type"] == "error" and reply["code"] == P.ERR_BAD_MESSAGE and "seconds" in reply["reason"]
        with pytest.raises(ValueError, match="seconds must be from 0 to 3600"):
            c.run(1e9)
        c.close()
        with pytest.raises(ValueError, match="persistent_bytes must be from 0"):
            client(broker.url, "huge", persistent_bytes=2**51)
        assert mgr.m.core.rejected >= 1
    finally:
        mgr.stop()


def test_a_flood_of_malformed_messages_does_not_hold_up_a_registered_job(broker, purge, tmp_path):
    """A registered job's requests go through a queue of its own (its route), so a backlog of
    malformed messages in the shared request queue does not stand between it and the manager
    (before: 2 s per request behind ~7,000 messages a second)."""
    flood_code = (
        "import sys, time, pika\nfrom gpemu.integrations.sharing import protocol as P\n"
        "ch = pika.BlockingConnection(pika.URLParameters(sys.argv[1])).channel()\n"
        "end, n = time.monotonic() + float(sys.argv[2]), 0\n"
        "while time.monotonic() < end:\n"
        "    ch.basic_publish(P.REQUEST_EXCHANGE, P.REQUEST_ROUTING_KEY, b'{' * 500); n += 1\n"
        "print(n)"
    )
    manager = start_manager_process(broker.url, tmp_path / "manager.log")
    try:
        with client(broker.url, "steady") as c:
            assert P.valid_route(c.route)
            floods = [
                subprocess.Popen([sys.executable, "-c", flood_code, broker.url, "6"], stdout=subprocess.PIPE, text=True)
                for _ in range(2)
            ]
            time.sleep(2.0)  # a backlog builds up in the shared queue
            extra = [c.run(0.01, GiB).elapsed_s - 0.01 for _ in range(100)]
            sent = sum(int(f.communicate(timeout=60)[0]) for f in floods)
        extra.sort()
        assert sent > 5000, sent
        assert extra[98] < 0.25 and extra[-1] < 1.0, extra[-5:]
    finally:
        manager.send_signal(signal.SIGTERM)
        manager.wait(10)
