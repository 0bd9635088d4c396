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
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sharing_broker_support import (  # noqa: E402
    LEASE,
    GiB,
    ThreadManager,
    broker,
    client,
    purge,
    start_manager_process,
)

from gpemu.integrations.sharing.client import SharingClient  # noqa: E402
from gpemu.integrations.sharing.status import fetch_status  # noqa: E402

pytestmark = pytest.mark.broker

__all__ = ["broker", "purge"]  # fixtures, used by name


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
        with (
            client(broker.url, "small", persistent_bytes=3 * GiB) as other,
            client(broker.url, "big", persistent_bytes=2 * GiB) as big,
        ):
            big.run(0.01, 5 * GiB)  # 3 + 5 = 8 fits
            with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory"):
                big.run(0.01, 6 * GiB)
            other.run(0.01, 3 * GiB)
    finally:
        mgr.stop()


def _spawn_victim(url: str, job_id: str, nbytes: int, lease: float = LEASE) -> subprocess.Popen:
    """A job process that registers ``nbytes`` and then asks for a 60 s request (to be killed)."""
    code = f"""
from gpemu.integrations.sharing.client import SharingClient
c = SharingClient({url!r}, job_id={job_id!r}, persistent_bytes={nbytes}, lease_s={lease})
c.register()
print("registered", flush=True)
c.run(60.0, {nbytes})
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "registered":
        proc.kill()
        raise AssertionError(f"the victim job did not register: {line!r}")
    return proc


def _wait_running(core, job_id: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = core.devices["0"].running
        watched = job_id in core.jobs and core.jobs[job_id].presence is not None
        if run is not None and run.req.job_id == job_id and watched:
            return
        time.sleep(0.02)
    raise AssertionError(f"{job_id} never ran (with its presence queue known)")


def _register_when_free(url: str, job: str, nbytes: int) -> tuple[SharingClient, int]:
    from gpemu.integrations.sharing.client import SharingRefusedError

    c = client(url, job, persistent_bytes=nbytes)
    refusals = 0
    while True:
        try:
            c.register()
            return c, refusals
        except SharingRefusedError:
            refusals += 1
            time.sleep(0.02)


def test_killed_job_frees_gpu_and_memory_as_soon_as_its_connection_closes(broker, purge):
    """kill -9 of a job: the broker hands the manager the job's presence message at once, so its
    memory and the emuGPU are free long before its 10 s lease would run out."""
    mgr = ThreadManager(broker.url, capacity=16 * GiB, lease=10.0)
    proc = _spawn_victim(broker.url, "victim", 12 << 30, lease=10.0)
    try:
        _wait_running(mgr.m.core, "victim")
        time.sleep(0.3)  # the manager's standby consumer is in place behind the job's
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.monotonic()
        c, _ = _register_when_free(broker.url, "survivor", 10 * GiB)  # fits only once the victim is gone
        c.run(0.05, 10 * GiB)  # and the GPU is free: not stuck behind the 60 s request
        took = time.monotonic() - killed_at
        c.close()
        assert took < 3.0, f"GPU freed {took:.2f} s after kill -9 (lease 10 s)"
        core = mgr.m.core
        assert "victim" not in core.jobs and core.disconnected == 1 and core.expired == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        mgr.stop()


def test_a_stopped_job_is_dropped_after_its_lease(broker, purge):
    """A job whose process is alive but silent (SIGSTOP): its connection stays open, so the
    lease is what frees its memory."""
    mgr = ThreadManager(broker.url, capacity=16 * GiB)
    proc = _spawn_victim(broker.url, "frozen", 12 << 30)
    try:
        _wait_running(mgr.m.core, "frozen")
        proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        c, refusals = _register_when_free(broker.url, "survivor", 10 * GiB)
        took = time.monotonic() - stopped_at
        c.run(0.05, 10 * GiB)
        c.close()
        # Held while the lease ran: the first try must be refused, unless a loaded machine made
        # even the first try come late (then it proves nothing).
        assert refusals >= 1 or took > LEASE / 2
        assert took < 2 * LEASE + 1.5, f"freed {took:.2f} s after SIGSTOP (lease {LEASE} s)"
        assert "frozen" not in mgr.m.core.jobs and mgr.m.core.expired >= 1
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
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
        assert " pika" not in text  # pika's connection dumps stay out of the log without --debug
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


def test_share_status_once_json_and_table(broker, purge):
    mgr = ThreadManager(broker.url)
    try:
        with client(broker.url, "visible-job") as c:
            c.run(0.01, GiB)
            code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
            out = subprocess.run(
                [sys.executable, "-c", code, "share-status", "--amqp", broker.url, "--once", "--json"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            snap = json.loads(out.stdout)
            assert [j["job_id"] for j in snap["jobs"]] == ["visible-job"]
            assert snap["jobs"][0]["served_requests"] == 1
            table = subprocess.run(
                [sys.executable, "-c", code, "share-status", "--amqp", broker.url, "--once"],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "COLUMNS": "200"},
            )
            assert "visible-job" in table.stdout and "P100" in table.stdout
    finally:
        mgr.stop()
    # no manager now: a clear error, exit status 2
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "share-status", "--amqp", broker.url, "--once", "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "no sharing manager answered" in out.stderr


# ---------------------------------------------------------------------------- through the emulator
JOB_SCRIPT = r"""
import json, sys
import torch
import gpemu
from gpemu.runtime import current

url, job_id, iters, hold_gib, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
rt = current()
if rt is None:  # not started by `gpemu run --share`
    rt = gpemu.patch(gpu="P100", sharing=url, model="resnet50", job_id=job_id)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(8 * 30 * 30, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
hold = torch.empty(int(hold_gib * (1 << 30)), dtype=torch.uint8, device="cuda") if hold_gib else None

def step():
    x, y = torch.randn(32, 3, 32, 32).cuda(), torch.randint(0, 10, (32,)).cuda()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"
for _ in range(iters):
    step()
torch.cuda.synchronize()
report = {"counters": dict(rt.recorder.counters), "iterations": len(rt.recorder.iterations),
          "sharing_waits": [w.end - w.start for w in rt.recorder.waits if w.reason == "sharing"]}
print("trained", flush=True)
if sys.stdin.readline().strip() == "oom":
    big = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")  # fits this job's own 16 GiB view
    try:
        step()
        torch.cuda.synchronize()
        report["oom"] = None
    except Exception as exc:
        report["oom"] = {"type": type(exc).__name__, "cause": type(exc.__cause__).__name__,
                         "message": str(exc)}
    del big
json.dump(report, open(out, "w"))
gpemu.unpatch()
print("done", flush=True)
"""


def _line(proc: subprocess.Popen, err: Path, timeout: float = 120.0) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert box and box[0], f"job process said nothing (exit {proc.poll()}):\n{err.read_text()[-3000:]}"
    return box[0].strip()


def _job_commands(script: Path, url: str, iters: int, tmp_path: Path) -> dict[str, list[str]]:
    """The two jobs: "a" through gpemu.patch(sharing=...), "b" through `gpemu run --share`."""
    cli = [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"]
    commands = {
        # job a holds 9 GiB for its whole life (persistent memory the manager must learn)
        "a": [sys.executable, str(script), url, "job-a", str(iters), "9", str(tmp_path / "a.json")],
        "b": cli
        + [
            "run",
            "--gpu",
            "P100",
            "--model",
            "resnet50",
            "--share",
            url,
            "--no-summary",
            "--",
            sys.executable,
            str(script),
            url,
            "job-b",
            str(iters),
            "0",
            str(tmp_path / "b.json"),
        ],
    }
    return commands


def _check_shared(reports: dict, jobs: dict, core: Any, iters: int) -> None:
    """Both jobs were served, time-sliced and saw their waits; job b's refusal reached it as a CUDA OOM."""
    import torch

    a, b = reports["a"]["counters"], reports["b"]["counters"]
    for name, rep in reports.items():
        c = rep["counters"]
        assert rep["iterations"] == iters
        assert c["sharing_requests"] >= iters  # at least one request per iteration
        assert jobs[f"job-{name}"][1] == c["sharing_requests"]  # manager served each request once
        assert c["sharing_wait_s"] > 0 and c["sharing_queued_s"] > 0  # each waited behind the other
        assert rep["sharing_waits"] and sum(rep["sharing_waits"]) > 0  # host waits, reason "sharing"
    dev = core.devices["0"]
    assert dev.served == a["sharing_requests"] + b["sharing_requests"]
    assert dev.busy_s == pytest.approx(a["sharing_gpu_s"] + b["sharing_gpu_s"], rel=1e-6)
    # Equal jobs asked for equal GPU time; round-robin interleaved them (both queued above).
    assert a["sharing_gpu_s"] == pytest.approx(b["sharing_gpu_s"], rel=0.05)
    oom = reports["b"]["oom"]
    assert oom is not None, "8 GiB on top of job a's 9 GiB fit on a 16 GiB P100"
    assert "out of memory" in oom["message"] and "9.00 GiB persistent memory of 1 other job" in oom["message"]
    # The engine's backend worker hands the refusal to the host as the program's CUDA OOM
    # (until gpemu.time re-raises it unwrapped, it arrives as the RuntimeError's cause).
    assert torch.cuda.OutOfMemoryError.__name__ in (oom["type"], oom["cause"])


def test_two_emulated_training_jobs_share_one_gpu_through_the_emulator(broker, purge, tmp_path):
    """Two real processes train under gpemu (one via gpemu.patch(sharing=...), one via
    `gpemu run --share`) against a real manager: both are served, time-sliced, the waits land
    in the emulator's statistics, and a memory refusal reaches user code as a CUDA OOM."""

    mgr = ThreadManager(broker.url, lease=10.0)
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    iters = 10
    procs, errs = {}, {}
    try:
        commands = _job_commands(script, broker.url, iters, tmp_path)
        for name, argv in commands.items():
            errs[name] = tmp_path / f"{name}.err"
            procs[name] = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                stderr=open(errs[name], "w"),
                env={**os.environ, "GPEMU_JOB_ID": "job-b"} if name == "b" else None,
            )
        for name, p in procs.items():
            assert _line(p, errs[name]) == "ready"
        for p in procs.values():  # start together so they contend for the GPU
            p.stdin.write("go\n")
            p.stdin.flush()
        for name, p in procs.items():
            assert _line(p, errs[name]) == "trained"
        core = mgr.m.core
        jobs = {j: (v.persistent_bytes, v.served_count) for j, v in list(core.jobs.items())}
        assert set(jobs) == {"job-a", "job-b"}
        # Registration and requests report real persistent memory from the device memory tracker.
        assert 9 * GiB <= jobs["job-a"][0] < 9 * GiB + 64 << 20
        assert 0 < jobs["job-b"][0] < 64 << 20
        procs["b"].stdin.write("oom\n")
        procs["b"].stdin.flush()
        assert _line(procs["b"], errs["b"]) == "done"
        procs["a"].stdin.write("exit\n")
        procs["a"].stdin.flush()
        assert _line(procs["a"], errs["a"]) == "done"
        for p in procs.values():
            assert p.wait(60) == 0
        reports = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in procs}
        _check_shared(reports, jobs, core, iters)
        assert core.refused == 1 and not core.jobs  # both deregistered at exit
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        mgr.stop()


# ---------------------------------------------------------------------------- deadline scheduling
def test_granted_jobs_resume_at_their_scheduled_end_on_a_back_to_back_timeline(broker, purge):
    """Two jobs through the real broker: each run() waits locally for a grant's end (never
    earlier), and their slots lie back to back on the manager's timeline without overlapping."""
    mgr = ThreadManager(broker.url, policy="round-robin")
    results: dict[str, list] = {}
    try:

        def job(name: str) -> None:
            with client(broker.url, name) as c:
                assert c.same_host  # the manager runs in this process: one clock
                results[name] = [c.run(0.03, GiB) for _ in range(12)]

        threads = [threading.Thread(target=job, args=(f"g{i}",)) for i in range(2)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        runs = [r for rs in results.values() for r in rs]
        assert len(runs) == 24
        for r in runs:
            assert r.exact and r.scheduled_end is not None and r.scheduled_start is not None
            assert r.scheduled_end == pytest.approx(r.scheduled_start + 0.03, abs=1e-9)
            assert r.resumed_at >= r.scheduled_end  # never before the work ends on the emuGPU
            assert r.elapsed_s >= 0.03 - 1e-6
        slots = sorted((r.scheduled_start, r.scheduled_end) for r in runs)
        assert all(s2 >= e1 for (_, e1), (s2, _) in zip(slots, slots[1:], strict=False))  # no overlap
        # Each job sends its next request as it resumes, while the other's slot runs: the next
        # slot starts exactly where the previous one ends (the manager does not wait for jobs).
        touching = sum(s2 == e1 for (_, e1), (s2, _) in zip(slots, slots[1:], strict=False))
        assert touching >= len(slots) // 2, slots
        # The manager served each request once; both jobs were time-sliced.
        assert mgr.m.core.devices["0"].served == 24
        assert all(sum(r.waited_s for r in rs) > 0 for rs in results.values())
    finally:
        mgr.stop()


def test_job_on_another_host_counts_its_grant_from_the_reply(broker, purge):
    mgr = ThreadManager(broker.url)
    try:
        c = client(broker.url, "remote")
        c.host = "elsewhere/not-this-boot"  # as if it ran on another machine: clocks not shared
        c.register()
        assert not c.same_host
        r = c.run(0.05, GiB)
        assert not r.exact and r.scheduled_start is None and r.idle_s == 0.0
        assert r.resumed_at >= r.scheduled_end and r.elapsed_s >= 0.05  # waited the remaining time
        legacy = client(broker.url, "legacy", deadlines=False)  # "done" replies still work
        legacy.register()
        done = legacy.run(0.02, GiB)
        assert done.scheduled_end is None and done.elapsed_s >= 0.02
        legacy.close()
        c.close()
        assert mgr.m.core.devices["0"].served == 2
    finally:
        mgr.stop()


def test_killed_job_granted_slot_is_released_for_a_waiting_job(broker, purge):
    """A job killed (-9) while it waits out a granted 60 s slot: the job queued behind it gets
    the GPU within two lease periods, not after 60 s."""
    # No slicing: the victim's 60 s request is granted at once, then it is killed mid-slot.
    mgr = ThreadManager(broker.url, capacity=16 * GiB, quantum_s=None)
    proc = _spawn_victim(broker.url, "granted-victim", 1 << 30)
    try:
        deadline = time.monotonic() + 10
        core = mgr.m.core
        while time.monotonic() < deadline:
            job = core.jobs.get("granted-victim")
            if job is not None and any(p.get("type") == "granted" for p in list(job.done.values())):
                break
            time.sleep(0.02)
        else:
            pytest.fail("the victim's request was never granted")
        waiter = client(broker.url, "waiter")
        waiter.register()
        box: list = []
        t = threading.Thread(target=lambda: box.append(waiter.run(0.05, GiB)))
        t.start()
        time.sleep(0.2)  # the waiter's request is queued behind the granted 60 s slot
        assert not box and core.devices["0"].pending
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = time.monotonic()
        t.join(2 * LEASE + 5)
        assert box, "the waiter never got the GPU"
        r = box[0]
        assert r.scheduled_start <= killed_at + 2 * LEASE + 0.5  # the victim's slot was cut short
        assert "granted-victim" not in core.jobs and core.expired + core.disconnected >= 1
        assert core.devices["0"].busy_s < 60.0
        waiter.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        mgr.stop()


# ---------------------------------------------------------------------------- hostile jobs and input
