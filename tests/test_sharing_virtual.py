"""The sharing manager on virtual time (protocol, "Virtual time"): slots are decided on the jobs'
virtual clocks, in the order their virtual times say, whatever order their messages arrive in."""

from __future__ import annotations

import threading

import pytest
from sharing_broker_support import ThreadManager, broker, client, purge  # noqa: F401 (fixtures)
from sharing_harness import GiB, Harness


class VirtualHarness(Harness):
    """A core on virtual time; jobs register and request with their virtual times."""

    def __init__(self, policy: str = "fifo", expected_jobs: int = 0, quantum_s: float | None = None) -> None:
        super().__init__(policy, quantum_s=quantum_s, clock="virtual", expected_jobs=expected_jobs)

    def join(self, job: str, vtime: float = 0.0, **extra) -> dict:
        return self.register(job, clock="virtual", vtime=vtime, **extra)

    def ask(self, job: str, rid: str, seconds: float, vtime: float) -> list[dict]:
        return self.request(job, rid, seconds, grant=True, vtime=vtime)


def _granted(replies: list[dict]) -> list[tuple[str, float, float]]:
    return [(r["request_id"], r["start"], r["end"]) for r in replies if r["type"] == "granted"]


def test_a_slot_waits_for_every_job_that_could_still_ask_earlier():
    """Nothing is decided while a job that could still ask for the slot is silent. A asks first
    (in real order) for work at t=1, but B's request, sent at t=0.5 on B's clock and arriving
    later, goes first, as it would have on real time."""
    h = VirtualHarness("fifo")
    assert h.join("A")["type"] == "registered" and h.join("B")["clock"] == "virtual"
    assert h.ask("A", "a1", 1.0, vtime=0.0) == []  # B, at 0, could still ask for t=0
    assert _granted(h.ask("B", "b1", 1.0, vtime=0.5)) == [("a1", 0.0, 1.0)]  # A may ask again at 1
    assert _granted(h.ask("A", "a2", 1.0, vtime=1.0)) == [("b1", 1.0, 2.0)]  # B sent its at 0.5
    assert _granted(h.deregister("B")) == [("a2", 2.0, 3.0)]
    assert h.inbox["A"][-1]["waited_s"] == pytest.approx(1.0)


def test_the_policy_chooses_among_requests_sent_by_the_slots_start():
    h = VirtualHarness("round-robin")
    for job in "ABC":
        h.join(job)
    h.ask("A", "a1", 2.0, vtime=0.0)
    h.ask("C", "c1", 1.0, vtime=5.0)  # sent after A's first slot ends: not a candidate at t=2
    assert _granted(h.ask("B", "b1", 1.0, vtime=1.0)) == [("a1", 0.0, 2.0)]
    # At t=2 both A (again) and B have asked: B, with less GPU time, goes first.
    assert _granted(h.ask("A", "a2", 2.0, vtime=2.0)) == [("b1", 2.0, 3.0)]
    assert _granted(h.deregister("B")) == [("a2", 3.0, 5.0)]  # C's request is from t=5
    assert _granted(h.deregister("A")) == [("c1", 5.0, 6.0)]


def test_expected_jobs_hold_the_first_slot_until_all_registered():
    h = VirtualHarness("fifo", expected_jobs=2)
    h.join("A")
    assert h.ask("A", "a1", 1.0, vtime=3.0) == []  # one of two jobs: B may still come, earlier
    assert h.join("B", vtime=1.0)["type"] == "registered"  # registered at 1: A's slot at 3 waits for it
    assert _granted(h.ask("B", "b1", 1.0, vtime=1.0)) == [("b1", 1.0, 2.0)]  # B may ask again at 2
    assert _granted(h.ask("B", "b2", 0.5, vtime=3.5)) == [("a1", 3.0, 4.0)]
    assert _granted(h.deregister("A")) == [("b2", 4.0, 4.5)]


def test_long_requests_are_sliced_on_the_virtual_timeline():
    h = VirtualHarness("round-robin", quantum_s=0.5)
    h.join("A"), h.join("B")
    h.ask("A", "a1", 1.5, vtime=0.0)
    # Slices alternate (the job with less GPU time next; ties by job id): A 0-0.5, B 0.5-1,
    # A 1-1.5, B 1.5-2 (B's last); A's last slice waits for B, which may ask again at 2.
    assert _granted(h.ask("B", "b1", 1.0, vtime=0.0)) == [("b1", 0.5, 2.0)]
    assert _granted(h.deregister("B")) == [("a1", 0.0, 2.5)]


def test_a_job_on_the_other_clock_is_refused_with_a_reason():
    h = VirtualHarness()
    reply = h.register("real-job")
    assert reply["type"] == "error" and "virtual time" in reply["reason"]
    real = Harness()
    reply = real.register("virtual-job", clock="virtual", vtime=0.0)
    assert reply["type"] == "error" and "--clock virtual" in reply["reason"]
    h.join("A")
    reply = h.request("A", "no-time", 1.0, grant=True)[0]
    assert reply["type"] == "error" and "vtime" in reply["reason"]


# ------------------------------------------------------------------ over a real broker
@pytest.mark.broker
def test_jobs_on_virtual_time_get_the_schedule_real_time_would_give(broker, purge):  # noqa: F811
    """Three jobs of 0.2 s iterations share one emuGPU round-robin through a real broker and
    manager on virtual time: they finish in virtual time exactly where a fair share puts them,
    however their threads were scheduled for real, in a fraction of that time."""
    import time

    manager = ThreadManager(broker.url, "round-robin", time_mode="virtual", expected_jobs=3, quantum_s=None)
    ends: dict[str, float] = {}
    counts = {"j1": 30, "j2": 20, "j3": 10}

    def job(name: str) -> None:
        with client(broker.url, name, clock="virtual", vtime=100.0) as c:
            for _ in range(counts[name]):
                c.run(0.2, 2 * GiB)
            ends[name] = c.vtime

    t0 = time.monotonic()
    threads = [threading.Thread(target=job, args=(n,)) for n in counts]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        manager.stop()
    wall = time.monotonic() - t0
    # Three jobs at a third each until j3's 10 iterations are done (t=6 s), then two at a half
    # until j2's are (t=10 s), then j1 alone (t=12 s): the sum of their GPU work. Exactly: ties go by
    # job id, never by the real order of the messages.
    assert ends == pytest.approx({"j3": 106.0, "j2": 110.0, "j1": 112.0}, abs=1e-9)
    assert wall < 12.0 / 2


# An emulated training job on virtual time whose GPU time goes through the manager: prints its
# virtual time after each iteration (loss.item() waits for the iteration's GPU work).
_EMULATED_JOB = r"""
import sys, time
import torch
import gpemu

url, job, origin, iterations = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
gpemu.patch(gpu="P100", sharing=url, model="resnet50", job_id=job, summary=False, clock="virtual",
            clock_origin=origin)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                            torch.nn.Flatten(), torch.nn.Linear(16, 1000)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
images, labels = torch.randn(32, 3, 224, 224), torch.randint(0, 1000, (32,))
for _ in range(iterations):
    loss = torch.nn.functional.cross_entropy(model(images.cuda()), labels.cuda())
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss.item()
    print("it", time.perf_counter(), flush=True)
gpemu.unpatch()
"""


@pytest.mark.broker
def test_two_emulated_jobs_share_a_gpu_on_virtual_time(broker, purge, tmp_path):  # noqa: F811
    """Two emulated PyTorch jobs (their own processes, gpemu.patch(clock="virtual", sharing=...))
    time-share one emulated P100 on virtual time: alone, an iteration takes its GPU time; while
    both run, two iterations' worth (round-robin). Each job starts when its process has started
    (its start-up CPU time)."""
    import subprocess
    import sys

    from gpemu.clock import REAL
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db

    open_profile_db(EmuConfig.from_env())  # built before the jobs start (else one of them builds it)
    # (a lease long enough for a job process whose heartbeat thread waits for the GIL on a busy host:
    # this test is about the schedule, not about dropping silent jobs)
    manager = ThreadManager(broker.url, "round-robin", time_mode="virtual", expected_jobs=2, quantum_s=None, lease=5.0)
    script = tmp_path / "job.py"
    script.write_text(_EMULATED_JOB)
    origin = str(REAL.perf_counter())
    counts = {"a": 12, "b": 6}
    try:
        procs = {
            j: subprocess.Popen([sys.executable, str(script), broker.url, j, origin, str(n)], stdout=subprocess.PIPE)
            for j, n in counts.items()
        }
        outs = {j: p.communicate(timeout=120)[0].decode() for j, p in procs.items()}
    finally:
        manager.stop()
    marks = [[float(line.split()[1]) for line in out.splitlines() if line.startswith("it ")] for out in outs.values()]
    assert [len(m) for m in marks] == [12, 6]
    steps = [(a, b) for m in marks for a, b in zip(m, m[1:], strict=False)]
    alone = min(b - a for a, b in steps)
    # Both jobs run from (at the latest) the later one's first mark to the earlier one's last; the
    # later one's first iteration began before its first mark.
    both = (max(m[0] for m in marks), min(m[-1] for m in marks))
    shared = [b - a for a, b in steps if a >= both[0] and b <= both[1]]
    solo = [b - a for a, b in steps if b <= both[0] - 2 * alone or a >= both[1]]
    assert 0.1 < alone < 0.3 and len(shared) >= 4
    assert shared == pytest.approx([2 * alone] * len(shared), rel=0.02)
    assert solo == pytest.approx([alone] * len(solo), rel=0.02)
