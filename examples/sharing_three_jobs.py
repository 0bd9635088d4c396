"""Three ResNet-50 training jobs time-sharing one emulated P100 (Salus-style figure).

    python examples/sharing_three_jobs.py --out sharing.png              # ~2-3 minutes
    python examples/sharing_three_jobs.py --spacing 4 --durations 12,6,2 --out quick.png
    python examples/sharing_three_jobs.py --amqp amqp://guest:guest@localhost/ --out sharing.png

Job k starts ``k * spacing`` seconds after the first and trains for a fixed number of
iterations (``--durations``, later jobs shorter); they finish in reverse order. Each iteration asks the sharing manager for one
iteration of GPU time (forward + backward of ResNet-50 at the batch size on a P100, from the
profile database) and blocks until served. The figure shows each job's throughput over time:
alone a job gets the whole GPU, with N jobs each gets 1/N (round-robin policy).

Jobs are driven through ``SharingClient`` directly, so this needs only the profile database
(no emulated PyTorch). Without ``--amqp`` a private RabbitMQ broker is started (needs
``rabbitmq-server`` installed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path


def iteration_cost(batch_size: int) -> tuple[float, int, int]:
    """(seconds, peak bytes, persistent bytes) of one ResNet-50 iteration on a P100."""
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db

    db = open_profile_db(EmuConfig.from_env())
    seconds = (db.lookup("P100", "resnet50", batch_size, "forward").value
               + db.lookup("P100", "resnet50", batch_size, "backward").value)
    peak = int(db.lookup("P100", "resnet50", batch_size, "peak_memory").value)
    persistent = int(db.lookup("P100", "resnet50", batch_size, "persistent_memory").value)
    return seconds, peak, persistent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amqp", help="broker URL (default: start a private broker)")
    ap.add_argument("--spacing", type=float, default=30.0, help="seconds between job starts")
    ap.add_argument("--durations", default="90,45,15",
                    help="GPU seconds of work of each job (alone it would take this long); with 30 s spacing, "
                         "90,45,15 makes them finish in reverse order in ~2.5 minutes")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--policy", default="round-robin")
    ap.add_argument("--out", default="sharing_three_jobs.png", help="figure path (PNG/PDF)")
    args = ap.parse_args()

    from gpemu.integrations.sharing.client import SharingClient

    seconds, peak, persistent = iteration_cost(args.batch_size)
    try:
        durations = [float(x) for x in args.durations.split(",")]
    except ValueError:
        ap.error(f"--durations must be comma-separated seconds, got {args.durations!r}")
    counts = [max(1, int(d / seconds)) for d in durations]
    print(f"ResNet-50 bs{args.batch_size} on P100: {seconds * 1e3:.1f} ms/iteration, iterations per job: {counts}")

    broker = None
    url = args.amqp
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from rabbitmq_broker import RabbitBroker

        broker = RabbitBroker.start()
        url = broker.url
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    manager = subprocess.Popen([sys.executable, "-c", code, "share-manager", "--amqp", url, "--device", "0=P100",
                                "--policy", args.policy, "--log-level", "warning"])
    marks: dict[str, list[float]] = {}
    t0 = time.monotonic() + 2.0

    def job(k: int) -> None:
        name = f"job{k + 1}"
        times = marks.setdefault(name, [])
        while time.monotonic() < t0 + k * args.spacing:
            time.sleep(0.01)
        with SharingClient(url, job_id=name, persistent_bytes=persistent) as c:
            for _ in range(counts[k]):
                c.run(seconds, peak, "iteration")
                times.append(time.monotonic() - t0)
        print(f"{name} finished at {time.monotonic() - t0:.1f} s", flush=True)

    try:
        threads = [threading.Thread(target=job, args=(k,)) for k in range(len(counts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        manager.terminate()
        manager.wait(10)
        if broker is not None:
            broker.stop()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    window = 2.0
    end = max(ts[-1] for ts in marks.values())
    for name, ts in marks.items():
        xs, ys = [], []
        t = 0.0
        while t < end:
            n = sum(1 for x in ts if t <= x < t + window)
            xs.append(t + window / 2)
            ys.append(n * args.batch_size / window)
            t += window
        ax.plot(xs, ys, label=name)
    ax.axhline(args.batch_size / seconds, color="grey", ls=":", lw=1, label="alone")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("throughput (images/s)")
    ax.set_title(f"3 ResNet-50 jobs sharing one emulated P100 ({args.policy})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=150)
    print(f"figure written to {args.out}")


if __name__ == "__main__":
    main()
