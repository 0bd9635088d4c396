"""What a run leaves behind when it ends (component ``gpemu.run_outputs``).

At interpreter exit (``gpemu.unpatch()`` unregisters it), the run's summary is printed
(``config.summary``), written as JSON (``config.metrics_path``) and its Chrome trace written
(``config.trace_path``). Ranks of a multi-process job write their own files
(``metrics.rank3.json``). Summaries are computed by :mod:`gpemu.observe`, traces written by
:mod:`gpemu.trace`.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .observe import compute_summary, format_summary, json_safe, records_from_runtime
from .trace import write_trace

if TYPE_CHECKING:  # pragma: no cover
    from .runtime import Runtime

__all__ = ["install", "finish", "write_metrics", "per_rank_path"]


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


def finish(rt: "Runtime") -> dict[str, Any] | None:
    """End-of-run output: print the summary, write metrics JSON and trace as configured.

    A process that did no GPU work (a DataLoader worker, a helper Python started under
    ``gpemu run``) writes nothing, so it cannot overwrite the real run's files."""
    records = records_from_runtime(rt)
    if not records.spans and not records.iterations:
        if rt.config.summary and not _is_worker_process():
            print("[gpemu] no emulated GPU work was recorded in this process", file=sys.stderr, flush=True)
        return None
    s = compute_summary(records)
    rank = _rank()
    if rank is not None:
        s["rank"] = rank
    if rt.config.summary:
        text = format_summary(s)
        if rank:
            text = f"[rank {rank}] " + text
        print(text, file=sys.stderr, flush=True)
    if rt.config.metrics_path:
        path = write_metrics(s, per_rank_path(rt.config.metrics_path, rank))
        print(f"[gpemu] metrics written to {path}", file=sys.stderr, flush=True)
    if rt.config.trace_path:
        path = write_trace(records, per_rank_path(rt.config.trace_path, rank), summary=s)
        print(f"[gpemu] trace written to {path} (open in https://ui.perfetto.dev or chrome://tracing; "
              f"`gpemu report {path}`)", file=sys.stderr, flush=True)
    return s


def install(rt: "Runtime") -> None:
    """Register the end-of-run output for this run (unregistered again by ``gpemu.unpatch()``)."""

    def at_exit() -> None:
        try:
            finish(rt)
        except Exception as exc:  # never turn a finished training run into a crash at exit
            print(f"[gpemu] could not write the run summary: {type(exc).__name__}: {exc}", file=sys.stderr)
            if rt.config.debug:
                raise

    atexit.register(at_exit)
    rt.patcher.on_restore(lambda: atexit.unregister(at_exit))
    rt.at_exit = at_exit
