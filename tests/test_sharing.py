"""Sharing manager scheduler, policies and protocol, on a virtual clock (no broker needed)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from gpemu.integrations.sharing import protocol as P
from gpemu.integrations.sharing.policies import Policy, load_policy

sys.path.insert(0, str(Path(__file__).parent))
from sharing_harness import GiB, GrantHarness, Harness, closed_loop, jain, rq  # noqa: E402


def _flooded_waits(policy: str, depth: int = 16, horizon: float = 20.0) -> tuple[list[float], int]:
    """A 20 ms job (one request in flight) beside a job keeping ``depth`` legal 0.5 s requests in
    flight, quantum 0.5 s, lookahead 10 ms: the 20 ms job's waits (queued time per request) and
    how many requests it got served."""
    h = Harness(policy, quantum_s=0.5, lookahead_s=0.01, lease_s=1e9)
    h.register("flood")
    h.register("small")
    h.inbox.clear()
    sent = {"small": 0.0}
    for k in range(depth):
        h.request("flood", f"flood-{k}", 0.5)
    h.request("small", "small-0", 0.02)
    waits: list[float] = []
    counters = {"flood": depth - 1, "small": 0}
    while h.now < horizon:
        h.advance_to(h.core.next_deadline())
        for job in ("flood", "small"):
            box = h.inbox.get(job, [])
            while box:
                reply = box.pop(0)
                assert reply["type"] == "done", reply
                if job == "small":
                    waits.append(h.now - sent["small"] - 0.02)
                    sent["small"] = h.now
                counters[job] += 1
                h.request(job, f"{job}-{counters[job]}", 0.5 if job == "flood" else 0.02)
    return waits, len(waits)


@pytest.mark.parametrize("policy", ["fifo", "round-robin", "weighted"])
def test_a_job_with_many_requests_in_flight_does_not_starve_another(policy):
    """docs/sharing.md: no job holds the emuGPU more than one quantum while others wait, under
    every policy. A job's share of the queue must not grow with the requests it keeps in flight
    (fifo served the flooder's 16 queued requests first: 8 s per 20 ms request)."""
    waits, served = _flooded_waits(policy)
    p99 = sorted(waits)[int(0.99 * (len(waits) - 1))]
    assert p99 <= 1.5 * 0.5, f"{policy}: p99 wait {p99:.3f} s"
    assert served >= 30  # about one per quantum of the flooder's over 20 s


# ---------------------------------------------------------------------- policies
def test_round_robin_gives_equal_jobs_equal_shares():
    h = Harness("round-robin")
    for j in "abcd":
        h.register(j)
    served = closed_loop(h, {"a": 0.05, "b": 0.05, "c": 0.05, "d": 0.05}, horizon=20.0)
    assert jain(list(served.values())) >= 0.99
    # the GPU never idles while work waits: total served equals the elapsed virtual time
    assert sum(served.values()) == pytest.approx(h.now, rel=0.01)


def test_round_robin_is_fair_in_time_when_iterations_differ():
    # Jobs that always have work waiting (two requests in flight) get equal GPU *time*.
    h = Harness("round-robin")
    for j in "abc":
        h.register(j)
    served = closed_loop(h, {"a": 0.01, "b": 0.04, "c": 0.1}, horizon=30.0, depth=2)
    assert jain(list(served.values())) >= 0.99
    # With one request in flight, a short-iteration job is absent from the queue at the moment its
    # own request ends, so a work-conserving manager serves someone else: it gets fewer seconds.
    h1 = Harness("round-robin")
    for j in "abc":
        h1.register(j)
    one = closed_loop(h1, {"a": 0.01, "b": 0.04, "c": 0.1}, horizon=30.0)
    assert one["a"] < one["b"] and one["b"] == pytest.approx(one["c"], rel=0.05)


def test_fifo_serves_in_arrival_order_and_favours_long_iterations():
    h = Harness("fifo")
    for j in "ab":
        h.register(j)
    h.request("a", "a1", 1.0)
    h.request("b", "b1", 1.0)
    h.request("a", "a2", 1.0)  # a second outstanding request from a (e.g. a pipelined job)
    order = []
    for t in (1.0, 2.0, 3.0):
        order += [r["request_id"] for r in h.advance_to(t)]
    assert order == ["a1", "b1", "a2"]
    # closed loop: FIFO shares GPU time in proportion to iteration length, round-robin does not
    f = Harness("fifo")
    for j in "ab":
        f.register(j)
    served = closed_loop(f, {"a": 0.01, "b": 0.05}, horizon=10.0)
    assert served["b"] / served["a"] == pytest.approx(5.0, rel=0.1)


def test_weighted_shares_follow_weights():
    h = Harness("weighted")
    h.register("hi", weight=3.0)
    h.register("lo", weight=1.0)
    served = closed_loop(h, {"hi": 0.02, "lo": 0.02}, horizon=20.0, depth=2)
    assert served["hi"] / served["lo"] == pytest.approx(3.0, rel=0.05)


def test_late_joiner_gets_its_share_from_now_not_the_past():
    h = Harness("round-robin")
    h.register("old")
    closed_loop(h, {"old": 0.05}, horizon=10.0)
    h.register("new")
    before = h.core.jobs["old"].view.served_s
    h.inbox.clear()
    # continue both for 10 more virtual seconds
    counters = {"old": 1000, "new": 0}
    h.request("new", "new-0", 0.05)
    h.request("old", "old-1000", 0.05)
    served = {"old": 0.0, "new": 0.0}
    start = h.now
    while h.now < start + 10.0:
        h.advance_to(h.core.next_deadline())
        for j in served:
            for r in h.inbox.pop(j, []):
                if r["type"] == "done":
                    served[j] += r["served_s"]
                    counters[j] += 1
                    h.request(j, f"{j}-{counters[j]}", 0.05)
    assert before > 9.0
    assert served["new"] / served["old"] == pytest.approx(1.0, rel=0.05)


class ShortestFirst(Policy):
    name = "shortest-first"

    def pick(self, pending, jobs):
        return min(pending, key=lambda r: (r.seconds, r.seq))


def test_custom_policy_class_by_import_path():
    cls = load_policy(f"{__name__}:ShortestFirst")
    assert cls is ShortestFirst
    h = Harness(cls, lease_s=100.0)
    for j in "abc":
        h.register(j)
    h.request("a", "long", 3.0)  # starts at once (GPU idle)
    h.request("b", "mid", 2.0)
    h.request("c", "short", 1.0)
    done = h.advance_to(3.0) + h.advance_to(4.0) + h.advance_to(6.0)
    assert [r["request_id"] for r in done] == ["long", "short", "mid"]


@pytest.mark.parametrize("spec", ["lottery", "nosuchmod:X", f"{__name__}:jain", "json:loads"])
def test_bad_policy_names_are_one_clear_error(spec):
    with pytest.raises(ValueError, match="policy"):
        load_policy(spec)


# ---------------------------------------------------------------------- memory
def test_request_refused_when_peak_plus_others_persistent_exceeds_capacity():
    h = Harness(capacity=16 * GiB)
    h.register("a", persistent=6 * GiB)
    h.register("b", persistent=6 * GiB)
    ok = h.request("a", "fits", 1.0, peak=10 * GiB)  # 6 (b) + 10 = 16: fits exactly
    assert ok == []
    too_big = h.request("b", "oom", 1.0, peak=10 * GiB + 1) + h.advance_to(1.0)
    kinds = {r["request_id"]: r["type"] for r in too_big}
    assert kinds == {"fits": "done", "oom": "refused"}
    reason = next(r for r in too_big if r["type"] == "refused")["reason"]
    assert "out of memory" in reason and "16.00 GiB" in reason


def test_requests_update_the_jobs_persistent_memory():
    """Persistent memory can grow after registration (optimizer state at the first step): the
    figure a request carries is what other jobs' requests are checked against from then on."""
    h = Harness(capacity=16 * GiB)
    h.register("a", persistent=1 * GiB)
    h.register("b", persistent=1 * GiB)
    h.request("a", "grow", 1.0, peak=8 * GiB, persistent_bytes=7 * GiB)
    assert h.core.jobs["a"].persistent_bytes == 7 * GiB
    out = h.advance_to(1.0) + h.request("b", "b1", 1.0, peak=9 * GiB) + h.advance_to(2.0)
    assert {r["request_id"]: r["type"] for r in out} == {"grow": "done", "b1": "done"}  # 7 + 9 = 16
    out = h.request("b", "b2", 1.0, peak=9 * GiB + 1) + h.advance_to(3.0)
    assert [r["type"] for r in out] == ["refused"]
    with pytest.raises(P.ProtocolError, match="persistent_bytes"):
        P.parse_message(
            P.encode(
                {
                    "type": "request",
                    "job_id": "a",
                    "request_id": "r",
                    "device": "0",
                    "seconds": 1.0,
                    "peak_bytes": 0,
                    "persistent_bytes": -1,
                }
            )
        )


def test_registration_refused_when_persistent_memory_cannot_fit():
    h = Harness(capacity=16 * GiB)
    assert h.register("a", persistent=10 * GiB)["type"] == "registered"
    refused = h.register("b", persistent=7 * GiB)
    assert refused["type"] == "refused" and "does not fit" in refused["reason"]
    # once a leaves, b fits
    h.deregister("a")
    assert h.register("b", persistent=7 * GiB)["type"] == "registered"


# ---------------------------------------------------------------------- reliability
def test_duplicate_deliveries_are_never_served_twice():
    h = Harness()
    h.register("a")
    h.request("a", "r1", 1.0)
    assert h.request("a", "r1", 1.0) == []  # duplicate while running: not queued again
    done = h.advance_to(1.0)
    assert [r["type"] for r in done] == ["done"]
    again = h.request("a", "r1", 1.0)  # duplicate after the answer: same answer, no GPU time
    assert again == done
    assert h.core.next_deadline() is None or h.core.devices["0"].running is None
    assert h.core.jobs["a"].served_count == 1
    assert h.core.jobs["a"].view.served_s == pytest.approx(1.0)
    # both deliveries of r1 were acknowledged with the answer
    assert h.acked.count(2) == 1 and h.acked.count(3) == 1


def test_duplicate_registration_is_idempotent_and_a_job_id_cannot_be_taken_over():
    h = Harness()
    first = h.register("a")
    second = h.register("a")
    assert first == second and first["type"] == "registered"
    thief = bytes(range(32))
    body = {
        "type": "register",
        "job_id": "a",
        "request_id": "someone-else",
        "device": "0",
        "persistent_bytes": 0,
        "key": thief.hex(),
    }
    other = h.send(body, "x", key=thief)[0]
    assert other["type"] == "error" and other["code"] == P.ERR_JOB_EXISTS
    assert h.core.jobs["a"].key == h.keys["a"]


def test_messages_not_signed_with_the_jobs_key_are_rejected_and_not_served():
    h = Harness()
    h.register("victim")
    attacker = bytes(range(32))
    forged = h.send(
        {"type": "request", "job_id": "victim", "request_id": "x", "device": "0", "seconds": 5.0, "peak_bytes": 0},
        "attacker",
        key=attacker,
    )
    assert forged[0]["type"] == "error" and forged[0]["code"] == P.ERR_BAD_SIGNATURE
    assert h.outs[-1].key is None  # not signed: the sender did not prove it is the job
    unsigned = h.send({"type": "deregister", "job_id": "victim", "request_id": "y"}, "attacker")
    assert unsigned[0]["code"] == P.ERR_BAD_SIGNATURE and "victim" in h.core.jobs
    assert h.core.devices["0"].running is None and h.core.rejected == 2
    # the job's own messages and every reply to it carry its key's signature
    ok = h.request("victim", "r1", 1.0) + h.advance_to(1.0)
    assert [r["type"] for r in ok] == ["done"] and h.outs[-1].key == h.keys["victim"]
    assert P.verify(h.keys["victim"], P.encode(ok[0]), P.sign(h.outs[-1].key, P.encode(ok[0])))


def test_silent_job_loses_gpu_and_memory_after_its_lease():
    h = Harness(lease_s=1.0, capacity=16 * GiB)
    h.register("dead", persistent=10 * GiB)
    h.register("alive", persistent=1 * GiB)
    h.request("dead", "long", 100.0)
    h.request("alive", "short", 0.5)
    t = 0.0
    while t < 3.0:  # alive keeps heartbeating; dead is silent
        t += 0.25
        h.advance_to(t)
        h.heartbeat("alive")
        if any(r["type"] == "done" for r in h.inbox.get("alive", [])):
            break
    assert "dead" not in h.core.jobs
    assert t <= 2 * 1.0 + 0.5 + 0.25  # freed within two lease periods (+ the short request)
    assert h.register("big", persistent=14 * GiB)["type"] == "registered"  # its memory is free


def test_a_thousand_malformed_messages_are_rejected_and_service_goes_on():
    h = Harness()
    h.register("good")
    rnd = random.Random(7)
    bad_bodies = []
    for i in range(1000):
        k = i % 10
        base = {
            "v": 2,
            "type": "request",
            "job_id": "good",
            "request_id": f"b{i}",
            "device": "0",
            "seconds": 0.1,
            "peak_bytes": 0,
        }
        if k == 0:
            body = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 64)))
        elif k == 1:
            body = b"[1,2,3]"
        elif k == 2:
            body = json.dumps({**base, "seconds": -1.0}).encode()
        elif k == 3:
            body = json.dumps({**base, "device": "7"}).encode()
        elif k == 4:
            body = json.dumps({**base, "request_id": f"forged{i}"}).encode()  # a valid request, not signed
        elif k == 5:
            body = json.dumps({**base, "seconds": "NaN"}).encode()
        elif k == 6:
            body = json.dumps({**base, "type": "launch-missiles"}).encode()
        elif k == 7:
            body = json.dumps({k2: v for k2, v in base.items() if k2 != "peak_bytes"}).encode()
        elif k == 8:
            body = json.dumps({**base, "v": 99}).encode()
        else:
            body = json.dumps({**base, "job_id": "nobody"}).encode()
        bad_bodies.append(body)
    for i, body in enumerate(bad_bodies):
        h._tag += 1
        h._deliver(h.core.receive(body, rq("attacker"), h._tag, h.now))
        if i % 100 == 0:
            h.request("good", f"g{i}", 0.01)
            h.advance_to(h.now + 0.01)
    assert h.core.rejected == 1000
    assert h.core.jobs["good"].served_count == 10
    assert h.core.devices["0"].running is None and not h.core.devices["0"].pending
    assert len(h.acked) == 1000 + 10 + 1  # every message acknowledged exactly once


# ---------------------------------------------------------------------- deadline scheduling (grants)
def test_grant_is_sent_when_scheduled_and_the_timeline_is_back_to_back():
    h = GrantHarness("fifo", backdate_s=0.0)
    assert h.register("a")["same_host"] is True
    h.register("b")
    h.now = 10.0
    ga = h.grant("a", "a1", 1.0)
    assert [r["type"] for r in ga] == ["granted"]  # at once, not when the work has ended
    assert (ga[0]["start"], ga[0]["end"], ga[0]["remaining_s"]) == (10.0, 11.0, 1.0)
    assert h.acked == [1, 2, 3]  # the request left the queue with its grant
    h.now = 10.2
    assert h.grant("b", "b1", 0.5) == []  # queued behind a
    # The loop wakes late (a busy machine): b still starts exactly where a ends.
    gb = h.advance_to(11.004)
    assert [(r["request_id"], r["start"], r["end"]) for r in gb] == [("b1", 11.0, 11.5)]
    assert gb[0]["remaining_s"] == pytest.approx(0.496) and gb[0]["waited_s"] == pytest.approx(0.8)
    assert h.advance_to(11.5) == []  # a granted request's end sends nothing more
    dev = h.core.devices["0"]
    assert dev.running is None and dev.busy_s == pytest.approx(1.5) and dev.served == 2


def test_lookahead_grants_the_next_slot_before_the_gpu_frees_up():
    h = GrantHarness("round-robin", lookahead_s=0.1)
    for j in "abc":
        h.register(j)
    h.grant("a", "a1", 1.0)
    h.grant("b", "b1", 1.0)
    h.grant("a", "a2", 1.0)  # a second request of a: round-robin must still serve b first
    assert h.core.next_deadline() == pytest.approx(0.9)
    assert h.advance_to(0.89) == []
    early = h.advance_to(0.9)
    assert [(r["request_id"], r["start"], r["end"]) for r in early] == [("b1", 1.0, 2.0)]
    h.now = 0.95
    h.grant("c", "c1", 1.0)  # arrives before the boundary but after b's slot was decided
    nxt = h.advance_to(1.9)
    assert [(r["request_id"], r["start"]) for r in nxt] == [("c1", 2.0)]  # c has had less time than a
    assert [r["request_id"] for r in h.advance_to(2.9)] == ["a2"]
    ends = [(r["start"], r["end"]) for box in h.inbox.values() for r in box if r["type"] == "granted"]
    ends.sort()
    assert all(s2 >= e1 for (_, e1), (s2, _) in zip(ends, ends[1:], strict=False))  # never overlapping


def test_same_host_request_to_an_idle_gpu_starts_when_it_was_sent():
    h = GrantHarness("fifo", backdate_s=0.05)
    h.register("near")
    h.register("far", host="otherhost/boot-2")
    h.now = 5.0
    g = h.grant("near", "n1", 0.01, sent_at=4.9995)  # 0.5 ms in flight
    assert g[0]["start"] == 4.9995 and g[0]["idle_s"] == 0.0
    h.now = 5.1
    g = h.grant("near", "n2", 0.01, sent_at=5.0)  # in flight for 100 ms: backdated 50 ms only
    # idle since n1 ended (5.0095; the request was sent before): idle until its backdated start
    assert g[0]["start"] == pytest.approx(5.05) and g[0]["idle_s"] == pytest.approx(5.05 - 5.0095)
    h.now = 5.2
    assert h.grant("near", "n3", 0.01, sent_at=7.0)[0]["start"] == 5.2  # a clock ahead of ours: now
    h.now = 5.3
    g = h.grant("far", "f1", 0.01, sent_at=5.2999)  # another host's clock means nothing here
    assert g[0]["start"] == 5.3 and g[0]["idle_s"] is None
    # Never before work already scheduled: the next one starts where n4 ends.
    h.now = 6.0
    h.grant("near", "n4", 0.01, sent_at=6.0)
    h.now = 6.011
    h.advance_to(6.011)
    assert h.grant("near", "n5", 0.01, sent_at=6.005)[0]["start"] == pytest.approx(6.01)
    # Without backdating the trip to the manager on an idle GPU is reported as idle time.
    nb = GrantHarness("fifo", backdate_s=0.0)
    nb.register("near")
    nb.now = 3.0
    g = nb.grant("near", "x", 0.01, sent_at=2.9994)
    assert g[0]["start"] == 3.0 and g[0]["idle_s"] == pytest.approx(0.0006)


def test_duplicate_of_a_granted_request_gets_the_same_grant_and_no_more_time():
    h = GrantHarness()
    h.register("a")
    first = h.grant("a", "r1", 2.0)[0]
    h.now = 0.5
    again = h.grant("a", "r1", 2.0)[0]  # resent (lost reply): same slot, remaining counted from now
    assert (again["type"], again["start"], again["end"]) == ("granted", first["start"], first["end"])
    assert again["remaining_s"] == pytest.approx(1.5)
    h.advance_to(2.0)
    h.now = 2.5
    late = h.grant("a", "r1", 2.0)[0]
    assert late["end"] == first["end"] and late["remaining_s"] == 0.0
    assert h.core.jobs["a"].served_count == 1 and h.core.devices["0"].busy_s == pytest.approx(2.0)


def test_killed_job_granted_slot_is_released_after_its_lease():
    h = GrantHarness("fifo", lease_s=1.0, lookahead_s=0.5)
    h.register("dead", persistent=10 * GiB)
    h.register("alive")
    assert h.grant("dead", "long", 100.0)[0]["end"] == 100.0
    assert h.grant("alive", "short", 0.5) == []  # queued behind the granted 100 s slot
    t = 0.0
    got = []
    while not got and t < 5.0:
        t += 0.25
        got = [r for r in h.advance_to(t) if r.get("request_id") == "short"]
        h.heartbeat("alive")
    assert "dead" not in h.core.jobs
    assert got and got[0]["start"] <= 2 * 1.0 + 0.25  # within two leases, not at 100 s
    dev = h.core.devices["0"]
    assert dev.busy_s == pytest.approx(got[0]["start"] + 0.5)  # the dead slot's unused rest is not counted
    assert h.register("big", persistent=14 * GiB)["type"] == "registered"


@pytest.mark.parametrize(
    "field,value,fragment", [("grant", 1, "grant"), ("sent_at", -1.0, "sent_at"), ("sent_at", "now", "sent_at")]
)
def test_grant_fields_are_validated(field, value, fragment):
    body = {
        "type": "request",
        "job_id": "a",
        "request_id": "r",
        "device": "0",
        "seconds": 1.0,
        "peak_bytes": 0,
        field: value,
    }
    with pytest.raises(P.ProtocolError, match=fragment):
        P.parse_message(P.encode(body))


# ---------------------------------------------------------------------- time slices
@pytest.mark.parametrize("policy", ["fifo", "round-robin"])
def test_a_long_request_is_served_in_quanta_while_others_wait(policy):
    """A job asking for an hour of GPU time holds the emuGPU for one quantum at a time."""
    h = GrantHarness(policy, quantum_s=0.5, lookahead_s=0.0, lease_s=1e9)
    h.register("hog")
    h.register("small")
    assert h.grant("hog", "hour", 3600.0) == []  # no answer until its last slice is scheduled
    h.now = 0.1
    assert h.grant("small", "s1", 0.002) == []
    got = h.advance_to(0.5)  # the hog's first slice ends: the small request is next
    assert [(r["request_id"], r["start"], r["end"]) for r in got] == [("s1", 0.5, 0.502)]
    assert got[0]["waited_s"] == pytest.approx(0.4)
    t, grants = 0.5, []
    while not grants and t < 4000:  # alone now: slices go back to back until the last one is granted
        t = h.core.next_deadline()
        grants = h.advance_to(t)
    g = grants[0]
    assert (g["request_id"], g["start"], g["seconds"]) == ("hour", 0.0, 3600.0)
    assert g["end"] == pytest.approx(3600.002) and g["waited_s"] == pytest.approx(0.002)
    dev = h.core.devices["0"]
    assert dev.served == 2 and dev.busy_s == pytest.approx(3600.002)
    assert h.core.jobs["hog"].served_count == 1 and h.core.jobs["hog"].view.served_s == pytest.approx(3600.0)


def test_slices_of_a_legacy_request_end_with_one_done_and_the_dropped_hog_frees_its_slots():
    h = Harness("round-robin", quantum_s=1.0, lease_s=100.0)
    h.register("hog")
    h.register("b")
    h.request("hog", "h1", 2.5)
    h.request("b", "b1", 1.0)
    done = []
    for t in (1.0, 2.0, 3.0, 3.5):
        done += [(r["request_id"], round(h.now, 6)) for r in h.advance_to(t) if r["type"] == "done"]
    assert done == [("b1", 2.0), ("h1", 3.5)]  # hog 0-1, b 1-2, hog 2-3 and 3-3.5
    assert h.core.devices["0"].served == 2
    h.request("hog", "h2", 100.0)
    h.advance_to(4.0)
    h.deregister("hog")
    dev = h.core.devices["0"]
    assert dev.running is None and not dev.pending and dev.busy_s == pytest.approx(3.5 + 0.5)
    assert sorted(h.acked) == sorted(set(h.acked))  # every delivery acknowledged once
