"""Drivers of the sharing manager's core on a virtual clock, shared by the sharing tests."""

from __future__ import annotations

from gpemu.integrations.sharing import protocol as P
from gpemu.integrations.sharing.manager import DeviceSpec, SharingCore

GiB = 1 << 30


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def rq(name: str) -> str:
    """The reply queue name a job called ``name`` uses in these tests."""
    return P.REPLY_PREFIX + name.ljust(8, "_")


class Harness:
    """Drives a SharingCore like the daemon would, with a virtual clock and closed-loop jobs.

    Every job has its own key: its messages are signed with it and it is sent in ``register``
    (a manager without a job secret). Replies land in ``inbox[job]``; ``signed[job]`` counts
    the replies signed with that job's key."""

    def __init__(
        self,
        policy: str | type = "fifo",
        capacity: int = 16 * GiB,
        lease_s: float = 5.0,
        quantum_s: float | None = None,
        **kw,
    ) -> None:
        self.core = SharingCore([DeviceSpec("0", "P100", capacity)], policy, lease_s, quantum_s=quantum_s, **kw)
        self.now = 0.0
        self.keys: dict[str, bytes] = {}
        self.inbox: dict[str, list[dict]] = {}
        self.outs: list = []
        self.acked: list = []
        self._tag = 0

    def key(self, job: str) -> bytes:
        return self.keys.setdefault(job, bytes([len(self.keys) + 1]) * P.KEY_BYTES)

    def send(self, payload: dict, reply_to: str | None = None, key: bytes | None = None) -> list[dict]:
        self._tag += 1
        body = P.encode(payload)
        outs = self.core.receive(
            body, rq(reply_to) if reply_to else None, self._tag, self.now, P.sign(key, body) if key else None
        )
        return self._deliver(outs)

    def _deliver(self, outs) -> list[dict]:
        got = []
        for o in outs:
            self.outs.append(o)
            self.acked += o.ack
            if o.reply_to and o.payload is not None:
                self.inbox.setdefault(o.reply_to[len(P.REPLY_PREFIX) :].rstrip("_"), []).append(o.payload)
                got.append(o.payload)
        return got

    def register(self, job: str, persistent: int = GiB, weight: float = 1.0, device: str = "0", **extra) -> dict:
        key = self.key(job)
        return self.send(
            {
                "type": "register",
                "job_id": job,
                "request_id": f"reg-{job}",
                "device": device,
                "persistent_bytes": persistent,
                "weight": weight,
                "key": key.hex(),
                **extra,
            },
            reply_to=job,
            key=key,
        )[0]

    def request(self, job: str, rid: str, seconds: float, peak: int = 2 * GiB, **extra) -> list[dict]:
        return self.send(
            {
                "type": "request",
                "job_id": job,
                "request_id": rid,
                "device": "0",
                "seconds": seconds,
                "peak_bytes": peak,
                **extra,
            },
            reply_to=job,
            key=self.keys[job],
        )

    def heartbeat(self, job: str) -> list[dict]:
        return self.send({"type": "heartbeat", "job_id": job}, reply_to=job + "-hb", key=self.keys[job])

    def deregister(self, job: str, rid: str = "bye") -> list[dict]:
        return self.send({"type": "deregister", "job_id": job, "request_id": rid}, reply_to=job, key=self.keys[job])

    def advance_to(self, t: float) -> list[dict]:
        self.now = t
        return self._deliver(self.core.advance(t))

    def run_until_idle(self, limit: float = 1e6) -> None:
        while (d := self.core.next_deadline()) is not None and d < limit:
            self.advance_to(d)
            if not any(dev.running or dev.pending for dev in self.core.devices.values()):
                break


def closed_loop(h: Harness, durations: dict[str, float], horizon: float, depth: int = 1) -> dict[str, float]:
    """Each job keeps ``depth`` requests outstanding (1: one per iteration, like a training loop)."""
    counters = {j: depth - 1 for j in durations}
    for j in durations:
        for k in range(depth):
            h.request(j, f"{j}-{k}", durations[j])
    served = {j: 0.0 for j in durations}
    while h.now < horizon:
        d = h.core.next_deadline()
        for _ in h.advance_to(d):
            pass
        for j in durations:
            box = h.inbox.get(j, [])
            while box:
                r = box.pop(0)
                if r["type"] == "done":
                    served[j] += r["served_s"]
                    counters[j] += 1
                    h.request(j, f"{j}-{counters[j]}", durations[j])
    return served


HOST = "testhost/boot-1"


class GrantHarness(Harness):
    """A core whose jobs ask for grants; ``host`` decides whether they share its clock."""

    def __init__(
        self,
        policy: str | type = "fifo",
        lookahead_s: float = 0.0,
        backdate_s: float = 0.05,
        lease_s: float = 100.0,
        capacity: int = 16 * GiB,
        quantum_s: float | None = None,
    ) -> None:
        super().__init__(
            policy, capacity, lease_s, quantum_s, host=HOST, lookahead_s=lookahead_s, backdate_s=backdate_s
        )

    def register(
        self, job: str, persistent: int = GiB, weight: float = 1.0, device: str = "0", host: str = HOST
    ) -> dict:
        return super().register(job, persistent, weight, device, host=host)

    def grant(self, job: str, rid: str, seconds: float, sent_at: float | None = None, peak: int = 2 * GiB) -> list:
        extra = {"sent_at": sent_at} if sent_at is not None else {}
        return self.request(job, rid, seconds, peak, grant=True, **extra)
