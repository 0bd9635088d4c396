"""What a run leaves behind when it ends (component ``gpemu.run_outputs``).

At interpreter exit (``gpemu.unpatch()`` unregisters it), the run's summary is printed
(``config.summary``), written as JSON (``config.metrics_path``) and its Chrome trace written
(``config.trace_path``). Ranks of a multi-process job write their own files
(``metrics.rank3.json``) and prefix every line of their summary with ``[rank N]``. Summaries are
computed by :mod:`gpemu.observe`, traces written by :mod:`gpemu.trace`.

A process stopped by SIGTERM or SIGHUP (Kubernetes stops a pod with SIGTERM) never reaches
``atexit``: while those signals would kill the process (their default action), a handler installed
at patch time writes the outputs first and then lets the signal kill the process as before (same
exit status). A handler the program installs itself, before or after, is left alone (the program
then exits its own way and ``atexit`` writes the outputs). ``gpemu.unpatch()`` restores the
previous disposition.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .observe import compute_summary, format_summary, json_safe, records_from_runtime
from .trace import write_trace

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "finish", "write_metrics", "per_rank_path", "PLACEHOLDER_NOTE", "STOP_SIGNALS"]

# Said once at the end of a run's summary: the first thing a newcomer wonders about.
PLACEHOLDER_NOTE = (
    "[gpemu] note: tensor values on emulated GPUs are placeholders (a loss prints 0.000, "
    "accuracy 0%); times and memory are what is emulated. See README, 'What gpemu does not do'."
)

# Signals whose default action ends the process without running atexit.
STOP_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGHUP")


def per_rank_path(path: str | os.PathLike[str], rank: int | None) -> Path:
    """``metrics.json`` for rank 0 (or no rank), ``metrics.rank3.json`` for rank 3, so ranks of a
    multi-process job do not overwrite each other's files."""
    p = Path(path)
    if not rank:
        return p
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}")


def write_metrics(s: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a summary as JSON, atomically (a reader never sees half a file)."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(json_safe(s), indent=2) + "\n")
    os.replace(tmp, p)
    return p


def _rank() -> int | None:
    """This process's rank in a multi-process job, when it has one."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
        if dist.is_available():
            return int(dist.get_node_local_rank())  # torchrun's LOCAL_RANK; raises when unset
    except Exception:
        return None
    return None


def _is_worker_process() -> bool:
    """A multiprocessing child (e.g. a spawned DataLoader worker) that only inherited gpemu."""
    import multiprocessing

    return multiprocessing.parent_process() is not None


def _emit(text: str) -> None:
    """Write ``text`` and a newline to stderr in ONE write, so the lines of ranks that finish at
    the same moment never interleave within a line (a pipe write up to 4 KiB is atomic)."""
    data = text + "\n"
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced sys.stderr (tests, notebooks)
        sys.stderr.write(data)
        sys.stderr.flush()
        return
    try:
        sys.stderr.flush()  # whatever Python buffered comes first
    except RuntimeError:  # reentrant: a stop signal arrived in the middle of a stderr write
        pass
    raw = data.encode(getattr(sys.stderr, "encoding", None) or "utf-8", "replace")
    while raw:
        raw = raw[os.write(fd, raw) :]


def _touched_gpu(rt: Runtime) -> bool:
    """Whether the program used the emulated GPUs at all (initialised CUDA or allocated on one):
    a torchrun parent, a helper Python or a script that died before its first line did not."""
    cuda = rt.cuda
    if cuda is not None and getattr(cuda, "initialized", False):
        return True
    return any(getattr(m, "peak_allocated", 0) > 0 for m in rt.memory)


def _died_of_an_exception() -> bool:
    """An uncaught exception ended the program (its traceback is what matters, not our line)."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def finish(rt: Runtime) -> dict[str, Any] | None:
    """End-of-run output: print the summary, write metrics JSON and trace as configured.

    A process that did no GPU work (a DataLoader worker, a helper Python started under
    ``gpemu run``) writes nothing, so it cannot overwrite the real run's files; it says so only
    when the program used the emulated GPU and still recorded no work."""
    records = records_from_runtime(rt)
    if not records.spans and not records.iterations:
        if rt.config.summary and not _is_worker_process() and _touched_gpu(rt) and not _died_of_an_exception():
            _emit("[gpemu] no emulated GPU work was recorded in this process")
        return None
    s = compute_summary(records)
    rank = _rank()
    if rank is not None:
        s["rank"] = rank
    lines: list[str] = []
    if rt.config.summary:
        lines.append(format_summary(s))
        if not rank:
            lines.append(PLACEHOLDER_NOTE)
    if rt.config.metrics_path:
        path = write_metrics(s, per_rank_path(rt.config.metrics_path, rank))
        lines.append(f"[gpemu] metrics written to {path}")
    if rt.config.trace_path:
        path = write_trace(records, per_rank_path(rt.config.trace_path, rank), summary=s)
        lines.append(
            f"[gpemu] trace written to {path} (open in https://ui.perfetto.dev or chrome://tracing; "
            f"`gpemu report {path}`)"
        )
    if lines:
        text = "\n".join(lines)
        if rank is not None:
            text = "\n".join(f"[rank {rank}] {line}" for line in text.split("\n"))
        _emit(text)
    return s


def _install_stop_signals(rt: Runtime, at_exit: Any) -> None:
    """SIGTERM/SIGHUP whose action is the default (kill the process, skipping atexit): write the
    run's outputs first, then die of the same signal. Signals the program handles or ignores
    are left alone. Python sets handlers only from the main thread; elsewhere nothing is done."""
    if threading.current_thread() is not threading.main_thread():
        return
    pid = os.getpid()
    for name in STOP_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            if signal.getsignal(signum) is not signal.SIG_DFL:
                continue
        except (OSError, ValueError):
            continue

        def on_signal(received: int, frame: Any) -> None:
            # A forked child (a DataLoader worker) inherits this handler and a copy of the
            # parent's records: it must not write the parent's files.
            if os.getpid() == pid:
                at_exit()
            signal.signal(received, signal.SIG_DFL)
            os.kill(os.getpid(), received)  # the default action, as without gpemu

        signal.signal(signum, on_signal)

        def restore(signum: int = signum, handler: Any = on_signal) -> None:
            if threading.current_thread() is threading.main_thread() and signal.getsignal(signum) is handler:
                signal.signal(signum, signal.SIG_DFL)

        rt.patcher.on_restore(restore)


def install(rt: Runtime) -> None:
    """Register the end-of-run output for this run (unregistered again by ``gpemu.unpatch()``)."""

    done = threading.Lock()

    def at_exit() -> None:
        if not done.acquire(blocking=False):
            return  # already written (a stop signal arrived while or after exiting)
        try:
            finish(rt)
        except Exception as exc:  # never turn a finished training run into a crash at exit
            print(f"[gpemu] could not write the run summary: {type(exc).__name__}: {exc}", file=sys.stderr)
            if rt.config.debug:
                raise

    atexit.register(at_exit)
    rt.patcher.on_restore(lambda: atexit.unregister(at_exit))
    _install_stop_signals(rt, at_exit)
    rt.at_exit = at_exit
