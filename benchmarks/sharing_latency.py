"""Latency the sharing manager adds to each GPU-time request, at 1, 4 and 16 concurrent jobs.

    python benchmarks/sharing_latency.py                       # starts a private loopback broker
    python benchmarks/sharing_latency.py --amqp URL            # or use a running one
    python benchmarks/sharing_latency.py --jobs 1,4,16 --requests 300 --seconds 0.002
    python benchmarks/sharing_latency.py --mode threads        # N connections in one process

All jobs share one emuGPU through a manager process (`gpemu share-manager`, round-robin).
``--mode processes`` (default) runs every job as its own process, like real jobs; ``--mode
threads`` runs the N jobs as N connections (threads) of one process, which takes N-1 Python
processes out of the competition for the CPU (one client process, the manager, the broker).

Added latency of one request = wall time from sending it to its reply, minus the GPU time it
asked for, minus the time the manager kept it queued behind other jobs' work (which the manager
reports). So it is the messaging + scheduling overhead, not sharing itself. Prints p50/p99 per
job count, the mode, and the machine's load average before and after (the overhead is mostly
waiting for the CPU on a busy machine). Target: p99 <= 1 ms at 16 jobs on a loopback broker.
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


def job(url: str, name: str, requests: int, seconds: float, start_at: float, out: "mp.Queue | queue.Queue") -> None:
    from gpemu.integrations.sharing.client import SharingClient

    with SharingClient(url, job_id=name, lease_s=10.0) as c:
        c.run(seconds)  # warm-up (connection, first-use costs)
        while time.time() < start_at:
            time.sleep(0.001)
        added = []
        for _ in range(requests):
            r = c.run(seconds)
            added.append(r.elapsed_s - r.seconds - r.waited_s)
    out.put(added)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amqp", help="broker URL (default: start a private broker)")
    ap.add_argument("--jobs", default="1,4,16", help="comma-separated concurrent job counts")
    ap.add_argument("--requests", type=int, default=200, help="requests per job")
    ap.add_argument("--seconds", type=float, default=0.002, help="GPU time per request")
    ap.add_argument("--mode", choices=["processes", "threads"], default="processes",
                    help="each job its own process, or all jobs as connections of one process")
    args = ap.parse_args()

    broker = None
    url = args.amqp
    if url is None:
        from gpemu.integrations.sharing.broker import RabbitBroker

        broker = RabbitBroker.start()
        url = broker.url
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    manager = subprocess.Popen([sys.executable, "-c", code, "share-manager", "--amqp", url, "--device",
                                "0=V100:32GiB", "--policy", "round-robin", "--log-level", "warning"])
    ctx = mp.get_context("spawn")
    try:
        time.sleep(2.0)
        print(f"# {os.cpu_count()} CPUs, load average {load()} (1/5/15 min) at start; {args.requests} requests/job "
              f"of {args.seconds * 1e3:g} ms GPU time, one shared emuGPU, loopback broker; "
              f"jobs as {'one process each' if args.mode == 'processes' else 'connections of one process'}")
        print(f"{'jobs':>5} {'mode':>10} {'requests':>9} {'p50 added (ms)':>15} {'p99 added (ms)':>15} {'mean (ms)':>10}")
        for n in [int(x) for x in args.jobs.split(",")]:
            start_at = time.time() + 3.0 + 0.3 * n
            jobs_args = [(url, f"bench-{n}-{i}", args.requests, args.seconds, start_at) for i in range(n)]
            if args.mode == "processes":
                out: "mp.Queue | queue.Queue" = ctx.Queue()
                workers = [ctx.Process(target=job, args=(*a, out)) for a in jobs_args]
            else:
                out = queue.Queue()
                workers = [threading.Thread(target=job, args=(*a, out)) for a in jobs_args]
            for w in workers:
                w.start()
            added = [x for _ in workers for x in out.get(timeout=600)]
            for w in workers:
                w.join()
            print(f"{n:>5} {args.mode:>10} {len(added):>9} {percentile(added, 0.5) * 1e3:>15.3f} "
                  f"{percentile(added, 0.99) * 1e3:>15.3f} {sum(added) / len(added) * 1e3:>10.3f}", flush=True)
        print(f"# load average {load()} at the end")
    finally:
        manager.terminate()
        manager.wait(10)
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()
