"""The machine a benchmark figure was taken on: every benchmark prints it beside its figures,
because timings from different machines differ 2-4x and must not be compared by mistake.

Imported by the scripts in this folder as ``from machine import machine`` (a script's own
folder is first on ``sys.path``)."""

from __future__ import annotations

import os
import platform

__all__ = ["machine"]


def machine() -> str:
    """CPU model, cores and load average now, e.g. ``AMD EPYC, 2 cores, load 0.31 0.70 1.02``."""
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores, load {load}"
