"""The sharing manager's protocol checks, isolation between jobs and hostile input, on a virtual
clock (no broker needed)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from gpemu.integrations.sharing import protocol as P
from gpemu.integrations.sharing.manager import DeviceSpec, parse_device
from gpemu.integrations.sharing.policies import Policy

sys.path.insert(0, str(Path(__file__).parent))
from sharing_harness import GiB, Harness, rq  # noqa: E402


# ---------------------------------------------------------------------- protocol
@pytest.mark.parametrize(
    "payload,fragment",
    [
        ({"type": "request"}, "lacks"),
        (
            {"type": "request", "job_id": "a", "request_id": "r", "device": "0", "seconds": math.inf, "peak_bytes": 0},
            "finite",
        ),
        (
            {"type": "request", "job_id": "a", "request_id": "r", "device": "0", "seconds": 1, "peak_bytes": 1.5},
            "integer",
        ),
        ({"type": "register", "job_id": "", "request_id": "r", "device": "0", "persistent_bytes": 0}, "job_id"),
        ({"type": "heartbeat", "job_id": "a", "token": "t"}, "unknown fields"),
        (
            {"type": "register", "job_id": "a", "request_id": "r", "device": "0", "persistent_bytes": 0, "key": "00"},
            "key must be 32 bytes",
        ),
        ({"type": "heartbeat", "job_id": "a", "presence": "gpemu.sharing.requests"}, "presence must name"),
        (
            {"type": "register", "job_id": "a", "request_id": "r", "device": "0", "persistent_bytes": 0, "weight": 0},
            "weight",
        ),
    ],
)
def test_protocol_errors_say_what_is_wrong(payload, fragment):
    with pytest.raises(P.ProtocolError, match=fragment):
        P.parse_message(P.encode(payload))


def test_parse_device_specs():
    assert parse_device("0=P100:16GiB") == DeviceSpec("0", "P100", 16 * GiB)
    assert parse_device("gpu-a=V100", lambda name: 32 * GiB).capacity_bytes == 32 * GiB
    for bad in ("V100", "0=", "0=V100:lots", "0=V100:-1GiB"):
        with pytest.raises(ValueError, match="ID=GPU|memory size"):
            parse_device(bad, lambda name: GiB)


# ---------------------------------------------------------------------- isolation and hostile input
def test_connection_gone_frees_the_jobs_gpu_and_memory_at_once():
    h = Harness(capacity=16 * GiB, lease_s=100.0)
    h.register("victim", persistent=12 * GiB, presence=P.REPLY_PREFIX + "victim-presence")
    h.request("victim", "long", 60.0)
    assert h.core.presence_seen == [("victim", P.REPLY_PREFIX + "victim-presence")]
    assert h.core.connection_gone("victim", P.REPLY_PREFIX + "some-other-queue", 1.0) == []  # not its queue
    h.now = 1.0
    h.core.connection_gone("victim", P.REPLY_PREFIX + "victim-presence", 1.0)
    assert "victim" not in h.core.jobs and h.core.disconnected == 1
    assert h.core.devices["0"].running is None and h.core.devices["0"].busy_s == pytest.approx(1.0)
    assert h.register("next", persistent=14 * GiB)["type"] == "registered"  # its memory is free


def test_job_secret_derives_keys_so_no_job_can_act_as_another():
    secret = b"s" * 32
    h = Harness(job_secret=secret)
    k_a = P.derive_job_key(secret, "a")
    reply = h.send(
        {"type": "register", "job_id": "a", "request_id": "r", "device": "0", "persistent_bytes": 0}, "a", key=k_a
    )[0]
    assert reply["type"] == "registered" and h.core.jobs["a"].key == k_a
    # b knows its own derived key only: registering as "c" or acting as "a" with it fails
    k_b = P.derive_job_key(secret, "b")
    as_c = h.send(
        {"type": "register", "job_id": "c", "request_id": "r", "device": "0", "persistent_bytes": 0}, "b", key=k_b
    )[0]
    assert as_c["code"] == P.ERR_BAD_SIGNATURE and "c" not in h.core.jobs
    own_key = bytes(range(32))  # a key of its own is not accepted where keys are derived
    mine = h.send(
        {
            "type": "register",
            "job_id": "d",
            "request_id": "r",
            "device": "0",
            "persistent_bytes": 0,
            "key": own_key.hex(),
        },
        "d",
        key=own_key,
    )[0]
    assert mine["code"] == P.ERR_BAD_SIGNATURE
    as_a = h.send(
        {"type": "request", "job_id": "a", "request_id": "x", "device": "0", "seconds": 1.0, "peak_bytes": 0},
        "b",
        key=k_b,
    )[0]
    assert as_a["code"] == P.ERR_BAD_SIGNATURE and h.core.devices["0"].running is None
    # a job the manager forgot (restart) gets a signed "unknown job" and registers again
    gone = h.send(
        {"type": "request", "job_id": "e", "request_id": "x", "device": "0", "seconds": 1.0, "peak_bytes": 0},
        "e",
        key=P.derive_job_key(secret, "e"),
    )[0]
    assert gone["code"] == P.ERR_UNKNOWN_JOB and h.outs[-1].key == P.derive_job_key(secret, "e")


@pytest.mark.parametrize(
    "reply_to", ["gpemu.sharing.requests", "amq.gen-abc", "gpemu.sharing.reply.x y", "gpemu.sharing.reply." + "z" * 300]
)
def test_replies_go_only_to_reply_queues(reply_to):
    h = Harness()
    h._tag += 1
    outs = h.core.receive(P.encode({"type": "status"}), reply_to, h._tag, 0.0)
    assert len(outs) == 1 and outs[0].reply_to is None and outs[0].ack == [h._tag]
    assert "reply_to must name a queue" in outs[0].payload["reason"] and h.core.rejected == 1


@pytest.mark.parametrize(
    "body,fragment",
    [
        (b"[" * 5000 + b"]" * 5000, "flat JSON object"),
        (b'{"v": 2, "type": "status", "x": ' + b"[" * 100000 + b"}", "at most"),
        (b'{"v": 2, "type": {"nested": 1}}', "flat JSON object"),
        (b'{"v": 2, "type": "status", "request_id": "[[[["}', None),  # brackets inside a string are fine
        (b"\xff\xfe", "not valid JSON"),
        (b'{"v": 2, "type": "' + b"x" * 10000 + b'"}', "chars)"),
    ],
)
def test_poison_bodies_are_refused_before_decoding(body, fragment):
    if fragment is None:
        assert P.parse_message(body).type == "status"
        return
    with pytest.raises(P.ProtocolError, match=re_escape(fragment)) as err:
        P.parse_message(body)
    assert len(err.value.reason) < 400  # a reason quotes only a little of the input


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_failing_custom_policy_falls_back_to_arrival_order():
    class Broken(Policy):
        name = "broken"

        def pick(self, pending, jobs):
            raise RuntimeError("bug in a researcher's policy")

    h = Harness(Broken)
    h.register("a")
    h.request("a", "r1", 1.0)
    assert [r["type"] for r in h.advance_to(1.0)] == ["done"]


def test_a_job_flooding_requests_is_capped():
    h = Harness(max_active_per_job=4)
    h.register("flood")
    h.register("good")
    replies = [r for i in range(10) for r in h.request("flood", f"f{i}", 1.0)]
    assert [r["code"] for r in replies] == [P.ERR_BUSY] * 6  # 1 running... 4 queued at most
    assert len(h.core.jobs["flood"].active) == 4


def test_rejections_are_logged_with_a_bounded_budget(caplog):
    h = Harness()
    with caplog.at_level("WARNING", logger="gpemu.sharing.manager"):
        for i in range(500):
            h._tag += 1
            h.core.receive(b"not json %d" % i, rq("x"), h._tag, i * 0.01)
        h.core.receive(b"late", rq("x"), 0, 100.0)  # the next window: the summary line first
    lines = [r.getMessage() for r in caplog.records]
    assert h.core.rejected == 501
    assert len(lines) <= 25
    assert any("more message(s) rejected" in line and line.startswith("480 ") for line in lines), lines[-3:]


def test_rejections_not_yet_summarised_are_logged_when_the_manager_stops(caplog):
    h = Harness()
    with caplog.at_level("WARNING", logger="gpemu.sharing.manager"):
        for i in range(50):
            h._tag += 1
            h.core.receive(b"not json %d" % i, rq("x"), h._tag, 1.0 + i * 0.01)
        h.core.flush_log(5.0)  # within the window: nothing yet
        assert not any("more message(s)" in r.getMessage() for r in caplog.records)
        h.core.flush_log(5.0, final=True)  # the manager stops
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("30 more message(s) rejected in the last 4 s") for line in lines), lines[-3:]


def test_the_config_checks_a_job_against_the_protocols_own_bounds():
    from gpemu import config

    assert (config.SHARING_MAX_BYTES, config.SHARING_MAX_ID_LEN) == (P.MAX_BYTES, P.MAX_ID_LEN)
    assert (config.SHARING_MIN_WEIGHT, config.SHARING_MAX_WEIGHT) == (P.MIN_WEIGHT, P.MAX_WEIGHT)
    with pytest.raises(config.ConfigError, match="sharing_persistent_bytes must be a byte count from 0"):
        config.EmuConfig(sharing_persistent_bytes=2**51)
    with pytest.raises(config.ConfigError, match="job_id must be printable text"):
        config.EmuConfig(job_id="x" * 201)
