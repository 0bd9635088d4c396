"""Latency the sharing manager adds to each GPU-time request, at 1, 4 and 16 concurrent jobs.

    python benchmarks/sharing_latency.py                       # starts a private loopback broker
    python benchmarks/sharing_latency.py --amqp URL            # or use a running one
    python benchmarks/sharing_latency.py --jobs 1,4,16 --requests 300 --seconds 0.002
    python benchmarks/sharing_latency.py --mode threads        # N connections in one process
    python benchmarks/sharing_latency.py --legacy              # "reply when done" (before deadlines)
    python benchmarks/sharing_latency.py --lookahead 0 --backdate 0   # manager options

All jobs share one emuGPU through a manager process (`gpemu share-manager`, round-robin).
``--mode processes`` (default) runs every job as its own process, like real jobs; ``--mode
threads`` runs the N jobs as N connections (threads) of one process, which takes N-1 Python
processes out of the competition for the CPU (one client process, the manager, the broker).

Added latency of one request (``added``, the figure the target is about) = the extra time the
job spends compared with a manager with no latency that follows the same schedule:

    (when run() returned) - (the request's scheduled end on the emuGPU's timeline)
    + (time the emuGPU sat idle because this request was still travelling to the manager:
       GPU free, request sent but not yet arrived; the manager measures it from the send time)

Job and manager run on this host, so the end and the send time are on one CLOCK_MONOTONIC and
both terms are exact. Sharing itself (queueing behind other jobs' slots) is not in it. With
``--legacy`` (reply "done" when the work has ended, no grant) there is no scheduled end on the
job's side and ``added`` is the old figure only.

The old figure (``old``, printed alongside for comparison) = wall time from sending a request to
run() returning, minus the GPU time it asked for, minus the time the manager reports it queued
behind other jobs. It also counts the request's trip to the manager when the emuGPU was busy
with other jobs meanwhile (then the trip cost nothing), so it is never below ``added`` by more
than clock noise.

``gpu busy`` = GPU seconds served / wall time of the measured stretch: with 16 jobs the
timeline should be back to back (close to 100 %); with one job the gap is the job's own time
between requests (plus messaging with --legacy or --backdate 0).

Prints p50/p99 per job count, the mode, and the machine's load average before and after (the
overhead is mostly waiting for the CPU on a busy machine). Target: p99 <= 1 ms at 16 jobs on a
loopback broker.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time


def job(
    url: str,
    name: str,
    requests: int,
    seconds: float,
    start_at: float,
    legacy: bool,
    spin: float | None,
    out: mp.Queue | queue.Queue,
) -> None:
    from gpemu.integrations.sharing.client import SharingClient

    if spin is not None:
        SharingClient.SPIN_MARGIN_S = spin

    with SharingClient(url, job_id=name, lease_s=10.0, deadlines=not legacy) as c:
        c.run(seconds)  # warm-up (connection, first-use costs)
        while time.time() < start_at:
            time.sleep(0.001)
        rows = []
        t0 = time.monotonic()
        for _ in range(requests):
            r = c.run(seconds)
            if not legacy:
                assert r.exact, "job and manager share this host: the grant's end must be exact"
            parts = None
            if r.granted_at is not None:
                # Where added time comes from: the grant reached the job after the slot ended;
                # the job woke up late from its local wait; the emuGPU idled while it travelled.
                parts = (
                    max(0.0, r.granted_at - r.scheduled_end),
                    max(0.0, r.resumed_at - max(r.scheduled_end, r.granted_at)),
                    r.idle_s,
                )
            rows.append((r.added_s, r.elapsed_s - r.seconds - r.waited_s, parts))
        t1 = time.monotonic()
    out.put((rows, t0, t1))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amqp", help="broker URL (default: start a private broker)")
    ap.add_argument("--jobs", default="1,4,16", help="comma-separated concurrent job counts")
    ap.add_argument("--requests", type=int, default=200, help="requests per job")
    ap.add_argument("--seconds", type=float, default=0.002, help="GPU time per request")
    ap.add_argument(
        "--mode",
        choices=["processes", "threads"],
        default="processes",
        help="each job its own process, or all jobs as connections of one process",
    )
    ap.add_argument(
        "--legacy",
        action="store_true",
        help="clients ask for a 'done' reply when the work has ended (no grants, no local wait)",
    )
    ap.add_argument("--lookahead", type=float, default=None, help="manager --lookahead (seconds)")
    ap.add_argument("--backdate", type=float, default=None, help="manager --backdate (seconds)")
    ap.add_argument(
        "--client-spin",
        type=float,
        default=None,
        help="jobs spin this long before a slot's end after sleeping (SharingClient.SPIN_MARGIN_S)",
    )
    return ap.parse_args()


def _start_manager(url: str, extra: list[str]) -> subprocess.Popen:
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [sys.executable, "-c", code, "share-manager", "--amqp", url, "--device", "0=V100:32GiB"]
        + ["--policy", "round-robin", "--log-level", "warning", *extra]
    )


def _ms(xs: list[float], q: float | None) -> str:
    if not xs:
        return "n/a"
    return f"{(percentile(xs, q) if q is not None else sum(xs) / len(xs)) * 1e3:.3f}"


def _run_jobs(args: argparse.Namespace, url: str, n: int) -> list:
    """``n`` concurrent jobs (processes or threads), started together; their results."""
    ctx = mp.get_context("spawn")
    start_at = time.time() + 3.0 + 0.3 * n
    jobs_args = [
        (url, f"bench-{n}-{i}", args.requests, args.seconds, start_at, args.legacy, args.client_spin) for i in range(n)
    ]
    if args.mode == "processes":
        out: mp.Queue | queue.Queue = ctx.Queue()
        workers: list = [ctx.Process(target=job, args=(*a, out)) for a in jobs_args]
    else:
        out = queue.Queue()
        workers = [threading.Thread(target=job, args=(*a, out)) for a in jobs_args]
    for w in workers:
        w.start()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    return results


def _print_row(args: argparse.Namespace, n: int, results: list) -> None:
    rows = [row for rs, _, _ in results for row in rs]
    old = [o for _, o, _ in rows]
    added = [a for a, _, _ in rows if a is not None]
    parts = [p for _, _, p in rows if p is not None]
    # Jobs start their measured requests together (start_at); from the first start to the
    # last finish the emuGPU served len(rows) * seconds.
    span = max(t1 for _, _, t1 in results) - min(t0 for _, t0, _ in results)
    busy = f"{100 * len(rows) * args.seconds / span:8.1f}%"
    split = (
        f"        {_ms([p[0] for p in parts], 0.99)} / {_ms([p[1] for p in parts], 0.99)} / "
        f"{_ms([p[2] for p in parts], 0.99)}, {100 * sum(p[0] > 0 for p in parts) / len(parts):.1f}%"
        if parts
        else ""
    )
    print(
        f"{n:>5} {args.mode:>10} {len(rows):>9} {_ms(added, 0.5):>10} {_ms(added, 0.99):>10} "
        f"{_ms(added, None):>7} {_ms(old, 0.5):>8} {_ms(old, 0.99):>8} {_ms(old, None):>9} {busy:>9}" + split,
        flush=True,
    )


def main() -> None:
    args = _arguments()
    broker = None
    url = args.amqp
    if url is None:
        from gpemu.integrations.sharing.broker import RabbitBroker

        broker = RabbitBroker.start()
        url = broker.url
    extra = []
    if args.lookahead is not None:
        extra += ["--lookahead", str(args.lookahead)]
    if args.backdate is not None:
        extra += ["--backdate", str(args.backdate)]
    manager = _start_manager(url, extra)
    try:
        time.sleep(2.0)
        print(
            f"# {os.cpu_count()} CPUs, load average {load()} (1/5/15 min) at start; {args.requests} requests/job "
            f"of {args.seconds * 1e3:g} ms GPU time, one shared emuGPU, loopback broker; "
            f"jobs as {'one process each' if args.mode == 'processes' else 'connections of one process'}; "
            f"{'legacy done replies' if args.legacy else 'deadline grants'}; manager options {extra or 'default'}"
            + (f"; client spin {args.client_spin * 1e3:g} ms" if args.client_spin is not None else "")
        )
        print(
            f"{'jobs':>5} {'mode':>10} {'requests':>9} {'added p50':>10} {'added p99':>10} {'mean':>7} "
            f"{'old p50':>8} {'old p99':>8} {'old mean':>9} {'gpu busy':>9}   (ms)   "
            f"p99 of: grant late / wake late / idle (ms), % grants late"
        )
        for n in [int(x) for x in args.jobs.split(",")]:
            _print_row(args, n, _run_jobs(args, url, n))
        print(f"# load average {load()} at the end")
    finally:
        manager.terminate()
        manager.wait(10)
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()
