"""Per-node sharing secrets (`gpemu k8s secrets`): made once, never printed, and the broker
config they become boots a real RabbitMQ with exactly the manager's and the jobs' users."""

from __future__ import annotations

import os
import stat
import threading
from urllib.parse import quote

import pika
import pika.exceptions
import pytest
from click.testing import CliRunner

from gpemu.cli import cli
from gpemu.integrations.sharing import protocol as P
from gpemu.integrations.sharing.broker import RabbitBroker
from gpemu.k8s.secrets import JOBS_USER, MANAGER_USER, SECRET_FILES, ensure_secrets, write_broker_config


def test_secrets_are_made_once_root_only_and_never_printed(tmp_path):
    root = tmp_path / "secrets"
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_secrets(root))) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    # Racing initContainers: each file made by exactly one of them, complete, the same for all.
    assert all(sum(r[name] for r in results) == 1 for name in SECRET_FILES)
    values = {name: (root / name).read_text() for name in SECRET_FILES}
    assert all(len(v.strip()) == 64 for v in values.values()) and len(set(values.values())) == 3
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(root / n).st_mode) == 0o600 for n in SECRET_FILES)
    assert sorted(p.name for p in root.iterdir()) == sorted(SECRET_FILES)  # no temporary files left
    out = CliRunner().invoke(cli, ["k8s", "secrets", "--dir", str(root), "--broker-config-dir", str(tmp_path / "b")])
    assert out.exit_code == 0 and "all present, kept" in out.output
    assert not any(v.strip() in out.output for v in values.values())
    assert {p.name: (root / p.name).read_text() for p in root.iterdir()} == values  # unchanged
    defs = (tmp_path / "b" / "definitions.json").read_text()
    assert not any(v.strip() in defs for v in values.values())  # salted hashes only


@pytest.mark.broker
def test_broker_config_boots_rabbitmq_with_the_two_users_and_no_guest(tmp_path):
    root = tmp_path / "secrets"
    ensure_secrets(root)
    _conf, defs = write_broker_config(root, tmp_path / "broker")
    manager_pw = (root / "manager-password").read_text().strip()
    jobs_pw = (root / "jobs-password").read_text().strip()
    manager_url = f"amqp://{MANAGER_USER}:{quote(manager_pw)}@127.0.0.1:{{port}}/%2F"
    broker = RabbitBroker.start(tmp_path / "node", extra_config=f"load_definitions = {defs}\n", ready_url=manager_url)
    try:
        manager = pika.BlockingConnection(pika.URLParameters(broker.ready_url))
        P.declare_topology(manager.channel())  # the manager may configure everything
        manager.close()
        jobs = pika.BlockingConnection(pika.URLParameters(broker.url_for(JOBS_USER, jobs_pw)))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="ACCESS_REFUSED"):
            jobs.channel().basic_get(P.REQUEST_QUEUE)  # JOB_PERMISSIONS: no reading the requests
        ch = jobs.channel()
        ch.basic_publish(P.REQUEST_EXCHANGE, P.REQUEST_ROUTING_KEY, b"{}")  # but publishing them
        jobs.close()
        for user, pw in (("guest", "guest"), (JOBS_USER, "wrong")):
            with pytest.raises(pika.exceptions.ProbableAuthenticationError):
                pika.BlockingConnection(pika.URLParameters(broker.url_for(user, pw)))
    finally:
        broker.stop()


def test_the_plugins_copies_of_the_sharing_protocol_facts_match_it():
    """gpemu.k8s restates two facts of the sharing protocol (the packages are independent)."""
    from gpemu.integrations.sharing import client, protocol
    from gpemu.k8s import allocation, secrets

    assert secrets.JOB_PERMISSIONS == protocol.JOB_PERMISSIONS
    assert allocation.CREDENTIALS_NAME == client.CREDENTIALS_FILE
    for secret, job_id in ((b"s" * 32, "k8s-0123abcd"), (bytes(range(40)), "k8s-x.1")):
        assert allocation.derive_job_key(secret, job_id) == protocol.derive_job_key(secret, job_id)
