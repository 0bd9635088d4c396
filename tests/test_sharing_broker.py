"""The sharing manager and clients over a real RabbitMQ broker, including fault injection."""

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
from rabbitmq_broker import RabbitBroker  # noqa: E402

from gpemu.integrations.sharing import protocol as P  # noqa: E402
from gpemu.integrations.sharing.client import SharingClient  # noqa: E402
from gpemu.integrations.sharing.manager import DeviceSpec, SharingManager  # noqa: E402
from gpemu.integrations.sharing.status import fetch_status  # noqa: E402

GiB = 1 << 30
LEASE = 0.6


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    b = RabbitBroker.start(tmp_path_factory.mktemp("rabbit"))
    yield b
    b.stop()


@pytest.fixture
def purge(broker):
    """Each test starts with an empty request queue."""
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    ch.queue_declare(P.REQUEST_QUEUE, durable=True)
    ch.queue_purge(P.REQUEST_QUEUE)
    conn.close()


class ThreadManager:
    def __init__(self, url: str, policy: str = "round-robin", capacity: int = 16 * GiB) -> None:
        self.m = SharingManager(url, [DeviceSpec("0", "P100", capacity)], policy, lease_s=LEASE,
                                status_interval_s=0.2, reconnect_s=0.2)
        self.t = threading.Thread(target=self.m.serve_forever, daemon=True)
        self.t.start()
        assert self.m.connected.wait(20)

    def stop(self) -> None:
        self.m.stop()
        self.t.join(10)


def start_manager_process(url: str, log: Path, capacity: str = "16GiB") -> subprocess.Popen:
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, "share-manager", "--amqp", url, "--device", f"0=P100:{capacity}",
         "--policy", "round-robin", "--lease", str(LEASE), "--status-interval", "0.2"],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def client(url: str, job: str, **kw) -> SharingClient:
    kw.setdefault("persistent_bytes", GiB)
    return SharingClient(url, job_id=job, lease_s=LEASE, manager_timeout_s=30, resend_s=0.5, **kw)


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def test_equal_jobs_share_fairly_and_status_reports_them(broker, purge):
    mgr = ThreadManager(broker.url)
    try:
        results: dict[str, list] = {}

        def job(name: str) -> None:
            with client(broker.url, name) as c:
                results[name] = [c.run(0.02, 2 * GiB) for _ in range(25)]

        threads = [threading.Thread(target=job, args=(f"job{i}",)) for i in range(4)]
        [t.start() for t in threads]
        time.sleep(0.8)
        snap = fetch_status(broker.url)  # while they run
        [t.join(60) for t in threads]
        assert {j["job_id"] for j in snap["jobs"]} <= set(results)
        assert snap["devices"][0]["gpu"] == "P100"
        served = {j: len(r) for j, r in results.items()}
        assert served == {f"job{i}": 25 for i in range(4)}
        core_dev = mgr.m.core.devices["0"]
        assert core_dev.served == 100
        assert core_dev.busy_s == pytest.approx(100 * 0.02, rel=1e-6)  # each request served exactly once
        # Every job waited for the others: evidence the GPU was time-sliced, not run in parallel.
        assert all(sum(r.waited_s for r in rs) > 0 for rs in results.values())
    finally:
        mgr.stop()


def test_request_that_does_not_fit_raises_cuda_oom(broker, purge):
    import torch

    mgr = ThreadManager(broker.url, capacity=8 * GiB)
    try:
        with client(broker.url, "small", persistent_bytes=3 * GiB) as other, \
                client(broker.url, "big", persistent_bytes=2 * GiB) as big:
            big.run(0.01, 5 * GiB)  # 3 + 5 = 8 fits
            with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory"):
                big.run(0.01, 6 * GiB)
            other.run(0.01, 3 * GiB)
    finally:
        mgr.stop()


def test_killed_job_frees_gpu_and_memory_within_two_leases(broker, purge, tmp_path):
    mgr = ThreadManager(broker.url, capacity=16 * GiB)
    code = f"""
import sys
from gpemu.integrations.sharing.client import SharingClient
c = SharingClient({broker.url!r}, job_id="victim", persistent_bytes=12 << 30, lease_s={LEASE})
c.register()
print("registered", flush=True)
c.run(60.0, 12 << 30)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "registered"
        deadline = time.monotonic() + 10
        while mgr.m.core.devices["0"].running is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mgr.m.core.devices["0"].running.job_id == "victim"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.monotonic()
        from gpemu.integrations.sharing.client import SharingRefusedError

        c = client(broker.url, "survivor", persistent_bytes=10 * GiB)  # fits only once victim is gone
        refusals = 0
        while True:
            try:
                c.register()
                break
            except SharingRefusedError:
                refusals += 1
                time.sleep(0.05)
        c.run(0.05, 10 * GiB)  # and the GPU is free: not stuck behind the 60 s request
        took = time.monotonic() - killed_at
        c.close()
        assert refusals >= 1  # the victim's memory was held until its lease ran out
        assert took < 2 * LEASE + 1.5, f"GPU freed {took:.2f} s after kill -9 (lease {LEASE} s)"
        assert "victim" not in mgr.m.core.jobs and mgr.m.core.expired >= 1
    finally:
        if proc.poll() is None:
            proc.kill()
        mgr.stop()


def test_manager_restart_does_not_strand_jobs(broker, purge, tmp_path):
    log = tmp_path / "manager.log"
    proc = start_manager_process(broker.url, log)
    done: list[str] = []
    errors: list[BaseException] = []
    try:
        c = client(broker.url, "steady")
        c.register()

        def loop() -> None:
            try:
                for _ in range(40):
                    done.append(c.run(0.02, GiB).request_id)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        t = threading.Thread(target=loop)
        t.start()
        while len(done) < 10:
            time.sleep(0.01)
            assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGKILL)  # mid-stream, possibly mid-request
        proc.wait(10)
        time.sleep(1.0)
        proc = start_manager_process(broker.url, log)
        t.join(60)
        assert not errors, errors
        assert len(done) == 40 and len(set(done)) == 40  # every request answered, once
        assert c.reconnects == 0  # the broker stayed up: only the manager went away
        c.close()
        text = log.read_text()
        assert "guest:guest" not in text and "guest:***@" in text  # credentials redacted
        assert text.count("job 'steady' registered") >= 2  # re-registered with the new manager
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


def test_broker_restart_is_survived_by_both_sides(broker, purge):
    mgr = ThreadManager(broker.url)
    try:
        c = client(broker.url, "persistent-job")
        c.register()
        done: list[str] = []
        errors: list[BaseException] = []

        def loop() -> None:
            try:
                for _ in range(30):
                    done.append(c.run(0.03, GiB).request_id)
            except BaseException as exc:  # pragma: no cover
                errors.append(exc)

        t = threading.Thread(target=loop)
        t.start()
        while len(done) < 5:
            time.sleep(0.01)
        broker.restart()
        t.join(90)
        assert not errors, errors
        assert len(done) == 30 and len(set(done)) == 30
        job = mgr.m.core.jobs.get("persistent-job")
        assert job is not None and job.served_count == 30  # redelivered duplicates were not served again
        assert mgr.m.core.devices["0"].busy_s == pytest.approx(30 * 0.03, rel=1e-6)
        c.close()
    finally:
        mgr.stop()


def test_a_thousand_malformed_messages_over_the_broker(broker, purge, caplog):
    import pika

    mgr = ThreadManager(broker.url)
    try:
        with client(broker.url, "good") as good:
            conn = pika.BlockingConnection(pika.URLParameters(broker.url))
            ch = conn.channel()
            bodies = []
            for i in range(1000):
                base = {"v": 1, "type": "request", "job_id": "good", "token": "forged-token", "request_id": f"m{i}",
                        "device": "0", "seconds": 0.5, "peak_bytes": 0}
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
                    bodies.append(json.dumps({"v": 1, "type": "register", "job_id": "x" * 500, "request_id": "r",
                                              "device": "0", "persistent_bytes": 0}).encode())
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


def test_share_status_once_json_and_table(broker, purge):
    mgr = ThreadManager(broker.url)
    try:
        with client(broker.url, "visible-job") as c:
            c.run(0.01, GiB)
            code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
            out = subprocess.run([sys.executable, "-c", code, "share-status", "--amqp", broker.url, "--once",
                                  "--json"], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            snap = json.loads(out.stdout)
            assert [j["job_id"] for j in snap["jobs"]] == ["visible-job"]
            assert snap["jobs"][0]["served_requests"] == 1
            table = subprocess.run([sys.executable, "-c", code, "share-status", "--amqp", broker.url, "--once"],
                                   capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
            assert "visible-job" in table.stdout and "P100" in table.stdout
    finally:
        mgr.stop()
    # no manager now: a clear error, exit status 2
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run([sys.executable, "-c", code, "share-status", "--amqp", broker.url, "--once",
                          "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no sharing manager answered" in out.stderr
