"""A real RabbitMQ broker, managers and clients for the sharing tests over a broker."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpemu.integrations.sharing import protocol as P
from gpemu.integrations.sharing.broker import RabbitBroker
from gpemu.integrations.sharing.client import SharingClient
from gpemu.integrations.sharing.manager import DeviceSpec, SharingManager

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
    def __init__(
        self,
        url: str,
        policy: str = "round-robin",
        capacity: int = 16 * GiB,
        lease: float = LEASE,
        device: str = "0",
        **kw,
    ) -> None:
        self.m = SharingManager(
            url,
            [DeviceSpec(device, "P100", capacity)],
            policy,
            lease_s=lease,
            status_interval_s=0.2,
            reconnect_s=0.2,
            **kw,
        )
        self.t = threading.Thread(target=self.m.serve_forever, daemon=True)
        self.t.start()
        assert self.m.connected.wait(20)

    def stop(self) -> None:
        self.m.stop()
        self.t.join(10)


def start_manager_process(url: str, log: Path, capacity: str = "16GiB") -> subprocess.Popen:
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "share-manager",
            "--amqp",
            url,
            "--device",
            f"0=P100:{capacity}",
            "--policy",
            "round-robin",
            "--lease",
            str(LEASE),
            "--status-interval",
            "0.2",
        ],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
    )


def client(url: str, job: str, **kw) -> SharingClient:
    kw.setdefault("persistent_bytes", GiB)
    kw.setdefault("lease_s", LEASE)
    kw.setdefault("manager_timeout_s", 30)
    return SharingClient(url, job_id=job, resend_s=0.5, **kw)


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))
