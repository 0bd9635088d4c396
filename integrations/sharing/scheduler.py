"""The sharing manager's scheduler: which request runs next on each emuGPU, and when.

:class:`Scheduler` is the half of :class:`~.core.SharingCore` that works on the timeline: it
finishes slots whose end passed, asks the policy for the next request (one candidate per job:
the job's oldest waiting request, so a job's share does not grow with the requests it keeps in
flight), grants it a lookahead before the previous slot ends, slices long requests into quanta,
expires silent jobs and frees a dropped job's slots. Pure state, clock passed in.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .policies import Fifo, PendingView
from .state import (
    DONE_MEMORY,
    EPS,
    SHARE_WINDOW_S,
    DeviceState,
    JobState,
    LogBudget,
    Outgoing,
    QueuedRequest,
    Slot,
    gib,
)

__all__ = ["Scheduler"]

log = logging.getLogger("gpemu.sharing.manager")


class Scheduler:
    """The timeline half of the sharing manager's core (see :class:`~.core.SharingCore`)."""

    devices: dict[str, DeviceState]
    jobs: dict[str, JobState]
    virtual: bool  # on virtual time (see _advance_virtual)
    expected_jobs: int  # virtual time: decide nothing before this many jobs registered
    jobs_seen: int
    lease_s: float
    lookahead_s: float
    quantum_s: float | None
    policy_name: str
    started_at: float | None
    expired: int
    refused: int
    rejected: int
    disconnected: int
    _seq: int
    _policy_warned: bool
    _log_budget: LogBudget

    def flush_log(self, now: float, final: bool = False) -> None:
        """Write the summary of rejections not logged one by one, once their window has passed
        (``final``: now, as the manager stops)."""
        self._log_budget.flush(now, final)

    def advance(self, now: float) -> list[Outgoing]:
        """Finish slots whose end passed, schedule the next ones, expire silent jobs."""
        self.flush_log(now)
        out: list[Outgoing] = []
        for job in [j for j in self.jobs.values() if now - j.last_seen > self.lease_s]:
            self.expired += 1
            log.warning(
                "job %r sent nothing for %.1f s (lease %.1f s): dropped, its GPU time and memory freed",
                job.job_id,
                now - job.last_seen,
                self.lease_s,
            )
            out += self._drop_job(job, now, "lease expired")
        for dev in self.devices.values():
            out += self._advance_virtual(dev) if self.virtual else self._advance_real(dev, now)
        return out

    def _advance_real(self, dev: DeviceState, now: float) -> list[Outgoing]:
        """Real time: finish slots whose end passed, grant the next a lookahead before the tail."""
        out: list[Outgoing] = []
        while True:
            run = dev.running
            if run is not None and run.end <= now:
                out += self._finish(dev, run)
                dev.running = dev.reserved.popleft() if dev.reserved else None
                continue
            tail = dev.reserved[-1] if dev.reserved else run
            if not dev.pending or (tail is not None and tail.end - self.lookahead_s > now):
                break
            out += self._start_next(dev, now, tail)
        return out

    # ------------------------------------------------------------------ virtual time
    def _frontier(self, dev: DeviceState) -> float:
        """Virtual time up to which every job of ``dev`` has said what it asks for: a job with a
        request queued sends nothing else before it is granted; any other job sends nothing
        before its frontier (protocol, "Virtual time"). Before ``expected_jobs`` registered,
        nothing is known."""
        if self.jobs_seen < self.expected_jobs:
            return float("-inf")
        queued = {r.job_id for r in dev.pending}
        return min((self.jobs[j].frontier for j in dev.jobs if j not in queued), default=float("inf"))

    def _advance_virtual(self, dev: DeviceState) -> list[Outgoing]:
        """Virtual time: the next slot starts when the emuGPU is free and the earliest queued
        request was sent; it is decided once no job can still send a request at or before that
        start (:meth:`_frontier`), among the requests sent by then, so the schedule does not
        depend on the real order of the messages. Decided and granted at once: the jobs wait on
        their own clocks, not for real."""
        out: list[Outgoing] = []
        while dev.pending:
            start = max(dev.free_at, min(r.origin for r in dev.pending))
            if self._frontier(dev) <= start:  # (a job at `start` may still ask for it: wait)
                break
            self._join_arrived(dev, start)
            sent = [r for r in dev.pending if r.origin <= start + EPS]
            out += self._start_virtual(dev, self._pick_among(dev, sent, start), start)
        return out

    def _join_arrived(self, dev: DeviceState, start: float) -> None:
        """Tell the policy of the jobs registered by ``start`` on the virtual timeline, in the
        order they arrived (a fair-share policy starts a job level with the jobs there then)."""
        dev.joining.sort()
        while dev.joining and dev.joining[0][0] <= start + EPS:
            _, job_id = dev.joining.pop(0)
            view = dev.jobs.get(job_id)
            if view is not None:
                waiting = {t[1] for t in dev.joining}
                dev.policy.registered(view, {j: v for j, v in dev.jobs.items() if j not in waiting})

    def _pick_among(self, dev: DeviceState, requests: list[QueuedRequest], start: float) -> QueuedRequest:
        """The policy's choice among ``requests`` (each job's earliest), in virtual arrival order."""
        heads: dict[str, QueuedRequest] = {}
        # (ties in virtual time go by job id, not by the real order the messages came in)
        for r in sorted(requests, key=lambda r: (r.origin, r.job_id, r.seq)):
            heads.setdefault(r.job_id, r)
        return self._pick(dev, dict(enumerate(heads.values())))

    def _start_virtual(self, dev: DeviceState, req: QueuedRequest, start: float) -> list[Outgoing]:
        dev.pending.remove(req)
        job = self.jobs[req.job_id]
        if req.started is None:
            refusal = self._refusal(dev, req, job)
            if refusal is not None:
                job.frontier = max(job.frontier, start)
                return [refusal]
            req.started = start
        slot = self._slot(dev, req, start)
        dev.free_at = slot.end
        if not slot.final:  # the rest is sent again when this slice ends, behind what came meanwhile
            self._seq += 1
            req.seq, req.origin = self._seq, slot.end
            dev.pending.append(req)
            return []
        job.frontier = slot.end
        return [self._answer(job, req, self._granted(req, slot.end))]

    def _candidates(self, dev: DeviceState) -> dict[int, QueuedRequest]:
        """One waiting request per job, its oldest, keyed by the arrival order the policy sees.

        A job that holds the emuGPU's timeline now (a slot running or granted ahead) has its next
        request seen as arriving now, behind every request already waiting: a job with one request
        in flight sends its next one only when the previous one ends. So under every policy a
        job's share of the queue does not grow with the requests it keeps in flight (under fifo, a
        job with 16 queued half-second requests made a 20 ms job wait 16 quanta)."""
        heads: dict[str, QueuedRequest] = {}
        for r in dev.pending:
            head = heads.get(r.job_id)
            if head is None or r.seq < head.seq:
                heads[r.job_id] = r
        holding = {slot.req.job_id for slot in (dev.running, *dev.reserved) if slot is not None}
        return {(r.seq + self._seq if r.job_id in holding else r.seq): r for r in heads.values()}

    def _pick(self, dev: DeviceState, candidates: dict[int, QueuedRequest] | None = None) -> QueuedRequest:
        """The policy's choice among ``candidates`` keyed by arrival order (default: the queue's
        heads, :meth:`_candidates`)."""
        if candidates is None:
            candidates = self._candidates(dev)
        pending = [
            PendingView(r.job_id, seq, r.left if self.quantum_s is None else min(r.left, self.quantum_s))
            for seq, r in candidates.items()
        ]
        try:
            return candidates[dev.policy.pick(pending, dev.jobs).seq]
        except Exception as exc:  # a user's policy must not stop the emuGPU
            if not self._policy_warned:
                self._policy_warned = True
                log.error(
                    "policy %s failed to pick a request (%r); serving in arrival order instead", self.policy_name, exc
                )
            return candidates[Fifo().pick(pending, dev.jobs).seq]

    def _refusal(self, dev: DeviceState, req: QueuedRequest, job: JobState) -> Outgoing | None:
        """The "refused" answer when a request's first slice would not fit in memory, else None."""
        others = sum(self.jobs[j].persistent_bytes for j in dev.jobs if j != req.job_id)
        need = max(req.peak_bytes, job.persistent_bytes)
        if others + need <= dev.spec.capacity_bytes:
            return None
        self.refused += 1
        reason = (
            f"CUDA out of memory on emuGPU {dev.spec.name} ({dev.spec.gpu}, "
            f"{gib(dev.spec.capacity_bytes)} total): this request's peak {gib(need)} plus "
            f"{gib(others)} persistent memory of {len(dev.jobs) - 1} other job(s) sharing it"
        )
        return self._answer(job, req, {"type": "refused", "request_id": req.rid, "reason": reason})

    def _slot(self, dev: DeviceState, req: QueuedRequest, start: float) -> Slot:
        """The next slice of ``req`` from ``start`` (at most one quantum), charged to its job.

        Charged when scheduled: a lookahead decision then sees the slots already given (a job
        is not picked again for time it has not been charged yet), and the figures are in place
        before the grant reaches the job. A dropped job's unused time is taken back."""
        piece = req.left if self.quantum_s is None or req.left <= self.quantum_s + EPS else self.quantum_s
        req.left = max(0.0, req.left - piece)
        slot = Slot(req, start, start + piece, req.left <= EPS)
        job = self.jobs[req.job_id]
        job.view.served_s += piece
        dev.policy.served(job.view, piece)
        dev.busy_s += piece
        dev.recent.append((slot.end, job.job_id, piece))
        if slot.final:
            req.deadline = slot.end
            dev.served += 1
            job.served_count += 1
        return slot

    def _granted(self, req: QueuedRequest, now: float) -> dict[str, Any]:
        assert req.deadline is not None
        return {
            "type": "granted",
            "request_id": req.rid,
            "start": req.started,
            "end": req.deadline,
            "remaining_s": max(0.0, req.deadline - now),
            "seconds": req.seconds,
            "waited_s": max(0.0, req.deadline - req.origin - req.seconds),
            "idle_s": req.idle,
        }

    def _start_next(self, dev: DeviceState, now: float, tail: Slot | None) -> list[Outgoing]:
        req = self._pick(dev)
        dev.pending.remove(req)
        job = self.jobs[req.job_id]
        first = req.started is None
        if first:
            refusal = self._refusal(dev, req, job)
            if refusal is not None:
                return [refusal]
        # Back-to-back work starts when the previous slot ends, not when the loop noticed;
        # on an idle emuGPU a new request starts when the job sent it (same host, see backdate_s).
        free = tail.end if tail is not None else min(now, dev.free_at)
        start = max(req.origin, free) if first else free
        slot = self._slot(dev, req, start)
        if first:
            req.started = start
            # GPU time lost while the request travelled to us: idle emuGPU, request already sent.
            req.idle = max(0.0, start - max(req.sent_at, free)) if req.sent_at is not None else None
        if tail is None:
            dev.running = slot
        else:
            dev.reserved.append(slot)
        if not slot.final or not req.grant:  # queued again when this slice ends (see _finish)
            return []
        return [self._answer(job, req, self._granted(req, now))]

    def _finish(self, dev: DeviceState, slot: Slot) -> list[Outgoing]:
        dev.free_at = slot.end
        req = slot.req
        if not slot.final:
            # Back of the line, as if it arrived now: requests that came during the slice go
            # first under any policy that honours arrival order.
            self._seq += 1
            req.seq = self._seq
            dev.pending.append(req)
            return []
        if req.grant:  # answered (and acknowledged) when granted
            return []
        job = self.jobs[req.job_id]
        payload = {
            "type": "done",
            "request_id": req.rid,
            "served_s": req.seconds,
            "waited_s": max(0.0, slot.end - req.origin - req.seconds),
        }
        return [self._answer(job, req, payload)]

    def _answer(self, job: JobState, req: QueuedRequest, payload: dict[str, Any]) -> Outgoing:
        job.active.pop(req.rid, None)
        job.done[req.rid] = payload
        while len(job.done) > DONE_MEMORY:
            job.done.popitem(last=False)
        return Outgoing(req.reply_to, payload, req.tags, job.key)

    def _drop_job(self, job: JobState, now: float, why: str) -> list[Outgoing]:
        dev = self.devices[job.device]
        # Slots granted ahead to other jobs keep their times (their grants are out); the
        # dropped job's own future slots are freed.
        for slot in [s for s in dev.reserved if s.req.job_id == job.job_id]:
            dev.reserved.remove(slot)
            dev.busy_s -= slot.end - slot.start
            if slot.final:
                dev.served -= 1
        run = dev.running
        if run is not None and run.req.job_id == job.job_id:
            dev.free_at = max(run.start, min(now, run.end))
            dev.busy_s -= run.end - dev.free_at  # the slot's unused rest is free again
            dev.running = dev.reserved.popleft() if dev.reserved else None
        dev.pending = [r for r in dev.pending if r.job_id != job.job_id]
        # Its unanswered requests leave the queue (acknowledged, never answered).
        out = [Outgoing(None, None, req.tags) for req in job.active.values() if req.tags]
        job.active.clear()
        dev.jobs.pop(job.job_id, None)
        self.jobs.pop(job.job_id, None)
        log.info("job %r left emuGPU %s (%s)", job.job_id, dev.spec.name, why)
        return out

    def forget_delivery_tags(self) -> None:
        """The channel is gone: its unacked messages will be redelivered, so drop their tags."""
        for job in self.jobs.values():
            for req in job.active.values():
                req.tags.clear()

    # ------------------------------------------------------------------ queries
    def next_deadline(self) -> float | None:
        ends = []
        for d in self.devices.values() if not self.virtual else ():  # (virtual: nothing waits for real)
            if d.running is not None:
                ends.append(d.running.end)
                if d.pending:  # the next decision, a lookahead before the tail of the timeline ends
                    ends.append((d.reserved[-1] if d.reserved else d.running).end - self.lookahead_s)
        if self.jobs:
            ends.append(min(j.last_seen for j in self.jobs.values()) + self.lease_s + 1e-3)
        return min(ends) if ends else None

    def precise_deadline(self) -> float | None:
        """The earliest end that is answered with a "done" reply at that moment (legacy clients).

        Only those need the loop on time to the microsecond; a granted request's end only
        frees the emuGPU on the timeline, which was fixed when it was granted.
        """
        ends = [
            d.running.end
            for d in self.devices.values()
            if d.running is not None and d.running.final and not d.running.req.grant
        ]
        return min(ends) if ends else None

    def status(self, now: float) -> dict[str, Any]:
        devices, jobs = [], []
        if self.virtual:  # the emuGPUs' virtual timeline, up to what is scheduled
            now = max((d.free_at for d in self.devices.values()), default=now)
        for dev in self.devices.values():
            while dev.recent and dev.recent[0][0] < now - SHARE_WINDOW_S:
                dev.recent.popleft()
            recent: dict[str, float] = {}
            for _, job_id, s in dev.recent:
                recent[job_id] = recent.get(job_id, 0.0) + s
            total_recent = sum(recent.values()) or 1.0
            total = sum(v.served_s for v in dev.jobs.values()) or 1.0
            up = max(now - (self.started_at or now), 1e-9)
            devices.append(
                {
                    "device": dev.spec.name,
                    "gpu": dev.spec.gpu,
                    "capacity_bytes": dev.spec.capacity_bytes,
                    "persistent_bytes": sum(self.jobs[j].persistent_bytes for j in dev.jobs),
                    "jobs": len(dev.jobs),
                    "queue": len(dev.pending),
                    "running": dev.running.req.job_id if dev.running else None,
                    "served_requests": dev.served,
                    "busy_s": dev.busy_s,
                    "utilisation": min(1.0, dev.busy_s / up),
                }
            )
            for view in dev.jobs.values():
                job = self.jobs[view.job_id]
                jobs.append(
                    {
                        "job_id": view.job_id,
                        "device": dev.spec.name,
                        "weight": view.weight,
                        "persistent_bytes": job.persistent_bytes,
                        "served_s": view.served_s,
                        "served_requests": job.served_count,
                        "queued": len(job.active),
                        "share": view.served_s / total,
                        "recent_share": recent.get(view.job_id, 0.0) / total_recent,
                    }
                )
        return {
            "type": "status",
            "policy": self.policy_name,
            "lease_s": self.lease_s,
            "quantum_s": self.quantum_s,
            "time": time.time(),
            "devices": devices,
            "jobs": jobs,
            "rejected": self.rejected,
            "refused": self.refused,
            "expired": self.expired,
            "disconnected": self.disconnected,
        }
