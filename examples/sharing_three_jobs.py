"""Three ResNet-50 training jobs time-sharing one emulated P100 (Salus-style figure).

    python examples/sharing_three_jobs.py --out sharing.png              # ~2-3 minutes
    python examples/sharing_three_jobs.py --spacing 4 --durations 12,6,2 --out quick.png
    python examples/sharing_three_jobs.py --amqp amqp://guest:guest@localhost/ --out sharing.png

Job k starts ``k * spacing`` seconds after the first and trains for a fixed number of iterations
(``--durations``, later jobs shorter); they finish in reverse order. Each iteration asks the
sharing manager for one iteration of GPU time (forward + backward of ResNet-50 at the batch size on
a P100, from the profile database, whose backward column is the rest of a whole training iteration:
loss, zero_grad, backward and the SGD step, see gpemu.costmodel.measured_loop) and blocks until
served. The figure shows each job's throughput over time: alone a job gets the whole GPU, with N
jobs each gets 1/N (round-robin policy).

By default jobs are driven through ``SharingClient`` directly, so this needs only the profile
database (no emulated PyTorch). ``--full`` runs every job as its own Python process training a
PyTorch model on an emulated P100 instead (``gpemu.patch(gpu="P100", sharing=URL,
model="resnet50")``, the model timed as ResNet-50), so the figure comes out of the whole emulator:
requests, memory and waits as a real training script makes them. Without ``--amqp`` a private
RabbitMQ broker is started (needs ``rabbitmq-server`` installed).

    python examples/sharing_three_jobs.py --full --spacing 10 --durations 30,15,5 --out full.png
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class IterationCost(NamedTuple):
    """One ResNet-50 training iteration on a P100, from the profile database."""

    seconds: float
    peak_bytes: int
    persistent_bytes: int


def iteration_cost(batch_size: int) -> IterationCost:
    """The database's forward + backward, which together are the measured loop's whole iteration."""
    from gpemu.config import EmuConfig
    from gpemu.db import open_profile_db

    db = open_profile_db(EmuConfig.from_env())
    seconds = (
        db.lookup("P100", "resnet50", batch_size, "forward").value
        + db.lookup("P100", "resnet50", batch_size, "backward").value
    )
    peak = int(db.lookup("P100", "resnet50", batch_size, "peak_memory").value)
    persistent = int(db.lookup("P100", "resnet50", batch_size, "persistent_memory").value)
    return IterationCost(seconds, peak, persistent)


# One emulated training job (--full): an ordinary PyTorch loop; gpemu makes it run on an emulated
# P100 whose GPU time goes through the sharing manager. Prints the time of every finished iteration.
FULL_JOB = r"""
import sys, time
import torch
import gpemu

url, job_id = sys.argv[1], sys.argv[2]
iterations, start_at, batch = int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
gpemu.patch(gpu="P100", sharing=url, model="resnet50", job_id=job_id, summary=False)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                            torch.nn.Flatten(), torch.nn.Linear(16, 1000)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
while time.monotonic() < start_at:
    time.sleep(0.01)
images, labels = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))  # synthetic data
for _ in range(iterations):
    x, y = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    loss.item()  # wait for the iteration's GPU work, like a script logging its loss
    print("it", time.monotonic(), flush=True)
gpemu.unpatch()
"""


def progress_bar():
    """Iterations done over all jobs, on stderr (the figure and the printed lines stay clean)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def run_full_jobs(
    url: str,
    counts: list[int],
    spacing: float,
    batch_size: int,
    t0: float,
    marks: dict[str, list[float]],
    advance=lambda: None,
) -> None:
    """--full: every job a process training under gpemu.patch(sharing=url); all start at once
    (importing torch takes seconds) and begin training at their start time."""
    import tempfile

    script = Path(tempfile.mkdtemp(prefix="gpemu-sharing-example-")) / "job.py"
    script.write_text(FULL_JOB)
    procs = {}
    for k, n in enumerate(counts):
        name = f"job{k + 1}"
        marks[name] = []
        procs[name] = subprocess.Popen(
            [sys.executable, str(script), url, name, str(n), str(t0 + k * spacing), str(batch_size)],
            stdout=subprocess.PIPE,
            text=True,
        )

    def collect(name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith("it "):
                marks[name].append(float(line.split()[1]) - t0)  # CLOCK_MONOTONIC is system-wide
                advance()
        print(f"{name} finished at {time.monotonic() - t0:.1f} s (exit {proc.wait()})", flush=True)

    readers = [threading.Thread(target=collect, args=item) for item in procs.items()]
    for r in readers:
        r.start()
    for r in readers:
        r.join()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--amqp", help="broker URL (default: start a private broker)")
    ap.add_argument("--spacing", type=float, default=30.0, help="seconds between job starts")
    ap.add_argument(
        "--durations",
        default="90,45,15",
        help="GPU seconds of work of each job (alone it would take this long); with 30 s spacing, "
        "90,45,15 makes them finish in reverse order in ~2.5 minutes",
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--policy", default="round-robin")
    ap.add_argument("--out", default="sharing_three_jobs.png", help="figure path (PNG/PDF)")
    ap.add_argument(
        "--full", action="store_true", help="run each job as a PyTorch training process under gpemu.patch(sharing=...)"
    )
    args = ap.parse_args()
    try:
        args.durations = [float(x) for x in args.durations.split(",")]
    except ValueError:
        ap.error(f"--durations must be comma-separated seconds, got {args.durations!r}")
    return args


def start_manager(url: str, policy: str) -> subprocess.Popen:
    """The sharing manager (``gpemu share-manager``) for one P100, as its own process."""
    code = "import sys; from gpemu.cli import main; sys.exit(main(sys.argv[1:]))"
    argv = ["share-manager", "--amqp", url, "--device", "0=P100", "--policy", policy, "--log-level", "warning"]
    return subprocess.Popen([sys.executable, "-c", code, *argv])


def client_job(
    url: str,
    name: str,
    start_at: float,
    iterations: int,
    cost: IterationCost,
    t0: float,
    times: list[float],
    progress: Progress,
    task: TaskID,
) -> None:
    """One job driven through SharingClient: from ``start_at`` on, ask for one iteration of GPU
    time after another, recording when each was served."""
    from gpemu.integrations.sharing.client import SharingClient

    while time.monotonic() < start_at:
        time.sleep(0.01)
    with SharingClient(url, job_id=name, persistent_bytes=cost.persistent_bytes) as c:
        for _ in range(iterations):
            c.run(cost.seconds, cost.peak_bytes, "iteration")
            times.append(time.monotonic() - t0)
            progress.advance(task)
    progress.console.print(f"{name} finished at {time.monotonic() - t0:.1f} s", highlight=False)


def run_client_jobs(
    url: str,
    counts: list[int],
    spacing: float,
    cost: IterationCost,
    t0: float,
    marks: dict[str, list[float]],
    progress: Progress,
    task: TaskID,
) -> None:
    """Every job a thread driving SharingClient (the default: no emulated PyTorch needed)."""
    threads = []
    for k, n in enumerate(counts):
        name = f"job{k + 1}"
        marks[name] = []
        job_args = (url, name, t0 + k * spacing, n, cost, t0, marks[name], progress, task)
        threads.append(threading.Thread(target=client_job, args=job_args, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)  # a timed join lets Ctrl-C through


def throughput(ts: list[float], end: float, batch_size: int, window: float = 2.0) -> tuple[list[float], list[float]]:
    """A job's images/s in windows of ``window`` seconds, from the times its iterations ended.

    Each iteration is spread over the time between its end and the previous one's (the first,
    whose start is unknown, is left out): counting whole iteration ends per window swung by one
    iteration (+-8% at 163 ms a window of 2 s) and drew a job above "alone"."""
    spans = [(a, b) for a, b in zip(ts, ts[1:], strict=False) if b > a]
    xs, ys = [], []
    t = 0.0
    while t < end:
        n = sum(max(0.0, min(b, t + window) - max(a, t)) / (b - a) for a, b in spans)
        xs.append(t + window / 2)
        ys.append(n * batch_size / window)
        t += window
    return xs, ys


def plot(marks: dict[str, list[float]], args: argparse.Namespace, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    end = max(ts[-1] for ts in marks.values())
    for name, ts in marks.items():
        ax.plot(*throughput(ts, end, args.batch_size), label=name)
    ax.axhline(args.batch_size / seconds, color="grey", ls=":", lw=1, label="alone")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("throughput (images/s)")
    how = "emulated PyTorch jobs" if args.full else "ResNet-50 jobs"
    ax.set_title(f"{len(marks)} {how} sharing one emulated P100 ({args.policy})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the data, not on it
    fig.tight_layout()
    fig.savefig(args.out, dpi=150)


def main() -> None:
    args = parse_args()
    cost = iteration_cost(args.batch_size)
    counts = [max(1, int(d / cost.seconds)) for d in args.durations]
    print(f"ResNet-50 bs{args.batch_size} on P100: {cost.seconds * 1e3:.1f} ms/iteration, iterations per job: {counts}")

    broker = None
    url = args.amqp
    if url is None:
        from gpemu.integrations.sharing.broker import RabbitBroker

        broker = RabbitBroker.start()
        url = broker.url
    manager = start_manager(url, args.policy)
    marks: dict[str, list[float]] = {}
    t0 = time.monotonic() + (20.0 if args.full else 2.0)  # --full: time for the processes to start
    progress = progress_bar()
    task = progress.add_task("iterations of all jobs", total=sum(counts))

    def advance() -> None:
        progress.advance(task)

    try:
        with progress:
            if args.full:
                run_full_jobs(url, counts, args.spacing, args.batch_size, t0, marks, advance)
            else:
                run_client_jobs(url, counts, args.spacing, cost, t0, marks, progress, task)
    finally:
        manager.terminate()
        manager.wait(10)
        if broker is not None:
            broker.stop()

    if not all(marks.values()):
        sys.exit(f"a job recorded no iterations: {', '.join(n for n, ts in marks.items() if not ts)}")
    plot(marks, args, cost.seconds)
    print(f"figure written to {args.out}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
