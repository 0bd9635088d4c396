"""End-of-run output (gpemu.run_outputs): written on SIGTERM/SIGHUP too, quiet where nothing ran,
one block per rank with every line marked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import gpemu
from gpemu import run_outputs
from gpemu.clock import VirtualClock

# The console entry point as a user runs it (`gpemu ...`), with this interpreter.
GPEMU = [sys.executable, "-c", "import sys; from gpemu.cli import main; sys.exit(main())"]

LONG_SCRIPT = textwrap.dedent("""
    import time, torch
    model = torch.nn.Linear(64, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(32, 64).cuda()).sum()
        opt.zero_grad(); loss.backward(); opt.step(); loss.item()
    print("ready", flush=True)
    time.sleep(120)                       # a long training run, stopped from outside
""")


@pytest.mark.subprocess
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_stop_signal_still_writes_summary_metrics_and_trace(signame, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LONG_SCRIPT)
    metrics, trace = tmp_path / "m.json", tmp_path / "t.json"
    sig = getattr(signal, signame)
    # The behaviour under test is for a program whose action for the signal is the default: the
    # child starts so whatever this test process inherited (a launcher that ignores or blocks
    # SIGHUP, e.g. nohup) - gpemu rightly leaves an ignored signal alone.
    parent = (signal.getsignal(sig), signal.pthread_sigmask(signal.SIG_BLOCK, []))

    def default_action() -> None:
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])

    proc = subprocess.Popen(
        [*GPEMU, "run", "--gpu", "V100", "--metrics", str(metrics), "--trace", str(trace), "--", "python", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_action,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"  # `gpemu run` exec'd: this pid is the script
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(
                f"{signame} did not stop the run in 60 s (this process: handler {parent[0]}, "
                f"blocked {sorted(parent[1])}); its stderr:\n{err[-3000:]}"
            )
    finally:
        proc.kill()
    assert proc.returncode == -sig, err  # still dies of the signal, as without gpemu
    assert "gpemu summary: 1 emulated GPU(s)" in err and "3 iteration(s)" in err
    assert json.loads(metrics.read_text())["iterations"] == 3
    assert json.loads(trace.read_text())["otherData"]["format"] == "gpemu-trace/1"


def test_stop_handlers_leave_the_programs_own_and_are_restored() -> None:
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    own = lambda signum, frame: None  # noqa: E731
    previous_hup = signal.signal(signal.SIGHUP, own)
    try:
        gpemu.patch(gpu="V100", summary=False, clock=VirtualClock())
        assert callable(signal.getsignal(signal.SIGTERM))  # gpemu's: default action was kill
        assert signal.getsignal(signal.SIGHUP) is own  # the program's own: untouched
        gpemu.unpatch()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) is own
    finally:
        gpemu.unpatch()
        signal.signal(signal.SIGHUP, previous_hup)


def test_no_work_line_only_after_the_gpu_was_used(capsys) -> None:
    rt = gpemu.patch(gpu="V100", clock=VirtualClock())
    try:
        assert run_outputs.finish(rt) is None
        assert "no emulated GPU work" not in capsys.readouterr().err  # never touched the GPU
        torch.cuda.init()
        assert run_outputs.finish(rt) is None
        assert "no emulated GPU work was recorded" in capsys.readouterr().err
    finally:
        gpemu.unpatch()


def test_a_rank_prints_one_block_of_marked_lines_for_its_own_gpu(monkeypatch, capsys) -> None:
    rt = gpemu.patch(gpu="V100", num_gpus=2, clock=VirtualClock())
    try:
        rt.engine.default_stream(1).enqueue(0.01, "forward", "net")
        monkeypatch.setattr(run_outputs, "_rank", lambda: 1)
        s = run_outputs.finish(rt)
    finally:
        gpemu.unpatch()
    err = capsys.readouterr().err
    lines = err.rstrip("\n").split("\n")
    assert s["rank"] == 1 and len(lines) > 5
    assert all(line.startswith("[rank 1] ") for line in lines), err
    assert "GPU 1 (Tesla V100-PCIE-32GB)" in err and "GPU 0 (" not in err  # the idle GPU is the other rank's
    assert "1 of 2 emulated GPU(s)" in err
    assert "placeholders" not in err  # said once, by rank 0


SPAWN_SCRIPT = textwrap.dedent("""
    import torch, torch.multiprocessing as mp

    def work(i):
        x = torch.zeros(256, 256 * (i + 1), device="cuda")
        (x.T @ x).sum().item()

    if __name__ == "__main__":
        mp.spawn(work, nprocs=2, join=True)
        work(2)
""")


@pytest.mark.subprocess
def test_spawned_children_write_files_of_their_own(tmp_path: Path) -> None:
    """mp.spawn children have no rank: each writes its own metrics and trace (numbered as
    multiprocessing numbers them), and marks its summary lines; the script's own are unchanged."""
    script = tmp_path / "spawn.py"
    script.write_text(SPAWN_SCRIPT)
    metrics, trace = tmp_path / "m.json", tmp_path / "t.json"
    proc = subprocess.run(
        [*GPEMU, "run", "--gpu", "A100", "--metrics", str(metrics), "--trace", str(trace), "--", "python", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    written = {p.name for p in tmp_path.glob("*.json")}
    assert written == {"m.json", "m.proc1.json", "m.proc2.json", "t.json", "t.proc1.json", "t.proc2.json"}
    runs = {name: json.loads((tmp_path / name).read_text()) for name in ("m.json", "m.proc1.json", "m.proc2.json")}
    assert runs["m.json"].get("process") is None and {
        runs["m.proc1.json"]["process"],
        runs["m.proc2.json"]["process"],
    } == {"1", "2"}
    busy = {name: r["devices"][0]["whole"]["busy_s"] for name, r in runs.items()}
    assert len(set(busy.values())) == 3, busy  # three processes' own work (their matrices differ)
    assert "[proc 1] gpemu summary" in proc.stderr and "[proc 2] gpemu summary" in proc.stderr


@pytest.mark.subprocess
def test_a_script_that_never_ran_gets_no_gpemu_line(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("def f(:\n")
    started = time.monotonic()
    proc = subprocess.run(
        [*GPEMU, "run", "--gpu", "V100", "--", "python", str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "SyntaxError" in proc.stderr
    assert "no emulated GPU work" not in proc.stderr, proc.stderr
    assert time.monotonic() - started < 120


@pytest.mark.subprocess
def test_errors_are_one_line_in_logs() -> None:
    """Not a terminal (a log file, a pipe): rich must not hard-wrap the message at 80 columns."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "COLUMNS"}
    proc = subprocess.run(
        [*GPEMU, "run", "--gpu", "V1OO", "--", "python", "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) > 80, proc.stderr
    assert lines[0].startswith("error: unknown GPU 'V1OO'") and "valid gpus:" in lines[0].lower()


SMALL_SCRIPT = textwrap.dedent("""
    import torch
    model = torch.nn.Linear(64, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(32, 64).cuda()).sum()
        opt.zero_grad(); loss.backward(); opt.step(); loss.item()
    print("script done", flush=True)
""")


@pytest.mark.subprocess
def test_an_unwritable_output_path_is_one_line_at_start(tmp_path: Path) -> None:
    """A --metrics path no file can be created at fails `gpemu run` before the script runs,
    naming the path, instead of costing the summary at the end of the run."""
    script = tmp_path / "train.py"
    script.write_text(SMALL_SCRIPT)
    proc = subprocess.run(
        [*GPEMU, "run", "--metrics", "/proc/self/gpemu/m.json", "--", "python", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "script done" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "/proc/self/gpemu/m.json" in lines[-1] and "cannot write there" in lines[-1]


@pytest.mark.subprocess
def test_outputs_that_fail_to_write_keep_the_summary_and_leave_no_temp_files(tmp_path: Path) -> None:
    """A disk that fills up during the run (here: a 200-byte file size limit): the script's output
    and exit status are kept, the summary is printed, each failed file is one line with its path,
    and no temporary file stays behind."""
    import resource

    script = tmp_path / "train.py"
    script.write_text(SMALL_SCRIPT)
    out = tmp_path / "out"

    def full_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))

    proc = subprocess.run(
        [*GPEMU, "run", "--metrics", str(out / "m.json"), "--trace", str(out / "t.json"), "--", "python", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=full_disk,
    )
    assert proc.returncode == 0 and "script done" in proc.stdout, proc.stderr[-2000:]
    assert "gpemu summary:" in proc.stderr
    assert f"could not write the metrics to {out / 'm.json'}: File too large" in proc.stderr
    assert f"could not write the trace to {out / 't.json'}: File too large" in proc.stderr
    assert list(out.iterdir()) == []


@pytest.mark.subprocess
def test_report_plot_to_an_unwritable_path_is_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    script = tmp_path / "train.py"
    script.write_text(SMALL_SCRIPT)
    made = subprocess.run(
        [*GPEMU, "run", "--trace", str(trace), "--", "python", str(script)], capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stderr[-2000:]
    proc = subprocess.run(
        [*GPEMU, "report", str(trace), "--plot", "/proc/self/x/fig.png"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "cannot write the figure to /proc/self/x/fig.png" in proc.stderr
