"""What a run leaves behind when it ends (component ``gpemu.run_outputs``).

At interpreter exit (``gpemu.unpatch()`` unregisters it), the run's summary is printed
(``config.summary``), written as JSON (``config.metrics_path``) and its Chrome trace written
(``config.trace_path``). Ranks of a multi-process job write their own files
(``metrics.rank3.json``) and prefix every line of their summary with ``[rank N]``; so do the
script's child processes that have no rank (``mp.spawn``, ``multiprocessing.Process``: numbered as
multiprocessing numbers them, ``metrics.proc2.json`` and ``[proc 2]``). Summaries are
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
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from .config import ConfigError, EmuConfig
from .observe import compute_summary, format_summary, json_safe, records_from_runtime
from .trace import write_trace

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = [
    "install",
    "finish",
    "write_metrics",
    "write_atomically",
    "unwritable_reason",
    "check_output_paths",
    "per_rank_path",
    "per_process_path",
    "process_tag",
    "ProcessTag",
    "RunOutputs",
    "StopSignalHandler",
    "PLACEHOLDER_NOTE",
    "STOP_SIGNALS",
]

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
    return per_process_path(path, ProcessTag("rank", str(rank)) if rank else None)


class ProcessTag(NamedTuple):
    """Which process of a job writes an output, when it is not the job's first: ``rank 3``, or
    ``proc 2`` for the script's second child process without a rank."""

    kind: str  # "rank" | "proc"
    number: str

    @property
    def suffix(self) -> str:
        return f"{self.kind}{self.number}"

    @property
    def prefix(self) -> str:
        return f"[{self.kind} {self.number}]"


def per_process_path(path: str | os.PathLike[str], tag: ProcessTag | None) -> Path:
    """``metrics.json`` for the job's first process, ``metrics.rank3.json`` /
    ``metrics.proc2.json`` for others, so its processes do not overwrite each other's files."""
    p = Path(path)
    if tag is None:
        return p
    return p.with_name(f"{p.stem}.{tag.suffix}{p.suffix}")


def process_tag() -> ProcessTag | None:
    """This process's tag (:class:`ProcessTag`): its rank when it has one other than 0; else, in a
    child process of the script (``mp.spawn``, ``multiprocessing.Process``), its number as
    multiprocessing gives it (``1``, ``2``, ...; ``1-2`` for a child's second child); else None."""
    rank = _rank()
    if rank is not None:
        return ProcessTag("rank", str(rank)) if rank else None
    import multiprocessing

    if multiprocessing.parent_process() is None:
        return None
    identity = multiprocessing.current_process()._identity
    return ProcessTag("proc", "-".join(map(str, identity)) if identity else f"pid{os.getpid()}")


def write_metrics(s: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write a summary as JSON, atomically (a reader never sees half a file, and a write that
    fails, e.g. on a full disk, leaves no temporary file behind)."""
    text = json.dumps(json_safe(s), indent=2) + "\n"
    return write_atomically(path, lambda f: f.write(text))


def write_atomically(path: str | os.PathLike[str], write: Callable[[IO[str]], Any]) -> Path:
    """Create ``path`` (and its directory) through a temporary file beside it, renamed into place
    when ``write`` finished; the temporary file is removed when anything fails."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            write(f)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return p


def unwritable_reason(path: str | os.PathLike[str]) -> str | None:
    """Why a file could not be created at ``path`` (checked before a run, so a bad --metrics or
    --trace path is found at start, not after hours of training), or None. The directory that
    would hold it (or its nearest existing ancestor, the rest being made when writing) is probed
    by creating and removing an empty file there: permissions, read-only file systems and
    pseudo file systems all answer as they will at the end. A full disk shows only when writing."""
    import tempfile

    p = Path(path)
    if p.exists() and not p.is_file():
        return "it exists and is not a regular file"
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".gpemu-probe-", dir=parent)
    except OSError as exc:
        return f"cannot create a file in {parent}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(probe)
    return None


def check_output_paths(config: EmuConfig) -> None:
    """ConfigError naming each --metrics / --trace path no file could be written to."""
    for option, path in (
        ("--metrics (GPEMU_METRICS)", config.metrics_path),
        ("--trace (GPEMU_TRACE)", config.trace_path),
    ):
        if path:
            reason = unwritable_reason(path)
            if reason is not None:
                raise ConfigError(f"{option} {path}: cannot write there ({reason})")


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

    The summary is printed whatever happens to the files: a file that cannot be written (full
    disk, a directory removed during the run) is one line naming its path. A process that did
    no GPU work (a DataLoader worker, a helper Python started under ``gpemu run``) writes nothing,
    so it cannot overwrite the real run's files; it says so only when the program used the
    emulated GPU and still recorded no work."""
    records = records_from_runtime(rt)
    if not records.spans and not records.iterations:
        if rt.config.summary and not _is_worker_process() and _touched_gpu(rt) and not _died_of_an_exception():
            _emit("[gpemu] no emulated GPU work was recorded in this process")
        return None
    s = compute_summary(records)
    rank = _rank()
    tag = process_tag()
    if rank is not None:
        s["rank"] = rank
    elif tag is not None:
        s["process"] = tag.number
    lines: list[str] = []
    if rt.config.summary:
        lines.append(format_summary(s))
        if tag is None and not rt.config.real_values:  # (real values: the run's first line said it)
            lines.append(PLACEHOLDER_NOTE)
    if rt.config.metrics_path:
        metrics = per_process_path(rt.config.metrics_path, tag)
        lines.append(_write_one("metrics", metrics, lambda p: write_metrics(s, p)))
    if rt.config.trace_path:
        trace = per_process_path(rt.config.trace_path, tag)
        lines.append(_write_one("trace", trace, lambda p: write_trace(records, p, summary=s)))
    if lines:
        text = "\n".join(lines)
        if rank is not None:
            text = "\n".join(f"[rank {rank}] {line}" for line in text.split("\n"))
        elif tag is not None:
            text = "\n".join(f"{tag.prefix} {line}" for line in text.split("\n"))
        _emit(text)
    return s


def _write_one(what: str, path: Path, write: Callable[[Path], Path]) -> str:
    """Write one output file; the line saying where it went, or why it could not be written."""
    try:
        written = write(path)
    except OSError as exc:
        return f"[gpemu] could not write the {what} to {path}: {exc.strerror or exc}"
    if what == "trace":
        return (
            f"[gpemu] trace written to {written} (open in https://ui.perfetto.dev or chrome://tracing; "
            f"`gpemu report {written}`)"
        )
    return f"[gpemu] {what} written to {written}"


class StopSignalHandler:
    """The handler of one stop signal (SIGTERM/SIGHUP) whose action was the default: writes the
    run's outputs, then dies of the same signal as it would have without gpemu."""

    def __init__(self, signum: int, outputs: RunOutputs) -> None:
        self.signum = signum
        self.outputs = outputs
        self.pid = os.getpid()

    def __call__(self, received: int, frame: Any) -> None:
        # A forked child (a DataLoader worker) inherits this handler and a copy of the parent's
        # records: it must not write the parent's files.
        if os.getpid() == self.pid:
            self.outputs.at_exit()
        signal.signal(received, signal.SIG_DFL)
        os.kill(os.getpid(), received)  # the default action, as without gpemu

    def restore(self) -> None:
        """Back to the default action, unless the program has installed its own handler since."""
        signum = self.signum
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signum) is self:
            signal.signal(signum, signal.SIG_DFL)


class RunOutputs:
    """The end-of-run output of one run: written once, at exit or on a stop signal."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._done = threading.Lock()

    def at_exit(self) -> None:
        if not self._done.acquire(blocking=False):
            return  # already written (a stop signal arrived while or after exiting)
        try:
            finish(self.rt)
        except Exception as exc:  # never turn a finished training run into a crash at exit
            print(f"[gpemu] could not write the run summary: {type(exc).__name__}: {exc}", file=sys.stderr)
            if self.rt.config.debug:
                raise

    def install_stop_signals(self) -> None:
        """SIGTERM/SIGHUP whose action is the default (kill the process, skipping atexit): write
        the run's outputs first. Signals the program handles or ignores are left alone. Python
        sets handlers only from the main thread; elsewhere nothing is done."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in STOP_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            try:
                if signal.getsignal(signum) is not signal.SIG_DFL:
                    continue
            except (OSError, ValueError):
                continue
            handler = StopSignalHandler(signum, self)
            signal.signal(signum, handler)
            self.rt.patcher.on_restore(handler.restore)


def install(rt: Runtime) -> None:
    """Register the end-of-run output for this run (unregistered again by ``gpemu.unpatch()``).

    An output path no file could be written to fails here, at start, with one line."""
    check_output_paths(rt.config)
    outputs = RunOutputs(rt)
    atexit.register(outputs.at_exit)
    rt.patcher.on_restore(lambda: atexit.unregister(outputs.at_exit))
    outputs.install_stop_signals()
    rt.at_exit = outputs.at_exit
