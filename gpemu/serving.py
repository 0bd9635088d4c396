"""Serving metrics (issue 33): time to first token, time per output token, tokens/s and the
KV cache's peak, from the model calls of a generation or serving loop.

A **token step** (noted by :mod:`gpemu.token_steps`) is an outermost model call
without autograd whose arguments include token ids (an integer tensor, ``(batch, positions)``):
a call over several positions is a **prefill** (it reads a prompt and gives each sequence its
first token), a call over one position is a **decode** step (one more token per sequence).
Each step is noted with when it was issued (host time) and when its GPU work ends, and the
bytes of the KV cache it was given: the memory blocks of the tensors held by its non-tensor
arguments (an HF ``Cache``, a server's own cache object), each block once, after the call (a
dynamic cache grows, a static or paged one is all there).

A run is a serving run when it has at least one decode step; then:

* **TTFT**: per prefill, from its issue to the end of its GPU work;
* **TPOT**: per decode step, from the end of the previous step on its GPU to its own end;
* **tokens/s**: tokens produced (one per sequence per step) over the span of the steps;
* **KV-cache peak**: the largest cache seen.

A run keeps its first :data:`MAX_STEPS` token steps (a bound on memory and on the trace).

Only the emulator's own view of a loop: what a request waited before its prefill was issued is
the server's (its own clock), not seen here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["MAX_STEPS", "TokenStep", "serving_summary", "serving_lines", "step_rows", "steps_from_rows"]


# Token steps kept per run (a trace stores each): a serving run's first 200,000 model calls.
MAX_STEPS = 200_000


class TokenStep(NamedTuple):
    """One model call of a generation loop (times on the run's clock, seconds)."""

    device: int
    start: float  # the host time it was issued
    end: float  # when its GPU work ends
    sequences: int  # the batch: sequences that each get one token
    positions: int  # token positions per sequence (1: a decode step; more: a prefill)
    kv_bytes: int  # the KV cache it was given, after the call


def _percentiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)

    def rank(p: float) -> float:  # nearest rank
        return ordered[max(0, min(n - 1, math.ceil(p * n) - 1))]

    return {"p50_s": rank(0.50), "p99_s": rank(0.99), "mean_s": sum(ordered) / n, "count": n}


def serving_summary(steps: Sequence[TokenStep]) -> dict[str, Any] | None:
    """The serving metrics of a run's token steps (None: no decode step, not a serving run)."""
    if not any(s.positions == 1 for s in steps):
        return None
    ttft = [s.end - s.start for s in steps if s.positions > 1]
    tpot: list[float] = []
    for d in sorted({s.device for s in steps}):
        ordered = sorted((s for s in steps if s.device == d), key=lambda s: s.end)
        tpot += [b.end - a.end for a, b in zip(ordered, ordered[1:], strict=False) if b.positions == 1]
    tokens = sum(s.sequences for s in steps)
    span = max(s.end for s in steps) - min(s.start for s in steps)
    return {
        "prefills": len(ttft),
        "decode_steps": sum(1 for s in steps if s.positions == 1),
        "prompt_tokens": sum(s.sequences * s.positions for s in steps if s.positions > 1),
        "generated_tokens": tokens,
        "ttft": _percentiles(ttft),
        "tpot": _percentiles(tpot),
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "kv_cache_peak_bytes": max(s.kv_bytes for s in steps),
    }


def serving_lines(serving: dict[str, Any] | None, width: int, seconds: Any, size: Any) -> list[str]:
    """The summary's serving line (``seconds``/``size``: the summary's formatters)."""
    if not serving:
        return []

    def dist(d: dict[str, float] | None) -> str:
        return f"p50 {seconds(d['p50_s'])}, p99 {seconds(d['p99_s'])}" if d else "-"

    return [
        "serving".ljust(width + 2) + f"TTFT {dist(serving['ttft'])} ({serving['prefills']} prefill(s)); "
        f"TPOT {dist(serving['tpot'])} ({serving['decode_steps']} decode step(s)); "
        f"{serving['tokens_per_s']:,.0f} tokens/s; KV cache peak {size(serving['kv_cache_peak_bytes'])}"
    ]


def step_rows(steps: Sequence[TokenStep], t0: float) -> list[list[float]]:
    """Token steps as a trace stores them: ``[device, start_us, end_us, sequences, positions,
    kv_bytes]`` rows, times in microseconds since ``t0``."""
    return [
        [s.device, round((s.start - t0) * 1e6, 3), round((s.end - t0) * 1e6, 3), s.sequences, s.positions, s.kv_bytes]
        for s in steps
    ]


def steps_from_rows(rows: Any, devices: int) -> list[TokenStep]:
    """:func:`step_rows`' rows back as token steps (times in seconds); ValueError saying what
    is wrong with a row."""
    if not isinstance(rows, list):
        raise ValueError("serving must be a list of [device, start_us, end_us, sequences, positions, kv_bytes] rows")
    steps = []
    for i, row in enumerate(rows):
        ok = isinstance(row, list) and len(row) == 6
        ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in row)
        if not ok or not 0 <= row[0] < devices or row[2] < row[1] or min(row[3:]) < 0:
            raise ValueError(
                f"serving[{i}] must be [device (0..{devices - 1}), start_us, end_us >= start_us, sequences, "
                "positions, kv_bytes] with numbers >= 0"
            )
        steps.append(TokenStep(int(row[0]), row[1] / 1e6, row[2] / 1e6, int(row[3]), int(row[4]), int(row[5])))
    return steps
