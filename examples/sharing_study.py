"""A GPU-sharing study: 40 training jobs arrive at one emulated V100 and share it through the
sharing manager, either in equal shares (round-robin) or least attained service first (a job that
has had the least GPU time goes next, newcomers first, as Tiresias does). Which gives the shorter
job completion times? An hour of GPU work, so in real time an hour per policy; on virtual time
about a minute.

    python examples/sharing_study.py                                  # 40 jobs, both policies
    python examples/sharing_study.py --policies round-robin --jobs 10 # one policy, fewer jobs
    python examples/sharing_study.py --clock real --scale 0.05        # the same study in real time, 20x shorter

Every job is a ResNet-50 training loop at batch 32 on the V100 (an iteration's GPU time from the
profile database), with a few milliseconds of host work between iterations (its input
pipeline). Jobs arrive at random times (a Poisson process) with random lengths (log-normal, a
few short jobs and some long ones, as in cluster traces); the same seed gives the same jobs.
Each job drives a ``SharingClient`` from a thread of this process, so the study needs the profile
database and a RabbitMQ broker (started privately unless ``--amqp``), not PyTorch.

On virtual time (``--clock virtual``, the default) the manager is ``gpemu share-manager --clock
virtual --jobs N`` and every job runs on its own virtual clock (``SharingClient(clock="virtual")``):
a job arrives at its virtual arrival time, its host work advances its clock instead of sleeping,
and the manager decides each slot once no job can still ask for an earlier one, so the schedule
is the one real time gives, at the speed of the messages (docs/sharing.md, "Virtual time").
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpemu.integrations.sharing.policies import JobView, PendingView, Policy

GPU, MODEL, BATCH = "V100", "resnet50", 32
POLICIES = {"round-robin": "round-robin", "least-attained": "sharing_study:LeastAttained"}


class LeastAttained(Policy):
    """Least attained service: the waiting job that has had the least GPU time goes next, and a
    job that arrives starts at none (the manager loads it by name: ``sharing_study:LeastAttained``)."""

    name = "least-attained"

    def pick(self, pending: Sequence[PendingView], jobs: Mapping[str, JobView]) -> PendingView:
        return min(pending, key=lambda r: (jobs[r.job_id].served_s, r.seq))


@dataclass
class Job:
    name: str
    arrival: float  # seconds after the study starts
    iterations: int
    finish: float | None = None  # seconds after the study starts

    @property
    def completion(self) -> float:
        assert self.finish is not None
        return self.finish - self.arrival


@dataclass
class Study:
    """One run of the study: its jobs and how long it took for real."""

    policy: str
    clock: str
    jobs: list[Job] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def makespan(self) -> float:
        return max(j.finish or 0.0 for j in self.jobs)


def iteration_seconds() -> float:
    """One ResNet-50 training iteration on the V100 (the database's forward + backward)."""
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db

    db = open_profile_db(EmuConfig.from_env())
    return db.lookup(GPU, MODEL, BATCH, "forward").value + db.lookup(GPU, MODEL, BATCH, "backward").value


def make_jobs(count: int, seed: int, mean_gap_s: float, mean_gpu_s: float, iteration_s: float) -> list[Job]:
    """``count`` jobs: Poisson arrivals ``mean_gap_s`` apart on average, log-normal GPU work of
    ``mean_gpu_s`` on average (sigma 1: the longest ~10x the median)."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    mu = math.log(mean_gpu_s) - 0.5  # a log-normal's mean is exp(mu + sigma^2 / 2)
    for k in range(count):
        gpu_s = min(rng.lognormvariate(mu, 1.0), 8 * mean_gpu_s)
        jobs.append(Job(f"job{k:02d}", t, max(1, round(gpu_s / iteration_s))))
        t += rng.expovariate(1.0 / mean_gap_s)
    return jobs


def start_manager(url: str, policy: str, clock: str, jobs: int) -> subprocess.Popen:
    """``gpemu share-manager`` for one V100 (it finds this file's policy: examples/ on its path)."""
    import os

    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    spec = POLICIES.get(policy, policy)
    argv = ["share-manager", "--amqp", url, "--device", f"0={GPU}", "--policy", spec, "--log-level", "warning"]
    argv += ["--clock", clock] + (["--jobs", str(jobs)] if clock == "virtual" else [])
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-c", code, *argv], env={**os.environ, "PYTHONPATH": path})


def run_job(url: str, job: Job, clock: str, iteration_s: float, host_s: float, t0: float) -> None:
    """One job: arrive, then one iteration after another (its host work, then its GPU work)."""
    from gpemu.integrations.sharing.client import SharingClient

    virtual = clock == "virtual"
    if not virtual:
        while time.monotonic() < t0 + job.arrival:
            time.sleep(min(0.05, max(0.0, t0 + job.arrival - time.monotonic())))
    with SharingClient(url, job_id=job.name, clock=clock, vtime=job.arrival, lease_s=30.0) as c:
        for _ in range(job.iterations):
            if virtual:
                c.advance(host_s)
            else:
                time.sleep(host_s)
            c.run(iteration_s, 4 << 30, "iteration")
        job.finish = c.vtime if virtual else time.monotonic() - t0


def run_study(url: str, policy: str, clock: str, jobs: list[Job], iteration_s: float, host_s: float) -> Study:
    """All jobs through one manager; returns them with their finish times."""
    jobs = [Job(j.name, j.arrival, j.iterations) for j in jobs]
    manager = start_manager(url, policy, clock, len(jobs))
    time.sleep(3.0)  # the manager's start (it imports gpemu's command line)
    t0 = time.monotonic() + 1.0
    started = time.monotonic()
    threads = [
        threading.Thread(target=run_job, args=(url, j, clock, iteration_s, host_s, t0), daemon=True) for j in jobs
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # a timed join lets Ctrl-C through
    finally:
        manager.terminate()
        manager.wait(10)
    unfinished = [j.name for j in jobs if j.finish is None]
    if unfinished:
        sys.exit(f"jobs did not finish: {', '.join(unfinished)}")
    return Study(policy, clock, jobs, time.monotonic() - started)


def report(study: Study) -> None:
    times = [j.completion for j in study.jobs]
    p90 = statistics.quantiles(times, n=10)[-1] if len(times) > 1 else times[0]
    print(
        f"{study.policy:<12} completion time mean {statistics.mean(times):7.1f} s, median "
        f"{statistics.median(times):7.1f} s, p90 {p90:7.1f} s; makespan {study.makespan:7.1f} s "
        f"({study.clock} time, {study.wall_s:.1f} s of real time, {study.makespan / study.wall_s:.0f}x)",
        flush=True,
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument(
        "--policies",
        default="round-robin,least-attained",
        help="comma separated: round-robin, least-attained, or any `gpemu share-manager --policy`",
    )
    ap.add_argument("--clock", choices=("virtual", "real"), default="virtual")
    ap.add_argument("--mean-gap", type=float, default=110.0, help="mean seconds between arrivals (load ~0.8)")
    ap.add_argument("--mean-work", type=float, default=90.0, help="mean GPU seconds of a job")
    ap.add_argument("--host-ms", type=float, default=5.0, help="host work between iterations (ms)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply arrivals and job lengths (shorter runs)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--amqp", help="broker URL (default: start a private broker)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    iteration_s = iteration_seconds()
    jobs = make_jobs(args.jobs, args.seed, args.mean_gap * args.scale, args.mean_work * args.scale, iteration_s)
    work = sum(j.iterations for j in jobs) * iteration_s
    print(
        f"{len(jobs)} ResNet-50 jobs (batch {BATCH}, {iteration_s * 1e3:.1f} ms/iteration on the {GPU}), "
        f"{work / 60:.1f} min of GPU work, arriving over {jobs[-1].arrival / 60:.1f} min",
        flush=True,
    )
    broker, url = None, args.amqp
    if url is None:
        from gpemu.integrations.sharing.broker import RabbitBroker

        broker = RabbitBroker.start()
        url = broker.url
    try:
        for policy in args.policies.split(","):
            report(run_study(url, policy.strip(), args.clock, jobs, iteration_s, args.host_ms / 1e3))
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
